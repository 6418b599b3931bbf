"""Features gathered on the device (``--feature-placement``): the CPU is the device here, so every mode's logic runs;
the UVA kernel itself needs CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gnnray.train import placement
from gnnray.train.feature_reader import Held, LocalRows
from gnnray.train.placement import DEVICE_SHARE, choose, place
from gnnray.train.prefetch import Prefetcher
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


def test_the_hot_ids_read_a_chunk_at_a_time_are_the_caches():
    """The same ids as the store's cache picks (ties at the lowest degree taken: lower ids first), any chunk."""
    from gnnray.store.shards import cache_ids

    for n, high in ((1000, 9), (777, 2), (50, 1)):  # few distinct degrees: many ties
        indptr = np.concatenate([[0], np.cumsum(np.random.default_rng(n).integers(0, high, n))])
        for count in (0, 1, n // 3, n // 2 + 1, n - 1, n):
            want = cache_ids(indptr, count / n)
            for chunk in (1, 7, n, 10 * n):
                got = list(placement.hot_ids(indptr, count, chunk))
                assert all(0 < g.size <= chunk for g in got), (n, count, chunk)
                got = np.concatenate(got) if got else np.zeros(0, np.int64)
                assert np.array_equal(got, want), (n, count, chunk)


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


def _sharded(table: np.ndarray, cache):
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
    cached = None
    if cache is not None:
        slot = np.full(table.shape[0], -1, dtype=np.int32)
        slot[cache] = np.arange(cache.size, dtype=np.int32)
        cached = [ray.put({"slot": slot, "rows": np.ascontiguousarray(table[cache])})]
    return ShardedFeatures(tuple(shards), table.shape[0], table.shape[1], str(table.dtype), cached, 30.0)


@pytest.mark.parametrize("mode", ["device", "uva"])
def test_sharded_device_gather_returns_the_host_gathers_rows(ray_cluster, mode):
    """This node's shard (and the cache) on the device, the other shards' rows fetched and scattered in."""
    from gnnray.train.feature_reader import ShardedRows

    table = np.random.default_rng(3).standard_normal((3000, 6)).astype(np.float32)
    handle = _sharded(table, np.arange(0, 3000, 7))
    reader = ShardedRows(handle)
    # uva: a budget of the cache alone (every 7th row); device: the cache, then the local shard
    free = int(429 * 6 * 4 / DEVICE_SHARE) if mode == "uva" else None
    placed = place(mode, reader, "cpu", np.zeros(1), free_bytes=free)
    expect_resident = 429 + (1000 if mode == "device" else 0)
    assert placed.resident_rows == expect_resident
    for case, ids in _id_cases(3000).items():
        pos, rows = reader.remote(ids, placed.held)
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


# (cache ids or None, rows the budget holds) -> (cache rows, local shard rows) on the device
_UVA_BUDGETS = {"no cache, part of the local shard": (None, 600, 0, 600),
                "no cache, all of it": (None, 5000, 0, 1000),
                "part of the cache": (np.arange(0, 3000, 7), 300, 300, 0),
                "the cache, then part of the local shard": (np.arange(0, 3000, 7), 629, 429, 200)}


@pytest.mark.parametrize("case", list(_UVA_BUDGETS))
def test_sharded_uva_places_what_its_budget_holds_and_the_host_sends_only_the_rest(ray_cluster, case):
    """The device takes the cache, then this node's shard, as far as the budget goes; every other row, and no row
    it holds, comes from the host."""
    from gnnray.train.feature_reader import ShardedRows

    cache, budget_rows, cached, local = _UVA_BUDGETS[case]
    table = np.random.default_rng(4).standard_normal((3000, 6)).astype(np.float32)
    reader = ShardedRows(_sharded(table, cache))
    placed = place("uva", reader, "cpu", np.zeros(1), free_bytes=int(budget_rows * 6 * 4 / DEVICE_SHARE) + 1)
    assert placed.resident_rows == cached + local <= budget_rows
    assert placed.held == Held(cached, {1: local})
    on_device = np.zeros(3000, bool)
    if cache is not None:
        on_device[cache[:cached]] = True
    on_device[1000:1000 + local] = True
    ids = np.random.default_rng(5).permutation(3000)
    host = placed.host_rows(ids)
    assert np.array_equal(np.sort(ids[host.pos]), np.flatnonzero(~on_device))  # the rest, once each
    got = placed.gather(torch.from_numpy(ids), (torch.from_numpy(host.pos), torch.from_numpy(host.rows)))
    assert np.array_equal(got.numpy(), table[ids])
    for case_ids in _id_cases(3000).values():
        host = placed.host_rows(case_ids)
        got = placed.gather(torch.from_numpy(case_ids), (torch.from_numpy(host.pos), torch.from_numpy(host.rows)))
        assert np.array_equal(got.numpy(), table[case_ids])


@pytest.mark.parametrize("mode,free", [("device", None), ("uva", 60_000)])
def test_rows_go_to_the_device_in_pieces(monkeypatch, mode, free):
    """With pieces of a few rows, the placed table is the same, and no host buffer is larger than a piece."""
    table = _table()
    whole = place(mode, LocalRows(table), "cpu", _indptr(), free_bytes=free)
    monkeypatch.setattr(placement, "PIECE_BYTES", 5 * 12 * 4)  # 5 rows
    sizes = []
    real_empty = torch.empty

    def empty(*shape, **kwargs):  # every host buffer placing makes, by its size
        t = real_empty(*shape, **kwargs)
        if t.device.type == "cpu":
            sizes.append(t.numel() * t.element_size())
        return t

    monkeypatch.setattr(torch, "empty", empty)
    pieces = place(mode, LocalRows(table), "cpu", _indptr(), free_bytes=free)
    monkeypatch.undo()
    assert torch.equal(pieces._resident, whole._resident) and pieces.resident_rows > 5
    assert (pieces._slot is None) == (whole._slot is None) and (whole._slot is None or torch.equal(pieces._slot,
                                                                                                    whole._slot))
    assert [b for b in sizes if b > 5 * 12 * 4 and b != pieces.resident_rows * 12 * 4] == []


def test_pages_the_gpu_cannot_register_leave_the_host_path_in_one_line(monkeypatch, caplog):
    """No pinned copy of the table in each worker: the worker says why in one line and the host gathers."""
    import logging

    class Runtime:  # CUDA's runtime as torch calls it, refusing the registration (cudaErrorNotSupported)
        def cudaHostRegister(self, ptr, size, flags):
            return 801

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    monkeypatch.setattr(placement, "_clear_cuda_error", lambda: None)
    with caplog.at_level(logging.WARNING, logger=placement.__name__):
        assert place("uva", LocalRows(_table()), "cuda", _indptr(), free_bytes=10**6) is None
    lines = [r.getMessage() for r in caplog.records if r.name == placement.__name__]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith("--feature-placement uva: the store's pages (0 MiB) could not be registered for the "
                               "GPU (CUDA error 801); this worker gathers features on the host"), lines


_HOST_GROWTH = """
import resource, sys
import numpy as np
from gnnray.train import placement
from gnnray.train.feature_reader import LocalRows

rows, dim, piece = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
placement.PIECE_BYTES = piece
table = np.empty((rows, dim), dtype=np.float32)
table.fill(1.0)  # resident before the baseline, as the store's pages are
table.flags.writeable = False
indptr = np.arange(rows + 1, dtype=np.int64) * 3
# torch's first operations load code and set up its allocators (tens of MB): done first, on a small table
placement.place("uva", LocalRows(table[:1000]), "meta", indptr[:1001], free_bytes=table[:1000].nbytes)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
placed = placement.place("uva", LocalRows(table), "meta", indptr, free_bytes=table.nbytes)  # cache: half
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(placed.resident_rows, (after - before) * 1024)
"""


def test_placing_grows_host_memory_by_a_piece_not_by_the_cache():
    """torch's meta device stands in for a GPU (it holds no host memory): a 128 MiB table with a cache budget of
    half of it grows the process's peak host memory by a piece, not by a host copy of the 64 MiB cache."""
    import subprocess
    import sys

    rows, dim, piece = 2**18, 128, 4 * 2**20
    out = subprocess.run([sys.executable, "-c", _HOST_GROWTH, str(rows), str(dim), str(piece)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    cached, growth = map(int, out.stdout.split())
    assert cached == rows // 2
    assert growth <= 1.1 * piece, growth  # a piece, and a chunk of ids


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


def test_a_worker_sizes_its_features_from_what_the_device_samplers_structure_leaves(monkeypatch):
    """One budget of the worker's GPU: free memory after the model, less the structure --sample-on device copies
    there when the batches open; a structure the GPU cannot hold is refused before anything is placed."""
    from gnnray.errors import ConfigError
    from gnnray.train.placement import free_for_features

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 80 * gib))
    gpu = torch.device("cuda", 0)
    assert free_for_features(gpu, 0) == 60 * gib
    assert free_for_features(gpu, 15 * gib) == 45 * gib
    with pytest.raises(ConfigError, match="use --sample-on actors"):
        free_for_features(gpu, 25 * gib)  # more than a quarter of the GPU
    assert free_for_features(torch.device("cpu"), 15 * gib) is None  # place() holds the whole table on a CPU
