"""Tests of gnnray.graph_store: the numpy Graph, CSC building, the object-store handle, the DGL and GraphBolt views.

The DGL views (gnnray.sampler.graphbolt) are tested where DGL is installed (marked ``dgl``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
import torch

from conftest import mapping_perms, tiny_graph
from gnnray.data.csc import csc_from_edges
from gnnray.data.graph import Graph
from gnnray.sampler.graphbolt import to_dgl  # imports DGL when called
from gnnray.store.handle import publish

ARRAYS = ("indptr", "indices", "feat", "label", "train_idx", "valid_idx", "test_idx")


def brute_force_csc(src, dst, num_nodes):
    indptr = [0]
    indices = []
    for v in range(num_nodes):
        indices += [int(s) for s, d in zip(src, dst) if d == v]  # input order kept
        indptr.append(len(indices))
    return np.array(indptr, dtype=np.int64), np.array(indices, dtype=np.int64)


@pytest.mark.parametrize("num_nodes, num_edges, seed", [(1, 0, 0), (5, 0, 0), (7, 30, 1), (40, 200, 2), (3, 50, 3)])
def test_csc_from_edges_matches_brute_force(num_nodes, num_edges, seed):
    rng = np.random.default_rng(seed)
    src, dst = rng.integers(0, num_nodes, num_edges), rng.integers(0, num_nodes, num_edges)
    indptr, indices = csc_from_edges(src, dst, num_nodes)
    want_indptr, want_indices = brute_force_csc(src, dst, num_nodes)
    assert indptr.dtype == np.int64 and indices.dtype == np.int64
    assert indptr.tolist() == want_indptr.tolist()
    assert indices.tolist() == want_indices.tolist()
    assert indices.flags.c_contiguous


def test_csc_from_edges_isolated_trailing_nodes():
    indptr, indices = csc_from_edges(np.array([0, 1]), np.array([1, 0]), 5)
    assert indptr.tolist() == [0, 1, 2, 2, 2, 2]
    assert indices.tolist() == [1, 0]


def test_graph_properties(graph):
    assert graph.num_nodes == 40
    assert graph.num_edges == 200
    assert graph.feat_dim == 4
    assert graph.nbytes == sum(getattr(graph, a).nbytes for a in ARRAYS)
    assert graph.split("train") is graph.train_idx
    assert graph.split("valid") is graph.valid_idx
    assert graph.split("test") is graph.test_idx
    with pytest.raises(KeyError):
        graph.split("other")
    with pytest.raises(dataclasses.FrozenInstanceError):
        graph.name = "x"


def test_publish_get_returns_equal_read_only_arrays(ray_cluster, graph):
    handle = publish(graph)
    assert (handle.num_nodes, handle.num_edges, handle.feat_dim, handle.num_classes, handle.nbytes, handle.name) == \
        (graph.num_nodes, graph.num_edges, graph.feat_dim, graph.num_classes, graph.nbytes, graph.name)
    got = handle.get()
    assert isinstance(got, Graph)
    assert got.num_classes == graph.num_classes
    assert got.name == graph.name
    for name in ARRAYS:
        a, b = getattr(graph, name), getattr(got, name)
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(a, b, err_msg=name)
        assert not b.flags.writeable, name
    with pytest.raises(ValueError):
        got.feat[0, 0] = 1.0
    with pytest.raises(ValueError):
        got.indices[:] = 0
    # The original is untouched and still writable (publish did not freeze the caller's arrays).
    assert graph.feat.flags.writeable


def test_handle_pickles_small_and_works_in_a_task(ray_cluster, graph):
    import ray

    handle = publish(graph)
    data = ray.cloudpickle.dumps(handle)
    assert len(data) < 2000
    assert len(data) < graph.nbytes  # the graph itself does not travel
    again = ray.cloudpickle.loads(data)
    np.testing.assert_array_equal(again.get().indices, graph.indices)

    @ray.remote(num_cpus=0)
    def remote_sum(h):
        g = h.get()
        return int(g.indices.sum()), bool(g.feat.flags.writeable)

    total, writeable = ray.get(remote_sum.remote(handle))
    assert total == int(graph.indices.sum())
    assert not writeable


@pytest.mark.dgl
def test_to_dgl_in_edges(graph):
    g = to_dgl(graph)
    assert g.num_nodes() == graph.num_nodes
    assert g.num_edges() == graph.num_edges
    for v in range(graph.num_nodes):
        src, dst = g.in_edges(v)
        assert (dst == v).all()
        want = Counter(graph.indices[graph.indptr[v]:graph.indptr[v + 1]].tolist())
        assert Counter(src.tolist()) == want, v
    assert g.in_degrees().tolist() == np.diff(graph.indptr).tolist()


@pytest.mark.dgl
def test_to_dgl_is_csc_only(graph):
    import dgl

    g = to_dgl(graph)
    formats = g.formats()
    assert formats["created"] == ["csc"]
    assert formats["not created"] == []
    with pytest.raises(dgl.DGLError):
        g.edges()  # needs COO: must raise, not build a private copy
    assert g.formats()["created"] == ["csc"]


@pytest.mark.dgl
def test_to_dgl_does_not_copy(graph):
    g = to_dgl(graph)
    indptr, indices, _ = g.adj_tensors("csc")
    assert indptr.data_ptr() == graph.indptr.ctypes.data
    assert indices.data_ptr() == graph.indices.ctypes.data


@pytest.mark.dgl
def test_to_dgl_over_read_only_store_arrays_does_not_copy(ray_cluster, graph):
    import warnings

    got = publish(graph).get()
    with warnings.catch_warnings():
        # torch's read-only warning is silenced inside to_dgl
        warnings.filterwarnings("error", message=".*not writable.*")
        g = to_dgl(got)
    indptr, indices, _ = g.adj_tensors("csc")
    assert indptr.data_ptr() == got.indptr.ctypes.data
    assert indices.data_ptr() == got.indices.ctypes.data
    assert g.in_degrees().tolist() == np.diff(graph.indptr).tolist()


@pytest.fixture
def torch_threads():
    """Restores torch's thread count, which GraphBoltSampler sets for the whole process."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("backend", ["native", pytest.param("graphbolt", marks=pytest.mark.dgl)])
@pytest.mark.parametrize("structure", ["int32", "mixed"])
def test_sampler_reads_the_write_protected_store_arrays_in_place(ray_cluster, torch_threads, monkeypatch, structure,
                                                                 backend):
    """The sampler (gnnray's, or GraphBolt's) samples from the store's read-only pages themselves, int64 ``indptr``
    beside int32 ``indices`` too."""
    from gnnray.data.csc import compact_csc
    from gnnray.sampler.sampler import make_sampler

    graph = tiny_graph(num_nodes=20_000, num_edges=200_000, seed=5)  # past Ray's 100 KiB inlining: in shared memory
    indptr, indices = compact_csc(graph.indptr, graph.indices)
    graph = dataclasses.replace(graph, indptr=indptr.astype(np.int64) if structure == "mixed" else indptr,
                                indices=indices)
    got = publish(graph).get()
    assert (got.indptr.dtype, got.indices.dtype) == (graph.indptr.dtype, np.int32)
    assert not got.indptr.flags.writeable and not got.indices.flags.writeable

    sampler = make_sampler(got, (5, 5), backend)
    reads = []  # per layer drawn, the (address, dtype) of the indptr and indices it was drawn from
    if backend == "graphbolt":  # GraphBolt's graph, made once
        reads.append([(t.data_ptr(), t.numpy().dtype) for t in (sampler._g.csc_indptr, sampler._g.indices)])
    else:  # the arrays gnnray's kernels are given, layer by layer
        from gnnray.sampler import pick

        draw = pick.sample_layer

        def seen(indptr, indices, *rest):
            reads.append([(a.ctypes.data, a.dtype) for a in (indptr, indices)])
            return draw(indptr, indices, *rest)

        monkeypatch.setattr(pick, "sample_layer", seen)
    seeds = graph.train_idx[:256]
    mb = sampler.sample(seeds)
    assert len(reads) == (1 if backend == "graphbolt" else 2)
    for read in reads:
        for (address, dtype), array in zip(read, (got.indptr, got.indices)):
            assert address == array.ctypes.data and dtype == array.dtype  # no copy, no conversion
            assert mapping_perms(address) == "r--s"  # the read-only alias of the store's pages
    assert mb.seeds.tolist() == seeds.tolist() and mb.input_nodes.dtype == torch.int32
    src = mb.input_nodes.long()
    for layer in mb.layers:  # every sampled edge is one of the graph's
        for j, v in enumerate(src[:layer.num_dst].tolist()):
            picked = Counter(src[layer.indices[layer.indptr[j]:layer.indptr[j + 1]].long()].tolist())
            have = Counter(graph.indices[graph.indptr[v]:graph.indptr[v + 1]].tolist())
            assert not picked - have
        src = src[:layer.num_dst]
