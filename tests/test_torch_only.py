"""The train worker's code runs with torch alone, as on a bare GPU machine (no Ray, no DGL).

A subprocess makes ``import ray``, ``import dgl`` and ``import pyarrow`` fail (``sys.modules[name] = None``;
a lent GPU machine may lack pyarrow too, and a step needs no table), imports the
modules a train worker steps with, and trains each built-in model for an epoch through the
``Prefetcher`` on synthetic :class:`Layer` batches (typed ones for the relational models).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, math, sys
sys.modules["ray"] = None  # any import of them now raises ImportError
sys.modules["dgl"] = None
sys.modules["pyarrow"] = None
sys.path.insert(0, sys.argv[1])

import numpy as np
import torch

import gnnray.batch, gnnray.train.prefetch, gnnray.train.step
import gnnray.models.model, gnnray.models.conv, gnnray.models.dropout
from bench.gpu.batches import RELATIONS, synthetic_batch
from gnnray.models.model import MODELS, build_model
from gnnray.train.feature_reader import LocalRows
from gnnray.train.prefetch import Prefetcher
from gnnray.train.step import train_epoch

results = {}
for name in MODELS:
    try:
        relations = RELATIONS if name.startswith("r") else 1
        rng = np.random.default_rng(0)
        mbs = [synthetic_batch(rng, 16, (3, 2), 4, relations) for _ in range(3)]
        feat = rng.standard_normal((max(int(m.input_nodes.max()) + 1 for m in mbs), 8), dtype=np.float32)
        rows = [m.pack(np.int32) for m in mbs]  # as an int32 graph's rows come
        torch.manual_seed(0)
        model = build_model(8, 4, 2, 8, 0.1, name=name, heads=2, num_relations=relations)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        with Prefetcher(rows, LocalRows(feat.astype(np.float16)), "cpu", depth=2) as batches:
            stats = train_epoch(model, optimizer, batches, len(rows), 4, "cpu")
        assert math.isfinite(stats["loss"]) and 0.0 <= stats["train_acc"] <= 1.0, stats
        results[name] = "ok"
    except Exception as exc:
        results[name] = f"{type(exc).__name__}: {exc}"
loaded = sorted(k for k in ("ray", "dgl", "pyarrow") if sys.modules.get(k) is not None)
print(json.dumps(dict(results=results, loaded=loaded, numpy=np.__version__, torch=torch.__version__,
                      python=sys.version.split()[0])))
"""


def test_train_worker_code_runs_without_ray_and_dgl():
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(REPO)], capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["loaded"] == [], out
    assert out["results"] and all(v == "ok" for v in out["results"].values()), out["results"]
