"""The train worker imports no DGL: training steps, sampled evaluation and the final layer-wise inference.

A real run (``gnnray.driver.fit.run``, two workers) with a plain-torch model
that raises if ``dgl`` is in the worker's ``sys.modules`` whenever it computes:
a DGL import anywhere in the worker's path before its last computation (the
final layer-wise inference) fails the run. The layer-wise accuracies the
ranks computed together must equal a full-graph forward of the checkpoint.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import plain_sage
from gnnray.config import parse_args
from plain_sage import mean_sage, whole_graph


def test_train_worker_never_imports_dgl(ray_cluster, tmp_path):
    import ray.cloudpickle

    from gnnray.data.load import load_graph
    from gnnray.driver.fit import run
    from gnnray.train import checkpoint

    ray.cloudpickle.register_pickle_by_value(plain_sage)  # tests/ is not on the workers' path

    class NoDgl(torch.nn.Module):
        """Raises where it computes if the process has imported DGL."""

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

            if "dgl" in sys.modules:
                raise RuntimeError("the train worker has imported dgl")

    args = ["--dataset", "synthetic", "--synthetic-nodes", "1000", "--synthetic-feat-dim", "8", "--fanouts", "5,5",
            "--batch-size", "200", "--hidden", "16", "--num-workers", "2", "--sampler-actors", "1", "--epochs", "1",
            "--eval-batch-size", "64", "--inference-batch-size", "128", "--storage-path", str(tmp_path),
            "--name", "nodgl"]
    cfg = parse_args(args)
    summary = run(cfg, model_factory=lambda f, c, cfg: NoDgl(mean_sage(f, cfg.model.hidden, c)))
    assert summary.metrics["eval"] == "layerwise" and summary.metrics["inference_s"] > 0
    assert "test_acc_sampled" in summary.metrics

    graph = load_graph(cfg.data, cfg.run.seed)
    model = mean_sage(graph.feat_dim, 16, graph.num_classes)
    model.load_state_dict({k.removeprefix("inner."): v for k, v in
                           checkpoint.load_state(summary.checkpoint)["model"].items()})
    with torch.no_grad():
        pred = model([whole_graph(graph)] * 2, torch.from_numpy(graph.feat)).argmax(1).numpy()
    for split, key in (("test", "test_acc"), ("valid", "val_acc_layerwise")):
        ids = graph.split(split)
        assert summary.metrics[key] == pytest.approx(float(np.mean(pred[ids] == graph.label[ids])), abs=1e-9), key
