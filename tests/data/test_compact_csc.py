"""The graph structure as int32 (compact_csc): the same graph, half the bytes, sampled without a copy.

Both samplers are checked: gnnray's own (``Sampler``) everywhere, GraphBolt's (``GraphBoltSampler``, the ``dgl``
extra) in the tests and cases marked ``dgl``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gnnray.batch import MiniBatch
from gnnray.data.csc import build_csc, compact_csc, structure_dtypes, typed_csc
from gnnray.data.graph import Graph
from gnnray.data.synthetic import synthetic_hetero_parts, synthetic_parts
from gnnray.data.validate import validate
from gnnray.sampler.graphbolt import to_dgl, to_graphbolt  # DGL is imported when they are called
from gnnray.sampler.sampler import Sampler


def parts(typed: bool):
    make = synthetic_hetero_parts if typed else synthetic_parts
    return make(600, 4, 8, 8, 0)


def wide(graph: Graph) -> Graph:
    """``graph`` with its structure as int64, as every graph was before compact_csc."""
    return dataclasses.replace(graph, indptr=graph.indptr.astype(np.int64), indices=graph.indices.astype(np.int64))


def neighbor_lists(indptr: np.ndarray, indices: np.ndarray, etype=None) -> list:
    """Each node's in-neighbors in CSC order (with their relations if ``etype`` is given)."""
    rows = []
    for a, b in zip(indptr[:-1].tolist(), indptr[1:].tolist()):
        nbrs = indices[a:b].tolist()
        rows.append(nbrs if etype is None else list(zip(nbrs, etype[a:b].tolist())))
    return rows


# ----------------------------------------------------------------------------- the build


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("self_loops", [False, True])
def test_build_stores_int32_with_the_int64_builders_neighbor_lists(reverse, self_loops):
    p = parts(typed=False)
    want = build_csc(p.src.copy(), p.dst.copy(), p.num_nodes, reverse, self_loops)
    assert want[0].dtype == want[1].dtype == np.int32  # written in structure_dtypes from the start
    graph = p.build(reverse, self_loops)
    assert graph.indptr.dtype == graph.indices.dtype == np.int32
    np.testing.assert_array_equal(graph.indptr, want[0])
    assert neighbor_lists(graph.indptr, graph.indices) == neighbor_lists(*want)
    assert graph.num_edges == want[1].size and graph.num_edges > 0
    validate(graph, "compact")


@pytest.mark.parametrize("reverse", [False, True])
def test_typed_build_stores_int32_aligned_with_the_relations(reverse):
    p = parts(typed=True)
    indptr, indices, etype = typed_csc(p.src.copy(), p.dst.copy(), p.etype.copy(), p.num_nodes,
                                       len(p.edge_types), reverse)
    graph = p.build(reverse)
    assert graph.indptr.dtype == graph.indices.dtype == np.int32
    assert neighbor_lists(graph.indptr, graph.indices, graph.etype) == neighbor_lists(indptr, indices, etype)
    validate(graph, "compact typed")


def test_int64_structure_still_validates():
    graph = parts(typed=False).build()
    validate(wide(graph), "int64")
    validate(dataclasses.replace(graph, indptr=graph.indptr.astype(np.int64)), "mixed")


@pytest.mark.dgl
def test_dgl_refuses_a_mixed_pair():
    graph = parts(typed=False).build()
    mixed = dataclasses.replace(graph, indptr=graph.indptr.astype(np.int64))
    with pytest.raises(ValueError, match="same dtype"):
        to_dgl(mixed)  # what GraphBolt is for (test_graphbolt_uses_the_arrays_without_a_copy)


# ----------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("num_nodes, num_edges, ptr, idx", [
    (0, 0, np.int32, np.int32),
    (1000, 2**31 - 1, np.int32, np.int32),  # the largest offset, 2**31 - 1, fits
    (1000, 2**31, np.int64, np.int32),  # only indptr widens: node ids still fit
    (111_059_956, 3_231_371_744, np.int64, np.int32),  # papers100M, reverse edges
    (2**31 - 1, 10, np.int32, np.int32),  # the largest node id, 2**31 - 2, fits
    (2**31, 10, np.int32, np.int64),
    (2**31, 2**33, np.int64, np.int64),
])
def test_each_structure_array_is_int32_while_its_values_fit(num_nodes, num_edges, ptr, idx):
    assert structure_dtypes(num_nodes, num_edges) == (np.dtype(ptr), np.dtype(idx))


class _Counted:
    """Stands for an array of ``size`` elements without them: compact_csc reads only its shape and calls astype."""

    def __init__(self, size: int, dtype=np.int64):
        self.shape, self.dtype, self.asked = (size,), np.dtype(dtype), []

    def astype(self, dtype, copy=True):
        self.asked.append((np.dtype(dtype), copy))
        return self if np.dtype(dtype) == self.dtype else _Counted(self.shape[0], dtype)


@pytest.mark.parametrize("num_nodes, num_edges, ptr, idx", [
    (100, 2**31 - 1, np.int32, np.int32), (100, 2**31, np.int64, np.int32), (2**31, 100, np.int32, np.int64)])
def test_compact_csc_follows_the_rule_from_the_counts(num_nodes, num_edges, ptr, idx):
    indptr, indices = _Counted(num_nodes + 1), _Counted(num_edges)
    out_ptr, out_idx = compact_csc(indptr, indices)
    assert (out_ptr.dtype, out_idx.dtype) == (np.dtype(ptr), np.dtype(idx))
    for before, after in ((indptr, out_ptr), (indices, out_idx)):
        if after.dtype == np.int64:  # kept as it is: no copy
            assert after is before and before.asked == [(np.dtype(np.int64), False)]


def test_compact_csc_converts_the_values_and_keeps_int32_input():
    indptr = np.array([0, 2, 2, 5], dtype=np.int64)
    indices = np.array([2, 0, 1, 1, 2], dtype=np.int64)
    a, b = compact_csc(indptr, indices)
    assert a.dtype == b.dtype == np.int32
    assert a.tolist() == indptr.tolist() and b.tolist() == indices.tolist()
    assert not np.shares_memory(a, indptr) and not np.shares_memory(b, indices)  # the int64 ones can be freed
    c, d = compact_csc(a, b)
    assert c is a and d is b


# ----------------------------------------------------------------------------- sampling

# The samplers: gnnray's own everywhere, GraphBolt's where DGL is installed.
BACKENDS = ["native", pytest.param("graphbolt", marks=pytest.mark.dgl)]


@pytest.fixture
def torch_threads():
    """Restores torch's thread count, which GraphBoltSampler sets for the whole process."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def make_sampler(backend: str, graph: Graph, fanouts, threads: int = 1):
    if backend == "graphbolt":
        from gnnray.sampler.graphbolt import GraphBoltSampler

        return GraphBoltSampler(graph, fanouts, threads)
    return Sampler(graph, fanouts, threads=threads)


def global_edges(mb: MiniBatch) -> list:
    """Each block's edges as sorted (src, dst, relation) global ids: the same whatever order nodes were numbered in."""
    src = mb.input_nodes.long()
    out = []
    for layer in mb.layers:
        dst = torch.repeat_interleave(torch.arange(layer.num_dst), layer.indptr.long().diff())
        rel = [None] * layer.indices.numel() if layer.etype is None else layer.etype.tolist()
        out.append(sorted(zip(src[layer.indices.long()].tolist(), src[dst].tolist(), rel)))
        src = src[:layer.num_dst]
    return out


def sample(backend: str, graph: Graph, fanouts, seeds: np.ndarray, seed: int) -> MiniBatch:
    """The blocks of ``seeds`` drawn with ``seed``: the run's seed of gnnray's sampler (batch 0 of epoch 0,
    whatever the dtypes), GraphBolt's global seed on one torch thread (one random stream per thread)."""
    if backend == "graphbolt":
        import dgl.graphbolt

        sampler = make_sampler(backend, graph, fanouts)  # one thread
        dgl.graphbolt.seed(seed)
        return sampler.sample(seeds)
    return Sampler(graph, fanouts, seed=seed).sample(seeds, epoch=0, batch=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("typed", [False, True])
def test_int32_graph_samples_the_int64_graphs_blocks(torch_threads, typed, backend):
    graph = parts(typed).build(True)
    assert graph.indptr.dtype == graph.indices.dtype == np.int32
    seeds = graph.train_idx[:64]  # int64: the sampler converts them to the dtype of indices
    fanouts = (4, 3, 2)
    compact, reference = sample(backend, graph, fanouts, seeds, 7), sample(backend, wide(graph), fanouts, seeds, 7)
    # int64 offsets beside int32 ids (the layout past 2**31 edges): the same blocks, in int32 ids.
    mixed = sample(backend, dataclasses.replace(graph, indptr=graph.indptr.astype(np.int64)), fanouts, seeds, 7)
    assert mixed.input_nodes.dtype == mixed.layers[0].indptr.dtype == torch.int32
    assert global_edges(mixed) == global_edges(reference)
    assert compact.input_nodes.dtype == compact.seeds.dtype == compact.layers[0].indices.dtype == torch.int32
    assert reference.input_nodes.dtype == torch.int64
    assert compact.labels.dtype == torch.int64 and compact.labels.tolist() == graph.label[seeds].tolist()
    assert compact.seeds.tolist() == reference.seeds.tolist() == seeds.tolist()
    assert sorted(compact.input_nodes.tolist()) == sorted(reference.input_nodes.tolist())
    edges = global_edges(compact)
    assert edges == global_edges(reference)
    # Sampling is random here (another seed, other edges), so the equality above says something.
    assert global_edges(sample(backend, graph, fanouts, seeds, 8)) != edges
    if typed:
        assert all(r is not None for e in edges for _, _, r in e)

    # A packed batch round-trips with int32 ids.
    packed = compact.pack(Sampler(graph, fanouts).id_dtype)
    assert packed.dtype == np.int32
    back = MiniBatch.unpack(torch.from_numpy(packed))
    assert global_edges(back) == edges


STRUCTURES = [(np.int32, np.int32), (np.int64, np.int32), (np.int64, np.int64)]


@pytest.mark.parametrize("ptr, idx", STRUCTURES)
def test_sampled_ids_come_in_the_dtype_of_indices(ptr, idx):
    graph = parts(typed=False).build(True)
    g = dataclasses.replace(graph, indptr=graph.indptr.astype(ptr), indices=graph.indices.astype(idx))
    mb = Sampler(g, (3, 3)).sample(g.train_idx[:32])
    want = torch.from_numpy(g.indices[:0]).dtype
    assert mb.input_nodes.dtype == mb.seeds.dtype == want
    assert all(l.indptr.dtype == l.indices.dtype == want for l in mb.layers)


@pytest.mark.dgl
@pytest.mark.parametrize("ptr, idx", STRUCTURES)
def test_graphbolt_uses_the_arrays_without_a_copy(torch_threads, ptr, idx):
    from gnnray.sampler.graphbolt import GraphBoltSampler

    graph = parts(typed=False).build(True)
    g = dataclasses.replace(graph, indptr=graph.indptr.astype(ptr), indices=graph.indices.astype(idx))
    sampler = GraphBoltSampler(g, (3, 3))
    mb = sampler.sample(g.train_idx[:32])
    assert mb.input_nodes.dtype == torch.from_numpy(g.indices[:0]).dtype
    # GraphBolt samples from the arrays themselves, in their own dtypes.
    bolt = sampler._g
    assert bolt.csc_indptr.data_ptr() == g.indptr.ctypes.data
    assert bolt.csc_indptr.dtype == torch.from_numpy(g.indptr).dtype
    assert bolt.indices.data_ptr() == g.indices.ctypes.data
    assert to_graphbolt(g).indices.data_ptr() == g.indices.ctypes.data


@pytest.mark.dgl
def test_to_dgl_uses_the_arrays_without_a_copy():
    import dgl

    graph = parts(typed=False).build(True)
    for g in (graph, wide(graph)):
        dg = to_dgl(g)
        assert dg.idtype == torch.from_numpy(g.indices[:0]).dtype
        # Sampling neither copies the arrays nor builds another format.
        seeds = torch.from_numpy(g.train_idx[:32]).to(dg.idtype)
        dgl.dataloading.NeighborSampler([3, 3]).sample_blocks(dg, seeds)
        indptr, indices, eids = dg.adj_tensors("csc")
        assert indptr.data_ptr() == g.indptr.ctypes.data
        assert indices.data_ptr() == g.indices.ctypes.data
        assert eids.numel() == 0
        assert dg.formats()["created"] == ["csc"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("structure", ["int32", "mixed", "int64"])
def test_parallel_sampling_stays_right_batch_after_batch(torch_threads, structure, backend):
    """Batch after batch on two threads, every block's edges are the graph's and its sources unique.

    gnnray's sampler splits a layer's destinations over its threads; GraphBolt splits a batch's seeds over
    torch's (64 per task) and dedups them concurrently. (DGL 2.1's fused sampler, used before GraphBolt, went
    wrong after the first batch on int32 graphs: this is the check that caught it.)
    """
    graph = parts(typed=False).build(True)
    graph = {"int32": graph, "int64": wide(graph),
             "mixed": dataclasses.replace(graph, indptr=graph.indptr.astype(np.int64))}[structure]
    sampler = make_sampler(backend, graph, (3, 2), threads=2)
    assert sampler.threads == 2
    rng = np.random.default_rng(0)
    for _ in range(20):
        seeds = rng.choice(graph.num_nodes, 200, replace=False)
        mb = sampler.sample(seeds)
        src = mb.input_nodes.numpy()
        assert len(np.unique(src)) == len(src)
        for layer in mb.layers:
            indptr, indices = layer.indptr.numpy(), layer.indices.numpy()
            assert layer.num_src == len(src) and (indices.size == 0 or indices.max() < layer.num_src)
            for j, v in enumerate(src[:layer.num_dst].tolist()):
                have = set(graph.indices[graph.indptr[v]:graph.indptr[v + 1]].tolist())
                assert set(src[indices[indptr[j]:indptr[j + 1]]].tolist()) <= have
            src = src[:layer.num_dst]
