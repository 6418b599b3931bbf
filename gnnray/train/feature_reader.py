"""With stage 5 (train worker's prefetch thread, inference actors): input features of a mini-batch's nodes.

:func:`reader_for` gives every process the same :class:`FeatureReader` interface:

- one shard (the default): rows are read zero-copy from the node's copy of the
  whole table (:class:`LocalRows`);
- ``--feature-shards K`` (:class:`ShardedRows`): rows in the cache or in a shard
  this node holds are read zero-copy here; the others are asked of their
  shard's server, one call per (mini-batch, remote shard), all sent before the
  local rows are copied, so the fetch overlaps the local work and, in the
  prefetch thread, the training step. This is the one place features are
  gathered: the servers return only the rows asked for, so each feature byte
  crosses the network once, and it lands in the prefetch slot's buffer
  (pinned on a GPU) it is copied to the device from. Rows are routed to their
  shards by one sort (``shards.route``), and the calls are waited for together
  under one ``--feature-timeout`` per batch (``store/calls.py``): a failure
  names the shard and its node, and the calls still pending are cancelled.

Rows land in the buffer's dtype: float16 storage is widened to float32 while
it is copied into a float32 buffer, or kept (``FeatureReader.dtype``) where the
prefetch thread copies it to a GPU, so half the bytes cross PCIe and the
device widens them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from gnnray.data.graph import Graph
from gnnray.store.calls import GATHER, wait_calls
from gnnray.store.handle import readonly_tensor, write_protected
from gnnray.store.shards import ShardedFeatures, route


@dataclass
class FetchStats:
    """What a reader's gathers cost (cumulative; :meth:`since` gives an interval's).

    Attributes:
        batches: Gathers.
        rows: Rows gathered.
        cached_rows: Rows read from the cache.
        local_rows: Rows read from a shard on this node (or the whole table).
        remote_rows: Rows fetched from other nodes.
        remote_bytes: Their bytes as stored (what crossed the network).
        remote_calls: Gather calls to shard servers.
        wait_s: Time spent waiting for remote rows after the local work.
    """

    batches: int = 0
    rows: int = 0
    cached_rows: int = 0
    local_rows: int = 0
    remote_rows: int = 0
    remote_bytes: int = 0
    remote_calls: int = 0
    wait_s: float = 0.0

    def since(self, earlier: "FetchStats") -> "FetchStats":
        return FetchStats(**{k: v - getattr(earlier, k) for k, v in vars(self).items()})

    def summary(self) -> dict:
        """Per-batch figures for the metrics line (``metrics.jsonl``)."""
        b = max(self.batches, 1)
        return dict(remote_bytes_per_batch=self.remote_bytes / b, remote_calls_per_batch=self.remote_calls / b,
                    remote_wait_s_per_batch=self.wait_s / b,
                    cache_hit_rate=self.cached_rows / max(self.rows, 1),
                    remote_row_share=self.remote_rows / max(self.rows, 1))


class FeatureReader:
    """``gather(ids, out)``: rows ``ids`` of the feature table into ``out`` (float32, or :attr:`dtype`)."""

    dim: int
    dtype: np.dtype = np.dtype(np.float32)  # as stored

    def __init__(self):
        self._stats = FetchStats()

    def gather(self, ids: np.ndarray, out: np.ndarray) -> None:
        raise NotImplementedError

    def stats(self) -> FetchStats:
        """A copy of the cumulative stats (one thread gathers; a copy read meanwhile is off by a batch at most)."""
        return FetchStats(**vars(self._stats))


class LocalRows(FeatureReader):
    """The whole table on this node's store (``--feature-shards 1``)."""

    def __init__(self, feat: np.ndarray):
        super().__init__()
        self.table, self.dim, self.dtype = feat, int(feat.shape[1]), np.dtype(feat.dtype)

    def gather(self, ids, out):
        take_rows(self.table, ids, out)
        s = self._stats
        s.batches, s.rows, s.local_rows = s.batches + 1, s.rows + len(ids), s.local_rows + len(ids)


class ShardedRows(FeatureReader):
    """A sharded table: the cache and this node's shards read here, the rest fetched from their servers."""

    def __init__(self, handle: ShardedFeatures):
        import ray

        super().__init__()
        self._h, self.dim, self.dtype, self.num_rows = handle, handle.dim, np.dtype(handle.dtype), handle.num_rows
        self._starts = np.array([s.lo for s in handle.shards], dtype=np.int64)
        node = ray.get_runtime_context().get_node_id()
        # A shard on this node is a zero-copy read; no process ever gets another node's shard (the whole of it
        # would be pulled here).
        self._local = {k: write_protected(ray.get(s.ref[0])) for k, s in enumerate(handle.shards)
                       if s.node_id == node}
        self._slot = self._cached = None
        if handle.cache is not None:
            cache = ray.get(handle.cache[0])  # pulled to this node once; later processes here read that copy
            self._slot, self._cached = write_protected(cache["slot"]), write_protected(cache["rows"])

    @property
    def cache(self) -> Optional[tuple]:
        """``(slot, rows)`` of the cache, zero-copy (``slot[id]``: its row in ``rows``, or -1), or ``None``."""
        return None if self._slot is None else (self._slot, self._cached)

    def local_shards(self) -> list:
        """``(k, lo, rows)`` of each shard on this node, zero-copy: rows ``lo..lo + len(rows)`` of the table."""
        return [(k, self._h.shards[k].lo, rows) for k, rows in self._local.items()]

    def gather(self, ids, out):
        self._gather(np.asarray(ids), out)

    def remote(self, ids: np.ndarray, held: "Held") -> tuple:
        """``(pos, rows)``: the rows of ``ids`` a device holding ``held`` lacks, read here or fetched from other
        nodes, compact and as stored (positions in ``ids``, increasing)."""
        ids = np.asarray(ids)
        cached, local = self._held(ids, held)
        pos = np.flatnonzero(~(cached | local))
        rows = np.empty((pos.size, self.dim), dtype=self.dtype)
        self._gather(ids[pos], rows)
        s = self._stats  # the held rows count as read, as where the host reads them
        s.rows, s.cached_rows = s.rows + int(cached.sum()), s.cached_rows + int(cached.sum())
        s.rows, s.local_rows = s.rows + int(local.sum()), s.local_rows + int(local.sum())
        return pos.astype(np.int64), rows

    def _held(self, ids: np.ndarray, held: "Held") -> tuple:
        """Which of ``ids`` the device holds: by the cache's first rows, else by a local shard's first rows."""
        cached = np.zeros(ids.size, dtype=bool)
        if self._slot is not None and held.cached:
            s = self._slot[ids]
            cached = (s >= 0) & (s < held.cached)
        local = np.zeros(ids.size, dtype=bool)
        for k, count in held.local.items():
            lo = self._h.shards[k].lo
            local |= (ids >= lo) & (ids < lo + count)
        return cached, local & ~cached

    def _gather(self, ids: np.ndarray, out: np.ndarray) -> None:
        s, n = self._stats, len(ids)
        if self.dim == 0:  # no features (--embedding-dim alone): nothing to fetch
            s.batches, s.rows = s.batches + 1, s.rows + n
            return
        hit = self._slot[ids] >= 0 if self._slot is not None else None
        order, at = route(self._starts, ids, hit)
        calls, local = [], []
        for k, shard in enumerate(self._h.shards):
            pos = order[at[k]:at[k + 1]]
            if pos.size and k in self._local:
                local.append((k, pos))
            elif pos.size:
                calls.append((shard, pos, shard.server.gather.remote(ids[pos] - shard.lo)))
        cached = order[at[-1]:]
        if cached.size:
            take_rows(self._cached, self._slot[ids[cached]], out, rows=cached)
        for k, pos in local:
            take_rows(self._local[k], ids[pos] - self._h.shards[k].lo, out, rows=pos)
        start = time.perf_counter()

        def put(i, rows):  # each shard's rows as they arrive, while the others are still on the way
            out[calls[i][1]] = rows
            s.remote_bytes += rows.nbytes

        # One deadline for all the calls, waited for together; a failure names its shard and node.
        wait_calls([(shard, ref) for shard, _, ref in calls], self._h.timeout_s, GATHER, put)
        s.wait_s += time.perf_counter() - start
        s.batches, s.rows, s.remote_calls = s.batches + 1, s.rows + n, s.remote_calls + len(calls)
        s.cached_rows += int(cached.size)
        s.local_rows += sum(int(p.size) for _, p in local)
        s.remote_rows += sum(int(p.size) for _, p, _ in calls)


@dataclass(frozen=True)
class Held:
    """What a device holds of a sharded table: the cache's first ``cached`` rows, and of each local shard ``k``
    its first ``local[k]`` rows (:meth:`ShardedRows.remote` leaves them out)."""

    cached: int = 0
    local: dict = field(default_factory=dict)


def reader_for(graph: Graph, features: Optional[ShardedFeatures]) -> FeatureReader:
    """The reader of ``graph``'s features: its own table, or the sharded one its handle names."""
    return LocalRows(graph.feat) if features is None else ShardedRows(features)


def take_rows(table: np.ndarray, ids: np.ndarray, out: np.ndarray, rows: Optional[np.ndarray] = None) -> None:
    """``out[rows] = table[ids]`` (all of ``out`` without ``rows``), widening float16 into a float32 ``out``; no
    temporary where the dtypes match.

    torch's ``index_select``, not ``np.take``: it runs on torch's threads, and ``np.take(..., out=)`` buffers
    its whole output (mode "raise"), 3x slower even on one thread (docs/performance.md#benchgpu). Ids out of range
    raise, as np.take's did.
    """
    src, dst = readonly_tensor(table), torch.from_numpy(out)  # the table may be the store's read-only pages
    idx = np.asarray(ids)
    idx = torch.from_numpy(idx if idx.dtype in (np.int32, np.int64) else idx.astype(np.int64))
    if rows is None and table.dtype == out.dtype and dst.is_contiguous():
        torch.index_select(src, 0, idx, out=dst)
    elif rows is None:
        dst.copy_(torch.index_select(src, 0, idx))
    else:
        dst[torch.from_numpy(np.asarray(rows, dtype=np.int64))] = torch.index_select(src, 0, idx).to(dst.dtype)
