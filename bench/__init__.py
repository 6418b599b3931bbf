"""Performance benchmark of gnnray's data path against plain single-process DGL.

Usage (from the repository root)::

    .venv/bin/python bench/benchmark.py            # full
    .venv/bin/python bench/benchmark.py --quick    # fewer batches and epochs
    .venv/bin/python -m bench --dataset synthetic --json out.json

It starts one local Ray cluster, measures the five figures of the performance
issue and the rows beside them, prints one table (figure, ours, baseline,
ratio, target, met?) and writes every number, with the settings, the machine
and the per-epoch metrics of every job run, to ``--json``. Each measurement is
guarded: one that fails shows its error in its row and the others still run.
Every baseline is measured in the same invocation, beside ours; ratios are
ours / baseline, rates and times are medians where there are rounds or
epochs, and nothing asserts on a time. Wall-clock numbers are noisy on small
machines, the more so when they are shared: compare ratios within one run;
the CPU-time and memory rows hardly move. The JSON records the load average
around each stage.

Every stream runs with the job's bounded read-ahead (``--max-ahead``, the
job's default unless given): the sampler pool stays at most that many
mini-batches per train worker ahead, so steady epochs measure sampling
beside training, not batches sampled long before.

The figures (GraphSAGE, 3 layers, hidden 256, fanouts 15,10,5, batch 1024),
each module's docstring says exactly what it times:

1. Data-wait fraction of the real job (``training.py``). Target: below 5%.
2. Sampler overhead: one sampler actor in the job's own Ray Data stream
   (``minibatch_stream``, bound included) against the same sampling in a
   plain loop on one core, and 2 actors against 1 (``sampler.py``, timing
   ``sampler_runs.py``). Target: at least 0.9x, i.e. packing, transport and
   unpacking cost at most ~10% of sampling.
3. Throughput of the real job against the DGL tutorials' loop in one process
   with the same model, fanouts, batch size and cores (``training.py``,
   ``dgl_loop.py``), with ``DataLoader(num_workers=0)`` and with DGL's own
   sampling process (``num_workers=1``). Target: >= 1x. Beside it: the job
   with 2 DDP workers against the 1-worker job and both loops.
4. Memory: private memory per added process using the node-shared graph
   against processes that each copy it (``memory.py``). Target: <5% of the
   graph's size per process.
5. GPU path: how much of the host-to-device copy the ``Prefetcher`` hides
   behind compute (``gpu/prefetch.py``); "n/a" without a GPU.

And, without targets:

- The fast trainer, a GPU worker's regime on the CPU (``training.py``):
  GraphSAGE 2 x 32, fanouts 15,10; data wait and seeds/s with 2 sampler
  actors against 1, and its step time against sampling one batch.
- Wall time of whole runs, start-up included (``wall.py``): ``python
  jobs/train_arxiv.py`` as a user starts it (its own Ray cluster) against the
  DGL loop's script, for a short and a longer run, and per added epoch.

``--quick`` keeps the same graph structure and features but marks only 20
batches' worth of nodes as training nodes (and 2 batches' worth as validation
and test), so epochs are short while each batch costs what it costs on the
full graph (``graphs.py``); it also takes fewer batches for figure 2 and
fewer epochs everywhere. The fast trainer always uses the full training
split (its epochs are short).
``cli.py`` holds the command line, ``common.py`` what the figures share.
"""

import os

# DGL asks for a backend on its first import; every entry point comes through here first.
os.environ.setdefault("DGLBACKEND", "pytorch")
