"""The in-edge CSC, built once from an edge list, with reverse edges and self loops if asked.

:func:`build_csc` is the one builder every reader's edge list goes through.
Untyped graphs are built with torch's stable sort; reverse edges are added
by :func:`bidirected_csc` a range of destination nodes per thread, each
range's keys sorted and de-duplicated on its own core, so a billion-edge
graph is never held as a sorted copy of its doubled edge list.
Both return the structure in :func:`structure_dtypes` (int32 where it fits),
written so from the start. Typed graphs (:func:`typed_csc`) are built in
numpy chunks.
"""

from __future__ import annotations

import warnings

import numpy as np

# Edges per step of the chunked build: bounds its temporaries (int64).
CHUNK_EDGES = 1 << 23
# The reverse-edge build takes its keys in ranges of at least this many edges, two per thread: each range is
# one pass over the edge list; its keys are 8 bytes each.
RANGE_EDGES = 1 << 25


def build_csc(src: np.ndarray, dst: np.ndarray, num_nodes: int, reverse: bool,
              self_loops: bool) -> tuple[np.ndarray, np.ndarray]:
    """In-edge CSC ``(indptr, indices)`` of the edges ``src -> dst``, in :func:`structure_dtypes`.

    Args:
        src, dst: Edge endpoints (any integer dtype; may be memory-mapped).
        num_nodes: Number of nodes.
        reverse: Add ``dst -> src`` for every edge and drop duplicate edges;
            each node's in-neighbors are then sorted by id.
        self_loops: Add a self loop to every node that lacks one.
    """
    if reverse:
        return bidirected_csc(src, dst, num_nodes, self_loops)
    if self_loops:
        has_loop = np.zeros(num_nodes, dtype=bool)
        has_loop[src[src == dst]] = True
        loops = np.flatnonzero(~has_loop)
        src, dst = np.concatenate([src, loops]), np.concatenate([dst, loops])
    return _sorted_csc(src, dst, num_nodes, *structure_dtypes(num_nodes, int(src.shape[0])))


def csc_from_edges(src: np.ndarray, dst: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Build the in-edge CSC ``(indptr, indices)`` of edges ``src -> dst``, both int64.

    Edges of a node keep their input order (stable sort), so the result is
    deterministic.
    """
    return _sorted_csc(src, dst, num_nodes, np.dtype(np.int64), np.dtype(np.int64))


def _sorted_csc(src, dst, n: int, ptr_dtype: np.dtype, idx_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """:func:`csc_from_edges` with torch's stable sort, the result in the given dtypes."""
    import torch

    d = _tensor(dst).to(torch.int64)
    order = torch.sort(d, stable=True)[1]
    counts = torch.bincount(d, minlength=n)
    del d
    indices = _tensor(src).to(torch.int64)[order].to(_torch_dtype(idx_dtype))
    del order
    indptr = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=indptr[1:])
    return indptr.numpy().astype(ptr_dtype, copy=False), indices.numpy()


def _tensor(a: np.ndarray):
    """``a`` as a tensor, without a copy where torch can share its memory; it is only read."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.as_tensor(np.asarray(a))


def _torch_dtype(dtype: np.dtype):
    import torch

    return {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}[np.dtype(dtype)]


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
    bytes less on every node. The sampler reads that mixed pair as it is
    (:mod:`gnnray.sampler.pick`); DGL's ``dgl.graph`` would not.
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
                   chunk: int = CHUNK_EDGES, range_edges: int = RANGE_EDGES) -> tuple[np.ndarray, np.ndarray]:
    """In-edge CSC of the edges ``src -> dst`` and ``dst -> src``, duplicates dropped, in :func:`structure_dtypes`.

    Each node's in-neighbors come sorted by id, plus a self loop for every
    node if ``self_loops``. Destination nodes are taken in ranges of about
    ``max(range_edges, E / (2 * threads))`` in-edges (``E`` both directions),
    one range per thread at a time, since a 1-D sort runs on one core: for
    each, the keys ``(dst - first) << 32 | src`` of its edges are gathered
    from the edge list (``chunk`` edges at a time), sorted in place (numpy's
    sort, with the GIL released: about 3 times faster than ``torch.sort``,
    and without its int64 order), then duplicates are dropped by comparing
    neighbours and the sources written, a chunk at a time. Peak memory is
    ``indices`` sized for all ``E`` edges (int32 below 2**31 nodes), two
    ``n``-sized counters and the ranges in flight, 8 bytes a key: ``E * 4``
    bytes, as much as ``indices``, and a chunk's temporaries per thread.
    ``src`` and ``dst`` may be memory-mapped.
    """
    import torch

    m, threads = int(src.shape[0]), max(1, torch.get_num_threads())
    starts = range(0, m, chunk)
    # One n-sized sum per group of chunks, at most 4 groups: not one per chunk (E / chunk of them) nor one per
    # thread of a many-core node (64 x 0.9 GB at papers100M); a linear pass, cheap beside the sorts.
    groups = min(threads, 4)
    deg = torch.full((n,), 1 if self_loops else 0, dtype=torch.int64)
    for part in _parallel(lambda group: _chunk_degrees(src, dst, group, chunk, n),
                          [starts[t::groups] for t in range(groups)], groups):
        deg += part
    ends = torch.cumsum(deg, 0).numpy()  # in-edges of nodes 0..v, duplicates included
    del deg
    total = int(ends[-1]) if n else 0
    indices = np.empty(total, dtype=structure_dtypes(n, total)[1])
    out, counts = torch.from_numpy(indices), torch.zeros(n, dtype=torch.int64)
    step = max(range_edges, -(-total // (2 * threads)))  # two ranges per thread: half the keys in flight
    shift = max(32, (n - 1).bit_length())  # a key's low bits: the source; its high bits: the destination's offset
    ranges, v = [], 0
    while v < n:
        w = min(n, max(v + 1, int(np.searchsorted(ends, (ends[v - 1] if v else 0) + step, side="right"))),
                v + (1 << (63 - shift)))  # keys stay below 2**63
        ranges.append((v, w))  # nodes [v, w): ~step in-edges
        v = w

    def build(vw: tuple) -> int:
        """Sort the range's keys; write its de-duplicated columns from its first slot and its counts."""
        v, w = vw
        first = int(ends[v - 1]) if v else 0
        key = _range_keys(src, dst, v, w, int(ends[w - 1]) - first, self_loops, chunk, shift, len(ranges) == 1)
        key.numpy().sort()  # in place, the GIL released; torch.sort would also return an int64 order
        # Duplicates dropped and columns written a chunk at a time: temporaries of a chunk, not of the range.
        at, low = first, (1 << shift) - 1
        for a in range(0, key.numel(), chunk):
            part = key[a:a + chunk]
            keep = torch.ones(part.numel(), dtype=torch.bool)
            torch.ne(part[1:], part[:-1], out=keep[1:])
            if a:
                keep[0] = bool(part[0] != key[a - 1])
            part = part[keep]
            out[at:at + part.numel()] = part & low
            counts[v:w] += torch.bincount(part >> shift, minlength=w - v)
            at += part.numel()
        return at - first

    kept = _parallel(build, ranges, threads)
    written = 0  # close the gaps the dropped duplicates left, in order (numpy copes with the overlap)
    for (v, _), size in zip(ranges, kept):
        first = int(ends[v - 1]) if v else 0
        if first != written:
            indices[written:written + size] = indices[first:first + size]
        written += size
    indptr = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=indptr[1:])
    # Past 2**31 edges before duplicates were dropped, but not after: indptr fits int32 again.
    indptr = indptr.numpy().astype(structure_dtypes(n, written)[0], copy=False)
    return indptr, indices[:written]


def _parallel(fn, items, threads: int) -> list:
    """``[fn(x) for x in items]``, ``threads`` at a time: torch ops release the GIL, and a 1-D sort or
    bincount uses one core."""
    if threads == 1 or len(items) < 2:
        return [fn(x) for x in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(fn, items))


def _chunk_degrees(src, dst, starts: range, chunk: int, n: int):
    """In-degree of each node in both directions, over the edges ``a .. a + chunk`` for each ``a`` of ``starts``."""
    import torch

    deg = torch.zeros(n, dtype=torch.int64)
    for a in starts:
        deg += torch.bincount(_tensor(dst[a:a + chunk]).to(torch.int64), minlength=n)
        deg += torch.bincount(_tensor(src[a:a + chunk]).to(torch.int64), minlength=n)
    return deg


def _range_keys(src, dst, v: int, w: int, count: int, self_loops: bool, chunk: int, shift: int, whole: bool):
    """The ``count`` int64 keys ``(d - v) << shift | s`` of the edges ``s -> d`` of both directions with
    ``v <= d < w`` (``whole``: every edge, no selection), and the loops of those nodes."""
    import torch

    key = torch.empty(count, dtype=torch.int64)
    at = 0
    for a in range(0, int(src.shape[0]), chunk):
        s = _tensor(src[a:a + chunk]).to(torch.int64)
        d = _tensor(dst[a:a + chunk]).to(torch.int64)
        for x, y in ((d, s), (s, d)):  # x: the destination
            if not whole:
                keep = (x >= v) & (x < w)
                x, y = x[keep], y[keep]
            part = key[at:at + x.numel()]
            torch.sub(x, v, out=part)
            part.bitwise_left_shift_(shift).bitwise_or_(y)
            at += x.numel()
    if self_loops:
        loops = torch.arange(v, w, dtype=torch.int64)
        key[at:at + w - v] = ((loops - v) << shift) | loops
        at += w - v
    assert at == count, (at, count)
    return key
