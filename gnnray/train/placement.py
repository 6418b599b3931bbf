"""With stage 5 (train worker): where a worker's feature rows are gathered (``--feature-placement``).

- ``host``: the prefetch thread gathers each batch's rows on the host and copies
  them to the device (:mod:`gnnray.train.prefetch`).
- ``device``: the node's table (with ``--feature-shards``: its shards and the
  cache) is copied once to the device and gathered there by ``index_select``;
  per step only the sampled structure, the input ids and rows fetched from other
  nodes cross.
- ``uva``: the table stays in host memory, pinned in place, and the GPU reads
  the rows it needs from there (a Triton kernel over host-mapped memory); the
  most-sampled rows (highest in-degree first) are also kept in a device cache
  sized from the GPU's free memory (less the structure the device sampler will
  copy there: :func:`free_for_features`). With shards: the node's cache, then its
  shards' first rows, as far as that budget goes; the host sends the rest. On
  a CPU "device" the same logic runs with plain indexing (what the tests check).

Rows go to the device in pieces of at most :data:`PIECE_BYTES`, gathered from
the store's pages into one reused host buffer (a contiguous run is copied from
the pages directly), so placing costs each worker that much host memory
whatever the table or the budget: a node's workers place at once.
- ``auto``: ``device`` where the table fits a share of the GPU's free memory,
  else ``uva``; ``host`` on a CPU worker (the CPU is the device: nothing to copy).

:func:`choose` is the decision, :class:`DeviceFeatures` the device-side table.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import torch

from gnnray.store.handle import readonly_tensor
from gnnray.train.feature_reader import FeatureReader, Held, LocalRows, ShardedRows
from gnnray.train.gpu_budget import gpu_budget

# Of the GPU's free memory once the model is there: what a resident table or the UVA cache may take. The rest is
# for activations, the optimizer's state and the batches in flight.
DEVICE_SHARE = 0.5
# The most bytes of rows (or of slot entries) a worker holds on the host at once while placing them on its device.
PIECE_BYTES = 64 * 2**20

logger = logging.getLogger(__name__)


def choose(asked: str, device_type: str, table_bytes: int, free_bytes: int, share: float = DEVICE_SHARE) -> str:
    """The placement a worker uses: ``asked`` unless ``auto``; then ``host`` on a CPU, else ``device`` where the
    table's ``table_bytes`` fit ``share`` of ``free_bytes`` (the GPU's free memory after the model), else ``uva``."""
    if asked != "auto":
        return asked
    if device_type != "cuda":
        return "host"
    return "device" if table_bytes <= share * free_bytes else "uva"


def plan_text(asked: str, use_gpu: bool, table_bytes: int) -> str:
    """The driver's line on where features are gathered (each worker logs what it did); empty for a CPU run's
    default, the host path, which needs no word."""
    mb = table_bytes / 2**20
    if asked == "auto" and not use_gpu:
        return ""
    if asked == "host":
        return f"features: gathered on the host ({mb:.0f} MB a node)"
    if asked == "auto":
        return (f"features: on each GPU where {mb:.0f} MB fit {DEVICE_SHARE:.0%} of its free memory, else read "
                f"from pinned host memory with the hottest rows cached on the GPU (--feature-placement auto)")
    if asked == "device":
        return f"features: {mb:.0f} MB a node copied once to each worker's device and gathered there"
    return f"features: read by the device from pinned host memory ({mb:.0f} MB a node), hottest rows cached there"


def feature_line(cfg, handle, use_gpu: bool) -> str:
    """:func:`plan_text` for a job (``JobConfig``) and its graph (``GraphHandle``): the rows a node holds."""
    sharded = handle.features
    held = (sharded.shard_bytes + sharded.cache_bytes if sharded is not None
            else handle.num_nodes * handle.feat_dim * np.dtype(cfg.data.feature_dtype).itemsize)
    return plan_text(cfg.data.feature_placement, use_gpu, held)


@dataclass
class HostRows:
    """Rows of a batch that the host supplies (fetched from other nodes, or a sharded node's own rows under
    ``uva``): ``out[pos] = rows`` on the device."""

    pos: np.ndarray  # int64 positions in the batch
    rows: np.ndarray  # (len(pos), dim), as stored


class DeviceFeatures:
    """A worker's feature rows gathered on its device.

    ``resident`` rows live on the device; ``slot`` (``None``: every row, in id
    order) maps a node id to its resident row or -1. Rows not resident come from
    the host table (``uva``: read in place by the device) or, with shards, from
    the reader (:meth:`host_rows`, fetched on the prefetch thread): all those
    ``held`` does not name, so no row crosses twice.
    """

    def __init__(self, mode: str, reader: FeatureReader, device: torch.device, resident: torch.Tensor,
                 slot: Optional[torch.Tensor], host: Optional[torch.Tensor] = None, note: str = "",
                 held: Optional[Held] = None):
        self.mode, self.reader, self.device, self.dim = mode, reader, torch.device(device), reader.dim
        self._resident, self._slot, self._host, self.held = resident, slot, host, held
        self._uva = _UvaGather(host) if host is not None and self.device.type == "cuda" else None
        self.note = note

    @property
    def resident_rows(self) -> int:
        return int(self._resident.shape[0])

    @property
    def host_supplied(self) -> bool:
        """Whether some rows only the host can supply (other nodes' shards): :meth:`host_rows` needs the ids."""
        return isinstance(self.reader, ShardedRows)

    def host_rows(self, ids: np.ndarray) -> Optional[HostRows]:
        """On the prefetch thread: the batch's rows that only the host can supply (with shards), else ``None``."""
        if not self.host_supplied:
            return None
        pos, rows = self.reader.remote(ids, self.held)
        return HostRows(pos, rows)

    def gather(self, ids: torch.Tensor, host: Optional[tuple] = None) -> torch.Tensor:
        """Float32 rows ``ids`` (a tensor on the device), on the device; ``host``: ``(pos, rows)`` tensors on the
        device (:meth:`host_rows`'), scattered in. Nothing is read back to the host."""
        if self._slot is None:
            out = self._resident.index_select(0, ids).float()
        elif self._uva is not None:
            out = self._uva(self._resident, self._slot, ids)
        else:
            pos = self._slot.index_select(0, ids).long()
            out = (self._resident.index_select(0, pos.clamp_min(0)).float() if self._resident.shape[0]
                   else torch.zeros((ids.shape[0], self.dim), dtype=torch.float32, device=ids.device))
            if self._host is not None:  # CPU as the device: the rows not cached, from the host table
                miss = (pos < 0).nonzero().squeeze(1)
                out[miss] = self._host.index_select(0, ids.index_select(0, miss)).float()
        if host is not None and host[0].numel():
            out[host[0]] = host[1].float()
        return out


def place(asked: str, reader: FeatureReader, device, indptr: np.ndarray,
          free_bytes: Optional[int] = None) -> Optional[DeviceFeatures]:
    """The worker's :class:`DeviceFeatures` for ``asked``, or ``None`` for the host path.

    ``free_bytes``: the device's free memory (default: asked of CUDA, after the model is there; the worker gives
    :func:`free_for_features`, less the device sampler's structure); it sizes the table's or the cache's budget.
    """
    device = torch.device(device)
    table = node_table_bytes(reader)
    if free_bytes is None:  # a CPU "device" holds the whole table
        free_bytes = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else int(table / DEVICE_SHARE) + 1
    mode = choose(asked, device.type, table, free_bytes)
    if mode == "uva" and asked == "auto" and device.type == "cuda" and isinstance(reader, LocalRows) \
            and not _has_triton():
        mode = "host"  # the GPU cannot read host memory without the kernel: the host gathers
    if mode == "host" or reader.dim == 0:
        return None
    budget = int(DEVICE_SHARE * free_bytes)
    if isinstance(reader, LocalRows):
        return _place_table(mode, reader, device, indptr, budget)
    return _place_shards(mode, reader, device, budget)


def free_for_features(device, structure: int) -> Optional[int]:
    """The free bytes :func:`place` sizes the features from on ``device``: a GPU's free memory now (with the model)
    less ``structure``, which the device sampler copies there later (0: batches are sampled elsewhere), so both
    fit one budget (:func:`gnnray.train.gpu_budget.gpu_budget`, which refuses a structure the GPU cannot hold);
    ``None`` on a CPU, where :func:`place` holds the whole table."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    free, why = gpu_budget(total, free, structure)
    logger.info("features sized from %s", why)
    return free


def node_table_bytes(reader: FeatureReader) -> int:
    """Bytes of the rows this node holds: the whole table, or its shards plus the cache."""
    if isinstance(reader, LocalRows):
        return int(reader.table.nbytes)
    return sum(int(rows.nbytes) for _, _, rows in reader.local_shards()) + (
        int(reader.cache[1].nbytes) if reader.cache is not None else 0)


def _place_table(mode: str, reader: LocalRows, device: torch.device, indptr: np.ndarray,
                 budget: int) -> Optional[DeviceFeatures]:
    table = reader.table
    n, row_bytes = table.shape[0], max(1, table.shape[1] * table.itemsize)
    if mode == "device":
        fill = _Resident(device, None, n, table.shape[1], table.dtype)
        fill.run(readonly_tensor(table))
        return DeviceFeatures(mode, reader, device, fill.rows, None)
    host = _pinned(table, device)
    if host is None:
        return None
    count = min(n, budget // row_bytes)
    fill = _Resident(device, n, count, table.shape[1], table.dtype)
    # About 24 bytes an id while choosing (in-degree, ids, mask): a chunk of PIECE_BYTES / 512 ids is under 5% of
    # a piece.
    for ids in hot_ids(indptr, count, max(1, PIECE_BYTES // 512)):
        fill.gather(host, ids)
    return DeviceFeatures(mode, reader, device, fill.rows, fill.slot, host,
                          f"{count} of {n} rows cached on the device")


def hot_ids(indptr: np.ndarray, count: int, chunk: int) -> Iterator[np.ndarray]:
    """The ``count`` ids of highest in-degree (ties: lower id first), as :func:`~gnnray.store.shards.cache_ids`
    picks them, in id order and at most ``chunk`` at a time: no array as long as the graph (a histogram of the
    in-degrees gives the lowest degree taken, then each chunk of ids is read against it)."""
    n = indptr.shape[0] - 1
    if count <= 0:
        return
    hist = np.zeros(1, dtype=np.int64)
    for a in range(0, n, chunk):
        h = np.bincount(np.diff(indptr[a:min(n, a + chunk) + 1]))
        hist = np.pad(hist, (0, max(0, h.size - hist.size)))
        hist[:h.size] += h
    at_least = np.cumsum(hist[::-1])[::-1]  # ids of in-degree >= d
    low = int(np.flatnonzero(at_least >= count)[-1])
    ties = count - (int(at_least[low + 1]) if low + 1 < at_least.size else 0)  # of in-degree low, first ids first
    for a in range(0, n, chunk):
        degree = np.diff(indptr[a:min(n, a + chunk) + 1])
        take = degree > low
        if ties:
            tied = np.flatnonzero(degree == low)[:ties]
            take[tied], ties = True, ties - tied.size
        ids = np.flatnonzero(take)
        if ids.size:
            yield ids + a


def _place_shards(mode: str, reader: ShardedRows, device: torch.device, budget: int) -> DeviceFeatures:
    """The cache, then this node's shards, on the device (``uva``: as far as ``budget`` goes, first rows first);
    the rest comes from the reader."""
    row_bytes = max(1, reader.dim * reader.dtype.itemsize)
    left = None if mode == "device" else budget // row_bytes  # rows the device may still take
    cache, shards = reader.cache, reader.local_shards()
    cached = 0 if cache is None else cache[1].shape[0] if left is None else min(cache[1].shape[0], left)
    local = {}
    for k, _, rows in shards:
        local[k] = rows.shape[0] if left is None else min(rows.shape[0], left - cached - sum(local.values()))
    fill = _Resident(device, reader.num_rows, cached + sum(local.values()), reader.dim, reader.dtype)
    if cached:
        fill.cache_prefix(*cache, cached)
    for k, lo, rows in shards:  # where a shard repeats a cached row, the cache's copy is the one read
        if local[k]:
            fill.run(readonly_tensor(rows[:local[k]]), ids_lo=lo)
    return DeviceFeatures(mode, reader, device, fill.rows, fill.slot, held=Held(cached, local),
                          note=f"{fill.at} rows on the device, the rest fetched by the host")


class _Resident:
    """A device's ``count`` resident rows and the slot of each of ``num_rows`` node ids (-1: not resident;
    ``None``: no slot), filled in pieces of at most :data:`PIECE_BYTES` through one reused host buffer."""

    def __init__(self, device: torch.device, num_rows: Optional[int], count: int, dim: int, dtype: np.dtype):
        self.device, self.at, dtype = device, 0, np.dtype(dtype)
        self.rows = torch.empty((count, dim), dtype=torch.from_numpy(np.zeros(0, dtype)).dtype, device=device)
        self.slot = None if num_rows is None else torch.full((num_rows,), -1, dtype=torch.int32, device=device)
        self._piece = max(1, PIECE_BYTES // max(1, dim * dtype.itemsize))
        self._ids = max(1, PIECE_BYTES // 8)  # int64 ids (or int32 slot entries) per piece
        self._buffer = None

    def _staging(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        if self._buffer is None:  # pinned on a GPU: the piece crosses by DMA
            self._buffer = torch.empty((self._piece, like.shape[1]), dtype=like.dtype,
                                       pin_memory=self.device.type == "cuda")
        return self._buffer[:rows]

    def gather(self, src: torch.Tensor, ids: np.ndarray) -> None:
        """Rows ``ids`` of the host tensor ``src`` next, a piece at a time."""
        for a in range(0, ids.size, self._piece):
            idx = torch.from_numpy(np.asarray(ids[a:a + self._piece], dtype=np.int64))
            k = idx.shape[0]
            buf = self._staging(k, src)
            torch.index_select(src, 0, idx, out=buf)
            self.rows[self.at:self.at + k].copy_(buf)
            self.slot[idx.to(self.device)] = torch.arange(self.at, self.at + k, dtype=torch.int32,
                                                          device=self.device)
            self.at += k

    def run(self, src: torch.Tensor, ids_lo: Optional[int] = None) -> None:
        """The contiguous rows ``src`` next, copied from their pages a piece at a time; ``ids_lo``: the id of the
        first, whose slots follow (an id already resident keeps its row)."""
        for a in range(0, src.shape[0], self._piece):
            b = min(src.shape[0], a + self._piece)
            self.rows[self.at:self.at + b - a].copy_(src[a:b])
            if ids_lo is not None:
                seg = self.slot[ids_lo + a:ids_lo + b]
                new = torch.arange(self.at, self.at + b - a, dtype=torch.int32, device=self.device)
                self.slot[ids_lo + a:ids_lo + b] = torch.where(seg < 0, new, seg)
            self.at += b - a

    def cache_prefix(self, slot: np.ndarray, rows: np.ndarray, count: int) -> None:
        """The cache's first ``count`` rows next: their slots from the cache's, a piece of ids at a time."""
        at = self.at
        self.run(readonly_tensor(rows[:count]))
        for a in range(0, slot.shape[0], self._ids):
            s = readonly_tensor(slot[a:a + self._ids]).to(self.device)
            self.slot[a:a + s.shape[0]] = torch.where((s >= 0) & (s < count), s + at, self.slot[a:a + s.shape[0]])


def _pinned(table: np.ndarray, device: torch.device) -> Optional[torch.Tensor]:
    """``table`` as a host tensor the device can read: the store's pages registered in place; ``None`` (said in
    one line) where that fails: the host then gathers each batch's rows, in bounded buffers. On a CPU device:
    the table itself."""
    t = readonly_tensor(table)
    if device.type != "cuda":
        return t
    ptr, size = t.data_ptr(), t.numel() * t.element_size()
    for held in _registered:  # pages registered once cannot be again (cudaErrorHostMemoryAlreadyRegistered)
        if held.data_ptr() <= ptr and ptr + size <= held.data_ptr() + held.numel() * held.element_size():
            return t
    # Mapped (readable by kernels through unified addressing) and read-only: the store's pages are read-only.
    flags = _HOST_REGISTER_MAPPED | _HOST_REGISTER_READ_ONLY
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, size, flags))
    if err == 0:
        _registered.append(t)  # never unregistered while the worker runs: kernels may still read it
        return t
    _clear_cuda_error()
    # A pinned copy of the table in every worker of the node could exhaust its memory: the host path instead.
    logger.warning(f"--feature-placement uva: the store's pages ({size / 2**20:.0f} MiB) could not be registered "
                   f"for the GPU (CUDA error {err}); this worker gathers features on the host")
    return None


def _clear_cuda_error() -> None:
    """Read away the CUDA runtime's last error: a failed ``cudaHostRegister`` leaves it set, and torch's next
    kernel launch would raise it. torch's ``cudart()`` lacks ``cudaGetLastError``, so it is called in the
    runtime library torch loaded."""
    import ctypes

    with open("/proc/self/maps") as maps:
        paths = [line.split()[-1] for line in maps if "/libcudart.so" in line]
    if paths:
        ctypes.CDLL(paths[0]).cudaGetLastError()


_HOST_REGISTER_MAPPED, _HOST_REGISTER_READ_ONLY = 0x02, 0x08  # cudaHostRegisterMapped, cudaHostRegisterReadOnly
_registered: list = []


class _UvaGather:
    """Rows from the device cache where ``slot`` has them, else read by the GPU from the pinned host table."""

    def __init__(self, host: torch.Tensor):
        self._host = host
        self._kernel = _uva_kernel()

    def __call__(self, cached: torch.Tensor, slot: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        n, dim = ids.shape[0], self._host.shape[1]
        out = torch.empty((n, dim), dtype=torch.float32, device=ids.device)
        if n:
            if not cached.shape[0]:  # no cache: a row the kernel never reads, so that its pointer is a real one
                cached = torch.zeros((1, dim), dtype=self._host.dtype, device=ids.device)
            block = min(1024, max(16, 1 << (dim - 1).bit_length()))
            self._kernel[(n,)](_HostPointer(self._host), cached, slot, ids, out, dim, BLOCK=block)
        return out


class _HostPointer:
    """A pinned host tensor passed to Triton by its host address: registered mapped memory is addressable from
    the device at the same address (unified virtual addressing)."""

    def __init__(self, t: torch.Tensor):
        self._t, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self._t.data_ptr()


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _uva_kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        raise RuntimeError("--feature-placement uva needs Triton (it comes with torch's CUDA wheels); use "
                           "--feature-placement device or host") from None

    @triton.jit
    def gather(host, cached, slot, ids, out, dim, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        node = tl.load(ids + row).to(tl.int64)
        at = tl.load(slot + node).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        for start in range(0, dim, BLOCK):
            c = start + cols
            mask = c < dim
            if at >= 0:
                v = tl.load(cached + at * dim + c, mask=mask)
            else:
                v = tl.load(host + node * dim + c, mask=mask)
            tl.store(out + row.to(tl.int64) * dim + c, v.to(tl.float32), mask=mask)

    return gather
