"""A run's processes import no DGL: the driver, the train workers, the sampler actors and the evaluation sampler;
and the sampler actors no torch.

A real run (``gnnray.driver.fit.run``, two workers, the default sampler) is
driven by a subprocess on the session's cluster. Every process of it, the
driver and each Ray worker the job starts (through the job's runtime env,
``PYTHONPATH``), first loads a ``sitecustomize`` that puts a finder ahead of
all others: any import of ``dgl`` or a submodule, even one whose failure is
caught, is written down and then fails. Each poisoned process also writes down
its pid, so the test checks that every actor of the job (Ray Train's workers,
the sampler actors of Ray Data's pool, the evaluation sampler) ran poisoned,
and that no process tried DGL. This holds beside an installed DGL (the
``dgl`` extra's environment) and without it, where an import would fail anyway
but would still be written down.

The model is plain torch and checks where it computes (training steps, sampled
evaluation, the final layer-wise inference) that its process is poisoned and
holds no DGL. The layer-wise accuracies the ranks computed together must equal
a full-graph forward of the checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gnnray.config import parse_args
from plain_sage import mean_sage, whole_graph

TESTS = Path(__file__).resolve().parents[1]

# Loaded first by every Python process started with its folder on PYTHONPATH.
POISON = '''
import os
import sys

_LOG = os.environ["GNNRAY_TEST_DGL_LOG"]


class NoDglFinder:
    """Ahead of every other finder: an import of dgl is written down, then fails."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch":  # written down, not refused: which processes pay for importing torch
            open(os.path.join(_LOG, f"torch-{os.getpid()}"), "w").close()
        if name == "dgl" or name.startswith("dgl."):
            with open(os.path.join(_LOG, f"tried-{os.getpid()}"), "a") as f:
                f.write(f"{name} {sys.argv}\\n")
            raise ImportError(f"{name}: no process of this run may import DGL (tests/train/test_no_dgl.py)")
        return None


sys.meta_path.insert(0, NoDglFinder())
with open(os.path.join(_LOG, f"armed-{os.getpid()}"), "w") as f:
    f.write(" ".join(sys.argv))
'''

DRIVER = '''
import json
import os
import sys

sys.path.insert(0, sys.argv[1])  # tests/: plain_sage

import ray
import ray.cloudpickle
import torch

import plain_sage
from gnnray.config import parse_args
from gnnray.driver.fit import run
from plain_sage import mean_sage

ray.cloudpickle.register_pickle_by_value(plain_sage)  # tests/ is not on the workers' path
out, args = sys.argv[2], sys.argv[3:]


class NoDgl(torch.nn.Module):
    """Raises where it computes unless its process is poisoned and holds no DGL."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    @property
    def num_layers(self) -> int:
        return self.inner.num_layers

    def forward(self, layers, x):
        self._check()
        return self.inner(layers, x)

    def layer(self, i, layer, h):
        self._check()
        return self.inner.layer(i, layer, h)

    @staticmethod
    def _check():
        import sys

        if not any(type(f).__name__ == "NoDglFinder" for f in sys.meta_path):
            raise RuntimeError("the train worker runs without the test's DGL poison")
        if "dgl" in sys.modules:
            raise RuntimeError("the train worker has imported dgl")


# The job's processes get the poison through its runtime env (a cluster's workers inherit the raylet's
# environment, not this process's); the rest as the tests' own connection (tests/conftest.py).
env = {k: os.environ[k] for k in ("PYTHONPATH", "GNNRAY_TEST_DGL_LOG")}
ray.init(address=os.environ["RAY_ADDRESS"],
         runtime_env={"env_vars": {**env, "DGLBACKEND": "pytorch", "OUTDATED_IGNORE": "1"}})
job = ray.get_runtime_context().get_job_id()
summary = run(parse_args(args), model_factory=lambda f, c, cfg: NoDgl(mean_sage(f, cfg.model.hidden, c)))
with open(out, "w") as f:
    json.dump({"job": job, "metrics": summary.metrics, "checkpoint": summary.checkpoint, "pid": os.getpid()}, f)
'''


def test_train_worker_never_imports_dgl(ray_cluster, tmp_path):
    from ray.util.state import list_actors

    from gnnray.data.load import load_graph
    from gnnray.train import checkpoint

    poison, log = tmp_path / "poison", tmp_path / "log"
    poison.mkdir()
    log.mkdir()
    (poison / "sitecustomize.py").write_text(POISON)
    (tmp_path / "driver.py").write_text(DRIVER)
    args = ["--dataset", "synthetic", "--synthetic-nodes", "1000", "--synthetic-feat-dim", "8", "--fanouts", "5,5",
            "--batch-size", "200", "--hidden", "16", "--num-workers", "2", "--sample-on", "actors", "--sampler-actors", "1", "--epochs", "1",
            "--eval-batch-size", "64", "--inference-batch-size", "128", "--storage-path", str(tmp_path / "runs"),
            "--name", "nodgl"]
    env = {**os.environ, "GNNRAY_TEST_DGL_LOG": str(log),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(poison), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(TESTS), str(tmp_path / "out.json"),
                           *args], env=env, capture_output=True, text=True, timeout=900)
    tried = {p.name: p.read_text() for p in log.glob("tried-*")}
    assert not tried, f"processes of the run tried to import DGL: {tried}"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    out = json.loads((tmp_path / "out.json").read_text())
    armed = {int(p.name.removeprefix("armed-")) for p in log.glob("armed-*")}
    assert out["pid"] in armed  # the driver
    actors = list_actors(filters=[("job_id", "=", out["job"])], detail=True, limit=10_000,
                         raise_on_missing_output=False)
    unarmed = [(a.class_name, a.pid) for a in actors if a.pid and a.pid not in armed]
    assert not unarmed, f"actors of the run without the poison: {unarmed}"
    names = " ".join(sorted({a.class_name for a in actors if a.pid}))
    # Train workers and sampler actors (evaluation's 400 seeds are sampled in the workers: SAMPLE_HERE_SEEDS).
    for kind in ("RayTrainWorker", "SamplerActor"):
        assert kind in names, (kind, names)
    # The sampler actors pack numpy arrays: only the processes that compute import torch (seconds of CPU and
    # about 280 MB of a process's own memory each).
    torch_pids = {int(p.name.removeprefix("torch-")) for p in log.glob("torch-*")}
    samplers = [a.pid for a in actors if "SamplerActor" in a.class_name and a.pid]
    assert samplers and not set(samplers) & torch_pids, (samplers, torch_pids)
    assert all(a.pid in torch_pids for a in actors if a.class_name == "RayTrainWorker" and a.pid)

    metrics = out["metrics"]
    assert metrics["eval"] == "layerwise" and metrics["inference_s"] > 0
    assert "test_acc_sampled" in metrics
    cfg = parse_args(args)
    graph = load_graph(cfg.data, cfg.run.seed)
    model = mean_sage(graph.feat_dim, 16, graph.num_classes)
    model.load_state_dict({k.removeprefix("inner."): v for k, v in
                           checkpoint.load_state(out["checkpoint"])["model"].items()})
    with torch.no_grad():
        pred = model([whole_graph(graph)] * 2, torch.from_numpy(graph.feat)).argmax(1).numpy()
    for split, key in (("test", "test_acc"), ("valid", "val_acc_layerwise")):
        ids = graph.split(split)
        assert metrics[key] == pytest.approx(float(np.mean(pred[ids] == graph.label[ids])), abs=1e-9), key
