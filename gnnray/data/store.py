"""Stage 2 (driver publishes, every process reads): the graph, held once per node in Ray's object store.

Input: a validated :class:`Graph` (driver). Output: a :class:`GraphHandle`, a
small picklable reference that every sampler actor and train worker turns back
into read-only numpy arrays with :meth:`GraphHandle.get`. The arrays are views on
the node's object store (zero-copy): N processes on a node share one copy.

Numpy arrays are used, not torch tensors, because Ray copies torch tensors out
of the store while numpy arrays arrive as read-only views.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any, Optional

import numpy as np

from gnnray.data.graph import Graph


@dataclass(frozen=True)
class GraphHandle:
    """A picklable reference to a :class:`Graph` in the object store.

    The ObjectRef sits inside a list so that Ray does not resolve it when the
    handle is passed as an argument; it is fetched (zero-copy) only by
    :meth:`get`. The driver that called :func:`publish` owns the object and must
    outlive every user of the handle.
    """

    _ref: list
    num_nodes: int
    num_edges: int
    feat_dim: int
    num_classes: int
    nbytes: int
    name: str
    types: Optional[dict] = None  # a typed graph's type names (Graph.types); its type arrays are in the store
    # --feature-shards K > 1: the sharded table (gnnray.data.shards.ShardedFeatures); the graph's own ``feat``
    # is then a (num_nodes, 0) placeholder and ``feat_dim`` is the table's.
    features: Optional[Any] = None

    def get(self) -> Graph:
        """Return the graph as write-protected numpy views on this node's object store.

        A write through any view (numpy, ``torch.from_numpy``, ctypes) kills
        the writing process with SIGSEGV instead of changing the copy every
        process on the node reads (see :class:`_ReadOnlyPages`).
        """
        import ray

        arrays: dict[str, Any] = ray.get(self._ref[0])
        return Graph(**{k: write_protected(v) for k, v in arrays.items()}, num_classes=self.num_classes,
                     name=self.name, **(self.types or {}))


def publish(graph: Graph) -> GraphHandle:
    """Put ``graph`` into the object store once (call on the driver)."""
    import ray

    arrays = {f.name: getattr(graph, f.name) for f in fields(graph) if isinstance(getattr(graph, f.name), np.ndarray)}
    ref = ray.put(arrays)
    return GraphHandle([ref], graph.num_nodes, graph.num_edges, graph.feat_dim, graph.num_classes, graph.nbytes,
                       graph.name, graph.types if graph.typed else None)


class _ReadOnlyPages:
    """A read-only second mapping of the shared pages under one store array; the base of the view on it.

    Ray hands out numpy arrays over its writable mapping of the node's store,
    flagged read-only; ``torch.from_numpy`` ignores the flag, so a write would
    change the copy every process on the node reads. ``mremap(addr, 0, size)``
    maps the same shared pages again (Linux, shared mappings only) and
    ``mprotect`` makes that alias read-only at the OS level. The alias covers
    whole pages, the array's edge pages included (the bytes of neighbouring
    objects are only mapped read-only there), and Ray's own mapping, which it
    writes new objects through, is left alone. The alias is unmapped when the
    last view on it is gone; until then ``source``, the array Ray returned,
    keeps the object pinned in the store.
    """

    def __init__(self, source: np.ndarray):
        import ctypes
        import mmap

        libc = _libc()
        self._addr = None
        addr = source.ctypes.data
        start = addr - addr % mmap.PAGESIZE
        self._size = -(-(addr + source.nbytes - start) // mmap.PAGESIZE) * mmap.PAGESIZE
        alias = libc.mremap(start, 0, self._size, 1)  # MREMAP_MAYMOVE
        if alias is None or alias == ctypes.c_void_p(-1).value:  # MAP_FAILED: not a shared mapping
            raise OSError(ctypes.get_errno(), "mremap")
        self._addr = alias
        if libc.mprotect(alias, self._size, mmap.PROT_READ) != 0:
            raise OSError(ctypes.get_errno(), "mprotect")
        self._source = source
        self.__array_interface__ = {**source.__array_interface__, "data": (alias + addr - start, True)}

    def __del__(self):
        if self._addr is not None:
            _libc().munmap(self._addr, self._size)


@functools.lru_cache(maxsize=None)
def _libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mremap.restype = ctypes.c_void_p
    libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def write_protected(a: np.ndarray) -> np.ndarray:
    """``a`` as a view on a read-only alias of its pages, or ``a`` itself where that cannot be made.

    Small objects (under 100 KiB) are inlined by Ray into each process's own
    memory, not shared, and other platforms lack ``mremap``: those arrays stay
    numpy-read-only views, and a write there changes only the writer's copy.
    """
    if a.nbytes == 0:
        return a
    try:
        return np.asarray(_ReadOnlyPages(a))
    except (OSError, AttributeError):  # AttributeError: no mremap in this libc
        return a


def to_graphbolt(graph: Graph):
    """Return GraphBolt's ``FusedCSCSamplingGraph`` over ``graph``'s CSC arrays, without copying them.

    This is what :class:`~gnnray.pipeline.sampler.Sampler` samples from. It
    takes each array in its own dtype: int32 ``indices`` beside an int64
    ``indptr`` past 2**31 edges (:func:`~gnnray.data.csc.structure_dtypes`),
    which DGL's ``dgl.graph`` (:func:`to_dgl`) refuses. Seeds passed to it must
    have ``indices``' dtype; the ids it samples come in it. Sampling only reads
    the arrays, so write-protected store views (:meth:`GraphHandle.get`) serve.

    A typed graph's ``etype`` is GraphBolt's ``type_per_edge`` (int8 as it is),
    so that it samples each relation of a node apart when given one fanout per
    relation, and returns the picked edges' relations. GraphBolt finds a node's
    relations as runs of equal codes: the typed CSC keeps each node's in-edges
    ordered by relation (:func:`~gnnray.data.csc.sort_by_relation`). Node types
    are not needed to sample homogeneous ids.
    """
    import dgl.graphbolt as gb

    indptr, indices = readonly_tensor(graph.indptr), readonly_tensor(graph.indices)
    if graph.etype is None:
        return gb.fused_csc_sampling_graph(indptr, indices)
    # GraphBolt wants the relations' names ("src:relation:dst", DGL's form): its count of fanouts per layer.
    relations = {":".join(t): j for j, t in enumerate(graph.edge_types)}
    return gb.fused_csc_sampling_graph(indptr, indices, type_per_edge=readonly_tensor(graph.etype),
                                       edge_type_to_id=relations)


def to_dgl(graph: Graph):
    """Return a DGL graph over ``graph``'s CSC arrays without copying them (both arrays of one dtype).

    gnnray samples with GraphBolt (:func:`to_graphbolt`); this DGL graph is
    for DGL's own loaders (the benchmark's baseline) and checks.

    The graph is restricted to the CSC format, so any DGL call that would
    materialise COO or CSR for the whole graph (a private copy per process)
    raises instead of silently copying. Its ``idtype`` is the arrays' dtype
    (both int32, or both int64: DGL rejects a mixed pair), so seeds passed to
    it must have that dtype, and the ids and edge ids it samples come in it.
    On an int32 graph, DGL 2.1's ``NeighborSampler`` goes wrong after its
    first batch on its fused path (the default with more than one DGL
    thread): pass it ``fused=False``.
    """
    import dgl
    import torch

    if graph.indptr.dtype != graph.indices.dtype:
        raise ValueError(f"indptr ({graph.indptr.dtype}) and indices ({graph.indices.dtype}) must have the same "
                         f"dtype for DGL's graph; sample such a graph with GraphBolt (to_graphbolt)")
    indptr, indices = readonly_tensor(graph.indptr), readonly_tensor(graph.indices)
    # No edge ids (an empty tensor of the idtype): edge ids are CSC positions.
    g = dgl.graph(("csc", (indptr, indices, torch.empty(0, dtype=indices.dtype))), num_nodes=graph.num_nodes)
    return g.formats("csc")


def readonly_tensor(a: np.ndarray):
    """``torch.from_numpy(a)`` for a read-only array, without torch's warning about it.

    The tensor must only be read: the pages under it are the object store's
    (or a read-only alias of them), which is why they are read-only.
    """
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a)
