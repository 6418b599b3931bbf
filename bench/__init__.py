"""Performance benchmark of gnnray's data path against plain single-process DGL.

Usage (from the repository root)::

    .venv/bin/python bench/benchmark.py            # full
    .venv/bin/python bench/benchmark.py --quick    # fewer batches and epochs
    .venv/bin/python -m bench --stages wall --json out.json

It starts one local Ray cluster, runs the stages (``--stages``, all unless
given), prints one table (figure, ours, baseline, ratio, target, met?) and
writes every number, with the settings, the machine and the per-epoch metrics
of every job run, to ``--json``. Each measurement is guarded: one that fails
shows its error in its row and the others still run. Every baseline is
measured in the same invocation, beside ours; ratios are ours / baseline,
rates and times are medians where there are rounds or epochs, and nothing
asserts on a time. Wall-clock numbers are noisy on small machines, the more
so when they are shared: compare ratios within one run; the CPU-time and
memory rows hardly move. The JSON records the load average around each stage.

Every stream runs with the job's bounded read-ahead (``--max-ahead``, the
job's default unless given): the sampler pool stays at most that many
mini-batches per train worker ahead, so steady epochs measure sampling
beside training, not batches sampled long before.

The stages (GraphSAGE 3 x 256, fanouts 15,10,5, batch 1024 unless said) and
the current figures they back; each module's docstring says exactly what it
times:

- ``sampler`` (``sampler.py``, timing ``sampler_runs.py``), figure 2: one
  sampler actor in the job's own Ray Data stream (``minibatch_stream``, bound
  included) against the same sampling in a plain loop on one core, and 2
  actors against 1. Target: at least 0.9x. The "sampler actor" rows of
  docs/performance.md#current-figures.
- ``fast`` (``training.py``): the fast trainer, a GPU worker's regime on the
  CPU (GraphSAGE 2 x 32, fanouts 15,10): data wait and seeds/s with 2 sampler
  actors against 1, and its step against sampling one batch. The "data wait,
  fast trainer" row.
- ``memory`` (``memory.py``), figure 4: private memory per added process
  using the node-shared graph against processes that each copy it. Target:
  <5% of the graph's size per process. The ~2 MiB per process of
  docs/performance.md#the-data-path-and-why.
- ``gpu`` (``gpu/prefetch.py``), figure 5: how much of the host-to-device
  copy the ``Prefetcher`` hides behind compute; "n/a" without a GPU.
- ``wall`` (``wall.py``; the DGL loop ``dgl_loop.py`` on DGL's modules
  ``dgl_models.py``; CPU per process ``cpu.py``): whole runs as a user starts
  them, ``python jobs/train_arxiv.py`` (its own Ray cluster; also with 2 DDP
  workers and with the CPU plan off) against the DGL loop's script with
  ``DataLoader(num_workers=0)`` and ``num_workers=1``: steady seeds/s and
  CPU-seconds per epoch from a short and a longer run, and start-up. The
  "steady seeds/s" and "the same runs" rows, and
  docs/performance.md#where-the-figures-come-from.
- ``--sharding`` (``sharding/``, run alone): ``--feature-shards`` on a
  simulated cluster of 4 nodes, docs/scaling.md#current-figures.

Figures 1 and 3 of the performance issue, the 3 x 256 job's data wait and its
seeds/s against the DGL loop in the same process, are retired: their figures
are in docs/history/performance.md, and ``wall`` measures the throughput now.

Run alone (``python -m bench.NAME``), each backing the figures named:

- ``sampling``: gnnray's sampler against GraphBolt's,
  docs/performance.md#sampling (and a GPU machine's cores in ``gpu_run.sh``).
- ``startup``: the command to the first training step, fresh or joining a
  head, docs/performance.md#start-up-and-the-end-of-a-run-a-whole-runs-fixed-cost.
- ``models``: each model's step against DGL's modules, docs/performance.md#models.
- ``products``: the products-sized whole run and the structure load against
  the DGL script, docs/performance.md#loading-and-memory.
- ``inference``, ``evaluation``: layer-wise inference against DGL's loop,
  sampled evaluation per 1k seeds (rows of docs/performance.md#current-figures).
- ``gpu`` (the folder ``gpu/``: torch and numpy only, no Ray or DGL): each
  model, layer-wise inference, prefetch, the DDP step and host syncs on a GPU,
  docs/performance.md#benchgpu; ``gather`` times the feature gather against
  torch's threads there. ``gpu.placements``: each ``--feature-placement``'s
  steady step against the ceiling on a GPU,
  docs/performance.md#features-and-sampling-on-the-device. ``gpu_run.sh``:
  one pass on a GPU machine, docs/performance.md#a-ray-job-on-a-gpu-h200.
- ``placement``: train workers beside their shards; ``sharding.layerwise``:
  layer-wise inference's hidden tables by shard (docs/scaling.md).
- ``storage``: runs in object storage, docs/storage.md#current-figures.

``--quick`` keeps the same graph structure and features but marks only 20
batches' worth of nodes as training nodes (and 2 batches' worth as validation
and test), so epochs are short while each batch costs what it costs on the
full graph (``graphs.py``); it also takes fewer batches for figure 2 and
fewer epochs everywhere. The fast trainer always uses the full training
split (its epochs are short).
``cli.py`` holds the command line; ``common.py`` what the stages share (the
settings, a job's configuration and its ``metrics.jsonl``, the table's rows);
``results/`` the raw JSON of the current figures.
"""

import os

# DGL asks for a backend on its first import; every entry point comes through here first.
os.environ.setdefault("DGLBACKEND", "pytorch")
