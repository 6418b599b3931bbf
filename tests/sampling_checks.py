"""What a sampled mini-batch must be, wherever it is sampled: the checks and cases that the sampler actors'
sampler (tests/sampler/) and the train worker's device sampler (tests/train/test_device_sampler.py) share.

Structure: sampled blocks are real, bounded, chained sub-graphs of the graph (:func:`check_batch`, per relation
:func:`check_typed_batch`). Uniformity: inclusion counts against ``k / d`` per in-edge (:func:`inclusion_statistic`),
at a bar a correct sampler exceeds with probability about 3e-7 (:func:`chi2_bar`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np

from conftest import tiny_graph
from gnnray.batch import MiniBatch
from gnnray.config import Fanouts
from gnnray.data.csc import csc_from_edges
from gnnray.data.graph import Graph

# (in-degree, fanout): Floyd's algorithm with few and many repeats, and selection sampling (10 * d < k * k).
CASES = [(12, 10), (40, 10), (300, 10), (7, 3), (30, 25), (100, 40), (500, 40)]


DRAWS = 3000


def star_graph(degrees: list[int]) -> tuple[Graph, np.ndarray]:
    """Destination ``i`` has ``degrees[i]`` in-edges from sources of its own: the source names its position."""
    first = np.concatenate([[0], np.cumsum(degrees)]) + len(degrees)
    src = np.concatenate([np.arange(a, a + d) for a, d in zip(first[:-1], degrees)])
    dst = np.repeat(np.arange(len(degrees)), degrees)
    n = int(first[-1])
    indptr, indices = csc_from_edges(src, dst, n)
    graph = Graph(indptr, indices, np.zeros((n, 0), np.float32), np.zeros(n, np.int64), np.arange(len(degrees)),
                  np.arange(0), np.arange(0), 2)
    return graph, first[:-1]


def draw_counts(draw, degrees: list[int], first: np.ndarray, draws: int) -> list[np.ndarray]:
    """Per destination, how often each of its in-edges was picked over ``draws`` calls of ``draw(r)`` (a
    :class:`MiniBatch` of one layer whose seeds are the destinations)."""
    counts = [np.zeros(d, np.int64) for d in degrees]
    for r in range(draws):
        mb = draw(r)
        layer = mb.layers[0]
        src = mb.input_nodes.numpy()[layer.indices.numpy()]
        indptr = layer.indptr.numpy()
        for i, d in enumerate(degrees):
            pos = src[indptr[i]:indptr[i + 1]] - first[i]
            assert len(np.unique(pos)) == len(pos), "an in-edge picked twice in one draw"
            counts[i] += np.bincount(pos, minlength=d)
    return counts


def chi2_bar(dof: int, z: float = 5.0) -> float:
    """The chi-square quantile at ``z`` standard deviations (Wilson-Hilferty; within 1% from a few dof up)."""
    h = 2 / (9 * dof)
    return dof * (1 - h + z * math.sqrt(h)) ** 3


def inclusion_statistic(counts: list[np.ndarray], fanout: int, draws: int) -> tuple[float, int]:
    """The chi-square statistic of inclusion counts against ``k / d`` per in-edge, and its degrees of freedom.

    For a uniform k-subset of d, each in-edge is in with p = k/d, variance p(1-p), and two in-edges covary by
    -p(1-p)/(d-1); the counts' quadratic form scaled by (d-1)/d is then chi-square with d-1 degrees of freedom.
    """
    stat, dof = 0.0, 0
    for c in counts:
        d = len(c)
        if d <= fanout:
            assert np.all(c == draws)  # all in-edges, every time
            continue
        p = fanout / d
        stat += float(((c - draws * p) ** 2).sum()) / (draws * p * (1 - p) * d / (d - 1))
        dof += d - 1
    return stat, dof


GRAPHS = {
    "tiny": lambda: tiny_graph(),
    # Many duplicate edges (multigraph) and a few high in-degree nodes.
    "multi": lambda: tiny_graph(num_nodes=12, num_edges=150, seed=3),
    "random500": lambda: tiny_graph(num_nodes=500, num_edges=4000, seed=1),
    # The structure as the loader stores it (compact_csc): int32 below 2**31 edges.
    "multi-int32": lambda: compact(tiny_graph(num_nodes=12, num_edges=150, seed=3)),
    "random500-int32": lambda: compact(tiny_graph(num_nodes=500, num_edges=4000, seed=1)),
    # Past 2**31 edges: int64 offsets beside int32 node ids.
    "random500-mixed": lambda: wide_indptr(compact(tiny_graph(num_nodes=500, num_edges=4000, seed=1))),
}


FANOUTS = [(2,), (3, 2), (-1, 4), (5, -1, 2), (-1, -1)]


def compact(graph: Graph) -> Graph:
    from gnnray.data.csc import compact_csc

    indptr, indices = compact_csc(graph.indptr, graph.indices)
    assert indices.dtype == np.int32
    return dataclasses.replace(graph, indptr=indptr, indices=indices)


def wide_indptr(graph: Graph) -> Graph:
    return dataclasses.replace(graph, indptr=graph.indptr.astype(np.int64))


def in_edge_counts(graph: Graph, v: int) -> Counter:
    return Counter(graph.indices[graph.indptr[v]:graph.indptr[v + 1]].tolist())


def layer_global_ids(mb: MiniBatch) -> list[tuple[np.ndarray, np.ndarray]]:
    """(src global ids, dst global ids) of every block, input layer first."""
    src = mb.input_nodes.numpy()
    out = []
    for layer in mb.layers:
        assert layer.num_src == len(src)
        dst = src[:layer.num_dst]
        out.append((src, dst))
        src = dst
    return out


def check_batch(graph: Graph, fanouts, seeds: np.ndarray, mb: MiniBatch) -> None:
    assert len(mb.layers) == len(fanouts)
    ids = layer_global_ids(mb)
    # The last block's destinations are the seeds, in order; labels follow them.
    assert mb.seeds.tolist() == seeds.tolist()
    assert ids[-1][1].tolist() == seeds.tolist()
    assert mb.labels.tolist() == graph.label[seeds].tolist()
    for i, (layer, fanout, (src, dst)) in enumerate(zip(mb.layers, fanouts, ids)):
        indptr, indices = layer.indptr.numpy(), layer.indices.numpy()
        assert indptr[0] == 0 and indptr[-1] == len(indices)
        assert np.all(np.diff(indptr) >= 0)
        assert indices.size == 0 or (indices.min() >= 0 and indices.max() < layer.num_src)
        assert len(np.unique(src)) == len(src), f"block {i}: duplicate source nodes"
        # Chained: block i's destinations are block i+1's sources.
        if i + 1 < len(mb.layers):
            assert mb.layers[i + 1].num_src == layer.num_dst
        for j, v in enumerate(dst.tolist()):
            sampled = Counter(src[indices[indptr[j]:indptr[j + 1]]].tolist())
            available = in_edge_counts(graph, v)
            degree = sum(available.values())
            n = sum(sampled.values())
            for u, k in sampled.items():
                assert k <= available[u], f"block {i}: edge {u}->{v} sampled {k}x, graph has {available[u]}"
            if fanout == -1 or degree <= fanout:
                assert n == degree, f"block {i}: node {v} has in-degree {degree}, sampled {n} (fanout {fanout})"
            else:
                assert n == fanout, f"block {i}: node {v} has in-degree {degree}, sampled {n} (fanout {fanout})"


RELATIONS = ("r0", "r1", "r2")


def typed_graph(num_nodes: int = 60, num_edges: int = 900, seed: int = 0, int32: bool = False) -> Graph:
    """Random edges of three relations and their reverses (six), built as the loader builds a typed CSC."""
    from gnnray.data.csc import compact_csc, typed_csc

    rng = np.random.default_rng(seed)
    src, dst = rng.integers(0, num_nodes, num_edges), rng.integers(0, num_nodes, num_edges)
    # Relation r2 is rare, so many nodes have one or two of its edges beside many of the others'.
    rel = rng.choice(3, num_edges, p=[0.55, 0.4, 0.05]).astype(np.int8)
    indptr, indices, etype = typed_csc(src, dst, rel, num_nodes, 3, reverse=True, chunk=97)
    if int32:
        indptr, indices = compact_csc(indptr, indices)
    names = RELATIONS + tuple(f"rev_{r}" for r in RELATIONS)
    return Graph(indptr, indices, np.zeros((num_nodes, 0), np.float32), rng.integers(0, 3, num_nodes),
                 np.arange(num_nodes), np.arange(0), np.arange(0), 3, "typed", etype=etype,
                 ntype=np.zeros(num_nodes, np.int8), node_types=("n",), edge_types=tuple(("n", r, "n") for r in names),
                 target_type="n")


def check_typed_batch(graph: Graph, fanouts: Fanouts, seeds: np.ndarray, mb: MiniBatch) -> int:
    """Each relation's sampled in-edges of each destination: real edges, min(its fanout, its in-degree) of them.

    Returns how many destinations got more in-edges than the default fanout of their layer (several relations'
    worth: impossible with one draw over all relations).
    """
    names = [r for _, r, _ in graph.edge_types]
    beyond = 0
    assert mb.seeds.tolist() == seeds.tolist()
    for i, (layer, (src, dst)) in enumerate(zip(mb.layers, layer_global_ids(mb))):
        indptr, indices, etype = layer.indptr.numpy(), layer.indices.numpy(), layer.etype.numpy()
        assert etype.dtype == graph.etype.dtype and etype.shape == indices.shape
        for j, v in enumerate(dst.tolist()):
            seg = slice(graph.indptr[v], graph.indptr[v + 1])
            available = Counter(zip(graph.indices[seg].tolist(), graph.etype[seg].tolist()))
            sampled = Counter(zip(src[indices[indptr[j]:indptr[j + 1]]].tolist(),
                                  etype[indptr[j]:indptr[j + 1]].tolist()))
            for edge, k in sampled.items():
                assert k <= available[edge], f"block {i}: edge {edge} into {v} sampled {k}x, graph has {available[edge]}"
            for code, name in enumerate(names):
                degree = sum(k for (_, t), k in available.items() if t == code)
                n = sum(k for (_, t), k in sampled.items() if t == code)
                fanout = fanouts.of(name)[i]
                want = degree if fanout == -1 else min(fanout, degree)
                assert n == want, f"block {i}: node {v} has {degree} {name} in-edges, sampled {n} (fanout {fanout})"
            beyond += fanouts.layers[i] != -1 and sum(sampled.values()) > fanouts.layers[i]
    return beyond


TYPED_FANOUTS = ["2", "3,2", "2,1;r0=5,1;rev_r2=1,-1", "1,-1,2;r1=-1,1,3"]
