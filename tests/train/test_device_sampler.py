"""Tests of gnnray.train.device_sampler on the CPU (the CPU as the device), against the actors' sampler.

The same checks as test_sampling.py (real, bounded, chained blocks; per-relation
fanouts) and test_pick.py (each in-edge picked with probability k/d, no in-edge
twice, every k-subset equally likely), run on the device sampler; the number
each destination keeps is compared with the native sampler's, batch by batch.
The device's own run of the same code needs a GPU (bench/gpu).
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import numpy as np
import pytest
import torch

from conftest import tiny_graph
from gnnray.config import Fanouts
from gnnray.errors import ConfigError
from gnnray.sampler.sampler import Sampler
from gnnray.train.device_sampler import DeviceSampler
from sampling_checks import (CASES, DRAWS, FANOUTS, GRAPHS, TYPED_FANOUTS, check_batch, check_typed_batch, chi2_bar,
                             draw_counts, inclusion_statistic, star_graph, typed_graph)


@pytest.mark.parametrize("name", list(GRAPHS))
@pytest.mark.parametrize("fanouts", FANOUTS, ids=lambda f: ",".join(map(str, f)))
def test_blocks_are_sampled_from_the_graph_as_the_actors_sample_them(name, fanouts):
    graph = GRAPHS[name]()
    device, native = DeviceSampler(graph, fanouts, "cpu"), Sampler(graph, fanouts)
    rng = np.random.default_rng(0)
    for size in (1, 5, min(40, graph.num_nodes)):
        seeds = rng.choice(graph.num_nodes, size, replace=False)
        mb = device.sample(seeds, epoch=2, batch=size)
        assert mb.epoch == 2
        check_batch(graph, fanouts, seeds, mb)
        ours = native.sample(seeds, epoch=2, batch=size)
        # The same dtypes, and the seeds' block keeps as many in-edges per seed (min(k, d) is not random).
        for name_ in ("seeds", "labels", "input_nodes"):
            assert getattr(mb, name_).dtype == getattr(ours, name_).dtype, name_
        assert mb.layers[-1].indptr.tolist() == ours.layers[-1].indptr.tolist()
        assert mb.layers[-1].indices.dtype == ours.layers[-1].indices.dtype


def test_nodes_without_in_edges_and_empty_batches():
    from gnnray.data.csc import csc_from_edges
    from gnnray.data.graph import Graph

    indptr, indices = csc_from_edges(np.array([0]), np.array([1]), 3)
    graph = Graph(indptr, indices, np.zeros((3, 2), np.float32), np.array([0, 1, 2]), np.arange(3),
                  np.arange(0), np.arange(0), 3)
    sampler = DeviceSampler(graph, (2, 2), "cpu")
    check_batch(graph, (2, 2), np.array([2, 1, 0]), sampler.sample(np.array([2, 1, 0])))
    empty = sampler.sample(np.array([], np.int64))
    assert empty.num_seeds == 0 and [layer.num_dst for layer in empty.layers] == [0, 0]


def test_new_ids_are_numbered_in_order_of_first_appearance():
    graph = tiny_graph(num_nodes=200, num_edges=3000, seed=4)
    mb = DeviceSampler(graph, (4, 3), "cpu").sample(np.arange(0, 60, 3), epoch=0, batch=1)
    for layer in mb.layers:
        local = layer.indices.tolist()
        seen = [j for i, j in enumerate(local) if j >= layer.num_dst and j not in local[:i]]
        assert seen == list(range(layer.num_dst, layer.num_src))


def test_a_batch_depends_on_its_seed_epoch_and_batch():
    graph = tiny_graph(num_nodes=300, num_edges=4000, seed=2)
    seeds = np.arange(40)

    def draw(**kw):
        return DeviceSampler(graph, (5, 5), "cpu", seed=kw.pop("seed", 0)).sample(seeds, **kw).input_nodes.tolist()

    assert draw(epoch=1, batch=7) == draw(epoch=1, batch=7)
    assert draw(epoch=1, batch=7) != draw(epoch=1, batch=8)
    assert draw(epoch=1, batch=7) != draw(epoch=2, batch=7)
    assert draw(epoch=1, batch=7) != draw(epoch=1, batch=7, seed=1)


# Each destination is copied COPIES times in one batch (copies draw independently), so DRAWS draws per
# destination take DRAWS / COPIES calls: torch's per-call cost on a tiny graph is what these tests would pay.
COPIES = 100


def _folded_counts(degrees: list[int], fanout: int) -> list[np.ndarray]:
    """Per destination of ``degrees``, how often each in-edge was picked over DRAWS draws (copies folded)."""
    graph, first = star_graph(degrees * COPIES)
    sampler = DeviceSampler(graph, [fanout], "cpu")
    seeds = np.arange(len(degrees) * COPIES)
    counts = draw_counts(lambda r: sampler.sample(seeds, epoch=1, batch=r), degrees * COPIES, first,
                         DRAWS // COPIES)
    return [sum(counts[c * len(degrees) + i] for c in range(COPIES)) for i in range(len(degrees))]


# One draw path for every (degree, fanout) here (no Floyd / selection switch as in pick.py): a few cases do.
DEVICE_CASES = [c for c in CASES if c[0] <= 100]


@pytest.mark.parametrize("degree, fanout", DEVICE_CASES, ids=[f"d{d}-k{k}" for d, k in DEVICE_CASES])
def test_each_in_edge_is_picked_with_probability_fanout_over_degree(degree, fanout):
    degrees = [degree] * 4 + [fanout, fanout - 1, 1]
    counts = _folded_counts(degrees, fanout)
    for c, d in zip(counts, degrees):
        assert c.sum() == DRAWS * min(d, fanout)
    stat, dof = inclusion_statistic(counts, fanout, DRAWS)
    assert stat < chi2_bar(dof), f"inclusion counts deviate from k/d: chi2 {stat:.0f} on {dof} dof"


def test_the_inclusion_check_fails_on_copies_that_draw_alike():
    """The folding is sound only if copies draw apart: the same picks in every copy would fold to a bias."""
    degrees = [40] * 4
    graph, first = star_graph(degrees)
    sampler = DeviceSampler(graph, [10], "cpu")
    one = draw_counts(lambda r: sampler.sample(np.arange(4), epoch=1, batch=r), degrees, first, DRAWS // COPIES)
    stat, dof = inclusion_statistic([c * COPIES for c in one], 10, DRAWS)
    assert stat > chi2_bar(dof)


@pytest.mark.parametrize("degree, fanout", [(5, 2), (6, 3), (8, 1)])
def test_every_subset_of_in_edges_is_equally_likely(degree, fanout):
    copies, calls = 60, 50
    graph, first = star_graph([degree] * copies)
    sampler = DeviceSampler(graph, [fanout], "cpu")
    subsets = {s: i for i, s in enumerate(itertools.combinations(range(degree), fanout))}
    seen = np.zeros(len(subsets), np.int64)
    for r in range(calls):
        mb = sampler.sample(np.arange(copies), epoch=1, batch=r)
        layer = mb.layers[0]
        src, indptr = mb.input_nodes.numpy()[layer.indices.numpy()], layer.indptr.numpy()
        for i in range(copies):
            seen[subsets[tuple(sorted((src[indptr[i]:indptr[i + 1]] - first[i]).tolist()))]] += 1
    expected = copies * calls / len(subsets)
    stat = float(((seen - expected) ** 2 / expected).sum())
    assert stat < chi2_bar(len(subsets) - 1), f"subsets deviate from uniform: chi2 {stat:.0f}"


@pytest.mark.parametrize("codes", ["int8", "int16"])
@pytest.mark.parametrize("int32", [False, True], ids=["int64", "int32"])
@pytest.mark.parametrize("text", TYPED_FANOUTS)
def test_typed_graphs_sample_each_relation_with_its_own_fanout(text, int32, codes):
    graph = typed_graph(int32=int32)
    graph = dataclasses.replace(graph, etype=graph.etype.astype(codes))
    fanouts = Fanouts.parse(text)
    sampler, native = DeviceSampler(graph, fanouts, "cpu"), Sampler(graph, fanouts)
    rng = np.random.default_rng(1)
    beyond = 0
    for size in (1, 7, 40):
        seeds = rng.choice(graph.num_nodes, size, replace=False)
        mb = sampler.sample(seeds)
        beyond += check_typed_batch(graph, fanouts, seeds, mb)
        assert mb.layers[-1].indptr.tolist() == native.sample(seeds).layers[-1].indptr.tolist()
    assert beyond > 0


def test_typed_nodes_draw_each_relation_with_probability_its_fanout_over_its_degree():
    # COPIES destinations, each with 30 in-edges of relation a and 9 of relation b (sources of its own),
    # fanouts 5 and 3.
    from gnnray.data.csc import typed_csc
    from gnnray.data.graph import Graph

    n = COPIES * 40
    dst = np.repeat(np.arange(COPIES), 39)
    src = (np.arange(1, 40) + 40 * np.arange(COPIES)[:, None]).ravel()
    rel = np.tile(np.array([0] * 30 + [1] * 9, np.int8), COPIES)
    indptr, indices, etype = typed_csc(src, dst, rel, n, 2, reverse=False)
    graph = Graph(indptr, indices, np.zeros((n, 0), np.float32), np.zeros(n, np.int64), np.arange(COPIES),
                  np.arange(0), np.arange(0), 2, "typed", etype=etype, ntype=np.zeros(n, np.int8),
                  node_types=("n",), edge_types=(("n", "a", "n"), ("n", "b", "n")), target_type="n")
    sampler = DeviceSampler(graph, Fanouts.parse("5;b=3"), "cpu")
    counts = np.zeros(40, np.int64)  # by a source's place among its destination's (1..39)
    for r in range(DRAWS // COPIES):
        layer = (mb := sampler.sample(np.arange(COPIES), epoch=0, batch=r)).layers[0]
        picked = mb.input_nodes.numpy()[layer.indices.numpy()]
        indptr = layer.indptr.numpy()
        for i in range(COPIES):
            got, codes = picked[indptr[i]:indptr[i + 1]], layer.etype.numpy()[indptr[i]:indptr[i + 1]]
            assert np.bincount(codes, minlength=2).tolist() == [5, 3]
            assert len(set(got.tolist())) == len(got)
            counts[got - 40 * i] += 1
    stat_a, dof_a = inclusion_statistic([counts[1:31]], 5, DRAWS)
    stat_b, dof_b = inclusion_statistic([counts[31:40]], 3, DRAWS)
    assert stat_a + stat_b < chi2_bar(dof_a + dof_b)


def test_bad_fanouts_are_refused_as_the_actors_refuse_them():
    with pytest.raises(ConfigError, match="no relations"):
        DeviceSampler(tiny_graph(), Fanouts.parse("2;r0=1"), "cpu")


def test_batches_move_and_pack_like_the_actors_batches():
    from gnnray.batch import MiniBatch

    graph = GRAPHS["random500-int32"]()
    sampler = DeviceSampler(graph, (3, 2), "cpu")
    mb = sampler.sample(torch.arange(20), epoch=3, batch=0)
    back = MiniBatch.unpack(torch.from_numpy(mb.pack(sampler.id_dtype)))
    assert back.input_nodes.tolist() == mb.input_nodes.tolist()
    assert [l.indptr.tolist() for l in back.layers] == [l.indptr.tolist() for l in mb.layers]
    assert mb.to("cpu").labels.dtype == torch.int64


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # CUDA where a GPU is (never in CI)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("placement", ["host", "device", "uva"])
def test_device_batches_follow_the_seed_plan_with_their_features(placement, device):
    """A rank's seed rows become batches of the plan's seeds, features gathered for their input nodes, wherever
    the features are placed."""
    from gnnray.config import parse_args
    from gnnray.seeds import SeedPlan
    from gnnray.train.device_sampler import device_batches
    from gnnray.train.feature_reader import LocalRows
    from gnnray.train.placement import place

    graph = tiny_graph(num_nodes=300, num_edges=3000, seed=6)
    cfg = parse_args(["--batch-size", "16", "--fanouts", "4,3", "--num-workers", "2", "--sample-on", "device"])
    plan = SeedPlan.for_run(graph.train_idx, 16, 2, cfg.run.seed)
    rows = [0, 2, plan.rows_per_epoch + 1]  # a rank's rows, into the next epoch
    placed = place(placement, LocalRows(graph.feat), device, graph.indptr, free_bytes=graph.feat.nbytes // 2)
    with device_batches(iter(rows), graph, cfg, 2, graph.feat, torch.device(device), placed) as batches:
        got = [(mb.to("cpu"), mb.x.cpu().clone()) for mb in batches]  # x is valid until the next batch
    assert len(got) == len(rows)
    for row, (mb, x) in zip(rows, got):
        epoch = row // plan.rows_per_epoch
        assert mb.epoch == epoch
        assert mb.seeds.tolist() == plan.batches(epoch)[row % plan.rows_per_epoch].tolist()
        check_batch(graph, (4, 3), mb.seeds.numpy(), mb)
        assert mb.labels.dtype == torch.int64 and mb.x.dtype == torch.float32
        assert torch.equal(x, torch.from_numpy(graph.feat[mb.input_nodes.numpy()]))


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's SCHED_IDLE policy only")
def test_a_cpu_worker_samples_on_one_thread_at_idle_priority():
    """A CPU worker's batches are sampled and gathered ahead, on a thread that takes only idle cores (after the
    first batch), and with one sampler thread: none of the step's cores is taken from it."""
    from gnnray.config import parse_args
    from gnnray.seeds import SeedPlan
    from gnnray.train.device_sampler import device_batches

    graph = tiny_graph(num_nodes=300, num_edges=3000, seed=6)
    cfg = parse_args(["--batch-size", "16", "--fanouts", "4,3", "--num-workers", "1", "--sample-on", "device"])
    plan = SeedPlan.for_run(graph.train_idx, 16, 1, cfg.run.seed)
    rows = range(plan.rows_per_epoch)  # more than the thread may prepare ahead: it stays alive, waiting
    with device_batches(iter(rows), graph, cfg, 1, graph.feat, torch.device("cpu")) as batches:
        mbs = [next(batches).seeds.tolist() for _ in range(2)]
        policy = os.sched_getscheduler(batches._thread.native_id)
        assert batches._sampler.threads == 1
    assert mbs == [plan.batches(0)[i].tolist() for i in range(2)]
    assert policy == os.SCHED_IDLE and os.sched_getscheduler(0) != os.SCHED_IDLE
