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

    for name in ("indptr", "indices", "label", "train_idx", "valid_idx", "test_idx"):
        a = getattr(graph, name)
        if not isinstance(a, np.ndarray) or a.dtype != np.int64 or a.ndim != 1:
            fail(f"{name} must be a 1-D int64 array, got {_describe(a)}")
    if not isinstance(graph.feat, np.ndarray) or graph.feat.dtype != np.float32 or graph.feat.ndim != 2:
        fail(f"feat must be a 2-D float32 array (num_nodes, feat_dim), got {_describe(graph.feat)}")

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


def _describe(a) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype} array of shape {a.shape}"
    return type(a).__name__

