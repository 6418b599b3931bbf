"""What a shard server holds for layer-wise inference: its node range's rows of the hidden tables.

The ranks' side is :mod:`gnnray.train.layerwise_hidden`: each chunk of a table a rank
computes is kept here, in this node's store, rows of it are served to the next
layer's chunks, and the table is dropped once the layer after it is done.

Rows are served in pieces small enough for Ray to send inside its reply
(:data:`PIECE_BYTES`), never as store objects: a store object freed by its
reader lingers on both nodes until the raylets' next batched delete, so a
chunk's rows would add up on every node at the rate the chunks go.
"""

from __future__ import annotations

import threading
from typing import Iterator, Optional

import numpy as np

# Ray sends a call's result inside its reply below 100 KiB (its max_direct_call_object_size); the rest is margin
# for the serialized array's header.
PIECE_BYTES = 96 * 1024


def piece_rows(width: int) -> int:
    """Rows of ``width`` float32 per piece of :meth:`HiddenRowsHeld.hidden`."""
    return max(1, PIECE_BYTES // max(1, 4 * width))


class HiddenRowsHeld:
    """Base of :class:`gnnray.store.shards.ShardServer`: the hidden rows of one evaluation at a time."""

    def __init__(self):
        self._lock = threading.Lock()  # calls run on up to max_concurrency threads
        self._token, self._tables, self._held, self._peak = None, {}, 0, 0

    def begin(self, token: str) -> None:
        """Make ``token`` the evaluation whose rows this server holds; the last one's tables are dropped.

        Called (and waited for) before any rank of that evaluation keeps rows, so any other token's
        :meth:`keep` is a late call of an evaluation already replaced: ignored, never a reset.
        """
        with self._lock:
            if token != self._token:
                self._token, self._tables, self._held, self._peak = token, {}, 0, 0

    def keep(self, token: str, layer: int, lo: int, rows: np.ndarray) -> int:
        """Hold ``rows`` (node ids ``lo..``) of hidden table ``layer`` of evaluation ``token`` in this node's store;
        the rows held (0 for an evaluation other than the one begun last: a late call of a failed one)."""
        import ray

        if token != self._token:
            return 0
        ref = ray.put(rows)  # a copy owned here: the argument is the caller's object, freed after the call
        rows = ray.get(ref)  # zero-copy view on that copy
        with self._lock:
            if token != self._token:  # replaced meanwhile
                return 0
            self._tables.setdefault(layer, _Table()).add(lo, ref, rows)
            self._held += rows.nbytes
            self._peak = max(self._peak, self._held)
        return rows.shape[0]

    def hidden(self, token: str, layer: int, ids: np.ndarray, piece: int) -> Iterator[np.ndarray]:
        """Rows ``ids`` (global node ids) of hidden table ``layer``, as float32, ``piece`` rows at a time (called
        with ``num_returns="streaming"``; :func:`piece_rows` keeps each piece out of the object store)."""
        table = self._tables.get(layer) if token == self._token else None
        if table is None:
            raise KeyError(f"hidden table {layer} of evaluation {token[:8]} is not held here (dropped, or never "
                           f"kept: a bug)")
        rows = table.take(np.asarray(ids, dtype=np.int64))
        for a in range(0, len(rows), piece):
            yield rows[a:a + piece]

    def drop(self, token: str, layer: Optional[int] = None) -> None:
        """Free hidden table ``layer`` of ``token`` (all of its tables without ``layer``)."""
        with self._lock:
            if token != self._token:
                return
            for t in [layer] if layer is not None else list(self._tables):
                table = self._tables.pop(t, None)
                self._held -= table.nbytes if table is not None else 0

    def hidden_bytes(self) -> dict:
        """Bytes of hidden rows held now and at most at once since the evaluation began (its store objects)."""
        return dict(held=self._held, peak=self._peak)


class _Table:
    """A hidden table's rows on one server: chunks ``(first node id, rows)``, in any order until read."""

    def __init__(self):
        self._chunks, self._index, self.nbytes = [], None, 0

    def add(self, lo: int, ref, rows: np.ndarray) -> None:
        self._chunks.append((int(lo), ref, rows))
        self.nbytes += rows.nbytes

    def take(self, ids: np.ndarray) -> np.ndarray:
        if self._index is None:  # read only once complete (the ranks wait for each other between layers)
            chunks = sorted(self._chunks, key=lambda c: c[0])
            self._index = (np.array([c[0] for c in chunks], dtype=np.int64),
                           np.array([c[0] + len(c[2]) for c in chunks], dtype=np.int64), [c[2] for c in chunks])
        starts, ends, parts = self._index
        part = np.searchsorted(starts, ids, side="right") - 1
        held = part >= 0
        held[held] = ids[held] < ends[part[held]]
        if not held.all():
            raise KeyError(f"{int(np.count_nonzero(~held))} rows asked for (node {int(ids[~held][0])} first) are in "
                           f"no chunk of this hidden table (the ranges of ranks and servers differ: a bug)")
        out = np.empty((len(ids), parts[0].shape[1] if parts else 0), dtype=np.float32)
        order = np.argsort(part, kind="stable")
        bounds = np.searchsorted(part[order], np.arange(len(parts) + 1))
        for k in np.flatnonzero(np.diff(bounds)):  # only the chunks asked for, one fancy index each
            p = order[bounds[k]:bounds[k + 1]]
            out[p] = parts[k][ids[p] - starts[k]]
        return out
