"""Layer-wise full-neighbor inference: exact against a full-graph forward, from checkpoints, and jobs/predict.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from conftest import shared_dataset, tiny_graph
from gnnray.train import checkpoint
from gnnray.driver import predict
from gnnray.inference import layerwise as inference
from gnnray.config import parse_args
from gnnray.data.store import publish
from gnnray.train.model import build_model

REPO = Path(__file__).resolve().parents[2]


def full_graph_forward(model, graph, x: np.ndarray) -> torch.Tensor:
    """The reference: every layer on the whole graph at once, in one process (no blocks, no chunks)."""
    import dgl

    dst = np.repeat(np.arange(graph.num_nodes), np.diff(graph.indptr))
    g = dgl.graph((torch.from_numpy(graph.indices), torch.from_numpy(dst)), num_nodes=graph.num_nodes)
    with torch.no_grad():
        return model([g] * model.num_layers, torch.from_numpy(x))


@pytest.mark.parametrize("name", ["sage", "gat", "gcn"])
def test_chunked_layers_equal_the_full_graph_forward(name):
    """Layer by layer, in chunks of 7 nodes with all their in-neighbors: the full-graph result within 1e-5."""
    graph = tiny_graph(num_nodes=60, num_edges=300, feat_dim=5)
    torch.manual_seed(0)
    model = build_model(5, graph.num_classes, 3, 8, 0.5, name=name, heads=2).eval()
    h = graph.feat
    for i in range(model.num_layers):
        runner = inference.LayerRunner(graph, model, i, [h])
        h = torch.cat([runner(np.arange(a, min(a + 7, graph.num_nodes)))[0]
                       for a in range(0, graph.num_nodes, 7)]).numpy()
    np.testing.assert_allclose(h, full_graph_forward(model, graph, graph.feat).numpy(), rtol=0, atol=1e-5)


def test_layerwise_job_equals_the_full_graph_forward(ray_cluster, tmp_path):
    """The Ray Data job (features + embedding table as input, chunks of 16) writes exact predictions and embeddings."""
    graph = tiny_graph(num_nodes=90, num_edges=500, feat_dim=3)
    embedding = np.random.default_rng(1).standard_normal((90, 2)).astype(np.float32)
    torch.manual_seed(0)
    model = build_model(5, graph.num_classes, 2, 6, 0.5).eval()
    out = tmp_path / "preds.parquet"
    result = inference.run(graph, publish(graph), model, embedding=embedding, work_dir=str(tmp_path / "work"),
                           batch_size=16, output=str(out), with_embeddings=True)

    x = np.concatenate([graph.feat, embedding], axis=1)
    logits = full_graph_forward(model, graph, x)
    table = pq.read_table(out).to_pydict()
    assert table["id"] == list(range(90))  # every node once, in id order
    np.testing.assert_array_equal(table["pred"], logits.argmax(1).numpy())
    hidden = model.layer(0, _full_block(graph), torch.from_numpy(x)).detach().numpy()  # the output layer's input
    np.testing.assert_allclose(np.array(table["embedding"]), hidden, rtol=0, atol=1e-5)
    for split in ("train", "valid", "test"):
        ids = graph.split(split)
        assert result.accuracy[split] == pytest.approx(np.mean(logits.argmax(1).numpy()[ids] == graph.label[ids]))
    assert os.listdir(tmp_path / "work") == []  # the layers' files are removed


def _full_block(graph):
    import dgl

    dst = np.repeat(np.arange(graph.num_nodes), np.diff(graph.indptr))
    return dgl.graph((torch.from_numpy(graph.indices), torch.from_numpy(dst)), num_nodes=graph.num_nodes)


@pytest.fixture(scope="module")
def cora_run(ray_cluster, tmp_path_factory):
    """One SAGE training run on cora with --eval layerwise (the sampled test accuracy is kept beside it)."""
    from gnnray.driver.fit import run

    cora = shared_dataset("cora")
    storage = tmp_path_factory.mktemp("runs")
    cfg = parse_args(["--dataset", str(cora), "--normalize-features", "--epochs", "20", "--batch-size", "32",
                      "--fanouts", "10,10", "--hidden", "64", "--lr", "0.01", "--weight-decay", "5e-4",
                      "--num-workers", "2", "--storage-path", str(storage), "--name", "cora"])
    return run(cfg), storage


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
    assert predict.main(["--checkpoint", str(tmp_path / "nope"), "--output", str(tmp_path / "p.parquet")]) == 2
    assert "no valid checkpoint" in capsys.readouterr().err

    # A checkpoint written without a configuration (as before this version) is named as such.
    model = build_model(3, 2, 1, 4, 0.0)
    ckpt = tmp_path / "checkpoint_old"
    ckpt.mkdir()
    checkpoint.save(str(ckpt), model, torch.optim.Adam(model.parameters()), {"epoch": 0, "best_val_acc": 0.5})
    assert predict.main(["--checkpoint", str(ckpt), "--output", str(tmp_path / "p.parquet")]) == 2
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


def test_layer_actor_opens_its_files_at_the_first_batch(ray_cluster, tmp_path):
    """An actor that starts as its layer ends (and gets no batch) must not fail on files already removed."""
    import ray

    graph = tiny_graph()
    model = build_model(graph.feat_dim, graph.num_classes, 2, 8, 0.0).eval()
    removed = str(tmp_path / "layer0.npy")  # the driver removed it after the layer: the actor starts anyway
    actor = inference._LayerActor(publish(graph), [ray.put(model)], 1, removed, None, None, False)
    with pytest.raises(FileNotFoundError):  # a batch would need it
        actor({"id": np.arange(4)})
    np.save(removed, np.zeros((graph.num_nodes, 8), dtype=np.float32))
    out = actor({"id": np.arange(4)})
    assert out["id"].tolist() == [0, 1, 2, 3] and out["pred"].shape == (4,)
