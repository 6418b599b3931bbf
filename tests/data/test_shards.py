"""Feature shards without a cluster: where rows come from (any range, the same rows), how shards are cut,
which nodes get them, which rows are cached."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from gnnray.data.features import ArrayRows, Normalized, NpyRows, RandomRows, SyntheticRows
from gnnray.data.shards import cache_ids, choose_nodes, shard_bounds
from gnnray.driver.preflight import Node
from gnnray.errors import ClusterError

MiB = 2**20


@pytest.mark.parametrize("lo,hi", [(0, 10), (65_530, 65_541), (3, 140_000), (131_072, 131_073)])
def test_generated_rows_do_not_depend_on_the_range(lo, hi):
    label = np.random.default_rng(1).integers(0, 4, 140_001)
    centroids = np.arange(12, dtype=np.float32).reshape(4, 3)
    for source in (SyntheticRows(5, centroids, 140_001), RandomRows(5, 3, 140_001)):
        whole = source.rows(0, 140_001, label)
        assert np.array_equal(source.rows(lo, hi, label), whole[lo:hi])
    assert not np.array_equal(RandomRows(5, 3, 100).rows(0, 100), RandomRows(6, 3, 100).rows(0, 100))


def test_sources_ship_only_their_range(tmp_path):
    table = np.random.default_rng(0).standard_normal((10_000, 8)).astype(np.float32)
    part = ArrayRows(table).part(2_000, 3_000)
    assert len(pickle.dumps(part)) < table.nbytes / 8  # the slice, not the table
    assert np.array_equal(part.rows(2_000, 3_000), table[2_000:3_000])
    np.save(tmp_path / "feat.npy", table)
    npy = NpyRows(str(tmp_path / "feat.npy"))
    assert len(pickle.dumps(npy.part(0, 10_000))) < 1_000  # a path
    assert np.array_equal(npy.rows(9_000, 10_000), table[9_000:])
    normalized = Normalized(ArrayRows(np.abs(table))).part(0, 10)
    assert np.allclose(normalized.rows(0, 10).sum(axis=1), 1.0)


def test_shard_bounds_cover_every_row_once():
    for n, k in ((10, 3), (7, 7), (1_000_003, 4)):
        b = shard_bounds(n, k)
        assert b[0] == 0 and b[-1] == n and np.all(np.diff(b) >= n // k) and np.all(np.diff(b) <= n // k + 1)


def test_cache_holds_the_highest_in_degree_nodes():
    indptr = np.cumsum([0, 5, 1, 9, 0, 3, 7, 2, 8, 4, 6])  # in-degrees 5 1 9 0 3 7 2 8 4 6
    assert cache_ids(indptr, 0.3).tolist() == [2, 5, 7]
    assert cache_ids(indptr, 0.0).size == 0


def _node(i: int, store_mib: float, gpus: float = 0) -> Node:
    return Node(f"{i:02d}" + "ab" * 27, "10.0.0.%d" % i, 8, gpus, int(store_mib * MiB))


def test_shards_go_to_nodes_that_fit_gpu_nodes_first_driver_last():
    cluster = [_node(0, 1000), _node(1, 100), _node(2, 200), _node(3, 200, gpus=1), _node(4, 50)]
    chosen = choose_nodes(3, 10 * MiB, 60 * MiB, 5 * MiB, cluster, driver_node=cluster[0].node_id)
    assert [n.address for n in chosen] == ["10.0.0.3", "10.0.0.2", "10.0.0.1"]
    with pytest.raises(ClusterError, match=r"--feature-shards 5: each shard node needs 75.0 MiB .* 4 of the "
                                           r"cluster's 5 nodes"):
        choose_nodes(5, 10 * MiB, 60 * MiB, 5 * MiB, cluster, driver_node="")


def test_every_node_must_hold_structure_and_cache():
    with pytest.raises(ClusterError, match=r"node 10.0.0.4 .* --feature-cache"):
        choose_nodes(2, 30 * MiB, 10 * MiB, 20 * MiB, [_node(3, 200), _node(4, 50)], driver_node="")
