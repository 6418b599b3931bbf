"""Models selectable by --model (sage, gat, gcn): layers in, logits out; they train through the job."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_graph
from gnnray.config import parse_args
from gnnray.models.model import GAT, GCN, GraphSAGE, build_model, model_for
from gnnray.sampler.sampler import Sampler

SYNTHETIC = ["--dataset", "synthetic", "--synthetic-nodes", "2000", "--synthetic-feat-dim", "16",
             "--fanouts", "5,5", "--batch-size", "32", "--hidden", "8", "--num-workers", "2",
             "--sampler-actors", "1,2", "--self-loops"]


def test_build_model_switch():
    assert isinstance(build_model(4, 3, 2, 8, 0.5), GraphSAGE)  # the default stays GraphSAGE
    gat = build_model(4, 3, 2, 8, 0.5, name="gat", heads=3)
    assert isinstance(gat, GAT) and gat.layers[0]._num_heads == 3 and gat.layers[1]._num_heads == 1
    assert isinstance(build_model(4, 3, 2, 8, 0.5, name="gcn"), GCN)
    with pytest.raises(ValueError, match="unknown model 'gin'.*sage, gat, gcn"):
        build_model(4, 3, 2, 8, 0.5, name="gin")
    cfg = parse_args(["--model", "gat", "--heads", "2", "--hidden", "5", "--fanouts", "3,3,3"])
    model = model_for(4, 3, cfg)
    assert isinstance(model, GAT) and model.num_layers == 3 and model.layers[0].fc.out_features == 10


@pytest.mark.parametrize("name", ["sage", "gat", "gcn"])
def test_models_learn_on_sampled_blocks(name):
    """forward(layers, x) gives seed logits; nodes without in-edges are fine; a few steps fit a tiny graph."""
    graph = tiny_graph(num_nodes=80, num_edges=240, feat_dim=6)
    assert np.any(np.diff(graph.indptr) == 0)  # some nodes have no in-edges
    torch.manual_seed(0)
    model = build_model(6, graph.num_classes, 2, 16, 0.0, name=name, heads=2)
    mb = Sampler(graph, (4, 4)).sample(np.arange(80))  # the same blocks in every run (the sampler's seed 0)
    x = torch.from_numpy(graph.feat[mb.input_nodes.numpy()])
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    losses = []
    for _ in range(30):
        logits = model(mb.layers, x)
        assert logits.shape == (80, graph.num_classes) and torch.isfinite(logits).all()
        loss = F.cross_entropy(logits, mb.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # GCN without self-loops learns slowest here: 0.63-0.70x over sampler seeds 0-7 (sage ~0.1x, gat ~0.4x).
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize("name", ["sage", "gat", "gcn"])
def test_models_give_the_same_logits_on_int32_and_int64_batches(name):
    """Train workers get int32-packed batches for graphs under 2**31 nodes: same numbers as int64."""
    from gnnray.batch import MiniBatch

    graph = tiny_graph(num_nodes=80, num_edges=240, feat_dim=6)
    torch.manual_seed(0)
    model = build_model(6, graph.num_classes, 2, 16, 0.0, name=name, heads=2).eval()
    mb = Sampler(graph, (4, 4)).sample(np.arange(0, 80, 3))
    x = torch.from_numpy(graph.feat[mb.input_nodes.numpy()])
    logits = {dtype: model(MiniBatch.unpack(torch.from_numpy(mb.pack(dtype))).layers, x)
              for dtype in (np.int32, np.int64)}
    torch.testing.assert_close(logits[np.int32], logits[np.int64])


def test_gat_trains_through_the_job(ray_cluster, tmp_path):
    """GAT trains with the same job and loop, and its final accuracy is layer-wise.

    GCN runs through the job in tests/train/test_embedding.py (on learned embeddings).
    """
    from gnnray.driver.fit import run
    from gnnray.train import checkpoint

    cfg = parse_args(SYNTHETIC + ["--model", "gat", "--heads", "2", "--epochs", "3", "--lr", "0.03",
                                  "--storage-path", str(tmp_path), "--name", "gat"])
    summary = run(cfg)
    chance = 1 / 8
    assert summary.test_acc > 2.5 * chance, summary.line()
    assert summary.metrics["eval"] == "layerwise" and "test_acc_sampled" in summary.metrics
    assert checkpoint.read_meta(summary.checkpoint)["config"]["model"]["name"] == "gat"


@pytest.mark.parametrize("args, message", [
    (["--heads", "0"], "--heads 0"),
    (["--embedding-dim", "-1"], "--embedding-dim -1"),
    (["--inference-batch-size", "0"], "--inference-batch-size 0"),
    (["--embedding-lr", "0"], "--embedding-lr 0"),
])
def test_new_options_are_validated(args, message):
    from gnnray.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        parse_args(args)
