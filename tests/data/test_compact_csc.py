"""The graph structure as int32 (compact_csc): the same graph, half the bytes, sampled by DGL without a copy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gnnray.data.csc import build_csc, compact_csc, structure_dtype, typed_csc
from gnnray.data.graph import Graph
from gnnray.data.store import to_dgl
from gnnray.data.synthetic import synthetic_hetero_parts, synthetic_parts
from gnnray.data.validate import validate
from gnnray.errors import DatasetError
from gnnray.pipeline.batch import MiniBatch
from gnnray.pipeline.sampler import Sampler


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
    want = build_csc(p.src.copy(), p.dst.copy(), p.num_nodes, reverse, self_loops)  # the int64 builder
    assert want[0].dtype == want[1].dtype == np.int64
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


def test_int64_structure_still_validates_and_a_mixed_pair_does_not():
    graph = parts(typed=False).build()
    validate(wide(graph), "int64")
    mixed = dataclasses.replace(graph, indptr=graph.indptr.astype(np.int64))
    with pytest.raises(DatasetError, match="indptr and indices must have the same dtype"):
        validate(mixed, "mixed")
    with pytest.raises(ValueError, match="same dtype"):
        to_dgl(mixed)


# ----------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("num_nodes, num_edges, dtype", [
    (0, 0, np.int32),
    (1000, 2**31 - 1, np.int32),  # the largest offset, 2**31 - 1, fits
    (1000, 2**31, np.int64),
    (1000, 2**33, np.int64),
    (2**31 - 1, 10, np.int32),  # the largest node id, 2**31 - 2, fits
    (2**31, 10, np.int64),
])
def test_structure_dtype_is_int32_below_2_31_edges_and_nodes(num_nodes, num_edges, dtype):
    assert structure_dtype(num_nodes, num_edges) == np.dtype(dtype)


class _Counted:
    """Stands for an array of ``size`` elements without them: compact_csc reads only its shape and calls astype."""

    def __init__(self, size: int, dtype=np.int64):
        self.shape, self.dtype, self.asked = (size,), np.dtype(dtype), []

    def astype(self, dtype, copy=True):
        self.asked.append((np.dtype(dtype), copy))
        return self if np.dtype(dtype) == self.dtype else _Counted(self.shape[0], dtype)


@pytest.mark.parametrize("num_nodes, num_edges, dtype", [
    (100, 2**31 - 1, np.int32), (100, 2**31, np.int64), (2**31, 100, np.int64)])
def test_compact_csc_follows_the_rule_from_the_counts(num_nodes, num_edges, dtype):
    indptr, indices = _Counted(num_nodes + 1), _Counted(num_edges)
    out_ptr, out_idx = compact_csc(indptr, indices)
    assert out_ptr.dtype == out_idx.dtype == np.dtype(dtype)
    if dtype == np.int64:  # kept as they are: no copy
        assert out_ptr is indptr and out_idx is indices
        assert indices.asked == [(np.dtype(np.int64), False)]


def test_compact_csc_converts_the_values_and_keeps_int32_input():
    indptr = np.array([0, 2, 2, 5], dtype=np.int64)
    indices = np.array([2, 0, 1, 1, 2], dtype=np.int64)
    a, b = compact_csc(indptr, indices)
    assert a.dtype == b.dtype == np.int32
    assert a.tolist() == indptr.tolist() and b.tolist() == indices.tolist()
    assert not np.shares_memory(a, indptr) and not np.shares_memory(b, indices)  # the int64 ones can be freed
    c, d = compact_csc(a, b)
    assert c is a and d is b


# ----------------------------------------------------------------------------- DGL


@pytest.fixture
def one_dgl_thread():
    """DGL samples in parallel with one random stream per thread: one thread makes a seed reproduce a batch."""
    from dgl.utils import get_num_threads, set_num_threads

    before = get_num_threads()
    set_num_threads(1)
    yield
    set_num_threads(before)


def global_edges(mb: MiniBatch) -> list:
    """Each block's edges as sorted (src, dst, relation) global ids: the same whatever order DGL numbered nodes in."""
    src = mb.input_nodes.long()
    out = []
    for layer in mb.layers:
        dst = torch.repeat_interleave(torch.arange(layer.num_dst), layer.indptr.long().diff())
        rel = [None] * layer.indices.numel() if layer.etype is None else layer.etype.tolist()
        out.append(sorted(zip(src[layer.indices.long()].tolist(), src[dst].tolist(), rel)))
        src = src[:layer.num_dst]
    return out


def sample(graph: Graph, fanouts, seeds: np.ndarray, seed: int) -> MiniBatch:
    import dgl

    sampler = Sampler(graph, fanouts)
    dgl.seed(seed)
    torch.manual_seed(seed)
    return sampler.sample(seeds)


@pytest.mark.parametrize("typed", [False, True])
def test_int32_graph_samples_the_int64_graphs_blocks(one_dgl_thread, typed):
    graph = parts(typed).build(True)
    assert graph.indices.dtype == np.int32
    assert to_dgl(graph).idtype == torch.int32 and to_dgl(wide(graph)).idtype == torch.int64
    seeds = graph.train_idx[:64]  # int64: the sampler converts them to the graph's idtype
    fanouts = (4, 3, 2)
    compact, reference = sample(graph, fanouts, seeds, 7), sample(wide(graph), fanouts, seeds, 7)
    assert compact.input_nodes.dtype == compact.seeds.dtype == compact.layers[0].indices.dtype == torch.int32
    assert reference.input_nodes.dtype == torch.int64
    assert compact.labels.dtype == torch.int64 and compact.labels.tolist() == graph.label[seeds].tolist()
    assert compact.seeds.tolist() == reference.seeds.tolist() == seeds.tolist()
    assert sorted(compact.input_nodes.tolist()) == sorted(reference.input_nodes.tolist())
    edges = global_edges(compact)
    assert edges == global_edges(reference)
    # Sampling is random here (another seed, other edges), so the equality above says something.
    assert global_edges(sample(graph, fanouts, seeds, 8)) != edges
    if typed:
        assert all(r is not None for e in edges for _, _, r in e)

    # A packed batch round-trips with int32 ids.
    packed = compact.pack(Sampler(graph, fanouts).id_dtype)
    assert packed.dtype == np.int32
    back = MiniBatch.unpack(torch.from_numpy(packed))
    assert global_edges(back) == edges


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


@pytest.fixture
def two_dgl_threads():
    """More than one DGL thread: NeighborSampler's fused CPU path, the one with a node-sized scratch array."""
    from dgl.utils import get_num_threads, set_num_threads

    before = get_num_threads()
    set_num_threads(2)
    yield
    set_num_threads(before)


@pytest.mark.parametrize("structure", ["int32", "int64"])
def test_fused_sampling_stays_right_batch_after_batch(two_dgl_threads, structure):
    """DGL 2.1's fused path allocates its scratch as int64 and uses it as the idtype: the Sampler hands it one of the idtype.

    Without that, an int32 graph's batches after the first have sources past
    the block's sources and edges the graph lacks.
    """
    graph = parts(typed=False).build(True)
    graph = graph if structure == "int32" else wide(graph)
    sampler = Sampler(graph, (3, 2))
    rng = np.random.default_rng(0)
    for _ in range(20):
        seeds = rng.choice(graph.num_nodes, 40, replace=False)
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
    scratch = [m for ms in sampler._sampler.mapping.values() for m in ms]
    assert scratch and all(m.dtype == torch.from_numpy(graph.indices[:0]).dtype for m in scratch)
