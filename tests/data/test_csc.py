"""The untyped CSC builder (gnnray.data.csc) against DGL's own CSC of the same edges.

The oracle is DGL's graph constructors: ``dgl.graph``, ``add_reverse_edges``
and ``to_simple`` (reverse edges, duplicates dropped), ``add_self_loop``, and
``adj_tensors("csc")``; each node's in-neighbors are compared as sorted lists
(DGL keeps no order within a column; gnnray's reverse build sorts them by id). Those comparisons are marked
``dgl`` (DGL is imported inside them); the builder's own properties, and the large-graph paths against the
one-range build, are checked everywhere.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gnnray.data.csc import bidirected_csc, build_csc


def edges(seed: int, n: int, m: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Random edges among the first ``n - 5`` of ``n`` nodes (the last five isolated), with duplicates,
    reciprocal pairs and self loops."""
    rng = np.random.default_rng(seed)
    src, dst = rng.integers(0, n - 5, m).astype(dtype), rng.integers(0, n - 5, m).astype(dtype)
    src[: m // 10], dst[: m // 10] = dst[m // 10: 2 * (m // 10)], src[m // 10: 2 * (m // 10)]  # reciprocal pairs
    src[-20:], dst[-20:] = src[:20], dst[:20]  # exact duplicates
    dst[-40:-20] = src[-40:-20]  # self loops
    return src, dst


def dgl_csc(src, dst, n: int, reverse: bool, self_loops: bool) -> tuple[np.ndarray, list]:
    """DGL's in-edge CSC: indptr and each node's sorted in-neighbors."""
    import dgl

    g = dgl.graph((torch.as_tensor(src).long(), torch.as_tensor(dst).long()), num_nodes=n)
    if reverse:
        g = dgl.to_simple(dgl.add_reverse_edges(g))
        if self_loops:
            g = dgl.add_self_loop(dgl.remove_self_loop(g))
    elif self_loops:  # a loop for every node that lacks one; the edge list is otherwise kept as it is
        nodes = torch.arange(n)
        lacking = nodes[~g.has_edges_between(nodes, nodes)]
        g = dgl.add_edges(g, lacking, lacking)
    indptr, indices, _ = g.adj_tensors("csc")
    indptr, indices = indptr.numpy(), indices.numpy()
    return indptr, [sorted(indices[a:b].tolist()) for a, b in zip(indptr[:-1], indptr[1:])]


def columns(indptr: np.ndarray, indices: np.ndarray) -> list:
    return [indices[a:b].tolist() for a, b in zip(indptr[:-1].tolist(), indptr[1:].tolist())]


@pytest.mark.dgl
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("self_loops", [False, True])
def test_build_csc_equals_dgls_csc(dtype, reverse, self_loops):
    n = 300
    src, dst = edges(0, n, 3000, dtype)
    indptr, indices = build_csc(src, dst, n, reverse, self_loops)
    want_ptr, want_cols = dgl_csc(src, dst, n, reverse, self_loops)
    np.testing.assert_array_equal(indptr, want_ptr)
    got = columns(indptr, indices)
    if reverse:  # sorted by id, each pair once
        assert got == want_cols
    else:
        assert [sorted(c) for c in got] == want_cols


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("self_loops", [False, True])
def test_build_csc_keeps_the_edge_lists_order_or_sorts_each_pair_once(dtype, reverse, self_loops):
    """Without reverse edges a node's in-edges keep the edge list's order (stable), a self loop after them where
    it lacked one; with them each column is sorted by id, each pair once. int32 below 2**31 nodes and edges."""
    n = 300
    src, dst = edges(0, n, 3000, dtype)
    indptr, indices = build_csc(src, dst, n, reverse, self_loops)
    got = columns(indptr, indices)
    if reverse:
        pairs = {(int(u), int(v)) for u, v in zip(src, dst)}
        pairs |= {(v, u) for u, v in pairs}
        if self_loops:
            pairs |= {(v, v) for v in range(n)}
        assert got == [sorted(u for u, w in pairs if w == v) for v in range(n)]
    else:
        for v in range(n):
            order = np.flatnonzero(dst == v)
            assert got[v][:order.size] == src[order].tolist()
            assert got[v][order.size:] == ([v] if self_loops and v not in got[v][:order.size] else [])
    assert indptr.dtype == indices.dtype == np.int32  # below 2**31 nodes and edges
    assert all(not c for c in got[n - 5:]) or self_loops  # isolated nodes: empty, or only their loop


@pytest.mark.parametrize("self_loops", [False, True])
@pytest.mark.parametrize("chunk, range_edges", [(7, 13), (100, 500), (1 << 20, 1 << 25)])
def test_ranges_and_chunks_give_the_same_csc(self_loops, chunk, range_edges):
    """The reverse build in many node ranges and edge chunks (the path of a large graph) is the one-range result."""
    n = 200
    src, dst = edges(1, n, 2000, np.int64)
    indptr, indices = bidirected_csc(src, dst, n, self_loops, chunk=chunk, range_edges=range_edges)
    want_ptr, want = bidirected_csc(src, dst, n, self_loops, chunk=1 << 30, range_edges=1 << 40)
    np.testing.assert_array_equal(indptr, want_ptr)
    assert columns(indptr, indices) == columns(want_ptr, want)


@pytest.mark.dgl
@pytest.mark.parametrize("self_loops", [False, True])
def test_the_one_range_build_equals_dgls_csc(self_loops):
    """The reference of test_ranges_and_chunks_give_the_same_csc, on its edges, against DGL."""
    n = 200
    src, dst = edges(1, n, 2000, np.int64)
    indptr, indices = bidirected_csc(src, dst, n, self_loops, chunk=1 << 30, range_edges=1 << 40)
    want_ptr, want_cols = dgl_csc(src, dst, n, True, self_loops)
    np.testing.assert_array_equal(indptr, want_ptr)
    assert columns(indptr, indices) == want_cols


def _mapped_build(tmp_path, n: int = 100):
    """Memory-mapped edge lists, and the CSC built from them in chunks: ``(src, dst, mapped, indptr, indices)``."""
    src, dst = edges(2, n, 800, np.int64)
    np.save(tmp_path / "src.npy", src)
    np.save(tmp_path / "dst.npy", dst)
    mapped = [np.load(tmp_path / f, mmap_mode="r") for f in ("src.npy", "dst.npy")]
    return src, dst, mapped, *bidirected_csc(*mapped, n, True, chunk=64, range_edges=100)


def test_memory_mapped_edges(tmp_path):
    """Edge lists may be memory-mapped (read-only): they are read in chunks, never written, into the CSC that
    in-memory edges give."""
    src, dst, mapped, indptr, indices = _mapped_build(tmp_path)
    want_ptr, want = bidirected_csc(src.copy(), dst.copy(), 100, True)
    np.testing.assert_array_equal(indptr, want_ptr)
    assert columns(indptr, indices) == columns(want_ptr, want)
    np.testing.assert_array_equal(mapped[0], src)  # never written
    np.testing.assert_array_equal(mapped[1], dst)


@pytest.mark.dgl
def test_memory_mapped_edges_give_dgls_csc(tmp_path):
    src, dst, _, indptr, indices = _mapped_build(tmp_path)
    want_ptr, want_cols = dgl_csc(src, dst, 100, True, True)
    np.testing.assert_array_equal(indptr, want_ptr)
    assert columns(indptr, indices) == want_cols


def test_empty_and_edgeless_graphs():
    none = np.zeros(0, dtype=np.int64)
    indptr, indices = build_csc(none, none, 4, True, False)
    assert indptr.tolist() == [0] * 5 and indices.size == 0
    indptr, indices = build_csc(none, none, 3, True, True)
    assert indptr.tolist() == [0, 1, 2, 3] and indices.tolist() == [0, 1, 2]
