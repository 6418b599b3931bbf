"""Tests of gnnray.sampler.pick through the sampler: uniform draws without replacement, reproducible per batch.

The draws are seeded by (run seed, epoch, batch, layer), so every statistical
check here is a fixed computation: it passes or fails the same way each run.
Each check compares counts over many batches with what a uniform draw without
replacement gives, at a bar that a correct sampler exceeds with probability
about 3e-7 (z = 5), and the same check is shown to fail on samplers with known
biases, so that it can tell.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from conftest import tiny_graph
from gnnray.data.graph import Graph
from gnnray.sampler.sampler import Sampler
from sampling_checks import CASES, DRAWS, chi2_bar, draw_counts, inclusion_statistic, star_graph, typed_graph


def _one_layer(graph: Graph, fanout: int, seeds: np.ndarray, **kwargs):
    sampler = Sampler(graph, [fanout], **kwargs)
    return lambda r: sampler.sample(seeds, epoch=1, batch=r)


@pytest.mark.parametrize("degree, fanout", CASES, ids=[f"d{d}-k{k}" for d, k in CASES])
def test_each_in_edge_is_picked_with_probability_fanout_over_degree(degree, fanout):
    degrees = [degree] * 4 + [fanout, fanout - 1, 1]  # and nodes that keep every in-edge
    graph, first = star_graph(degrees)
    counts = draw_counts(_one_layer(graph, fanout, np.arange(len(degrees))), degrees, first, DRAWS)
    for c, d in zip(counts, degrees):
        assert c.sum() == DRAWS * min(d, fanout)  # min(d, k) in-edges in every draw
    stat, dof = inclusion_statistic(counts, fanout, DRAWS)
    assert stat < chi2_bar(dof), f"inclusion counts deviate from k/d: chi2 {stat:.0f} on {dof} dof"


class _Biased:
    """Draws as the sampler does, with a bug a sampler could have, in numpy: :meth:`sample` returns one layer."""

    def __init__(self, graph: Graph, fanout: int, kind: str):
        self.graph, self.fanout, self.kind = graph, fanout, kind

    def positions(self, rng, d: int, k: int) -> list[int]:
        if self.kind == "floyd-off-by-one":  # Floyd's draw in [0, j) instead of [0, j]
            picked: list[int] = []
            for j in range(d - k, d):
                t = int(rng.integers(0, max(j, 1)))
                picked.append(j if t in picked else t)
            return picked
        if self.kind == "modulo":  # 8 random bits reduced modulo the range: low positions come more often
            picked = []
            while len(picked) < k:
                t = int(rng.integers(0, 256)) % d
                if t not in picked:
                    picked.append(t)
            return picked
        raise ValueError(self.kind)

    def sample(self, seeds: np.ndarray, epoch: int, batch: int):
        from gnnray.batch import Layer, MiniBatch

        g, rng = self.graph, np.random.default_rng([epoch, batch])
        indptr, src = [0], list(int(s) for s in seeds)
        for v in seeds:
            a, b = int(g.indptr[v]), int(g.indptr[v + 1])
            pos = range(b - a) if b - a <= self.fanout else self.positions(rng, b - a, self.fanout)
            src += [int(g.indices[a + p]) for p in pos]
            indptr.append(len(src) - len(seeds))
        local = torch.arange(len(seeds), len(src))
        layer = Layer(torch.tensor(indptr), local, len(src))
        return MiniBatch(torch.from_numpy(seeds), torch.zeros(len(seeds)), torch.tensor(src), [layer])


@pytest.mark.parametrize("kind", ["floyd-off-by-one", "modulo"])
def test_the_inclusion_check_fails_on_a_biased_sampler(kind):
    degrees = [12] * 4 + [40] * 4  # chi2 about 1550 (off by one) and 920 (modulo) against a bar of 317
    graph, first = star_graph(degrees)
    biased = _Biased(graph, 10, kind)
    counts = draw_counts(lambda r: biased.sample(np.arange(len(degrees)), 1, r), degrees, first, DRAWS)
    stat, dof = inclusion_statistic(counts, 10, DRAWS)
    assert stat > chi2_bar(dof), f"a {kind} sampler passed: chi2 {stat:.0f} on {dof} dof"


@pytest.mark.parametrize("degree, fanout", [(5, 2), (6, 3), (8, 1)])
def test_every_subset_of_in_edges_is_equally_likely(degree, fanout):
    """Not only the marginals: each of the C(d, k) subsets comes with probability 1 / C(d, k)."""
    graph, first = star_graph([degree] * 3)
    draw = _one_layer(graph, fanout, np.arange(3))
    subsets = {s: i for i, s in enumerate(itertools.combinations(range(degree), fanout))}
    seen = np.zeros(len(subsets), np.int64)
    draws = 2000
    for r in range(draws):
        mb = draw(r)
        layer = mb.layers[0]
        src, indptr = mb.input_nodes.numpy()[layer.indices.numpy()], layer.indptr.numpy()
        for i in range(3):
            seen[subsets[tuple(sorted((src[indptr[i]:indptr[i + 1]] - first[i]).tolist()))]] += 1
    expected = 3 * draws / len(subsets)
    stat = float(((seen - expected) ** 2 / expected).sum())
    assert stat < chi2_bar(len(subsets) - 1), f"subsets deviate from uniform: chi2 {stat:.0f}"


def test_typed_nodes_draw_each_relation_with_probability_its_fanout_over_its_degree():
    # One destination with 30 in-edges of relation 0 and 9 of relation 1, fanouts 5 and 3.
    from gnnray.data.csc import typed_csc

    src = np.arange(1, 40)
    rel = np.array([0] * 30 + [1] * 9, np.int8)
    indptr, indices, etype = typed_csc(src, np.zeros(39, np.int64), rel, 40, 2, reverse=False)
    graph = Graph(indptr, indices, np.zeros((40, 0), np.float32), np.zeros(40, np.int64), np.arange(1),
                  np.arange(0), np.arange(0), 2, "typed", etype=etype, ntype=np.zeros(40, np.int8),
                  node_types=("n",), edge_types=(("n", "a", "n"), ("n", "b", "n")), target_type="n")
    from gnnray.config import Fanouts

    sampler = Sampler(graph, Fanouts.parse("5;b=3"))
    counts = np.zeros(40, np.int64)
    for r in range(DRAWS):
        layer = (mb := sampler.sample(np.array([0]), epoch=0, batch=r)).layers[0]
        picked = mb.input_nodes.numpy()[layer.indices.numpy()]
        assert np.bincount(layer.etype.numpy(), minlength=2).tolist() == [5, 3]
        assert sorted(set(picked.tolist())) == sorted(picked.tolist())
        counts[picked] += 1
    stat_a, dof_a = inclusion_statistic([counts[1:31]], 5, DRAWS)
    stat_b, dof_b = inclusion_statistic([counts[31:40]], 3, DRAWS)
    assert stat_a + stat_b < chi2_bar(dof_a + dof_b)


# ----------------------------------------------------------------------------- reproducible draws

def _equal(a, b) -> bool:
    same = torch.equal(a.seeds, b.seeds) and torch.equal(a.input_nodes, b.input_nodes)
    return same and all(torch.equal(x.indptr, y.indptr) and torch.equal(x.indices, y.indices)
                        for x, y in zip(a.layers, b.layers))


def test_a_batch_is_the_same_for_its_seed_epoch_and_batch_whatever_the_threads():
    graph = tiny_graph(num_nodes=6000, num_edges=120_000, seed=4)
    seeds = np.random.default_rng(0).choice(graph.num_nodes, 1000, replace=False)
    one, three = Sampler(graph, (10, 10), seed=7, threads=1), Sampler(graph, (10, 10), seed=7, threads=3)
    a, b = one.sample(seeds, epoch=2, batch=5), three.sample(seeds, epoch=2, batch=5)
    assert a.layers[0].num_dst > 3 * 256  # the second layer's destinations are cut into three ranges
    assert _equal(a, b)
    assert _equal(a, one.sample(seeds, epoch=2, batch=5))  # again, after other calls' use of the node table
    for other in (one.sample(seeds, epoch=3, batch=5), one.sample(seeds, epoch=2, batch=6),
                  Sampler(graph, (10, 10), seed=8).sample(seeds, epoch=2, batch=5)):
        assert not _equal(a, other)


def test_evaluation_batches_are_named_by_their_seeds():
    graph = tiny_graph(num_nodes=500, num_edges=8000, seed=2)
    sampler = Sampler(graph, [4], seed=1)
    seeds = np.arange(0, 300, 3)

    def picks(order: np.ndarray) -> dict:  # seed -> its picked in-neighbours (global ids)
        mb = sampler.sample(order)
        layer, ids = mb.layers[0], mb.input_nodes.numpy()
        return {int(v): sorted(ids[layer.indices[layer.indptr[j]:layer.indptr[j + 1]].numpy()].tolist())
                for j, v in enumerate(order)}

    assert picks(seeds) == picks(seeds) == picks(seeds.astype(np.int32))  # the ids name it, not their dtype
    assert picks(seeds[::-1].copy()) != picks(seeds)  # the same nodes in another order: another batch, other picks


def test_the_node_table_is_left_clear_and_ids_are_numbered_in_order():
    graph = tiny_graph(num_nodes=300, num_edges=3000, seed=5)
    sampler = Sampler(graph, (5, 5))
    mb = sampler.sample(np.array([7, 3, 250]), epoch=0, batch=0)
    assert not sampler._table.any()
    for layer in mb.layers:  # sources first appear in order: each new local id is one more than the largest so far
        local = layer.indices.numpy()
        new = local[local >= layer.num_dst]
        firsts = new[np.concatenate([[True], new[1:] > np.maximum.accumulate(new)[:-1]])]
        assert firsts.tolist() == list(range(layer.num_dst, layer.num_dst + len(firsts)))
        assert layer.num_src == layer.num_dst + len(firsts)


# ----------------------------------------------------------------------------- the oracle: GraphBolt

@pytest.mark.dgl
@pytest.mark.parametrize("degree, fanout", [(40, 10), (300, 10), (30, 25)])
def test_graphbolt_draws_the_same_marginals(degree, fanout):
    """GraphBolt's picks pass the same check, and its counts and ours do not differ beyond chance."""
    from gnnray.sampler.graphbolt import GraphBoltSampler

    degrees = [degree] * 4
    graph, first = star_graph(degrees)
    seeds = np.arange(len(degrees))
    torch.manual_seed(0)
    gb = GraphBoltSampler(graph, [fanout])
    theirs = draw_counts(lambda r: gb.sample(seeds), degrees, first, DRAWS)
    ours = draw_counts(_one_layer(graph, fanout, seeds), degrees, first, DRAWS)
    for counts in (theirs, ours):
        stat, dof = inclusion_statistic(counts, fanout, DRAWS)
        assert stat < chi2_bar(dof), f"chi2 {stat:.0f} on {dof} dof"
    a, b = np.concatenate(ours), np.concatenate(theirs)
    stat = float(((a - b) ** 2 / (a + b)).sum())  # two samples of one distribution: about chi-square, d dof
    assert stat < chi2_bar(len(a)), f"our counts and GraphBolt's differ: chi2 {stat:.0f} on {len(a)}"


@pytest.mark.dgl
def test_graphbolt_and_ours_keep_the_same_edges_per_relation():
    from gnnray.sampler.graphbolt import GraphBoltSampler
    from gnnray.config import Fanouts

    graph = typed_graph(num_nodes=80, num_edges=2000, seed=3)
    fanouts = Fanouts.parse("2;r0=3;r1=1;rev_r0=4;rev_r2=1")  # one layer, most relations a fanout of their own
    seeds = np.arange(40)
    ours = Sampler(graph, fanouts).sample(seeds).layers[0]
    theirs = GraphBoltSampler(graph, fanouts).sample(seeds).layers[0]
    assert torch.equal(ours.indptr.long(), theirs.indptr.long())
    for j in range(40):
        a, b = slice(int(ours.indptr[j]), int(ours.indptr[j + 1])), slice(int(theirs.indptr[j]), int(theirs.indptr[j + 1]))
        assert np.bincount(ours.etype[a].numpy(), minlength=6).tolist() == \
            np.bincount(theirs.etype[b].numpy(), minlength=6).tolist()


def test_warm_up_compiles_what_sampling_a_graph_from_the_store_needs():
    """The driver's warm-up compiles (or loads) the kernels for the sampler actors' graph, read-only arrays from
    the store (numba compiles a read-only array's signature apart): their first batch compiles nothing."""
    import numba

    from gnnray.sampler import pick

    kernels = [f for f in vars(pick).values() if isinstance(f, numba.core.registry.CPUDispatcher)]
    graph = tiny_graph(num_nodes=500, num_edges=4000)
    for a in (graph.indptr, graph.indices):
        a.setflags(write=False)
    pick.warm_up(graph.indptr.dtype, graph.indices.dtype)
    compiled = {f: set(f.signatures) for f in kernels}
    Sampler(graph, (5, 5)).sample(graph.train_idx)
    added = {f.__name__: set(f.signatures) - compiled[f] for f in kernels}
    assert not any(added.values()), added
