"""With stage 5 (train worker): where a worker's feature rows are gathered (``--feature-placement``).

- ``host``: the prefetch thread gathers each batch's rows on the host and copies
  them to the device (:mod:`gnnray.pipeline.prefetch`).
- ``device``: the node's table (with ``--feature-shards``: its shards and the
  cache) is copied once to the device and gathered there by ``index_select``;
  per step only the sampled structure, the input ids and rows fetched from other
  nodes cross.
- ``uva``: the table stays in host memory, pinned in place, and the GPU reads
  the rows it needs from there (a Triton kernel over host-mapped memory); the
  most-sampled rows (highest in-degree first) are also kept in a device cache
  sized from the GPU's free memory. On a CPU "device" the same logic runs with
  plain indexing (what the tests check).
- ``auto``: ``device`` where the table fits a share of the GPU's free memory,
  else ``uva``; ``host`` on a CPU worker (the CPU is the device: nothing to copy).

:func:`choose` is the decision, :class:`DeviceFeatures` the device-side table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from gnnray.store.shards import cache_ids
from gnnray.store.handle import readonly_tensor
from gnnray.pipeline.feature_reader import FeatureReader, LocalRows, ShardedRows

# Of the GPU's free memory once the model is there: what a resident table or the UVA cache may take. The rest is
# for activations, the optimizer's state and the batches in flight.
DEVICE_SHARE = 0.5


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
    the reader (:meth:`host_rows`, fetched on the prefetch thread).
    """

    def __init__(self, mode: str, reader: FeatureReader, device: torch.device, resident: torch.Tensor,
                 slot: Optional[torch.Tensor], host: Optional[torch.Tensor] = None, note: str = ""):
        self.mode, self.reader, self.device, self.dim = mode, reader, torch.device(device), reader.dim
        self._resident, self._slot, self._host = resident, slot, host
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
        pos, rows = self.reader.remote(ids, local=self.mode == "uva")
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

    ``free_bytes``: the device's free memory (default: asked of CUDA, after the model is there); it sizes the
    ``uva`` cache.
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
    return _place_shards(mode, reader, device)


def node_table_bytes(reader: FeatureReader) -> int:
    """Bytes of the rows this node holds: the whole table, or its shards plus the cache."""
    if isinstance(reader, LocalRows):
        return int(reader.table.nbytes)
    return sum(int(a.nbytes) for _, a in reader.resident())


def _place_table(mode: str, reader: LocalRows, device: torch.device, indptr: np.ndarray,
                 budget: int) -> DeviceFeatures:
    table = reader.table
    if mode == "device":
        return DeviceFeatures(mode, reader, device, readonly_tensor(table).to(device), None)
    host, note = _pinned(table, device)
    row_bytes = max(1, table.shape[1] * table.itemsize)
    hot = cache_ids(indptr, min(1.0, budget // row_bytes / max(1, table.shape[0])))
    slot = np.full(table.shape[0], -1, dtype=np.int32)
    slot[hot] = np.arange(hot.size, dtype=np.int32)
    cached = torch.from_numpy(np.ascontiguousarray(table[hot])).to(device)
    return DeviceFeatures(mode, reader, device, cached, torch.from_numpy(slot).to(device), host,
                          f"{hot.size} of {table.shape[0]} rows cached on the device{note}")


def _place_shards(mode: str, reader: ShardedRows, device: torch.device) -> DeviceFeatures:
    """The cache (and under ``device`` this node's shards) on the device; the rest comes from the reader."""
    parts = reader.resident() if mode == "device" else reader.resident()[:1]
    parts = [(ids, rows) for ids, rows in parts if ids.size]
    slot = np.full(reader.num_rows, -1, dtype=np.int32)
    at = 0
    for ids, _ in parts:  # the cache (first) wins where a shard repeats its rows
        keep = slot[ids] < 0
        slot[ids[keep]] = np.arange(at, at + ids.size, dtype=np.int32)[keep]
        at += ids.size
    rows = (np.concatenate([r for _, r in parts]) if parts
            else np.zeros((0, reader.dim), dtype=reader.dtype))
    return DeviceFeatures(mode, reader, device, torch.from_numpy(np.ascontiguousarray(rows)).to(device),
                          torch.from_numpy(slot).to(device),
                          note=f"{rows.shape[0]} rows on the device, the rest fetched by the host")


def _pinned(table: np.ndarray, device: torch.device) -> tuple:
    """``table`` as a host tensor the device can read: the store's pages registered in place, or a pinned copy
    where that fails (said in the note). On a CPU device: the table itself."""
    t = readonly_tensor(table)
    if device.type != "cuda":
        return t, ""
    ptr, size = t.data_ptr(), t.numel() * t.element_size()
    for held in _registered:  # pages registered once cannot be again (cudaErrorHostMemoryAlreadyRegistered)
        if held.data_ptr() <= ptr and ptr + size <= held.data_ptr() + held.numel() * held.element_size():
            return t, ""
    # Mapped (readable by kernels through unified addressing) and read-only: the store's pages are read-only.
    flags = _HOST_REGISTER_MAPPED | _HOST_REGISTER_READ_ONLY
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, size, flags))
    if err == 0:
        _registered.append(t)  # never unregistered while the worker runs: kernels may still read it
        return t, ""
    _clear_cuda_error()
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    pinned.copy_(t)
    return pinned, f"; the store's pages could not be registered ({err}): a pinned copy"


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
