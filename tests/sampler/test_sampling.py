"""Tests of gnnray.sampler.sampler: sampled blocks are real, bounded, chained sub-graphs of the graph.

The structural checks run on both backends: gnnray's own sampler, and DGL's
GraphBolt where the dgl extra is installed. How uniform the draws are is
tested in test_pick.py.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from conftest import tiny_graph
from gnnray.batch import MiniBatch
from gnnray.config import Fanouts, from_dict, parse_args
from gnnray.data.graph import Graph
from gnnray.errors import ConfigError
from gnnray.sampler.sampler import Sampler, SamplerActor, make_sampler
from sampling_checks import (FANOUTS, GRAPHS, TYPED_FANOUTS, check_batch, check_typed_batch, compact, typed_graph,
                             wide_indptr)

BACKENDS = ["native", pytest.param("graphbolt", marks=pytest.mark.dgl)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(GRAPHS))
@pytest.mark.parametrize("fanouts", FANOUTS, ids=lambda f: ",".join(map(str, f)))
def test_blocks_are_sampled_from_the_graph(name, fanouts, backend):
    graph = GRAPHS[name]()
    sampler = make_sampler(graph, fanouts, backend)
    rng = np.random.default_rng(0)
    for size in (1, 5, min(40, graph.num_nodes)):
        seeds = rng.choice(graph.num_nodes, size, replace=False)
        mb = sampler.sample(seeds, epoch=2)
        assert mb.epoch == 2
        check_batch(graph, fanouts, seeds, mb)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nodes_without_in_edges_are_kept(backend):
    # 0 -> 1 only: node 0 has no in-edges; node 2 is isolated.
    from gnnray.data.csc import csc_from_edges

    indptr, indices = csc_from_edges(np.array([0]), np.array([1]), 3)
    graph = Graph(indptr, indices, np.zeros((3, 2), np.float32), np.array([0, 1, 2]), np.arange(3),
                  np.arange(0), np.arange(0), 3)
    mb = make_sampler(graph, (2, 2), backend).sample(np.array([2, 1, 0]))
    check_batch(graph, (2, 2), np.array([2, 1, 0]), mb)
    assert set(mb.input_nodes.tolist()) == {0, 1, 2}


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampler_accepts_other_int_dtypes_and_lists(backend):
    graph = tiny_graph()
    sampler = make_sampler(graph, (3,), backend)
    mb = sampler.sample(np.array([4, 2], dtype=np.int32))
    assert mb.seeds.dtype == torch.int64
    check_batch(graph, (3,), np.array([4, 2]), mb)
    # An int32 graph takes int64 seeds and gives int32 ids (the dtype of indices), int64 labels.
    small = compact(graph)
    mb = make_sampler(small, (3,), backend).sample(np.array([4, 2], dtype=np.int64))
    assert mb.seeds.dtype == mb.input_nodes.dtype == torch.int32 and mb.labels.dtype == torch.int64
    check_batch(small, (3,), np.array([4, 2]), mb)


def test_default_epoch_is_evaluation():
    assert Sampler(tiny_graph(), (2,)).sample(np.array([0])).epoch == -1


@pytest.mark.parametrize("structure", ["int64", "int32", "mixed"])
def test_sampler_actor_turns_rows_into_packed_minibatches(ray_cluster, structure):
    import pyarrow as pa

    from gnnray.batch import from_arrow
    from gnnray.seeds import SeedPlan
    from gnnray.store.handle import publish

    graph = {"int64": tiny_graph, "int32": lambda: compact(tiny_graph()),
             "mixed": lambda: wide_indptr(compact(tiny_graph()))}[structure]()
    handle = publish(graph)
    plan = SeedPlan.for_run(graph.train_idx, batch_size=4, num_workers=1, seed=3)
    actor = SamplerActor(handle, (3, 2), plan)
    rows = [2, plan.rows_per_epoch + 1, 3 * plan.rows_per_epoch]  # epochs 0, 1, 3: one call, several epochs
    out = actor({"row": np.array(rows)})
    assert isinstance(out, pa.Table) and out.column_names == ["packed"] and out.num_rows == len(rows)
    for row, packed in zip(rows, from_arrow(out)):
        assert packed.dtype == np.int32  # the tiny graph's ids fit
        mb = MiniBatch.unpack(torch.from_numpy(packed.copy()))
        epoch = row // plan.rows_per_epoch
        want = plan.batches(epoch)[row % plan.rows_per_epoch]
        assert mb.epoch == epoch
        assert mb.seeds.tolist() == want.tolist()
        assert len(mb.layers) == 2
        check_batch(graph, (3, 2), want, mb)


def test_sampler_actor_empty_seed_batch_gives_empty_minibatch(ray_cluster):
    from gnnray.batch import from_arrow
    from gnnray.seeds import SeedPlan
    from gnnray.store.handle import publish

    graph = tiny_graph()
    plan = SeedPlan.for_run(graph.train_idx[:1], batch_size=4, num_workers=2, seed=0)  # 1 seed, 2 batches
    out = SamplerActor(publish(graph), (2,), plan)({"row": np.array([0, 1])})
    sizes = [MiniBatch.unpack(torch.from_numpy(p.copy())).num_seeds for p in from_arrow(out)]
    assert sorted(sizes) == [0, 1]


def test_more_than_2_31_edges_int64_indptr_beside_int32_indices(tmp_path):
    """A real graph past 2**31 edges: int64 offsets, int32 node ids, sampled right and in place.

    Node 0 has 2**31 + 5 in-edges (self loops): a hole in a sparse file, so
    ``indices`` is 8 GiB long and takes a few KiB of disk and memory. The
    other nodes' edges lie past offset 2**31, where an int32 ``indptr`` could
    not point.
    """
    from gnnray.data.csc import structure_dtypes

    n, loops = 60, 2**31 + 5
    rng = np.random.default_rng(0)
    degree = rng.integers(0, 6, n - 1)
    path = tmp_path / "indices.int32"
    with open(path, "wb") as f:
        f.truncate((loops + int(degree.sum())) * 4)
    tail = np.memmap(path, dtype=np.int32, mode="r+", offset=loops * 4)
    tail[:] = rng.integers(1, n, tail.size)  # no edge from node 0: check_batch would count its 2**31 in-edges
    tail.flush()
    del tail
    indices = np.memmap(path, dtype=np.int32, mode="r")
    indptr = np.concatenate([[0, loops], loops + np.cumsum(degree)]).astype(np.int64)
    assert structure_dtypes(n, indices.size) == (np.int64, np.int32)
    assert indptr[1] >= 2**31 and indptr[-1] == indices.size > 2**31
    graph = Graph(indptr, indices, np.zeros((n, 0), np.float32), rng.integers(0, 3, n), np.arange(n),
                  np.arange(0), np.arange(0), 3)
    sampler = Sampler(graph, (4, 3))
    seeds = np.arange(1, n)  # not node 0, for the same reason
    mb = sampler.sample(seeds)
    assert mb.input_nodes.dtype == torch.int32
    check_batch(graph, (4, 3), seeds, mb)
    assert sum(int(l.indices.shape[0]) for l in mb.layers) > 0
    # Node 0 samples too: 3 of its loops, from anywhere in its 2**31 offsets.
    zero = sampler.sample(np.array([0]))
    assert zero.layers[-1].indptr.tolist() == [0, 3] and zero.input_nodes.tolist() == [0]


# ----------------------------------------------------------------------------- typed graphs: per-relation fanouts


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("codes", ["int8", "int16"])
@pytest.mark.parametrize("int32", [False, True], ids=["int64", "int32"])
@pytest.mark.parametrize("text", TYPED_FANOUTS)
def test_typed_graphs_sample_each_relation_with_its_own_fanout(text, int32, codes, backend):
    graph = typed_graph(int32=int32)
    graph = dataclasses.replace(graph, etype=graph.etype.astype(codes))  # int16 past 127 relations
    fanouts = Fanouts.parse(text)
    sampler = make_sampler(graph, fanouts, backend)
    rng = np.random.default_rng(1)
    beyond = 0
    for size in (1, 7, 40):
        seeds = rng.choice(graph.num_nodes, size, replace=False)
        beyond += check_typed_batch(graph, fanouts, seeds, sampler.sample(seeds))
    assert beyond > 0  # a node's relations are drawn apart: more than one default fanout's worth in total


def test_a_typed_graph_takes_a_list_of_ints_as_the_fanout_of_every_relation():
    graph = typed_graph(seed=2)
    seeds = np.arange(20)
    assert check_typed_batch(graph, Fanouts((2, 2)), seeds, Sampler(graph, [2, 2]).sample(seeds)) > 0


def test_typed_graphs_are_stored_with_in_edges_grouped_by_relation():
    """The sampler (and GraphBolt) reads each relation of a node as one run of equal codes: the typed CSC must come
    so."""
    graph = typed_graph()
    for v in range(graph.num_nodes):
        codes = graph.etype[graph.indptr[v]:graph.indptr[v + 1]]
        assert np.all(np.diff(codes.astype(np.int64)) >= 0)


def test_fanout_table_names_the_flag_the_relation_and_the_graphs_relations():
    from gnnray.data.typed import fanout_table

    graph = typed_graph()
    assert fanout_table(Fanouts.parse("4,3;r1=2,-1"), graph) == [[4, 2, 4, 4, 4, 4], [3, -1, 3, 3, 3, 3]]
    with pytest.raises(ConfigError) as info:
        fanout_table(Fanouts.parse("4,3;cites=2,2"), graph)
    for text in ("--fanouts", "'cites'", "r0, r1, r2, rev_r0, rev_r1, rev_r2"):
        assert text in str(info.value), str(info.value)
    with pytest.raises(ConfigError, match="--fanouts .*no relations.*--fanouts 4,3"):
        fanout_table(Fanouts.parse("4,3;r1=2,2"), tiny_graph())
    assert fanout_table(Fanouts.parse("4,3"), tiny_graph()) == [[4], [3]]


def test_untyped_graphs_sample_one_fanout_over_all_in_edges():
    graph = tiny_graph(num_nodes=12, num_edges=150, seed=3)
    sampler = Sampler(graph, Fanouts((3, 2)))
    assert [f.tolist() for f in sampler._fanouts] == [[2], [3]]  # one fanout per layer, output first
    seeds = np.arange(12)
    mb = sampler.sample(seeds)
    check_batch(graph, (3, 2), seeds, mb)
    assert all(layer.etype is None for layer in mb.layers)


# ----------------------------------------------------------------------------- the --fanouts text

def test_fanouts_text_gives_relations_their_own_lists():
    cfg = parse_args(["--fanouts", "10,10; cites=5,5 ;rev_writes=3,-1"])
    f = cfg.sampler.fanouts
    assert f.layers == (10, 10) and cfg.sampler.num_layers == 2 and list(f) == [10, 10]
    assert f.of("cites") == (5, 5) and f.of("rev_writes") == (3, -1) and f.of("writes") == (10, 10)
    assert str(f) == "10,10;cites=5,5;rev_writes=3,-1"
    # Checkpoints keep the configuration as JSON: the overrides survive.
    assert from_dict(json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg
    assert parse_args(["--fanouts", str(f)]) == cfg
    assert parse_args(["--fanouts", "5,5"]).sampler.fanouts == Fanouts((5, 5))


@pytest.mark.parametrize("text, says", [
    ("cites=5,5", "the default list comes first"),
    ("10,10;cites=5", "relation 'cites' has 1 fanouts but the default list 10,10 has 2 layers"),
    ("10,10;cites=5,5,5", "relation 'cites' has 3 fanouts"),
    ("10,10;cites=5,5;cites=3,3", "relation 'cites' is given twice"),
    ("10,10;cites", "'cites' is not relation=fanouts"),
    ("10,10;=5,5", "'=5,5' is not relation=fanouts"),
    ("10,10;cites=", "relation 'cites': '' is not a list of fanouts"),
    ("10,10;cites=5,x", "relation 'cites': '5,x' is not a list of fanouts"),
    ("10,10;cites=0,5", "each fanout must be a positive integer"),
    ("10,10;cites=-2,5", "each fanout must be a positive integer"),
])
def test_bad_fanouts_texts_are_refused_saying_what_is_wrong(text, says):
    with pytest.raises(ConfigError) as info:
        parse_args(["--fanouts", text])
    assert str(info.value).startswith("--fanouts ") and says in str(info.value), str(info.value)


@pytest.mark.parametrize("name", list(GRAPHS))
@pytest.mark.parametrize("fanouts", FANOUTS, ids=lambda f: ",".join(map(str, f)))
def test_a_packed_batch_is_within_its_bound(name, fanouts):
    """The bound sizes the stream's blocks (and with them what the read-ahead holds in the object store)."""
    from gnnray.sampler.sampler import packed_bytes_at_most

    graph = GRAPHS[name]()
    sampler = make_sampler(graph, fanouts)
    rng = np.random.default_rng(3)
    for size in (1, 5, min(40, graph.num_nodes)):
        for _ in range(3):
            packed = sampler.sample(rng.choice(graph.num_nodes, size, replace=False)).pack(sampler.id_dtype)
            assert packed.nbytes <= packed_bytes_at_most(graph, Fanouts.of_value(fanouts), size), (size, packed.nbytes)


@pytest.mark.parametrize("text", TYPED_FANOUTS)
def test_a_typed_batch_is_within_its_bound(text):
    from gnnray.sampler.sampler import packed_bytes_at_most

    graph, fanouts = typed_graph(int32=True), Fanouts.parse(text)
    sampler = make_sampler(graph, fanouts)
    rng = np.random.default_rng(4)
    for size in (1, 7, 40):
        packed = sampler.sample(rng.choice(graph.num_nodes, size, replace=False)).pack(sampler.id_dtype)
        assert packed.nbytes <= packed_bytes_at_most(graph, fanouts, size), (size, packed.nbytes)


@pytest.mark.parametrize("chunk", [1, 7, 1 << 22])
def test_the_largest_in_degree_is_read_a_chunk_at_a_time(chunk):
    from gnnray.sampler.sampler import max_in_degree

    graph = tiny_graph(num_nodes=50, num_edges=400, seed=5)
    assert max_in_degree(graph, chunk) == int(np.diff(graph.indptr).max())
