"""Features gathered on the device (``--feature-placement``): the CPU is the device here, so every mode's logic runs;
the UVA kernel itself needs CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gnnray.pipeline.feature_reader import LocalRows
from gnnray.pipeline.placement import DEVICE_SHARE, choose, place
from gnnray.pipeline.prefetch import Prefetcher
from test_prefetch import check, make_packed

NO_CUDA = "no CUDA device here"
NUM_NODES = 1000  # make_packed's ids are below it


def _table(dtype=np.float32) -> np.ndarray:
    t = np.random.default_rng(0).standard_normal((NUM_NODES, 12)).astype(dtype)
    t.flags.writeable = False  # as the store hands it out
    return t


def _indptr(n: int = NUM_NODES) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.random.default_rng(1).integers(0, 9, n))])


def _id_cases(n: int) -> dict:
    rng = np.random.default_rng(2)
    return {"random": rng.integers(0, n, 3000), "duplicates": np.array([7, 7, 7, n - 1, 0, n - 1]),
            "empty": np.zeros(0, dtype=np.int64), "int32": rng.integers(0, n, 500).astype(np.int32)}


def _host_gather(reader, ids: np.ndarray) -> np.ndarray:
    out = np.full((len(ids), reader.dim), np.nan, dtype=np.float32)
    reader.gather(ids, out)
    return out


def test_auto_picks_device_where_the_table_fits_a_share_of_free_memory():
    gib = 2**30
    assert choose("auto", "cuda", 1 * gib, 10 * gib) == "device"
    assert choose("auto", "cuda", int(DEVICE_SHARE * 10 * gib), 10 * gib) == "device"
    assert choose("auto", "cuda", int(DEVICE_SHARE * 10 * gib) + 1, 10 * gib) == "uva"
    assert choose("auto", "cuda", 28 * gib, 0) == "uva"
    assert choose("auto", "cpu", 1, 10 * gib) == "host"  # the CPU is the device: nothing to copy
    for asked in ("device", "uva", "host"):  # an explicit choice is kept, on any device
        assert choose(asked, "cuda", 100 * gib, 0) == asked
        assert choose(asked, "cpu", 1, 0) == asked


def test_auto_and_host_leave_the_host_path_on_a_cpu():
    reader = LocalRows(_table())
    assert place("auto", reader, "cpu", _indptr()) is None
    assert place("host", reader, "cpu", _indptr()) is None


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("mode,free", [("device", None), ("uva", None), ("uva", 40_000), ("uva", 0)])
def test_device_gather_returns_the_host_gathers_rows(dtype, mode, free):
    """Resident table, cache of the hottest rows plus the rest from the host table (part cached, none cached)."""
    table = _table(dtype)
    reader = LocalRows(table)
    placed = place(mode, reader, "cpu", _indptr(), free_bytes=free)
    if mode == "uva" and free is not None:
        cached = int(DEVICE_SHARE * free) // (table.shape[1] * table.itemsize)
        assert placed.resident_rows == min(cached, NUM_NODES) < NUM_NODES
    for case, ids in _id_cases(NUM_NODES).items():
        got = placed.gather(torch.from_numpy(ids))
        assert got.dtype == torch.float32 and tuple(got.shape) == (len(ids), table.shape[1]), case
        assert np.array_equal(got.numpy(), _host_gather(reader, ids)), case


def test_the_uva_cache_holds_the_highest_in_degree_rows():
    indptr = _indptr()
    placed = place("uva", LocalRows(_table()), "cpu", indptr, free_bytes=2 * 100 * 12 * 4)
    degree = np.diff(indptr)
    slot = placed._slot.numpy()
    assert placed.resident_rows == 100
    assert degree[slot >= 0].min() >= degree[slot < 0].max()


@pytest.mark.parametrize("mode", ["device", "uva"])
def test_prefetched_batches_carry_the_same_rows_on_every_placement(mode):
    table = _table()
    rows = [make_packed(i, 1 + (i * 5) % 23, num_extra=i % 4) for i in range(12)]
    placed = place(mode, LocalRows(table), "cpu", _indptr(), free_bytes=20_000)
    with Prefetcher(rows, table, "cpu", depth=2, placed=placed) as batches:
        n = 0
        for packed, mb in zip(rows, batches):
            check(mb, packed, table)
            n += 1
    assert n == len(rows)


# Sharded features: one shard on this node (local), two on a node that does not exist (fetched), and a cache.

FAR = "f" * 56


def _sharded(table: np.ndarray, cache: np.ndarray):
    import ray

    from gnnray.store.shards import Shard, ShardedFeatures, ShardServer, shard_bounds

    served = ray.remote(ShardServer).options(num_cpus=0, max_concurrency=8)
    here = ray.get_runtime_context().get_node_id()
    bounds = shard_bounds(table.shape[0], 3)
    shards = []
    for k in range(3):
        lo, hi = int(bounds[k]), int(bounds[k + 1])
        ref = ray.put(np.ascontiguousarray(table[lo:hi]))
        server = served.remote([ref])
        ray.get(server.__ray_ready__.remote())
        shards.append(Shard(lo, hi, here if k == 1 else FAR, f"10.9.9.{k}", [ref], server, [ray.put(hi - lo)]))
    slot = np.full(table.shape[0], -1, dtype=np.int32)
    slot[cache] = np.arange(cache.size, dtype=np.int32)
    cached = [ray.put({"slot": slot, "rows": np.ascontiguousarray(table[cache])})]
    return ShardedFeatures(tuple(shards), table.shape[0], table.shape[1], str(table.dtype), cached, 30.0)


@pytest.mark.parametrize("mode", ["device", "uva"])
def test_sharded_device_gather_returns_the_host_gathers_rows(ray_cluster, mode):
    """This node's shard (and the cache) on the device, the other shards' rows fetched and scattered in."""
    from gnnray.pipeline.feature_reader import ShardedRows

    table = np.random.default_rng(3).standard_normal((3000, 6)).astype(np.float32)
    handle = _sharded(table, np.arange(0, 3000, 7))
    reader = ShardedRows(handle)
    placed = place(mode, reader, "cpu", np.zeros(1))
    expect_resident = 429 + (1000 if mode == "device" else 0)  # cache rows (every 7th), then the local shard
    assert placed.resident_rows == expect_resident
    for case, ids in _id_cases(3000).items():
        pos, rows = reader.remote(ids, local=mode == "uva")
        host = placed.host_rows(ids)
        assert np.array_equal(host.pos, pos) and np.array_equal(host.rows, rows), case
        got = placed.gather(torch.from_numpy(ids), (torch.from_numpy(host.pos), torch.from_numpy(host.rows)))
        assert np.array_equal(got.numpy(), table[ids]), case
        assert np.array_equal(got.numpy(), _host_gather(ShardedRows(handle), ids)), case
    # Only rows the device lacks cross: none from the cache or (device) this node's shard.
    ids = np.arange(3000)
    pos = placed.host_rows(ids).pos
    lacking = np.ones(3000, bool)
    lacking[np.arange(0, 3000, 7)] = False
    if mode == "device":
        lacking[1000:2000] = False
    assert np.array_equal(np.sort(pos), np.flatnonzero(lacking))


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_uva_kernel_reads_pinned_host_rows_and_the_cache(dtype):
    table = _table(dtype)
    reader = LocalRows(table)
    for free in (2 * 300 * 12 * 4, 0):  # part of the table cached; none
        placed = place("uva", reader, "cuda", _indptr(), free_bytes=free)
        for case, ids in _id_cases(NUM_NODES).items():
            got = placed.gather(torch.from_numpy(ids).cuda()).cpu().numpy()
            assert np.array_equal(got, _host_gather(reader, ids)), case


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_cuda_prefetch_with_a_resident_table_copies_no_features():
    table = _table()
    rows = [make_packed(i, 1 + (i * 5) % 23, num_extra=i % 4) for i in range(8)]
    p = Prefetcher(rows, table, "cuda", depth=2, placed=place("device", LocalRows(table), "cuda", _indptr()))
    slots = list(p._slots)
    for packed, mb in zip(rows, p):
        assert mb.x.is_cuda
        check(mb, packed, table)
    assert all(s._feat.numel() == 0 for s in slots)  # no host buffer that scales with feature bytes
    p.close()


def test_learnable_embeddings_ride_along_on_every_placement():
    """With --embedding-dim the batch's x is its features then its embedding rows, whichever placement."""
    from gnnray.train.embedding import NodeEmbedding

    table = _table()
    rows = [make_packed(i, 1 + (i * 5) % 23, num_extra=i % 4) for i in range(6)]
    xs = {}
    for mode in ("host", "device", "uva"):
        placed = place(mode, LocalRows(table), "cpu", _indptr(), free_bytes=20_000)
        embedding = NodeEmbedding(NUM_NODES, 4, 0.01, seed=3)
        with Prefetcher(rows, table, "cpu", depth=2, embedding=embedding, placed=placed) as batches:
            xs[mode] = [mb.x.detach().clone() for mb in batches]
    assert len(xs["host"]) == len(rows) and xs["host"][0].shape[1] == table.shape[1] + 4
    for mode in ("device", "uva"):
        assert all(torch.equal(a, b) for a, b in zip(xs["host"], xs[mode])), mode
