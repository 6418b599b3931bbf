"""``python -m bench.gpu --smoke`` runs to its end without Ray and DGL and every row of its JSON succeeds.

Without CUDA (CI) every row runs on the CPU at small sizes: the GPU figures come from a lent GPU machine
(docs/performance.md). Which rows must be there comes from the bench's own model list, not from its output.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

RUN = ("import runpy, sys; sys.modules['ray'] = None; sys.modules['dgl'] = None; "
       "sys.argv = ['bench.gpu'] + sys.argv[1:]; runpy.run_module('bench.gpu', run_name='__main__')")


def test_gpu_bench_smoke_runs_every_row(tmp_path):
    from gnnray.models.model import MODELS

    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-c", RUN, "--smoke", "--json", str(out)], capture_output=True,
                          text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    layerwise = {f"layerwise {m}" for m in MODELS if not m.startswith("r")}  # the untyped models
    want = {f"model {m}" for m in MODELS} | layerwise | {"prefetch float32", "prefetch float16", "ddp step",
                                                          "syncs embedding", "syncs rgat", "syncs placed"}
    assert set(result["rows"]) == want
    failed = {k: r.get("error") for k, r in result["rows"].items() if r["status"] != "ok"}
    assert not failed, failed
    assert result["smoke"] and result["cpu_only"] == (not torch.cuda.is_available())
    if not torch.cuda.is_available():
        assert "smoke test" in proc.stdout  # it says it ran on the CPU
    for name in sorted({f"model {m}" for m in MODELS} | layerwise):
        row = result["rows"][name]
        # CPU against CPU here (the same arithmetic); on a GPU within float32's summation-order spread.
        assert row["met"], (name, row)
    assert result["rows"]["ddp step"]["weights_max_diff_across_ranks"] == 0.0
    # The collectives' rows ran their multi-rank paths (on a GPU they also count host syncs): rows updated, and
    # gnnray's synchronised BatchNorm agreeing with torch's nn.SyncBatchNorm.
    assert result["rows"]["syncs embedding"]["met"] and result["rows"]["syncs embedding"]["rows_updated"] > 0
    assert result["rows"]["syncs rgat"]["met"], result["rows"]["syncs rgat"]
