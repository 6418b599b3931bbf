"""Performance benchmark of gnnray's data path against plain single-process DGL.

Usage (from the repository root)::

    .venv/bin/python bench/benchmark.py            # full
    .venv/bin/python bench/benchmark.py --quick    # fewer batches and epochs
    .venv/bin/python -m bench --dataset synthetic --json out.json

It starts one local Ray cluster, measures the five figures of the performance
issue, prints one table (figure, ours, baseline, ratio, target, met?) and
writes every number, with the settings and the machine, to ``--json``. Each
measurement is guarded: one that fails shows its error in its row and the
others still run. Wall-clock numbers are noisy on small machines, the more so
when they are shared: compare ratios within one run; the CPU-time and memory
rows hardly move. The JSON records the load average around each stage.

The figures (GraphSAGE, 3 layers, hidden 256, fanouts 15,10,5, batch 1024),
each module's docstring says exactly what it times:

1. Data-wait fraction of the real job (``training.py``). Target: below 5%.
2. Sampler overhead: one sampler actor in the real Ray Data pipeline against
   the same sampling in a plain loop on one core, and 2 actors against 1
   (``sampler.py``, timing ``sampler_runs.py``). Target: at least 0.9x, i.e.
   packing, transport and unpacking cost at most ~10% of sampling.
3. Throughput of the real job against the DGL tutorials' loop in one process
   with the same model, fanouts, batch size and cores (``training.py``).
   Target: >= 1x.
4. Memory: private memory per added process using the node-shared graph
   against processes that each copy it (``memory.py``). Target: <5% of the
   graph's size per process.
5. GPU path: how much of the host-to-device copy the ``Prefetcher`` hides
   behind compute (``gpu.py``); "n/a" without a GPU.

``--quick`` keeps the same graph structure and features but marks only 20
batches' worth of nodes as training nodes (and 2 batches' worth as validation
and test), so epochs are short while each batch costs what it costs on the
full graph (``graphs.py``); it also takes fewer batches for figure 2.
``cli.py`` holds the command line, ``common.py`` what the figures share.
"""

import os

# DGL asks for a backend on its first import; every entry point comes through here first.
os.environ.setdefault("DGLBACKEND", "pytorch")
