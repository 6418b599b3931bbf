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
import sys
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
    # --feature-shards K > 1: the sharded table (gnnray.store.shards.ShardedFeatures); the graph's own ``feat``
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
        # Not while the interpreter shuts down: the process's exit unmaps everything at once, and Python code run
        # then is where Ray's SIGTERM handler, raising SystemExit, prints a traceback.
        if self._addr is not None and not sys.is_finalizing():
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
