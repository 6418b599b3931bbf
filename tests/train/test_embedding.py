"""Learnable node embeddings: DGL's sparse updates kept identical across DDP ranks, checkpoints, a featureless job.

The reference update is DGL's own: ``dgl.optim.SparseAdam`` on a ``dgl.nn.NodeEmbedding`` in this process, each
rank's lookup one forward call, so its optimizer sees every rank's rows of a step together, as
``dgl.distributed.optim.SparseAdam`` does after its exchange between trainers (the same update function).
The comparisons with it are marked ``dgl``; DGL is imported inside them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import run_gloo_ranks
from gnnray.config import DataConfig, parse_args
from gnnray.data.load import load_graph
from gnnray.data.synthetic import make_synthetic
from gnnray.errors import DatasetError
from gnnray.train import checkpoint
from gnnray.train.embedding import NodeEmbedding, init_rows

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
    np.save(f"{out}/rank{rank}.npy", table.store.weight.numpy())
    dist.barrier()  # without it, gloo's teardown here sometimes hangs one rank once the other has left
    dist.destroy_process_group()


def dgl_sparse_adam(n: int, dim: int, lr: float, seed: int, steps) -> np.ndarray:
    """The table DGL's ``SparseAdam`` makes: ``steps`` lists, per step, each rank's ``loss(rows) -> tensor`` and
    lookup ids; rows start as :func:`init_rows`."""
    import uuid

    import dgl

    start = torch.from_numpy(init_rows(seed, 0, n, dim))
    emb = dgl.nn.NodeEmbedding(n, dim, f"gnnray-test-{uuid.uuid4().hex[:12]}", init_func=lambda t: t.copy_(start))
    opt = dgl.optim.SparseAdam([emb], lr=lr)
    for per_rank in steps:
        opt.zero_grad()  # as DGL's examples: the step then forgets this step's lookups
        losses = [loss(emb(torch.as_tensor(np.asarray(ids, dtype=np.int64)))) for loss, ids in per_rank if len(ids)]
        sum(losses).backward()
        opt.step()
    return emb.weight.detach().clone().numpy()


@pytest.fixture(scope="module")
def rank_tables(tmp_path_factory):
    """The tables two gloo ranks end with after LOOKUPS (run once for the tests below)."""
    out = tmp_path_factory.mktemp("ranks")
    run_gloo_ranks(_rank_main, out, timeout=180)
    return np.load(out / "rank0.npy"), np.load(out / "rank1.npy")


def test_sparse_updates_stay_identical_across_ranks(rank_tables):
    """Two gloo ranks end with the same table; only the rows some rank looked up moved."""
    rank0, rank1 = rank_tables
    np.testing.assert_array_equal(rank0, rank1)
    initial = init_rows(5, 0, N, DIM)
    touched = sorted({i for r in LOOKUPS.values() for ids in r for i in ids})
    untouched = np.setdiff1d(np.arange(N), touched)
    np.testing.assert_array_equal(rank0[untouched], initial[untouched])  # sparse: other rows never move
    assert not np.allclose(rank0[touched], initial[touched])


@pytest.mark.dgl
def test_sparse_updates_across_ranks_match_dgl(rank_tables):
    """The ranks' table is the one DGL's SparseAdam makes from both ranks' rows."""
    steps = [[(lambda rows, r=r: (rows * (r + 1.0)).pow(2).sum(), LOOKUPS[r][step]) for r in (0, 1)]
             for step in range(2)]
    ref = dgl_sparse_adam(N, DIM, LR, 5, steps)
    np.testing.assert_allclose(rank_tables[0], ref, rtol=0, atol=1e-6)


def test_two_ranks_reduce_as_one_process_that_saw_both_lookups(rank_tables):
    """Without DGL: two gloo ranks (ids exchanged, the union's rows all-reduced) end with the table one process
    makes from each step's lookups of both ranks together, a row looked up twice counted twice in its mean."""
    rank0, rank1 = rank_tables
    np.testing.assert_array_equal(rank0, rank1)
    one = NodeEmbedding(N, DIM, LR, seed=5)
    for step in range(2):
        ids = LOOKUPS[0][step] + LOOKUPS[1][step]
        rows = one(torch.tensor(ids))
        k = len(LOOKUPS[0][step])
        (rows[:k].pow(2).sum() + (rows[k:] * 2.0).pow(2).sum()).backward()  # each rank's loss on its rows
        one.step()
    np.testing.assert_allclose(rank0, one.store.weight.numpy(), rtol=0, atol=1e-6)
    assert not np.allclose(rank0, init_rows(5, 0, N, DIM))


def test_rows_first_touched_late_move_by_about_lr():
    """Per-row step counts (DGL's): a row's first update moves each coordinate by about lr, whatever the step.

    torch's SparseAdam keeps one step count: a row first touched at step 10,000 would move by 3.16 lr.
    """
    t = NodeEmbedding(N, DIM, LR, seed=2)
    for _ in range(200):
        t.zero_grad()
        t(torch.tensor([1, 2])).sum().backward()
        t.step()
    before = t.store.weight[7].clone()
    t(torch.tensor([7])).sum().backward()
    t.step()
    np.testing.assert_allclose((before - t.store.weight[7]).numpy(), LR, rtol=1e-4)
    assert t.store.step_count[7] == 1 and t.store.step_count[1] == 200


def _save(table: NodeEmbedding, directory: Path) -> None:
    """A checkpoint of ``table`` in ``directory``: its shard files and the meta.json that lists them."""
    model = torch.nn.Linear(1, 1)
    directory.mkdir()
    checkpoint.save(str(directory), model, torch.optim.Adam(model.parameters()), {"epoch": 0, "best_val_acc": 0.0},
                    embedding=table.save(str(directory)))


def test_checkpoint_round_trip_resumes_the_same_updates(tmp_path):
    a = NodeEmbedding(N, DIM, LR, seed=1)
    for ids in ([1, 2], [2, 3]):
        a.zero_grad()
        _loss(a, ids, 0).backward()
        a.step()
    _save(a, tmp_path / "ckpt")
    assert checkpoint.corrupt_reason(str(tmp_path / "ckpt"), ("embedding",)) is None
    b = NodeEmbedding(N, DIM, LR, seed=99)
    b.load(str(tmp_path / "ckpt"))
    for t in (a, b):  # one more step each: same moments and step counts, same result
        t.zero_grad()
        _loss(t, [3, 4], 0).backward()
        t.step()
    torch.testing.assert_close(a.store.weight, b.store.weight, rtol=0, atol=0)
    assert a.nbytes == N * DIM * 4


def test_older_whole_table_checkpoints_still_load(tmp_path):
    """A checkpoint of the previous format (torch's SparseAdam state in state.pt) is read, rows where asked."""
    weight = torch.from_numpy(init_rows(3, 0, N, DIM)).requires_grad_()
    opt = torch.optim.SparseAdam([weight], lr=LR)
    weight.grad = torch.sparse_coo_tensor(torch.tensor([[2, 5]]), torch.ones(2, DIM), (N, DIM))
    opt.step()
    model = torch.nn.Linear(1, 1)
    (tmp_path / "old").mkdir()
    checkpoint.save(str(tmp_path / "old"), model, torch.optim.Adam(model.parameters()),
                    {"epoch": 0, "best_val_acc": 0.0},
                    extra={"embedding": {"weight": weight.detach(), "optimizer": opt.state_dict()}})
    rows = checkpoint.read_rows(str(tmp_path / "old"), 4, 10)
    np.testing.assert_array_equal(rows["weight"], weight.detach().numpy()[4:10])
    assert rows["step"].tolist() == [0, 1, 0, 0, 0, 0]  # row 5 was updated once, the others never
    t = NodeEmbedding(N, DIM, LR)
    t.load(str(tmp_path / "old"))
    np.testing.assert_array_equal(t.store.weight.numpy(), weight.detach().numpy())


def test_step_without_lookups_is_a_no_op():
    t = NodeEmbedding(N, DIM, LR)
    before = t.store.weight.clone()
    t.zero_grad()
    t.step()  # a rank with an empty batch still joins the all-reduce
    torch.testing.assert_close(t.store.weight, before)


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

    This is also the test that GCN trains through the job (GAT's is in tests/models/test_model.py).
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
    assert "embedding" not in checkpoint.load_state(summary.checkpoint)  # in its own files, not in state.pt
    rows = checkpoint.read_rows(summary.checkpoint, 0, 3000)
    assert rows["weight"].shape == (3000, 16)
    assert rows["exp_avg_sq"].any() and rows["step"].max() > 0  # SparseAdam's state is saved for resume
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
    # Checkpoints: each owner writes its rows; the same arrays as the replicated table's one file.
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        entry = sharded.save(d)
        assert [(s["lo"], s["hi"]) for s in entry["shards"]] == [(0, 300), (300, 700), (700, n)]
        for s in entry["shards"]:
            saved = np.load(f"{d}/{s['dir']}/exp_avg.npy")
            np.testing.assert_allclose(saved, replicated.store.exp_avg[s["lo"]:s["hi"]].numpy(), atol=1e-6)
    for o in owners:
        ray.kill(o[3])
