"""gnnray's benchmarks, each against a baseline run beside it; docs/performance.md has the figures.

``python -m bench`` (or ``bench/benchmark.py``; ``--quick``, ``--stages``, ``--json``; ``suite.py``) starts one
local Ray cluster and runs the stages: ``sampler`` (``actors.py``: a sampler actor in the job's stream against
a plain loop), ``fast`` (``training.py``: the fast trainer's data wait), ``memory`` (``memory.py``: memory per
added process), ``gpu`` (``gpu/overlap.py``: the prefetch overlap) and ``wall`` (``wall.py``: whole runs against
the DGL loop, ``dgl_loop.py``; CPU per process, ``cpu.py``). ``--sharding`` runs ``sharding/`` alone.
Run alone (``python -m bench.NAME``): ``sampling``, ``startup``, ``models``, ``products``, ``inference``,
``evaluation``, ``gather``, ``storage``, ``beside_shards``, ``sharding.hidden_tables``, ``gpu``,
``gpu.stages``, ``gpu.placements``; ``gpu_run.sh`` is one pass on a GPU machine. ``harness.py`` is the runner
they share (rounds, medians, the table, the JSON); ``results/`` holds the JSON of the current figures.
"""

import os

# DGL asks for a backend on its first import; every entry point comes through here first.
os.environ.setdefault("DGLBACKEND", "pytorch")
