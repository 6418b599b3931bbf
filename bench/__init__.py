"""gnnray's benchmarks, each against a baseline run beside it; docs/performance.md has the figures.

``python -m bench`` (``suite.py``) runs ``wall.py``: whole runs against the DGL loop (``dgl_loop.py``; CPU per
process, ``cpu.py``); ``--sharding`` runs ``sharding/`` instead. Run alone (``python -m bench.NAME``):
``sampling``, ``startup``, ``models``, ``beside``, ``products``, ``gather``, ``storage``, ``beside_shards``,
``sharding.hidden_tables``, ``gpu``, ``gpu.stages``, ``gpu.placements``; ``gpu_run.sh`` is one pass on a GPU
machine. ``harness.py`` is the runner they share (rounds, medians, the table, the JSON); ``settings.py`` what
the suite's figures share; ``results/`` holds the JSON of the current figures.
"""

import os

# DGL asks for a backend on its first import; every entry point comes through here first.
os.environ.setdefault("DGLBACKEND", "pytorch")
