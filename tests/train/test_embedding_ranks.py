"""Sharded embeddings on two ranks and three owners: DGL's update, checkpoints by shard, K=1 <-> K=3, lookups ahead.

The ranks are two Ray actors that form a gloo group, as Ray Train's workers do; the owners sit on the three
simulated shard nodes. The reference is DGL's own ``dgl.optim.SparseAdam`` on a ``dgl.nn.NodeEmbedding``
in this process (``test_embedding.dgl_sparse_adam``): each rank's lookup of a step is one forward call, so
DGL averages a row's gradient over the ranks that touched it and counts steps per row, as its
``dgl.distributed.optim.SparseAdam`` does for ``DistEmbedding`` after the exchange between trainers (the
distributed one needs DistGraph servers; both apply the same update). That comparison is marked ``dgl``;
without DGL, the sharded tables are checked against the replicated table on the same two ranks.
"""

from __future__ import annotations

import socket
import sys
import threading
import time

import numpy as np
import pytest
import torch
from ray import cloudpickle

from gnnray.batch import Layer, MiniBatch
from gnnray.train import checkpoint
from gnnray.train.embedding import NodeEmbedding, create_owners, init_rows
from test_embedding import dgl_sparse_adam

# The rank actor below must reach the workers by value: tests/ is not on their path.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, DIM, LR, SEED = 200, 4, 0.05, 3


def _steps(seed: int = 0, count: int = 5) -> list:
    """Per step, each rank's (ids, gradient of its rows): overlapping ranks, a repeated id, an empty lookup,
    and row 199 first touched at the last step."""
    rng = np.random.default_rng(seed)
    steps = []
    for step in range(count):
        per_rank = []
        for rank in range(2):
            ids = rng.choice(N - 1, 40, replace=False)
            if step == 1 and rank == 0:
                ids = np.r_[ids, ids[:3]]  # a row looked up twice by one rank counts twice
            if step == 2 and rank == 1:
                ids = ids[:0]  # nothing looked up: the rank still steps
            if step == count - 1:
                ids = np.r_[ids, N - 1]
            per_rank.append((ids.astype(np.int64), rng.standard_normal((len(ids), DIM)).astype(np.float32)))
        steps.append(per_rank)
    return steps


def _dgl(steps: list) -> np.ndarray:
    return dgl_sparse_adam(N, DIM, LR, SEED, [[(lambda rows, g=g: (rows * torch.from_numpy(g)).sum(), ids)
                                               for ids, g in per_rank] for per_rank in steps])


class _Rank:
    """One train worker: a gloo rank that looks up, steps and checkpoints as ``train.loop`` does."""

    def __init__(self, rank: int, port: int):
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        self._rank = rank

    def run(self, owners, steps: list, load=None, save=None):
        """``owners`` (K>1) or ``None`` (the replicated table); returns the whole table as this rank reads it
        afterwards, and rank 0's checkpoint entry when ``save``."""
        from gnnray.train.embedding import ShardedEmbedding

        table = ShardedEmbedding(owners, N, DIM, LR, 60.0) if owners else NodeEmbedding(N, DIM, LR, SEED)
        if load is not None or owners:
            table.load(load)
        for per_rank in steps:
            ids, g = per_rank[self._rank]
            (table(torch.from_numpy(ids)) * torch.from_numpy(g)).sum().backward()
            table.step()
        entry = table.save(save) if save and self._rank == 0 else None
        with torch.no_grad():
            return table(torch.arange(N)).numpy(), entry


@pytest.fixture(scope="module")
def ranks(ray_cluster):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    actors = [ray_cluster.remote(_Rank).options(num_cpus=0).remote(r, port) for r in range(2)]
    yield actors
    for a in actors:
        ray_cluster.kill(a)


def _run(ray, ranks, owners, steps, load=None, save=None):
    (w0, entry), (w1, _) = ray.get([r.run.remote(owners, steps, load, save) for r in ranks], timeout=300)
    np.testing.assert_array_equal(w0, w1)  # both ranks read the same table
    if save:
        model = torch.nn.Linear(1, 1)
        checkpoint.save(save, model, torch.optim.Adam(model.parameters()), {"epoch": 0, "best_val_acc": 0.0},
                        embedding=entry)
    return w0, entry


def _owners(shard_nodes, bounds):
    nodes = [n.node_id for n in shard_nodes]
    return create_owners([(lo, hi, nodes[k], f"sim{k}") for k, (lo, hi) in enumerate(bounds)], DIM, LR, SEED)


@pytest.mark.dgl
@pytest.mark.parametrize("seed", [0, 1])
def test_two_ranks_update_as_dgl(ray_cluster, shard_nodes, ranks, seed):
    """On 2 ranks, K=3 owners and the replicated K=1 table both give DGL's table (the reference of the tests
    below, which compare with the replicated one)."""
    ray = ray_cluster
    steps = _steps(seed=seed)
    want = _dgl(steps)
    sharded = _owners(shard_nodes, [(0, 70), (70, 140), (140, N)])
    for owners in (sharded, None):
        full, _ = _run(ray, ranks, owners, steps)
        np.testing.assert_allclose(full, want, rtol=0, atol=1e-5)
    for o in sharded:
        ray.kill(o[3])


def test_two_ranks_three_owners_update_as_one_table_and_resume_from_shard_files(ray_cluster, shard_nodes, ranks,
                                                                                tmp_path):
    """K=3 on 2 ranks gives the replicated table's values; its checkpoint (one file set per owner) resumes on K=3
    and on K=1."""
    ray = ray_cluster
    steps = _steps()
    want, _ = _run(ray, ranks, None, steps)  # the replicated table on the same ranks (DGL's: test above)
    sharded = _owners(shard_nodes, [(0, 70), (70, 140), (140, N)])

    full, _ = _run(ray, ranks, sharded, steps)
    np.testing.assert_allclose(full, want, rtol=0, atol=1e-5)
    assert not np.allclose(full[N - 1], init_rows(SEED, N - 1, N, DIM)[0])  # the row first touched last moved

    ckpt = tmp_path / "k3"
    ckpt.mkdir()
    _, entry = _run(ray, ranks, sharded, steps[:3], save=str(ckpt))
    # Each owner wrote only its rows (no process held the table), from its node.
    assert [(s["lo"], s["hi"]) for s in entry["shards"]] == [(0, 70), (70, 140), (140, N)]
    for s in entry["shards"]:
        assert np.load(ckpt / s["dir"] / "weight.npy", mmap_mode="r").shape == (s["hi"] - s["lo"], DIM)
    assert checkpoint.read_info(str(ckpt)) and checkpoint.corrupt_reason(str(ckpt), ("embedding",)) is None

    # Resume on K=3 owners with other bounds, and on the replicated K=1 table: both end at the same table.
    regrouped = _owners(shard_nodes, [(0, 20), (20, 150), (150, N)])
    for owners in (regrouped, None):
        resumed, _ = _run(ray, ranks, owners, steps[3:], load=str(ckpt))
        np.testing.assert_allclose(resumed, want, rtol=0, atol=1e-5)
    for o in sharded + regrouped:
        ray.kill(o[3])


def test_a_replicated_checkpoint_resumes_on_owners(ray_cluster, shard_nodes, ranks, tmp_path):
    """K=1 -> K=3: the owners take their rows and per-row state from the replicated table's one file set."""
    ray = ray_cluster
    steps = _steps(seed=1)
    want, _ = _run(ray, ranks, None, steps)  # without a break (DGL's table: test_two_ranks_update_as_dgl)
    ckpt = tmp_path / "k1"
    ckpt.mkdir()
    _, entry = _run(ray, ranks, None, steps[:2], save=str(ckpt))
    assert [(s["lo"], s["hi"]) for s in entry["shards"]] == [(0, N)]
    owners = _owners(shard_nodes, [(0, 70), (70, 140), (140, N)])
    resumed, _ = _run(ray, ranks, owners, steps[2:], load=str(ckpt))
    np.testing.assert_allclose(resumed, want, rtol=0, atol=1e-5)
    for o in owners:
        ray.kill(o[3])


def test_a_lost_owner_is_named_with_its_node(ray_cluster, shard_nodes):
    """A lookup whose owner is gone fails at once, naming the shard's rows and node; other calls are not waited on."""
    from gnnray.errors import FeatureShardError
    from gnnray.train.embedding import ShardedEmbedding

    owners = _owners(shard_nodes, [(0, 70), (70, 140), (140, N)])
    table = ShardedEmbedding(owners, N, DIM, LR, 60.0)
    assert table(torch.arange(N)).shape == (N, DIM)
    bad = owners[0][3].gather.remote(np.array([10**6]))  # an error inside the owner is named the same way
    with pytest.raises(FeatureShardError, match=r"embedding shard 0:70 on node sim0 \(.*\) failed: .*IndexError"):
        table._get_all([(owners[0], bad)])
    _kill(ray_cluster, owners[1][3])
    with pytest.raises(FeatureShardError, match=r"embedding shard 70:140 on node sim1 \(.*\) was lost"):
        table(torch.arange(N))
    for o in owners:
        ray_cluster.kill(o[3])


def _kill(ray, owner, timeout_s: float = 60.0) -> None:
    """``ray.kill`` only asks: a call sent at once can still be served. Return once the owner's calls fail."""
    ray.kill(owner)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(owner.ping.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the owner still answers {timeout_s:.0f} s after ray.kill")


def _packed(i: int, n: int, width: int = 12):
    """A one-layer packed mini-batch over ``width`` distinct nodes of ``n`` (its first four are the seeds)."""
    rng = np.random.default_rng(i)
    ids = rng.permutation(n)[:width]
    layer = Layer(torch.arange(0, 9, 2), torch.from_numpy(rng.integers(0, width, 8)), width)
    return MiniBatch(torch.from_numpy(ids[:4]), torch.zeros(4, dtype=torch.int64), torch.from_numpy(ids),
                     [layer]).pack()


def test_lookups_ahead_give_the_rows_of_their_step():
    """Rows read on the prefetch thread before earlier steps landed are brought up to date: the same table as
    lookups made at each step."""
    from gnnray.train.prefetch import Prefetcher

    n, feat_dim, batches = 30, 3, 12  # few nodes: consecutive batches share rows
    feat = np.random.default_rng(0).standard_normal((n, feat_dim)).astype(np.float32)
    packed = [_packed(i, n) for i in range(batches)]
    target = torch.from_numpy(np.random.default_rng(1).standard_normal((n, feat_dim + DIM)).astype(np.float32))

    def loss(x, ids):
        return ((x - target[ids]) ** 2).sum()

    now = NodeEmbedding(n, DIM, LR, SEED)
    for p in packed:
        mb = MiniBatch.unpack(torch.from_numpy(p.copy()))
        x = torch.cat([torch.from_numpy(feat[mb.input_nodes.numpy()]), now(mb.input_nodes)], dim=1)
        loss(x, mb.input_nodes).backward()
        now.step()

    ahead = NodeEmbedding(n, DIM, LR, SEED)
    requested = [threading.Event() for _ in range(batches + 2)]

    def source():  # row i+2 is asked for once batch i+1 is prepared, its rows read
        for i, p in enumerate(packed):
            requested[i].set()
            yield p
        for e in requested[batches:]:
            e.set()

    stale = []
    complete = ahead.complete
    ahead.complete = lambda lookup: (stale.append(lookup.version < ahead._version), complete(lookup))[1]
    with Prefetcher(source(), feat, "cpu", depth=3, embedding=ahead) as it:
        for i in range(batches):
            mb = next(it)
            assert mb.x.shape == (12, feat_dim + DIM)
            requested[i + 2].wait(30)  # the next batch's rows were read before this step
            loss(mb.x, mb.input_nodes).backward()
            ahead.step()
    assert sum(stale) >= batches - 2  # read ahead of a step that changed the table
    np.testing.assert_array_equal(ahead.store.weight.numpy(), now.store.weight.numpy())
