"""Feature shards without a cluster: where rows come from (any range, the same rows), how shards are cut,
which nodes get them, which rows are cached."""

from __future__ import annotations

import pickle
import re

import numpy as np
import pytest

from gnnray.data.feature_source import ArrayRows, Normalized, NpyRows, RandomRows, SyntheticRows
from gnnray.driver.preflight import Node
from gnnray.errors import ClusterError
from gnnray.store.shards import cache_ids, choose_nodes, shard_bounds
from s3_server import STORAGE_KINDS

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


def test_lost_shards_go_to_distinct_nodes_that_fit_them():
    """Repair: one node per lost shard; a node already holding a shard only if it fits a second one."""
    held_one = _node(1, 200)  # holds one 60 MiB shard: 10 + 5 + 60 + 60 = 135 <= 180, fits a second
    full = _node(2, 100)  # holds one: 135 > 90, no room for a second
    spare = _node(3, 100)  # holds none: 75 <= 90
    cluster = [full, held_one, spare]
    held = {held_one.node_id: 60 * MiB, full.node_id: 60 * MiB}
    chosen = choose_nodes(2, 10 * MiB, 60 * MiB, 5 * MiB, cluster, driver_node="", held=held)
    assert [n.address for n in chosen] == ["10.0.0.3", "10.0.0.1"]  # the empty node first, never `full`
    with pytest.raises(ClusterError, match=r"cannot rebuild 3 lost feature shard\(s\).* 2 of the 3 alive nodes "
                                           r"have it; missing: 1 more node\(s\) with an object store of at least "
                                           r"83.3 MiB"):
        choose_nodes(3, 10 * MiB, 60 * MiB, 5 * MiB, cluster, driver_node="", held=held)


def test_route_groups_rows_as_one_mask_per_shard_would():
    from gnnray.store.shards import route

    rng = np.random.default_rng(0)
    starts = shard_bounds(10_000, 5)[:-1]
    ids = rng.integers(0, 10_000, 4_000)
    skip = rng.random(4_000) < 0.2
    order, at = route(starts, ids, skip)
    owner = np.searchsorted(starts, ids, side="right") - 1
    for k in range(5):
        assert np.array_equal(order[at[k]:at[k + 1]], np.flatnonzero((owner == k) & ~skip)), k
    assert np.array_equal(order[at[-1]:], np.flatnonzero(skip))
    order, at = route(starts, np.zeros(0, dtype=np.int64))
    assert order.size == 0 and at.tolist() == [0] * 6


def test_parquet_shard_reads_only_the_row_groups_of_its_range(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gnnray.data.feature_source import ParquetRows

    n, d = 1_000, 3
    feat = np.random.default_rng(0).standard_normal((n, d)).astype(np.float32)
    pq.write_table(pa.table({"id": np.arange(n), "feat": pa.FixedSizeListArray.from_arrays(pa.array(feat.ravel()),
                                                                                           d)}),
                   tmp_path / "nodes.parquet", row_group_size=100)  # 10 row groups of 100 ids each
    read = []
    original = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, i, **kw: read.append(i) or original(self, i, **kw))
    source = ParquetRows(str(tmp_path / "nodes.parquet"), n)
    assert np.array_equal(source.rows(250, 420), feat[250:420])
    assert read == [2, 3, 4]  # ids 200..499: not the 7 other groups
    read.clear()
    assert np.array_equal(source.rows(0, n), feat)
    assert read == list(range(10))


@STORAGE_KINDS
def test_in_memory_tables_are_spilled_once_per_shard(storage_path, tmp_path):
    """The driver writes a table read into memory as one file per shard (in a directory or a bucket), and
    rebuilds shards from them."""
    from gnnray import run_storage
    from gnnray.data.feature_source import SpilledRows, spill

    table = np.random.default_rng(0).standard_normal((1_000, 4)).astype(np.float32)
    bounds = shard_bounds(1_000, 3)
    where = run_storage.join(storage_path, "spill")
    spilled = spill(Normalized(ArrayRows(table)), bounds, where, "float16")
    assert isinstance(spilled, SpilledRows) and all(run_storage.size(f) for f in spilled.files)
    assert [re.sub("-[0-9a-f]{20}[.]", ".", f.rsplit("/", 1)[-1]) for f in spilled.files] == [
        f"shard-{i}-of-3.npy" for i in range(3)]
    whole = Normalized(ArrayRows(table)).rows(0, 1_000).astype(np.float16)
    assert np.array_equal(spilled.rows(0, 1_000), whole)
    part = spilled.part(int(bounds[1]), int(bounds[2]))
    assert len(part.files) == 1 and len(pickle.dumps(part)) < 1_000  # a path, not rows
    assert np.array_equal(part.rows(int(bounds[1]), int(bounds[2])), whole[bounds[1]:bounds[2]])
    # Sources that hold no rows here stay as they are (nothing written).
    generated = RandomRows(0, 4, 1_000)
    assert spill(generated, bounds, str(tmp_path / "none"), "float32") is generated
    assert not (tmp_path / "none").exists()


@STORAGE_KINDS
def test_a_spill_is_written_once_for_its_content(storage_path, monkeypatch):
    """A resumed run finds its shards' files, whole, by what they hold, and writes none again; a changed table
    writes the shards that changed, and the files of the old table go; a file cut short is written again."""
    from gnnray import run_storage
    from gnnray.data.feature_source import spill

    writes = []
    save = run_storage.save_npy
    monkeypatch.setattr(run_storage, "save_npy", lambda path, a: writes.append(path) or save(path, a))
    table = np.random.default_rng(0).standard_normal((1_000, 4)).astype(np.float32)
    bounds, where = shard_bounds(1_000, 3), run_storage.join(storage_path, "spill")
    first = spill(ArrayRows(table), bounds, where, "float32").files
    assert writes == list(first)
    writes.clear()
    assert spill(ArrayRows(table), bounds, where, "float32").files == first and writes == []  # the resume
    changed = table.copy()
    changed[-1, 0] += 1  # in the last shard only
    writes.clear()
    files = spill(ArrayRows(changed), bounds, where, "float32").files
    assert files[:2] == first[:2] and writes == [files[2]] != [first[2]]
    assert run_storage.list_files(where) == sorted(f.rsplit("/", 1)[-1] for f in files)
    run_storage.write_bytes(files[1], run_storage.read_bytes(files[1])[:-8])  # as a write cut short would leave it
    writes.clear()
    assert spill(ArrayRows(changed), bounds, where, "float32").files == files and writes == [files[1]]
    assert np.array_equal(run_storage.npy_rows(files[1], 0, 1_000), changed[bounds[1]:bounds[2]])
    writes.clear()
    assert not set(spill(ArrayRows(changed), bounds, where, "float16").files) & set(files) and len(writes) == 3
