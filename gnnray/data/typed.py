"""Typed graphs (node and edge types), held as DGL's MAG240M example holds them: one homogeneous graph.

Node ids of all types share one id space (each type a range of ids, or any
order with ``ntype`` saying which), every edge has a relation code aligned
with the CSC's ``indices`` (``Graph.etype``), and one feature table has a row
for every node. Nodes without features get the mean of their neighbors'
features (:func:`fill_features`), computed once at load, in rounds: authors
from their papers, then institutions from their authors.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from gnnray.data.graph import GraphParts
from gnnray.errors import DatasetError

log = logging.getLogger(__name__)

# Bytes of the float32 rows gathered per step of a round: bounds its temporaries.
FILL_CHUNK_BYTES = 256 << 20


def stack_types(num_nodes: dict, relations: Sequence[tuple]) -> tuple:
    """One id space for per-type node ranges and per-relation edge lists (the ogbn-mag / MAG240M layout).

    Args:
        num_nodes: Node type -> count, in the order of the id ranges.
        relations: ``((src_type, relation, dst_type), src, dst)`` with per-type ids.

    Returns:
        ``(offset, src, dst, etype, ntype)``: the first global id of each type,
        global edge endpoints, relation codes (relations' order) and node type codes.
    """
    from gnnray.data.csc import etype_dtype

    offset, start = {}, 0
    for t, count in num_nodes.items():
        offset[t], start = start, start + int(count)
    code = {t: i for i, t in enumerate(num_nodes)}
    ntype = np.repeat(np.arange(len(code), dtype=np.int8), [int(c) for c in num_nodes.values()])
    dtype = etype_dtype(2 * len(relations))  # room for the reverse relations
    src = np.concatenate([np.asarray(s, dtype=np.int64) + offset[st] for (st, _, _), s, _ in relations])
    dst = np.concatenate([np.asarray(d, dtype=np.int64) + offset[dt] for (_, _, dt), _, d in relations])
    etype = np.concatenate([np.full(len(s), j, dtype=dtype) for j, (_, s, _) in enumerate(relations)])
    return offset, src, dst, etype, ntype


def fill_features(feat: np.ndarray, has_feat: np.ndarray, src: np.ndarray, dst: np.ndarray,
                  chunk_bytes: int = FILL_CHUNK_BYTES) -> int:
    """Give every node without features the mean of its neighbors' features, in place, in rounds.

    Neighbors are both directions' (an author's papers, an institution's
    authors). A round gives each node still without features the mean over
    those of its neighbors that had features when the round began, so
    authors are filled from their papers in round one and institutions from
    those authors in round two, whatever the order of the ids. Rounds stop
    when one fills nothing; nodes left (no path to a node with features)
    keep zeros.

    Args:
        feat: ``(num_nodes, dim)`` float32 or float16, writable (a memory map is fine); the
            rows of nodes without features must be zeros (those left unfilled stay so).
        has_feat: Whether each node's row is given.
        src, dst: The edges (may be memory-mapped).
        chunk_bytes: Bytes of float32 neighbor rows gathered at a time.

    Returns:
        How many nodes were left without a neighbor with features.
    """
    from gnnray.data.csc import CHUNK_EDGES, csc_from_edges

    import torch

    n, dim = feat.shape
    missing = ~np.asarray(has_feat, dtype=bool)
    if not missing.any():
        return 0
    # Neighbor lists of the nodes without features only, in chunks of edges.
    ends, nbrs = [], []
    for a in range(0, int(src.shape[0]), CHUNK_EDGES):
        s, d = np.asarray(src[a:a + CHUNK_EDGES], np.int64), np.asarray(dst[a:a + CHUNK_EDGES], np.int64)
        for node, other in ((d, s), (s, d)):
            keep = missing[node]
            ends.append(node[keep])
            nbrs.append(other[keep])
    indptr, nbr = csc_from_edges(np.concatenate(nbrs), np.concatenate(ends), n)
    del ends, nbrs
    available, todo = ~missing, np.flatnonzero(missing)
    step_edges = max(1, chunk_bytes // (4 * max(dim, 1)))
    while todo.size:
        filled = np.zeros(n, dtype=bool)
        degree = indptr[todo + 1] - indptr[todo]
        # Groups of nodes whose neighbor lists start in the same window of step_edges edges.
        window = (np.cumsum(degree) - degree) // step_edges
        cuts = np.r_[0, np.flatnonzero(np.diff(window)) + 1, todo.size]
        for lo, hi in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
            ids, deg = todo[lo:hi], degree[lo:hi]
            local = np.repeat(np.arange(ids.size), deg)
            first = np.repeat(indptr[ids] - np.r_[0, np.cumsum(deg)[:-1]], deg)
            neighbor = nbr[first + np.arange(local.size)]
            ok = available[neighbor]
            count = np.bincount(local[ok], minlength=ids.size)
            rows = np.asarray(feat[neighbor[ok]], dtype=np.float32)
            sums = torch.zeros(ids.size, dim).index_add_(0, torch.from_numpy(local[ok]), torch.from_numpy(rows))
            got = count > 0
            feat[ids[got]] = (sums[torch.from_numpy(got)] / torch.from_numpy(count[got, None])).numpy()
            filled[ids[got]] = True
        if not filled.any():
            break
        available |= filled
        todo = todo[~filled[todo]]
    return int(todo.size)


def fill_missing(parts: GraphParts, embedding_dim: int, source: str) -> None:
    """Give ``parts``' nodes without features their rows: zeros beside learnable embeddings, else neighbor means."""
    if parts.has_feat is None or parts.has_feat.all():
        return
    if embedding_dim > 0:
        parts.feat[~parts.has_feat] = 0  # the learnable embedding (every node has one) is their input
        return
    left = fill_features(parts.feat, parts.has_feat, parts.src, parts.dst)
    if left:
        log.warning("%s: %d nodes without features have no path to a node with features; they keep zeros "
                    "(pass --embedding-dim DIM to learn their input instead)", source, left)


def relation_codes(names: np.ndarray, declared: Sequence[str], what: str) -> np.ndarray:
    """Codes of the type names ``names`` (strings) in ``declared``; an unknown name raises naming it."""
    values, inverse = np.unique(np.asarray(names, dtype=object).astype(str), return_inverse=True)
    index = {t: i for i, t in enumerate(declared)}
    unknown = [v for v in values.tolist() if v not in index]
    if unknown:
        raise DatasetError(f"{what} has unknown types {unknown[:5]}; declare them in meta.json (known: "
                           f"{list(declared)})")
    lookup = np.array([index[v] for v in values.tolist()], dtype=np.int64)
    return lookup[inverse].reshape(-1)

