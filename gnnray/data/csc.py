"""The in-edge CSC, built once from an edge list, with reverse edges and self loops if asked.

:func:`build_csc` is the one builder every reader's edge list goes through.
Reverse edges are added by :func:`bidirected_csc` straight into the CSC, in
chunks, so a billion-edge graph is not copied several times on the way.
The builders work in int64; :func:`compact_csc`, applied once to the finished
CSC (:meth:`~gnnray.data.graph.GraphParts.build`), stores each array as int32
where its values fit (node ids in ``indices``, offsets in ``indptr``), which
halves the structure's bytes; GraphBolt samples from it without a copy.
"""

from __future__ import annotations

import numpy as np

# Edges per step of the chunked build: bounds its temporaries (int64).
CHUNK_EDGES = 1 << 23


def build_csc(src: np.ndarray, dst: np.ndarray, num_nodes: int, reverse: bool,
              self_loops: bool) -> tuple[np.ndarray, np.ndarray]:
    """In-edge CSC ``(indptr, indices)`` of the edges ``src -> dst``.

    Args:
        src, dst: Edge endpoints (any integer dtype; may be memory-mapped).
        num_nodes: Number of nodes.
        reverse: Add ``dst -> src`` for every edge and drop duplicate edges;
            each node's in-neighbors are then sorted by id.
        self_loops: Add a self loop to every node that lacks one.
    """
    if reverse:
        return bidirected_csc(src, dst, num_nodes, self_loops)
    src, dst = src.astype(np.int64, copy=False), dst.astype(np.int64, copy=False)
    if self_loops:
        has_loop = np.zeros(num_nodes, dtype=bool)
        has_loop[src[src == dst]] = True
        loops = np.flatnonzero(~has_loop)
        src, dst = np.concatenate([src, loops]), np.concatenate([dst, loops])
    return csc_from_edges(src, dst, num_nodes)


def csc_from_edges(src: np.ndarray, dst: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Build the in-edge CSC ``(indptr, indices)`` of edges ``src -> dst``.

    Edges of a node keep their input order (stable sort), so the result is
    deterministic.
    """
    order = np.argsort(dst, kind="stable")
    indices = np.ascontiguousarray(src[order], dtype=np.int64)
    counts = np.bincount(dst, minlength=num_nodes)
    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    return indptr, indices



def _scatter(indices: np.ndarray, free: np.ndarray, s: np.ndarray, d: np.ndarray,
             etype: np.ndarray = None, t=None) -> None:
    """Write the edges ``s -> d`` (and their relations ``t`` into ``etype``) at the next free slots of their ``d``."""
    order = np.argsort(d, kind="stable")
    d, s = d[order], s[order]
    starts = np.flatnonzero(np.r_[True, d[1:] != d[:-1]])
    counts = np.diff(np.r_[starts, d.size])
    slot = free[d] + (np.arange(d.size) - np.repeat(starts, counts))  # rank among the chunk's edges into d
    indices[slot] = s
    if etype is not None:
        etype[slot] = t[order]
    free[d[starts]] += counts


def typed_csc(src: np.ndarray, dst: np.ndarray, etype: np.ndarray, n: int, num_relations: int, reverse: bool,
              chunk: int = CHUNK_EDGES) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """In-edge CSC ``(indptr, indices, etype)`` of typed edges, built in chunks like :func:`bidirected_csc`.

    With ``reverse``, each edge ``s -r-> d`` also becomes ``d -rev_r-> s``,
    relation ``r + num_relations``. Duplicates are kept: two relations between
    the same pair are two different edges. Each node's in-edges come ordered
    by relation (:func:`sort_by_relation`). Peak memory is the output plus
    ``chunk``-sized temporaries; the inputs may be memory-mapped.
    """
    m = int(src.shape[0])
    total = num_relations * (2 if reverse else 1)
    deg = np.zeros(n, dtype=np.int64)
    for a in range(0, m, chunk):
        deg += np.bincount(dst[a:a + chunk], minlength=n)
        if reverse:
            deg += np.bincount(src[a:a + chunk], minlength=n)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(deg, out=indptr[1:])
    del deg
    indices = np.empty(int(indptr[-1]), dtype=np.int64)
    types = np.empty(int(indptr[-1]), dtype=etype_dtype(total))
    free = indptr[:-1].copy()
    for a in range(0, m, chunk):
        s, d = np.asarray(src[a:a + chunk], dtype=np.int64), np.asarray(dst[a:a + chunk], dtype=np.int64)
        t = np.asarray(etype[a:a + chunk], dtype=types.dtype)
        _scatter(indices, free, s, d, types, t)
        if reverse:
            _scatter(indices, free, d, s, types, t + num_relations)
    del free
    sort_by_relation(indptr, indices, types, chunk)
    return indptr, indices, types


def sort_by_relation(indptr: np.ndarray, indices: np.ndarray, etype: np.ndarray, chunk: int = CHUNK_EDGES) -> None:
    """Order each node's in-edges by relation, in place; within a relation they keep their order.

    GraphBolt samples a node's relations apart (one fanout per relation) by
    finding each relation's edges as one run of equal codes among the node's
    in-edges, so a typed CSC is built in this order, once at load. Blocks of
    about ``chunk`` edges at a time; blocks already in order are left as they are.
    """
    n = int(indptr.shape[0]) - 1
    codes = int(etype.max()) + 1 if etype.size else 1
    v = 0
    while v < n:
        w = min(n, max(v + 1, int(np.searchsorted(indptr, int(indptr[v]) + chunk, side="right")) - 1))
        a, b = int(indptr[v]), int(indptr[w])
        key = np.repeat(np.arange(w - v, dtype=np.int64), np.diff(indptr[v:w + 1])) * codes + etype[a:b]
        if np.any(key[1:] < key[:-1]):
            order = np.argsort(key, kind="stable")
            indices[a:b] = indices[a:b][order]
            etype[a:b] = etype[a:b][order]
        v = w


def structure_dtypes(num_nodes: int, num_edges: int) -> tuple[np.dtype, np.dtype]:
    """The dtypes of a graph's ``(indptr, indices)``: each int32 while its values fit, else int64.

    ``indptr`` holds offsets up to ``num_edges``, ``indices`` node ids below
    ``num_nodes``. Past 2**31 edges (papers100M, MAG240M with reverse edges)
    only ``indptr`` widens: ``indices``, the big array, stays int32, E x 4
    bytes less on every node. GraphBolt samples that mixed pair as it is
    (:func:`~gnnray.data.store.to_graphbolt`); DGL's ``dgl.graph`` would not.
    """
    def fits(count: int) -> np.dtype:
        return np.dtype(np.int32 if count < 2**31 else np.int64)

    return fits(num_edges), fits(num_nodes)


def compact_csc(indptr: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(indptr, indices)`` in :func:`structure_dtypes`: each int32 where its values fit, else unchanged.

    One ``astype`` copy per narrowed array: at the peak the int64 pair and the int32
    copies are alive, 1.5 times the int64 structure. Rebind the names to the result
    (``indptr, indices = compact_csc(indptr, indices)``) so that the int64
    arrays are freed on return.
    """
    ptr_dtype, idx_dtype = structure_dtypes(int(indptr.shape[0]) - 1, int(indices.shape[0]))
    return indptr.astype(ptr_dtype, copy=False), indices.astype(idx_dtype, copy=False)


def etype_dtype(num_relations: int) -> np.dtype:
    """The narrowest dtype of a relation code: one byte per edge while there are at most 127 relations."""
    return np.dtype(np.int8 if num_relations <= 127 else np.int16)


def bidirected_csc(src: np.ndarray, dst: np.ndarray, n: int, self_loops: bool,
                    chunk: int = CHUNK_EDGES) -> tuple[np.ndarray, np.ndarray]:
    """In-edge CSC of the edges ``src -> dst`` and ``dst -> src``, duplicates dropped, built in chunks.

    Each node's in-neighbors come sorted by id, plus a self loop for every
    node if ``self_loops``, without a copy of the doubled edge list: peak memory is the output (``indices`` for both
    directions, before duplicates are dropped), two ``n + 1`` counters and
    ``chunk``-sized temporaries. ``src`` and ``dst`` may be memory-mapped.
    """
    m = int(src.shape[0])
    deg = np.full(n, 1 if self_loops else 0, dtype=np.int64)
    for a in range(0, m, chunk):
        deg += np.bincount(dst[a:a + chunk], minlength=n)
        deg += np.bincount(src[a:a + chunk], minlength=n)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(deg, out=indptr[1:])
    del deg
    indices = np.empty(int(indptr[-1]), dtype=np.int64)
    free = indptr[:-1].copy()  # next unwritten slot of each node's segment

    for a in range(0, m, chunk):
        s, d = np.asarray(src[a:a + chunk], dtype=np.int64), np.asarray(dst[a:a + chunk], dtype=np.int64)
        _scatter(indices, free, s, d)
        _scatter(indices, free, d, s)
    if self_loops:
        for a in range(0, n, chunk):
            loops = np.arange(a, min(a + chunk, n), dtype=np.int64)
            _scatter(indices, free, loops, loops)
    del free

    # Sort each node's in-neighbors and drop duplicates, a block of nodes at a
    # time, compacting in place (the write position never passes the read one).
    out_ptr = np.zeros(n + 1, dtype=np.int64)
    v = written = 0
    while v < n:
        w = min(n, max(v + 1, int(np.searchsorted(indptr, indptr[v] + chunk, side="right")) - 1))
        local_dst = np.repeat(np.arange(w - v, dtype=np.int64), np.diff(indptr[v:w + 1]))
        key = np.unique(local_dst * n + indices[indptr[v]:indptr[w]])
        kept_dst, kept_src = np.divmod(key, n)
        indices[written:written + key.size] = kept_src
        out_ptr[v + 1:w + 1] = written + np.cumsum(np.bincount(kept_dst, minlength=w - v))
        written += key.size
        v = w
    # A view keeps the dropped duplicates' memory; worth a copy only when
    # many were dropped (a graph stored both ways already).
    return out_ptr, indices[:written].copy() if 2 * written < indices.size else indices[:written]

