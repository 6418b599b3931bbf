"""Learnable node embeddings: sparse updates kept identical across DDP ranks, checkpoints, and a featureless job."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import run_gloo_ranks
from gnnray.train import checkpoint
from gnnray.config import DataConfig, parse_args
from gnnray.data.load import load_graph
from gnnray.data.synthetic import make_synthetic
from gnnray.train.embedding import NodeEmbedding
from gnnray.errors import DatasetError

N, DIM, LR = 30, 4, 0.1
# Rows each rank looks up per step: overlapping, repeated, and disjoint ones.
LOOKUPS = {0: [[1, 2, 2, 7], [3, 4]], 1: [[2, 5, 9], [4, 4, 11]]}


def _loss(table: NodeEmbedding, ids: list, rank: int) -> torch.Tensor:
    return (table(torch.tensor(ids)) * (rank + 1.0)).pow(2).sum()  # a different gradient per rank


def _rank_main(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    table = NodeEmbedding(N, DIM, LR, seed=5)
    for ids in LOOKUPS[rank]:
        table.zero_grad()
        _loss(table, ids, rank).backward()
        table.step()
    np.save(f"{out}/rank{rank}.npy", table.table.weight.detach().numpy())
    dist.destroy_process_group()


def test_sparse_updates_stay_identical_across_ranks(tmp_path):
    """Two gloo ranks end with the same table: the one a single process gets from the averaged gradients."""
    run_gloo_ranks(_rank_main, tmp_path, timeout=180)
    rank0, rank1 = np.load(tmp_path / "rank0.npy"), np.load(tmp_path / "rank1.npy")
    np.testing.assert_array_equal(rank0, rank1)

    ref = NodeEmbedding(N, DIM, LR, seed=5)
    initial = ref.table.weight.detach().clone().numpy()
    for step in range(2):
        ref.zero_grad()
        (sum(_loss(ref, LOOKUPS[r][step], r) for r in (0, 1)) / 2).backward()  # DDP's mean over ranks
        ref.optimizer.step()
    np.testing.assert_allclose(rank0, ref.table.weight.detach().numpy(), rtol=0, atol=1e-6)
    touched = sorted({i for r in LOOKUPS.values() for ids in r for i in ids})
    untouched = np.setdiff1d(np.arange(N), touched)
    np.testing.assert_array_equal(rank0[untouched], initial[untouched])  # sparse: other rows never move
    assert not np.allclose(rank0[touched], initial[touched])


def test_state_dict_round_trip_resumes_the_same_updates():
    a = NodeEmbedding(N, DIM, LR, seed=1)
    for ids in ([1, 2], [2, 3]):
        a.zero_grad()
        _loss(a, ids, 0).backward()
        a.step()
    buf = io.BytesIO()  # through bytes, as a checkpoint: b must not share a's tensors
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = NodeEmbedding(N, DIM, LR, seed=99)
    b.load_state_dict(torch.load(buf))
    for t in (a, b):  # one more step each: same moments, same result
        t.zero_grad()
        _loss(t, [3, 4], 0).backward()
        t.step()
    torch.testing.assert_close(a.table.weight, b.table.weight, rtol=0, atol=0)
    assert a.nbytes == N * DIM * 4


def test_step_without_lookups_is_a_no_op():
    t = NodeEmbedding(N, DIM, LR)
    before = t.table.weight.detach().clone()
    t.zero_grad()
    t.step()  # a rank with an empty batch still joins the all-reduce
    torch.testing.assert_close(t.table.weight, before)


def write_featureless_dir(path: Path, n: int = 3000, classes: int = 4) -> Path:
    """A synthetic homophilous graph as a graph directory without features."""
    g = make_synthetic(n, classes, 4, 10, seed=0)
    dst = np.repeat(np.arange(n), np.diff(g.indptr))
    split = np.full(n, "none", dtype=object)
    for name in ("train", "valid", "test"):
        split[g.split(name)] = name
    path.mkdir()
    pq.write_table(pa.table({"src": g.indices, "dst": dst}), path / "edges.parquet")
    pq.write_table(pa.table({"id": np.arange(n), "label": g.label, "split": split.astype(str)}), path / "nodes.parquet")
    (path / "meta.json").write_text(json.dumps({"num_nodes": n, "num_classes": classes, "name": "featureless"}))
    return path


def test_featureless_graph_gets_zero_width_features(tmp_path):
    path = write_featureless_dir(tmp_path / "g", n=200)
    with pytest.raises(DatasetError, match="--embedding-dim"):
        load_graph(DataConfig(dataset=str(path)))
    g = load_graph(DataConfig(dataset=str(path), embedding_dim=8))
    assert g.feat.shape == (200, 0) and g.feat.dtype == np.float32 and g.feat_dim == 0 and g.feat.nbytes == 0


def test_featureless_job_learns_from_structure(ray_cluster, tmp_path):
    """GCN on 2 ranks with --embedding-dim on a graph without features: well above chance; checkpoints hold the table.

    This is also the test that GCN trains through the job (GAT's is in tests/train/test_model.py).
    """
    from gnnray.driver.fit import run

    path = write_featureless_dir(tmp_path / "g")
    cfg = parse_args(["--dataset", str(path), "--embedding-dim", "16", "--embedding-lr", "0.05", "--epochs", "3",
                      "--model", "gcn", "--self-loops",
                      "--fanouts", "5,5", "--batch-size", "128", "--hidden", "32", "--lr", "0.01",
                      "--num-workers", "2", "--storage-path", str(tmp_path / "runs"), "--name", "emb",
                      "--inference-batch-size", "1000"])
    summary = run(cfg)
    chance = 1 / 4
    assert summary.best_val_acc > 2 * chance and summary.test_acc > 2 * chance, summary.line()
    assert summary.metrics["eval"] == "layerwise"  # exact inference read the trained table
    state = checkpoint.load_state(summary.checkpoint)
    assert state["embedding"]["weight"].shape == (3000, 16)
    assert state["embedding"]["optimizer"]["state"]  # SparseAdam's moments are saved for resume
    config = checkpoint.read_meta(summary.checkpoint)["config"]
    assert config["data"]["embedding_dim"] == 16 and config["model"]["name"] == "gcn"


def test_sharded_table_updates_match_the_replicated_one(ray_cluster):
    """Owners applying SparseAdam to their rows give the replicated table's values; a rank holds only its batch."""
    from gnnray.train.embedding import NodeEmbedding, ShardedEmbedding, create_owners

    ray = ray_cluster
    n, dim, lr = 1000, 4, 0.05
    node = ray.get_runtime_context().get_node_id()
    owners = create_owners([(0, 300, node, "head"), (300, 700, node, "head"), (700, n, node, "head")], dim, lr, 7)
    sharded, replicated = ShardedEmbedding(owners, n, dim, lr, 60.0), NodeEmbedding(n, dim, lr, 7)
    rng = np.random.default_rng(0)
    for step in range(4):
        ids = torch.from_numpy(rng.choice(n, 50, replace=False))
        target = torch.from_numpy(rng.standard_normal((50, dim)).astype(np.float32))
        for table in (sharded, replicated):
            table.zero_grad()
            ((table(ids) - target) ** 2).sum().backward()
            table.step()
        assert sharded.nbytes == 0  # rows are dropped after the step: no table on the rank
    touched = torch.arange(n)
    with torch.no_grad():
        assert torch.allclose(sharded(touched), replicated(touched), atol=1e-6)
    state = sharded.state_dict()
    assert torch.allclose(state["weight"], replicated.table.weight.detach(), atol=1e-6)
    assert torch.allclose(state["optimizer"]["state"][0]["exp_avg"],
                          replicated.optimizer.state_dict()["state"][0]["exp_avg"].to_dense(), atol=1e-6)
