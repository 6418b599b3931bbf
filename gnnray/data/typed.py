"""Typed graphs (node and edge types), held as DGL's MAG240M example holds them: one homogeneous graph.

Node ids of all types share one id space (each type a range of ids, or any
order with ``ntype`` saying which), every edge has a relation code aligned
with the CSC's ``indices`` (``Graph.etype``), and one feature table has a row
for every node. Nodes without features get the mean of their neighbors'
features (:func:`fill_features`), computed once at load, in rounds: authors
from their papers, then institutions from their authors. :func:`relation_csc`
builds a typed CSC from per-relation (memory-mapped) edge files without
stacking them (MAG240M); :func:`symmetric_relations` gives the MAG240M
example's relation set; :func:`fanout_table` gives each relation its fanouts.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence, Union

import numpy as np

from gnnray.config import Fanouts
from gnnray.data.graph import Graph, GraphParts
from gnnray.errors import ConfigError, DatasetError

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
    indptr, nbr = csc_from_edges(np.concatenate(nbrs), np.concatenate(ends), feat.shape[0])
    del ends, nbrs
    return fill_rounds(feat, missing, indptr, nbr, chunk_bytes)


def fill_rounds(feat: np.ndarray, missing: np.ndarray, indptr: np.ndarray, nbr: np.ndarray,
                chunk_bytes: int = FILL_CHUNK_BYTES) -> int:
    """The rounds of :func:`fill_features`, given each node's neighbors (both directions) as a CSC.

    Only the lists of ``missing`` nodes are read. Returns how many nodes were
    left without a neighbor with features.
    """
    import torch

    n, dim = feat.shape
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



class EdgeColumn:
    """Row ``row`` of a ``(2, E)`` edge array (0: sources, 1: destinations) as global ids, read by slices.

    ``offset`` is the first global id of the row's node type. What
    :func:`relation_csc` reads from a memory-mapped edge file a chunk at a
    time, without a copy of the whole row.
    """

    def __init__(self, edge_index: np.ndarray, row: int, offset: int):
        self.edge_index, self.row, self.offset = edge_index, row, offset
        self.shape = (int(edge_index.shape[1]),)

    def __getitem__(self, s: slice) -> np.ndarray:
        return np.asarray(self.edge_index[self.row, s], dtype=np.int64) + self.offset


def relation_csc(num_nodes: int, streams: Sequence[tuple], num_codes: int) -> tuple:
    """In-edge CSC ``(indptr, indices, etype)`` of edge streams ``(src, dst, code)``, each read a chunk at a time.

    ``src`` and ``dst`` are sliceable columns of global ids (arrays or
    :class:`EdgeColumn`); every edge of a stream has relation ``code``. The
    arrays are written straight in their final dtypes
    (:func:`~gnnray.data.csc.structure_dtypes`, int8 codes): peak memory is the
    result plus two ``num_nodes`` int64 counters and chunk temporaries,
    however large the (memory-mapped) inputs. Streams are written in the order
    of their codes, so each node's in-edges come ordered by relation (as
    GraphBolt's per-relation sampling reads them) without a sort.
    """
    from gnnray.data.csc import CHUNK_EDGES, _scatter, etype_dtype, structure_dtypes

    indptr = np.zeros(num_nodes + 1, dtype=np.int64)
    for _, dst, _ in streams:
        for a in range(0, dst.shape[0], CHUNK_EDGES):
            indptr[1:] += np.bincount(dst[a:a + CHUNK_EDGES], minlength=num_nodes)
    np.cumsum(indptr, out=indptr)
    ptr_dtype, idx_dtype = structure_dtypes(num_nodes, int(indptr[-1]))
    indices = np.empty(int(indptr[-1]), dtype=idx_dtype)
    etype = np.empty(int(indptr[-1]), dtype=etype_dtype(num_codes))
    free = indptr[:-1].copy()  # next unwritten slot of each node's segment
    for src, dst, code in sorted(streams, key=lambda stream: stream[2]):
        for a in range(0, dst.shape[0], CHUNK_EDGES):
            d = dst[a:a + CHUNK_EDGES]
            _scatter(indices, free, src[a:a + CHUNK_EDGES], d, etype, np.full(d.size, code, dtype=etype.dtype))
    del free
    return indptr.astype(ptr_dtype, copy=False), indices, etype


def symmetric_relations(graph: Graph) -> Graph:
    """``graph`` with each relation between nodes of one type and its reverse (``r``, ``rev_r``) as one relation ``r``.

    DGL's MAG240M example's relation set: ``cites`` (paper to paper) holds
    both directions, while ``writes`` and ``affiliated_with`` keep their
    reverses. The codes are rewritten in place a chunk at a time (no copy of
    the edge types); the other relations keep their order. Each node's
    in-edges are then ordered by relation again (the merged ones were apart).
    """
    from gnnray.data.csc import CHUNK_EDGES, sort_by_relation

    code = {t: i for i, t in enumerate(graph.edge_types)}
    merged = {code[(d, f"rev_{r}", s)]: code[(s, r, d)] for s, r, d in graph.edge_types
              if s == d and (d, f"rev_{r}", s) in code}
    if not merged:
        return graph
    kept = [i for i in range(len(code)) if i not in merged]
    renumber = {old: new for new, old in enumerate(kept)}
    table = np.array([renumber[merged.get(i, i)] for i in range(len(code))], dtype=graph.etype.dtype)
    for a in range(0, graph.etype.size, CHUNK_EDGES):
        graph.etype[a:a + CHUNK_EDGES] = table[graph.etype[a:a + CHUNK_EDGES]]
    sort_by_relation(graph.indptr, graph.indices, graph.etype)
    return dataclasses.replace(graph, edge_types=tuple(graph.edge_types[i] for i in kept))


def fanout_table(fanouts: Union[Fanouts, Sequence[int]], graph: Graph, flag: str = "--fanouts") -> list[list[int]]:
    """Per layer (input layer first), the fanout of each of ``graph``'s relation codes; one fanout if untyped.

    A relation without its own list in ``fanouts`` gets the default, so
    ``10,10`` takes up to 10 in-edges of each relation per node, as DGL's
    samplers do on heterographs. Every :class:`~gnnray.sampler.sampler.Sampler`
    calls it; call it on the driver once the graph is loaded (it imports no
    torch), so that a bad ``--fanouts`` (or ``flag``) fails before any worker starts.

    Raises:
        ConfigError: ``fanouts`` names a relation the graph does not have, or
            gives relations' lists for an untyped graph.
    """
    fanouts = Fanouts.of_value(fanouts)
    if graph.etype is None:
        if fanouts.relations:
            raise ConfigError(f"{flag} {str(fanouts)!r}: {graph.name} has no relations (an untyped graph), so "
                              f"there is none to give fanouts of its own; give one list, e.g. "
                              f"{flag} {','.join(map(str, fanouts.layers))}")
        return [[f] for f in fanouts.layers]
    names = [r for _, r, _ in graph.edge_types]
    unknown = [r for r, _ in fanouts.relations if r not in names]
    if unknown:
        raise ConfigError(f"{flag} {str(fanouts)!r}: {graph.name} has no relation {unknown[0]!r}; its relations "
                          f"are {', '.join(names) or 'none'}")
    if not names:  # no relation at all: nothing to sample apart
        return [[f] for f in fanouts.layers]
    return [list(layer) for layer in zip(*(fanouts.of(r) for r in names))]
