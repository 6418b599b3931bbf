"""Layer-wise inference with sharded hidden tables (``gnnray.train.layerwise_hidden``) on three simulated nodes.

Against the same inference unsharded, in one process with the whole table:
equal predictions and hidden rows, with the ranks beside their shards (each
node's ranks compute its range) and with one rank elsewhere (every range sent
to its node's server). Each shard server's peak of hidden rows is the formula,
its range of two tables (2 x table / K), and nothing is left once it ends.
"""

from __future__ import annotations

import dataclasses
import socket
import sys

import numpy as np
import pytest
import ray
import ray.cloudpickle as cloudpickle

from gnnray.config import DataConfig, JobConfig
from gnnray.data.load import load_graph
from gnnray.models.model import build_model
from gnnray.store.shards import Shard, ShardedFeatures, hidden_nbytes, shard_bounds
from gnnray.train.feature_reader import LocalRows
from gnnray.train.layerwise import infer
from gnnray.train.layerwise_hidden import assign

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks' class reaches the workers by value

# 9,000 nodes x 64 wide: chunks of 600 rows are 150 KiB, objects in the store (not inlined by Ray).
CFG = DataConfig(dataset="synthetic", synthetic_nodes=9000, synthetic_feat_dim=12, synthetic_avg_degree=6,
                 feature_shards=3, feature_cache=0.1)
HIDDEN, LAYERS, CHUNK = 64, 4, 600  # three hidden tables: a server holds two at most


def _shards(bounds, nodes) -> ShardedFeatures:
    shards = tuple(Shard(int(lo), int(hi), n, "10.0.0.1", [None], None, [None])
                   for lo, hi, n in zip(bounds[:-1], bounds[1:], nodes))
    return ShardedFeatures(shards, int(bounds[-1]), 4, "float32", None, 1.0)


@pytest.mark.parametrize("ranks", [["a", "b", "c"], ["a", "a", "b", "c"], ["head"], ["a", "head"], ["b", "b"]])
def test_every_node_is_computed_once_by_the_ranks_of_its_range(ranks):
    shards = _shards(shard_bounds(1001, 3), ["a", "b", "c"])
    got = [assign(shards, ranks, r) for r in range(len(ranks))]
    covered = np.concatenate([np.arange(lo, hi) for mine in got for lo, hi, _ in mine])
    assert np.array_equal(np.sort(covered), np.arange(1001))
    for r, mine in enumerate(got):
        for lo, hi, k in mine:
            s = shards.shards[k]
            assert s.lo <= lo < hi <= s.hi
            # A range whose node runs a rank is computed there only.
            assert ranks[r] == s.node_id or s.node_id not in ranks


def test_hidden_bytes_are_two_tables_of_a_range():
    assert hidden_nbytes(9000, [64, 64], 3) == 3000 * 128 * 4
    assert hidden_nbytes(9001, [64], 3) == 3001 * 64 * 4  # two layers: one table
    assert hidden_nbytes(100, [8, 16, 4], 1) == 100 * 24 * 4  # the widest pair of neighbors


class Rank:
    """One rank of a gloo group, pinned to a node, running layer-wise inference as a train worker does."""

    def __init__(self, rank: int, world: int, port: int):
        import torch.distributed as dist

        if world > 1:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        self.rank, self.world = rank, world

    def infer(self, handle, model):
        from gnnray.train.feature_reader import reader_for
        from gnnray.train.layerwise import infer

        graph = handle.get()
        result = infer(model, graph, [reader_for(graph, handle.features)], CHUNK, "cpu", self.rank, self.world,
                       keep_input=True, shards=handle.features)
        return result.ranges, result.pred, result.last_input, result.correct, result.total


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def setting(shard_nodes, ray_cluster):
    """The K=3 publication, the model, and the reference: unsharded inference over the whole table, here."""
    from gnnray.driver import launch

    pub = launch.load_and_publish(JobConfig(data=CFG))
    whole = load_graph(dataclasses.replace(CFG, feature_shards=1))
    import torch

    torch.manual_seed(0)
    model = build_model(CFG.synthetic_feat_dim, whole.num_classes, LAYERS, HIDDEN, 0.5).eval()
    want = infer(model, whole, [LocalRows(whole.feat)], CHUNK, "cpu", keep_input=True)
    return pub, model, want


@pytest.mark.parametrize("placement", ["beside their shards", "one rank on the head"])
def test_sharded_tables_give_the_unsharded_predictions(setting, placement, ray_cluster):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    pub, model, want = setting
    features = pub.handle.features
    nodes = ([s.node_id for s in features.shards] if placement == "beside their shards"
             else [ray_cluster.get_runtime_context().get_node_id()])
    port = _free_port()
    ranks = [ray.remote(Rank).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False))
             .remote(r, len(nodes), port) for r, n in enumerate(nodes)]
    try:
        results = ray.get([r.infer.remote(pub.handle, model) for r in ranks], timeout=600)
    finally:
        for r in ranks:
            ray.kill(r)
    n = pub.graph.num_nodes
    pred, hidden, seen = np.full(n, -1), np.full((n, HIDDEN), np.nan, dtype=np.float32), 0
    for rank, (ranges, p, last_input, correct, total) in enumerate(results):
        at = 0
        for lo, hi, k in ranges:
            s = features.shards[k]
            assert s.lo <= lo < hi <= s.hi and (placement != "beside their shards" or nodes[rank] == s.node_id)
            pred[lo:hi], hidden[lo:hi] = p[at:at + hi - lo], last_input[at:at + hi - lo]
            at, seen = at + hi - lo, seen + hi - lo
        assert np.array_equal(correct, want.correct) and np.array_equal(total, want.total)  # summed over ranks
    assert seen == n
    np.testing.assert_array_equal(pred, want.pred)
    np.testing.assert_allclose(hidden, want.last_input, rtol=0, atol=1e-5)
    # Each server held its range of two of the three tables at most, and holds nothing now.
    widths = [HIDDEN] * (LAYERS - 1)
    for s in features.shards:
        held = ray.get(s.server.hidden_bytes.remote())
        assert held["held"] == 0, held
        assert held["peak"] == (s.hi - s.lo) * 2 * HIDDEN * 4 == hidden_nbytes(n, widths, 3), held


def _store_used(ray) -> dict:
    """Each node's store bytes now, as its raylet counts them: every object there, freed ones not yet deleted too."""
    from ray._private.internal_api import node_stats

    return {n["NodeID"]: int(node_stats(n["NodeManagerAddress"], n["NodeManagerPort"], include_memory_info=False)
                             .store_stats.object_store_bytes_used) for n in ray.nodes() if n.get("Alive")}


def test_rows_read_from_the_servers_leave_nothing_in_any_store(setting, ray_cluster):
    """A layer's reads add nothing to any node's store: the rows reach the reader inside Ray's replies. A result
    sent as a store object would stay on both nodes after the reader dropped it, until the raylets' next
    batched delete, so the nodes' stores would grow with every chunk read."""
    from gnnray.train.layerwise_hidden import Tables

    pub, _, _ = setting
    n = pub.graph.num_nodes
    table = np.random.default_rng(3).standard_normal((n, HIDDEN)).astype(np.float32)
    tables = Tables(pub.handle.features, 0, 1, "cpu")  # the driver's node holds no shard: it computes every range
    try:
        for lo, hi, k in tables.ranges:
            tables.keep(0, k, lo, table[lo:hi])
        reader = tables.reader(0, HIDDEN)
        ids = np.random.default_rng(4).permutation(n)  # each server's part: 3,000 rows, 750 KiB
        out = np.empty((n, HIDDEN), dtype=np.float32)
        before = _store_used(ray_cluster)
        reader.gather(ids, out)
        after = _store_used(ray_cluster)
    finally:
        tables.close()
    np.testing.assert_array_equal(out, table[ids])
    grew = {node: after[node] - before.get(node, 0) for node in after if after[node] > before.get(node, 0)}
    assert not grew, grew
