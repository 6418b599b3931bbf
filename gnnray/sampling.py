"""Stage 3 (sampler actor): seed batches become sampled mini-batches.

Input: rows of the seeds dataset (``epoch``, padded ``seeds``). Runs in a Ray
Data actor pool (``map_batches`` + ``ActorPoolStrategy``) whose actors each
attach the node-shared graph once, zero-copy. Output: one row per mini-batch,
``{"packed": MiniBatch.pack()[None]}``.

Train workers call :func:`sample` too, for evaluation, so sampling is the same
code wherever it runs.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from gnnray.batch import Layer, MiniBatch
from gnnray.graph_store import Graph, GraphHandle, to_dgl


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

    def sample(self, seeds: np.ndarray, epoch: int = -1) -> MiniBatch:
        """Sample the blocks of ``seeds`` (global node ids)."""
        seeds_t = torch.from_numpy(np.ascontiguousarray(seeds, dtype=np.int64))
        input_nodes, output_nodes, blocks = self._sampler.sample_blocks(self._g, seeds_t)
        layers = []
        for block in blocks:
            # Local-id CSC is what the worker's message passing reads (in-edges),
            # and half the bytes of COO.
            indptr, indices, _ = block.adj_tensors("csc")
            layers.append(Layer(indptr, indices, block.num_src_nodes()))
        labels = torch.from_numpy(self._graph.label[output_nodes.numpy()])
        return MiniBatch(output_nodes, labels, input_nodes, layers, epoch=epoch)


class SamplerActor:
    """The callable class of the sampler actor pool (one instance per actor).

    Args:
        graph: Handle of the node-shared graph; the actor keeps only views.
        fanouts: Neighbors per layer, input layer first.
        run: Run name that tags the actor's metrics (:class:`gnnray.metrics.SamplerMetrics`).
    """

    def __init__(self, graph: GraphHandle, fanouts: tuple[int, ...], run: str = "gnnray"):
        from gnnray.metrics import SamplerMetrics

        self._sampler = Sampler(graph.get(), fanouts)
        self._metrics = SamplerMetrics(run)

    def __call__(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # batch_size=1: one seed batch in, one mini-batch out, so each output
        # row is one training step and rows split evenly across ranks.
        start = time.perf_counter()
        seeds = rows["seeds"][0]
        mb = self._sampler.sample(seeds[seeds >= 0], epoch=int(rows["epoch"][0]))
        packed = mb.pack()[None]
        self._metrics.batch(sum(int(layer.indices.shape[0]) for layer in mb.layers), time.perf_counter() - start)
        return {"packed": packed}
