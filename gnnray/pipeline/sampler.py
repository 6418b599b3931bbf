"""Stage 4 (sampler actor): seed batches become sampled mini-batches.

Input: rows of the seeds dataset (row numbers of a ``SeedPlan``). Runs in a Ray
Data actor pool (``map_batches`` + ``ActorPoolStrategy``) whose actors each
attach the node-shared graph once, zero-copy. Output: one row per mini-batch,
a packed ``MiniBatch`` in an Arrow table (:func:`gnnray.pipeline.batch.to_arrow`).

Train workers call :func:`sample` too, for evaluation, so sampling is the same
code wherever it runs.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import torch

from gnnray.pipeline.batch import Layer, MiniBatch, id_dtype, to_arrow
from gnnray.data.graph import Graph
from gnnray.data.store import GraphHandle, to_dgl
from gnnray.pipeline.seeds import SeedPlan, SeedReader


class Sampler:
    """DGL neighbor sampling over a node-shared graph.

    Args:
        graph: The graph, usually read-only views on the object store.
        fanouts: Neighbors per layer, input layer first; ``-1`` takes all.
    """

    def __init__(self, graph: Graph, fanouts: tuple[int, ...]):
        import dgl

        self._graph = graph
        self._g = to_dgl(graph)
        self._sampler = dgl.dataloading.NeighborSampler(list(fanouts))
        self.id_dtype = id_dtype(graph.num_nodes)  # what to pack this graph's batches as

    def sample(self, seeds: np.ndarray, epoch: int = -1) -> MiniBatch:
        """Sample the blocks of ``seeds`` (global node ids)."""
        seeds_t = torch.from_numpy(np.ascontiguousarray(seeds, dtype=np.int64))
        input_nodes, output_nodes, blocks = self._sampler.sample_blocks(self._g, seeds_t)
        layers = []
        for block in blocks:
            # Local-id CSC is what the worker's message passing reads (in-edges),
            # and half the bytes of COO.
            indptr, indices, eids = block.adj_tensors("csc")
            layers.append(Layer(indptr, indices, block.num_src_nodes(), self._etypes(block, eids)))
        labels = torch.from_numpy(self._graph.label[output_nodes.numpy()])
        return MiniBatch(output_nodes, labels, input_nodes, layers, epoch=epoch)

    def _etypes(self, block, eids: torch.Tensor):
        """Each of ``block``'s CSC edges' relation, or ``None`` for an untyped graph.

        The graph's edge ids are its CSC positions (:func:`~gnnray.data.store.to_dgl`
        gives none), so a sampled edge's relation is ``etype`` at its parent id.
        """
        import dgl

        if self._graph.etype is None:
            return None
        parent = block.edata[dgl.EID]
        if eids.numel():
            parent = parent[eids]
        return torch.from_numpy(self._graph.etype[parent.numpy()])


class SamplerActor:
    """The callable class of the sampler actor pool (one instance per actor).

    Args:
        graph: Handle of the node-shared graph; the actor keeps only views.
        fanouts: Neighbors per layer, input layer first.
        plan: Which seeds each row number stands for.
        run: Run name that tags the actor's metrics (:class:`gnnray.metrics.SamplerMetrics`).
    """

    def __init__(self, graph: GraphHandle, fanouts: tuple[int, ...], plan: SeedPlan, run: str = "gnnray"):
        from gnnray.metrics import SamplerMetrics

        self._sampler = Sampler(graph.get(), fanouts)
        self._seeds = SeedReader(plan)
        self._metrics = SamplerMetrics(run)

    def __call__(self, rows: dict[str, np.ndarray]) -> pa.Table:
        # A whole block of rows per call, one mini-batch (one output row) per
        # input row: rows stay training steps, so they split evenly across
        # ranks, while Ray Data's per-call work (batch conversion, building
        # and storing the output block) is paid once per block, not per step.
        batches = []
        for row in rows["row"].tolist():
            start = time.perf_counter()
            epoch, seeds = self._seeds.seeds(row)
            mb = self._sampler.sample(seeds, epoch=epoch)
            batches.append(mb)
            self._metrics.batch(sum(int(layer.indices.shape[0]) for layer in mb.layers), time.perf_counter() - start)
        return to_arrow(batches, self._sampler.id_dtype)
