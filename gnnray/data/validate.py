"""Checks that a built :class:`~gnnray.data.graph.Graph` is consistent; every later stage relies on them."""

from __future__ import annotations

from typing import Optional

import numpy as np

from gnnray.data.graph import SPLITS, Graph
from gnnray.errors import DatasetError


def validate(graph: Graph, source: str, origins: Optional[dict] = None) -> None:
    """Check that ``graph`` is consistent; every later stage relies on it.

    Args:
        graph: The graph to check.
        source: File path or dataset name, named in the error.
        origins: Where ``feat`` and ``label`` were read (``"FILE: column 'x'"``),
            named instead of ``source`` in errors about them.

    Raises:
        DatasetError: The first problem found (dtypes, CSC structure, features,
            labels or splits).
    """
    def fail(problem: str, array: str = "") -> None:
        raise DatasetError(f"{(origins or {}).get(array, source)}: {problem}")

    for name in ("indptr", "indices"):
        a = getattr(graph, name)
        if not isinstance(a, np.ndarray) or a.dtype not in _STRUCTURE_DTYPES or a.ndim != 1:
            fail(f"{name} must be a 1-D int32 or int64 array, got {_describe(a)}")
    # Each array is as wide as its own values need (data/csc.py, structure_dtypes): GraphBolt samples any pair.
    if graph.indptr.dtype == np.int32 and graph.indices.size >= 2**31:
        fail(f"int32 indptr holds offsets below 2**31, this graph has {graph.indices.size} edges; "
             f"store indptr as int64")
    if graph.indices.dtype == np.int32 and graph.indptr.size > 2**31:
        fail(f"int32 indices hold node ids below 2**31, this graph has {graph.indptr.size - 1} nodes; "
             f"store indices as int64")
    for name in ("label", "train_idx", "valid_idx", "test_idx"):
        a = getattr(graph, name)
        if not isinstance(a, np.ndarray) or a.dtype != np.int64 or a.ndim != 1:
            fail(f"{name} must be a 1-D int64 array, got {_describe(a)}")
    if not isinstance(graph.feat, np.ndarray) or graph.feat.dtype not in _FEAT_DTYPES or graph.feat.ndim != 2:
        fail(f"feat must be a 2-D float32 (or float16) array (num_nodes, feat_dim), got {_describe(graph.feat)}")

    indptr, indices, feat, n = graph.indptr, graph.indices, graph.feat, graph.num_nodes
    if indptr.size == 0:
        fail("indptr is empty; it needs num_nodes + 1 entries")
    for name, rows in (("feat", feat.shape[0]), ("label", graph.label.shape[0])):
        if rows != n:
            fail(f"{name} has {rows} rows but indptr has {indptr.size} entries ({n} nodes); "
                 f"indptr needs num_nodes + 1 entries, {name} one row per node")
    if indptr[0] != 0:
        fail(f"indptr must start at 0, starts at {indptr[0]}")
    if np.any(indptr[1:] < indptr[:-1]):
        fail("indptr must be non-decreasing (it holds the cumulative in-degrees)")
    if indptr[-1] != indices.size:
        fail(f"indptr ends at {indptr[-1]} but there are {indices.size} indices (edges)")
    if indices.size and (indices.min() < 0 or indices.max() >= n):
        bad = np.count_nonzero((indices < 0) | (indices >= n))
        fail(f"{bad} edge source ids (indices) are outside [0, num_nodes={n})")

    # A row sum in float64 is non-finite exactly when the row holds a NaN or inf,
    # without a (num_nodes, feat_dim) temporary.
    bad_rows = np.count_nonzero(~np.isfinite(feat.sum(axis=1, dtype=np.float64)))
    if bad_rows:
        fail(f"{bad_rows} feature rows contain NaN or infinite values; clean or impute them", "feat")

    if graph.num_classes < 2:
        fail(f"num_classes is {graph.num_classes}; node classification needs at least 2")

    in_split = np.zeros(n, dtype=bool)
    for name in SPLITS:
        idx = graph.split(name)
        if idx.size == 0:
            fail(f"the {name} split is empty; every split (train, valid, test) needs at least one node")
        if idx.min() < 0 or idx.max() >= n:
            fail(f"the {name} split has node ids outside [0, num_nodes={n})")
        ordered = np.sort(idx)
        dup = ordered[1:][ordered[1:] == ordered[:-1]]
        if dup.size:
            fail(f"the {name} split lists {dup.size} node ids more than once, e.g. {dup[:3].tolist()}")
        if np.any(in_split[idx]):
            fail(f"the {name} split shares nodes with another split; each node belongs to one split at most")
        in_split[idx] = True
        lab = graph.label[idx]
        missing = np.count_nonzero(lab == -1)
        if missing:
            fail(f"{missing} nodes of the {name} split have no label (-1); label them or move them to split "
                 "'none'", "label")
        if np.any(lab < 0) or np.any(lab >= graph.num_classes):
            fail(f"labels of the {name} split must be in [0, num_classes={graph.num_classes}), "
                 f"found {lab.min()}..{lab.max()}", "label")
    if graph.typed:
        _validate_types(graph, fail)


def _validate_types(graph: Graph, fail) -> None:
    """A typed graph's checks: type arrays, each edge's endpoint types, labelled and split nodes of the target type."""
    etype, ntype, n = graph.etype, graph.ntype, graph.num_nodes
    if not isinstance(ntype, np.ndarray) or ntype.shape != (n,) or ntype.dtype.kind != "i":
        fail(f"ntype must be a 1-D integer array with one entry per node, got {_describe(ntype)}")
    if not isinstance(etype, np.ndarray) or etype.shape != graph.indices.shape or etype.dtype.kind != "i":
        fail(f"etype must be a 1-D integer array aligned with indices, got {_describe(etype)}")
    names = [r for _, r, _ in graph.edge_types]
    if len(set(names)) != len(names):
        fail(f"relation names repeat in {names}; each relation needs its own name", "etype")
    code = {t: i for i, t in enumerate(graph.node_types)}
    unknown = sorted({t for s, _, d in graph.edge_types for t in (s, d)} - set(code))
    if unknown:
        fail(f"edge types name node types {unknown} that are not among node_types {list(graph.node_types)}; "
             f"declare them", "etype")
    if graph.target_type not in code:
        fail(f"target_type {graph.target_type!r} is not among node_types {list(graph.node_types)}", "ntype")
    if ntype.size and (ntype.min() < 0 or ntype.max() >= len(code)):
        fail(f"ntype holds codes outside [0, {len(code)})", "ntype")
    if etype.size and (etype.min() < 0 or etype.max() >= len(names)):
        fail(f"etype holds codes outside [0, {len(names)})", "etype")
    src_t = np.array([code[s] for s, _, _ in graph.edge_types], dtype=np.int64)
    dst_t = np.array([code[d] for _, _, d in graph.edge_types], dtype=np.int64)
    # In node blocks of about CHUNK_EDGES edges: no edge-sized int64 temporary for a large graph.
    from gnnray.data.csc import CHUNK_EDGES

    indptr, v = graph.indptr, 0
    while v < n:
        # int(...): the sum must not wrap in int32.
        w = min(n, max(v + 1, int(np.searchsorted(indptr, int(indptr[v]) + CHUNK_EDGES, side="right")) - 1))
        a, b = int(indptr[v]), int(indptr[w])
        t = etype[a:b].astype(np.int64)
        dst = np.repeat(np.arange(v, w), np.diff(indptr[v:w + 1]))
        for end, nodes, want in (("source", graph.indices[a:b], src_t[t]), ("destination", dst, dst_t[t])):
            bad = np.flatnonzero(ntype[nodes] != want)
            if bad.size:
                e = bad[0]
                s_, r, d_ = graph.edge_types[t[e]]
                fail(f"{bad.size}+ edges have a {end} node of the wrong type, e.g. relation {r!r} ({s_} -> {d_}) "
                     f"from node {int(graph.indices[a + e])} ({graph.node_types[ntype[graph.indices[a + e]]]}) to "
                     f"node {int(dst[e])} ({graph.node_types[ntype[dst[e]]]}); each edge of a relation must join "
                     f"its declared types", "etype")
        v = w
    target = code[graph.target_type]
    labelled = np.flatnonzero(graph.label != -1)
    for what, ids, origin in [("labelled", labelled, "label")] + [(f"{s} split", graph.split(s), "split")
                                                                   for s in SPLITS]:
        wrong = ids[ntype[ids] != target]
        if wrong.size:
            fail(f"{wrong.size} {what} nodes are not of the target type {graph.target_type!r}, e.g. node "
                 f"{int(wrong[0])} ({graph.node_types[ntype[wrong[0]]]}); only target nodes may be labelled or "
                 f"in a split (label -1, split 'none' for the others)", origin)


_FEAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
_STRUCTURE_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def _describe(a) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype} array of shape {a.shape}"
    return type(a).__name__

