"""Layer-wise full-neighbor inference: exact against a full-graph forward, on the workers, from checkpoints, and
jobs/predict.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from conftest import shared_dataset, tiny_graph
from gnnray.batch import Layer
from gnnray.config import parse_args
from gnnray.driver import predict_job
from gnnray.inference import layerwise_task as inference
from gnnray.models.model import build_model
from gnnray.store.handle import publish
from gnnray.train import checkpoint
from gnnray.train.feature_reader import LocalRows
from gnnray.train.layerwise import full_block, infer
from plain_sage import mean_sage

REPO = Path(__file__).resolve().parents[2]


def whole_graph(graph) -> Layer:
    """The whole graph as one block: every node a destination, every in-edge (typed: with its relation)."""
    etype = None if graph.etype is None else torch.from_numpy(graph.etype.astype(np.int64))
    return Layer(torch.from_numpy(graph.indptr.astype(np.int64)), torch.from_numpy(graph.indices.astype(np.int64)),
                 graph.num_nodes, etype)


def full_graph_forward(model, graph, x: np.ndarray, layers: Optional[int] = None) -> torch.Tensor:
    """The reference: the first ``layers`` layers (all by default) on the whole graph at once, no chunks."""
    h = torch.from_numpy(x)
    with torch.no_grad():
        for i in range(model.num_layers if layers is None else layers):
            h = model.layer(i, whole_graph(graph), h)
    return h


def _model(name: str, in_feats: int, num_classes: int, layers: int, hidden: int):
    torch.manual_seed(0)
    if name == "mean-sage":  # plain torch, defined in the tests
        return mean_sage(in_feats, hidden, num_classes, layers).eval()
    return build_model(in_feats, num_classes, layers, hidden, 0.5, name=name, heads=2).eval()


@pytest.mark.parametrize("name", ["mean-sage", "sage", "gat", "gcn"])
def test_chunked_layers_equal_the_full_graph_forward(name):
    """Layer by layer, in chunks of 7 nodes with all their in-neighbors: the full-graph result within 1e-5."""
    graph = tiny_graph(num_nodes=60, num_edges=300, feat_dim=5)
    model = _model(name, 5, graph.num_classes, 3, 8)
    got = infer(model, graph, [LocalRows(graph.feat)], 7, "cpu", keep_input=True)
    want = full_graph_forward(model, graph, graph.feat)
    np.testing.assert_array_equal(got.pred, want.argmax(1).numpy())
    np.testing.assert_allclose(got.last_input, full_graph_forward(model, graph, graph.feat, 2).numpy(), rtol=0,
                               atol=1e-5)
    for k, split in enumerate(("train", "valid", "test")):
        ids = graph.split(split)
        assert got.correct[k] == np.sum(want.argmax(1).numpy()[ids] == graph.label[ids]) and got.total[k] == len(ids)


@pytest.mark.parametrize("typed", [False, True])
def test_full_block_is_the_all_neighbor_sample(typed):
    """A chunk's block from the CSC has the edges (and relations) GraphBolt samples with fanout -1."""
    from gnnray.data.synthetic import synthetic_hetero_parts
    from gnnray.sampler.sampler import Sampler

    graph = synthetic_hetero_parts(300, 4, 8, 8, 0).build() if typed else tiny_graph(num_nodes=90, num_edges=700)
    for a, b in [(0, graph.num_nodes), (0, 13), (40, 71), (graph.num_nodes - 5, graph.num_nodes)]:
        block, src = full_block(graph, a, b)
        src = np.arange(graph.num_nodes) if src is None else src
        assert block.num_dst == b - a and np.array_equal(src[:b - a], np.arange(a, b))
        assert len(np.unique(src)) == len(src) == block.num_src
        mb = Sampler(graph, [-1]).sample(np.arange(a, b))
        assert _edges(block, src) == _edges(mb.layers[0], mb.input_nodes.numpy())


def _edges(layer: Layer, src: np.ndarray) -> list:
    dst = np.repeat(np.arange(layer.num_dst), np.diff(layer.indptr.numpy()))
    etype = [0] * len(dst) if layer.etype is None else layer.etype.tolist()
    return sorted(zip(dst.tolist(), src[layer.indices.numpy()].tolist(), etype))


@pytest.mark.parametrize("name", ["mean-sage", "sage"])
def test_layerwise_task_equals_the_full_graph_forward(ray_cluster, tmp_path, name):
    """The Ray task (features + embedding table as input, chunks of 16) writes exact predictions and embeddings."""
    graph = tiny_graph(num_nodes=90, num_edges=500, feat_dim=3)
    embedding = np.random.default_rng(1).standard_normal((90, 2)).astype(np.float32)
    model = _model(name, 5, graph.num_classes, 2, 6)
    out = tmp_path / "preds.parquet"
    result = inference.run(graph, publish(graph), model, embedding=embedding, batch_size=16, output=str(out),
                           with_embeddings=True)

    x = np.concatenate([graph.feat, embedding], axis=1)
    logits = full_graph_forward(model, graph, x)
    table = pq.read_table(out).to_pydict()
    assert table["id"] == list(range(90))  # every node once, in id order
    np.testing.assert_array_equal(table["pred"], logits.argmax(1).numpy())
    hidden = full_graph_forward(model, graph, x, 1).numpy()  # the output layer's input
    np.testing.assert_allclose(np.array(table["embedding"]), hidden, rtol=0, atol=1e-5)
    for split in ("train", "valid", "test"):
        ids = graph.split(split)
        assert result.accuracy[split] == pytest.approx(np.mean(logits.argmax(1).numpy()[ids] == graph.label[ids]))
    assert os.listdir(tmp_path) == ["preds.parquet"]


# cora_run (tests/conftest.py): one SAGE run on cora with --eval layerwise, shared with tests/test_job.py.


def test_cora_layerwise_matches_or_beats_sampled(cora_run):
    summary, _ = cora_run
    layerwise, sampled = summary.test_acc, summary.metrics["test_acc_sampled"]
    print(f"cora test accuracy: layer-wise {layerwise:.4f}, sampled {sampled:.4f}")
    assert summary.metrics["eval"] == "layerwise" and "test_acc_sampled=" in summary.line()
    assert layerwise >= 0.77, summary.line()
    assert layerwise >= sampled - 0.01, summary.line()  # exact neighbors: no worse than a sample of 10


def test_predict_script_writes_parquet(cora_run, ray_cluster, tmp_path):
    """jobs/predict.py on the run directory reproduces the run's layer-wise test accuracy from its Parquet."""
    summary, storage = cora_run
    out = tmp_path / "out" / "preds.parquet"
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    proc = subprocess.run([sys.executable, "jobs/predict.py", "--checkpoint", str(storage / "cora"),
                           "--output", str(out), "--embeddings"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"test_acc={summary.test_acc:.4f}" in proc.stdout
    table = pq.read_table(out)
    assert table.column_names == ["id", "pred", "embedding"] and table.num_rows == 2708
    ids, pred = table.column("id").to_numpy(), table.column("pred").to_numpy()
    np.testing.assert_array_equal(ids, np.arange(2708))
    assert table.schema.field("embedding").type.list_size == 64  # the hidden layer's width
    from gnnray.config import DataConfig
    from gnnray.data.load import load_graph

    graph = load_graph(DataConfig(dataset=str(shared_dataset("cora"))))
    assert np.mean(pred[graph.test_idx] == graph.label[graph.test_idx]) == pytest.approx(summary.test_acc)
    assert sorted(os.listdir(out.parent)) == ["preds.parquet"]  # no work files left behind


def test_predict_rejects_bad_checkpoints(tmp_path, capsys):
    assert predict_job.main(["--checkpoint", str(tmp_path / "nope"), "--output", str(tmp_path / "p.parquet")]) == 2
    assert "no valid checkpoint" in capsys.readouterr().err

    # A checkpoint written without a configuration (as before this version) is named as such.
    model = build_model(3, 2, 1, 4, 0.0)
    ckpt = tmp_path / "checkpoint_old"
    ckpt.mkdir()
    checkpoint.save(str(ckpt), model, torch.optim.Adam(model.parameters()), {"epoch": 0, "best_val_acc": 0.5})
    assert predict_job.main(["--checkpoint", str(ckpt), "--output", str(tmp_path / "p.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gnnray: error:") and "no job configuration" in err and "Traceback" not in err


def test_config_round_trips_through_checkpoint_json():
    """predict.py rebuilds exactly the run's configuration from meta.json."""
    import dataclasses
    import json

    from gnnray.config import from_dict

    cfg = parse_args(["--model", "gat", "--heads", "3", "--fanouts", "5,-1", "--embedding-dim", "8", "--eval",
                      "sampled", "--reverse-edges", "yes", "--use-gpu", "no"])
    assert from_dict(json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg
    assert from_dict({"model": {"name": "gcn", "unknown_key": 1}}).model.name == "gcn"  # other versions load


def test_layerwise_needs_a_per_layer_model(tmp_path):
    class Plain(torch.nn.Module):
        def forward(self, blocks, x):
            return x

    graph = tiny_graph()
    assert not inference.supports_layerwise(Plain())
    with pytest.raises(ValueError, match="layer"):
        inference.run(graph, None, Plain())


def test_finished_run_resumed_gets_layerwise_accuracies(ray_cluster, tmp_path):
    """A run that finished under --eval sampled, started again under --eval layerwise: one Ray task adds them."""
    from gnnray.driver.fit import run

    args = ["--dataset", "synthetic", "--synthetic-nodes", "600", "--synthetic-feat-dim", "8", "--fanouts", "5,5",
            "--batch-size", "200", "--hidden", "16", "--num-workers", "1", "--sampler-actors", "1", "--epochs", "1",
            "--storage-path", str(tmp_path), "--name", "done"]
    sampled = run(parse_args(args + ["--eval", "sampled"]))
    assert "eval" not in sampled.metrics
    again = run(parse_args(args))  # nothing to train: the driver's fallback computes them
    assert again.metrics["eval"] == "layerwise" and again.metrics["test_acc_sampled"] == sampled.test_acc
    assert 0 <= again.test_acc <= 1 and again.metrics["inference_s"] > 0
    assert run(parse_args(args)).metrics == again.metrics  # computed once, read back from meta.json
