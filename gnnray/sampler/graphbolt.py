"""DGL's side of gnnray (the ``dgl`` extra): GraphBolt's sampler behind ``--sampler graphbolt``, and DGL graphs
over the node-shared arrays for the benchmark's DGL loop and the tests' oracles.

Why optional: DGL's last Linux wheel on PyPI (2.1.0) is built for torch
2.0-2.2.1, numpy < 2 and Python <= 3.12, and DGL has had no release since
2.4.0 (2024). ``import dgl`` fails beside a current torch (GraphBolt's
library exists only for torch <= 2.2.1), so DGL and the default install never
share a process. gnnray's own sampler (:class:`~gnnray.sampler.sampler.Sampler`)
draws with GraphBolt's semantics; the tests compare the two where DGL is
installed (``.ci/run``'s second environment).

Only the sampler actors import this module (and only with ``--sampler
graphbolt``); train workers never do.
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import torch  # the named exception to the torch rule: only --sampler graphbolt's actors load this module

from gnnray.batch import Layer, MiniBatch, id_dtype
from gnnray.config import Fanouts
from gnnray.data.graph import Graph
from gnnray.data.typed import fanout_table
from gnnray.errors import ConfigError
from gnnray.stack import DGL_INSTALL
from gnnray.store.handle import readonly_tensor



def import_dgl():
    """``import dgl``, or :class:`ConfigError` saying why it cannot load here and what installs it."""
    import os

    os.environ.setdefault("DGLBACKEND", "pytorch")
    try:
        import dgl
        import dgl.graphbolt  # noqa: F401  (the part that needs torch <= 2.2.1)
    except Exception as e:  # ImportError, or DGL's FileNotFoundError for a missing GraphBolt library
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"--sampler graphbolt needs DGL, which cannot be loaded beside torch {torch.__version__} "
                          f"({why}); install the dgl extra in its own environment: {DGL_INSTALL}, or use the default "
                          f"--sampler native") from None
    return dgl


class GraphBoltSampler:
    """Neighbor sampling with GraphBolt over a node-shared graph: :class:`~gnnray.sampler.sampler.Sampler`'s
    interface, DGL's draws.

    GraphBolt's ``FusedCSCSamplingGraph`` (:func:`to_graphbolt`) reads the
    store's arrays in place, each in its own dtype. It samples with torch's
    threads; its draws come from torch's generator, not from the run's seed.
    The picked sources are numbered with pandas' hash-table factorize (a
    fraction of GraphBolt's own ``unique_and_compact``).

    Args:
        graph: The graph, usually read-only views on the object store.
        fanouts: Neighbors per layer, input layer first.
        threads: torch's and DGL's threads.
    """

    def __init__(self, graph: Graph, fanouts: Union[Fanouts, Sequence[int]], threads: int = 1):
        dgl = import_dgl()
        torch.set_num_threads(max(1, threads))
        dgl.utils.set_num_threads(max(1, threads))
        self.threads = max(1, threads)
        self._graph = graph
        self._g = to_graphbolt(graph)
        self._fanouts = [torch.tensor(f) for f in reversed(fanout_table(fanouts, graph))]  # output layer first
        self.id_dtype = id_dtype(graph.num_nodes)
        # GraphBolt takes seeds only in the dtype of indices (int32 below 2**31 nodes); sampled ids come in it.
        self._seed_dtype = graph.indices.dtype

    def sample(self, seeds: np.ndarray, epoch: int = -1, batch=None):
        """The blocks of ``seeds`` as :meth:`Sampler.sample <gnnray.sampler.sampler.Sampler.sample>` gives them
        (``batch`` is unused: GraphBolt draws from torch's generator)."""
        import pandas as pd

        output_nodes = nodes = torch.from_numpy(np.ascontiguousarray(seeds, dtype=self._seed_dtype))
        layers = []
        for fanout in self._fanouts:
            # The private call returns GraphBolt's C++ subgraph: the picked edges' relations come with it, where
            # the public sample_neighbors splits them into a dict of subgraphs per relation.
            sub = self._g._sample_neighbors(nodes, fanout, replace=False)
            codes, src = pd.factorize(np.concatenate([nodes.numpy(), sub.indices.numpy()]))
            local = torch.from_numpy(codes[nodes.shape[0]:].astype(src.dtype))
            layers.append(Layer(sub.indptr.to(nodes.dtype), local, int(src.shape[0]), sub.type_per_edge))
            nodes = torch.from_numpy(src)
        layers.reverse()
        labels = torch.from_numpy(self._graph.label[output_nodes.numpy()])
        return MiniBatch(output_nodes, labels, nodes, layers, epoch=epoch)

    draw = sample  # what a sampler actor calls: GraphBolt's batches are tensors already (DGL imports torch)


def to_graphbolt(graph: Graph):
    """Return GraphBolt's ``FusedCSCSamplingGraph`` over ``graph``'s CSC arrays, without copying them.

    This is what :class:`GraphBoltSampler` samples from. It takes each array
    in its own dtype: int32 ``indices`` beside an int64 ``indptr`` past 2**31
    edges (:func:`~gnnray.data.csc.structure_dtypes`), which DGL's
    ``dgl.graph`` (:func:`to_dgl`) refuses. Seeds passed to it must
    have ``indices``' dtype; the ids it samples come in it. Sampling only reads
    the arrays, so write-protected store views (``GraphHandle.get``) serve.

    A typed graph's ``etype`` is GraphBolt's ``type_per_edge`` (int8 as it is),
    so that it samples each relation of a node apart when given one fanout per
    relation, and returns the picked edges' relations. GraphBolt finds a node's
    relations as runs of equal codes: the typed CSC keeps each node's in-edges
    ordered by relation (:func:`~gnnray.data.csc.sort_by_relation`). Node types
    are not needed to sample homogeneous ids.
    """
    gb = import_dgl().graphbolt

    indptr, indices = readonly_tensor(graph.indptr), readonly_tensor(graph.indices)
    if graph.etype is None:
        return gb.fused_csc_sampling_graph(indptr, indices)
    # GraphBolt wants the relations' names ("src:relation:dst", DGL's form): its count of fanouts per layer.
    relations = {":".join(t): j for j, t in enumerate(graph.edge_types)}
    return gb.fused_csc_sampling_graph(indptr, indices, type_per_edge=readonly_tensor(graph.etype),
                                       edge_type_to_id=relations)


def to_dgl(graph: Graph):
    """Return a DGL graph over ``graph``'s CSC arrays without copying them (both arrays of one dtype).

    This DGL graph is for DGL's own loaders (the benchmark's baseline) and
    the tests' oracles.

    The graph is restricted to the CSC format, so any DGL call that would
    materialise COO or CSR for the whole graph (a private copy per process)
    raises instead of silently copying. Its ``idtype`` is the arrays' dtype
    (both int32, or both int64: DGL rejects a mixed pair), so seeds passed to
    it must have that dtype, and the ids and edge ids it samples come in it.
    On an int32 graph, DGL 2.1's ``NeighborSampler`` goes wrong after its
    first batch on its fused path (the default with more than one DGL
    thread): pass it ``fused=False``.
    """
    dgl = import_dgl()
    if graph.indptr.dtype != graph.indices.dtype:
        raise ValueError(f"indptr ({graph.indptr.dtype}) and indices ({graph.indices.dtype}) must have the same "
                         f"dtype for DGL's graph; sample such a graph with GraphBolt (to_graphbolt)")
    indptr, indices = readonly_tensor(graph.indptr), readonly_tensor(graph.indices)
    # No edge ids (an empty tensor of the idtype): edge ids are CSC positions.
    g = dgl.graph(("csc", (indptr, indices, torch.empty(0, dtype=indices.dtype))), num_nodes=graph.num_nodes)
    return g.formats("csc")
