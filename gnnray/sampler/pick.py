"""Stage 4's kernels (sampler actor): pick each node's in-edges, then number the picked sources locally.

Uniform sampling without replacement, GraphBolt's semantics: a node whose
in-degree is at most the fanout keeps all its in-edges, ``-1`` keeps all, and
on a typed graph each relation of a node (a run of equal codes in its sorted
in-edges) is drawn apart with its own fanout.

Why numba: no maintained library samples beside a current torch on the CPU
(DGL's GraphBolt needs torch <= 2.2.1; PyG's samplers need pyg-lib or
torch-sparse, which PyPI does not serve for current torch), and a vectorised
torch or numpy draw pays for every in-edge of every node, where a loop pays
only for the picks. The kernels release the GIL, so the sampler runs them
on its own threads (:class:`Threads`), one contiguous range of nodes each.

Randomness: every node draws from its own splitmix64 stream, seeded by the
batch's key and the node's id, so a batch's sample depends on (run seed,
epoch, batch, layer) and not on the thread count or the order of work.
Picks use Floyd's algorithm (k draws, each checked against the picks so far)
or, where the fanout is large against the degree, selection sampling (one
draw per in-edge, in order): both are exactly uniform.

Compiled code is cached on disk (numba's ``cache=True``, beside this file or
in ``NUMBA_CACHE_DIR``), so only a node's first run pays for the compile
(:func:`warm_up`).
"""

from __future__ import annotations

import concurrent.futures
from typing import Optional

import numba
import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_LOW32 = np.uint64(0xFFFFFFFF)
_S30, _S27, _S31, _S32 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(32)
_JIT = dict(nogil=True, cache=True)


@numba.njit(inline="always", **_JIT)
def mix(z):
    """splitmix64's finaliser: a well-spread 64-bit value from any ``z``."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@numba.njit(inline="always", **_JIT)
def _below(x, n):
    """A draw in ``[0, n)`` from the 64 random bits ``x``: the high word of ``x * n`` (Lemire), without division."""
    b = np.uint64(n)
    a_lo, a_hi, b_lo, b_hi = x & _LOW32, x >> _S32, b & _LOW32, b >> _S32
    cross = ((a_lo * b_lo) >> _S32) + ((a_hi * b_lo) & _LOW32) + a_lo * b_hi
    return np.int64(((a_hi * b_lo) >> _S32) + (cross >> _S32) + a_hi * b_hi)


@numba.njit(inline="always", **_JIT)
def _run_end(etype, start, stop):
    """End of the run of ``etype[start]``'s code in the sorted ``etype[start:stop]`` (binary search)."""
    code = etype[start]
    lo, hi = start + 1, stop
    while lo < hi:
        mid = (lo + hi) >> 1
        if etype[mid] == code:
            lo = mid + 1
        else:
            hi = mid
    return lo


@numba.njit(inline="always", **_JIT)
def _take(degree, fanout):
    return degree if fanout < 0 or degree <= fanout else fanout


@numba.njit(**_JIT)
def count(indptr, nodes, fanouts, etype, out, lo, hi):
    """``out[i]`` = edges node ``nodes[i]`` keeps, for ``i`` in ``[lo, hi)``; ``etype`` is empty when untyped."""
    typed = etype.shape[0] > 0
    for i in range(lo, hi):
        v = nodes[i]
        start, stop = np.int64(indptr[v]), np.int64(indptr[v + 1])
        if not typed:
            out[i] = _take(stop - start, fanouts[0])
            continue
        n = 0
        p = start
        while p < stop:
            q = _run_end(etype, p, stop)
            n += _take(q - p, fanouts[etype[p]])
            p = q
        out[i] = n


@numba.njit(**_JIT)
def pick(indptr, indices, nodes, fanouts, etype, key, offsets, pos, out, out_etype, lo, hi):
    """Pick the in-edges of ``nodes[lo:hi]`` into ``out[offsets[i]:offsets[i + 1]]`` (sources' global ids; each
    edge's relation into ``out_etype`` when ``etype`` is not empty). ``pos`` (int64, as long as ``out``) is
    scratch for the picked edges' positions.

    One loop body for both kinds of graph (an untyped node is one run), written out: as separate numba
    functions the draws ran a fifth slower.
    """
    typed = etype.shape[0] > 0
    most = 0
    for f in fanouts:
        most = max(most, f)
    scratch = np.empty(max(most, 1), np.int64)
    # First every draw, from indptr alone (small, cached), then the gather from indices: its loads depend on
    # nothing else, so the core overlaps their cache misses (twice as fast as gathering while drawing).
    for i in range(lo, hi):
        v = nodes[i]
        p, stop = np.int64(indptr[v]), np.int64(indptr[v + 1])
        state = mix(key ^ (np.uint64(v) * _GOLDEN))
        at = offsets[i]
        while p < stop:
            q, f = (_run_end(etype, p, stop), fanouts[etype[p]]) if typed else (stop, fanouts[0])
            d = q - p
            k = d if f < 0 or d <= f else f
            if k == d:
                for j in range(d):
                    pos[at + j] = p + j
            elif 10 * d < k * k:  # selection sampling: a draw per in-edge, fewer steps than Floyd's k * k / 2
                need = k
                for j in range(d):
                    state += _GOLDEN
                    if _below(mix(state), d - j) < need:
                        pos[at + k - need] = p + j
                        need -= 1
                        if need == 0:
                            break
            else:  # Floyd: for j in d-k .. d-1 draw t in [0, j]; take t unless taken, else j
                for m in range(k):
                    j = d - k + m
                    state += _GOLDEN
                    t = _below(mix(state), j + 1)
                    for r in range(m):
                        if scratch[r] == t:
                            t = j
                            break
                    scratch[m] = t
                    pos[at + m] = p + t
            at += k
            p = q
    for e in range(offsets[lo], offsets[hi]):
        out[e] = indices[pos[e]]
    if typed:
        for e in range(offsets[lo], offsets[hi]):
            out_etype[e] = etype[pos[e]]


@numba.njit(**_JIT)
def relabel(nodes, picked, table, local, src):
    """Number ``picked`` in ``local``: ``nodes`` (unique) are ``0..len(nodes)-1``, new ids follow as they first
    appear. ``src`` receives the numbered ids; return their count. ``table`` (one entry per graph node, all
    zero) holds each id's number plus one while it runs, and is all zero again when it returns."""
    n = nodes.shape[0]
    for i in range(n):
        v = nodes[i]
        table[v] = i + 1
        src[i] = v
    for e in range(picked.shape[0]):
        v = picked[e]
        j = table[v] - 1
        if j < 0:
            j = n
            n += 1
            table[v] = n
            src[j] = v
        local[e] = j
    for i in range(n):
        table[src[i]] = 0
    return n


class Threads:
    """The sampler's threads: ``run(fn, n, *args)`` calls ``fn(*args, lo, hi)`` on ``[0, n)`` cut into one range a
    thread, the calling thread taking the first (numba's kernels release the GIL)."""

    def __init__(self, threads: int):
        self.threads = max(1, int(threads))
        self._pool = (concurrent.futures.ThreadPoolExecutor(self.threads - 1, thread_name_prefix="gnnray-sample")
                      if self.threads > 1 else None)

    def run(self, fn, n: int, *args) -> None:
        parts = min(self.threads, max(1, n // 256))  # a few hundred nodes a range, or the dispatch costs more
        cuts = [n * p // parts for p in range(parts + 1)]
        futures = [self._pool.submit(fn, *args, cuts[p], cuts[p + 1]) for p in range(1, parts)]
        fn(*args, cuts[0], cuts[1])
        for f in futures:
            f.result()


_NO_ETYPE = np.empty(0, np.int8)


def sample_layer(indptr: np.ndarray, indices: np.ndarray, nodes: np.ndarray, fanouts: np.ndarray,
                 etype: Optional[np.ndarray], key: int, threads: Threads):
    """One layer's picks: CSC offsets (int64, one more than ``nodes``), the picked sources' global ids (in
    ``indices``' dtype) and, on a typed graph, their relations."""
    codes = _NO_ETYPE if etype is None else etype
    n = nodes.shape[0]
    offsets = np.empty(n + 1, np.int64)
    offsets[0] = 0
    threads.run(count, n, indptr, nodes, fanouts, codes, offsets[1:])
    np.cumsum(offsets, out=offsets)
    total = int(offsets[-1])
    out = np.empty(total, indices.dtype)
    out_etype = _NO_ETYPE if etype is None else np.empty(total, etype.dtype)
    threads.run(pick, n, indptr, indices, nodes, fanouts, codes, np.uint64(key), offsets, np.empty(total, np.int64),
                out, out_etype)
    return offsets, out, (None if etype is None else out_etype)


def warm_up(indptr_dtype, indices_dtype, etype_dtype=None) -> None:
    """Compile the kernels for a graph of these dtypes, or load them from numba's cache (about 3 s to compile on
    a 2-core machine, 0.3 s to load): the driver calls it while Ray starts, so that the sampler actors on its
    node find them compiled."""
    indptr, indices, nodes = np.zeros(2, indptr_dtype), np.zeros(0, indices_dtype), np.zeros(1, indices_dtype)
    etype = None if etype_dtype is None else np.zeros(0, etype_dtype)
    for a in (indptr, indices, etype):  # read-only, as the store hands them over: numba compiles those apart
        if a is not None:
            a.setflags(write=False)
    offsets, picked, _ = sample_layer(indptr, indices, nodes, np.ones(1, np.int64), etype, 0, Threads(1))
    src = np.empty(1, indices_dtype)
    relabel(nodes, picked, np.zeros(1, np.int32 if np.dtype(indices_dtype).itemsize == 4 else np.int64),
            np.empty(0, indices_dtype), src)


_MASK = 2**64 - 1


def _mix_int(z: int) -> int:
    """:func:`mix` on Python ints (keys are made once per batch, where numba's call would cost more)."""
    z &= _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def batch_key(*parts: int) -> int:
    """A 64-bit key from integers (run seed, epoch, batch, layer): different parts, independent streams."""
    key = 0
    for p in parts:
        key = _mix_int(key * 0x9E3779B97F4A7C15 + _mix_int(p + 0x9E3779B97F4A7C15))
    return key
