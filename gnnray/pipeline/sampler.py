"""Stage 4 (sampler actor): seed batches become sampled mini-batches.

Input: rows of the seeds dataset (row numbers of a ``SeedPlan``). Runs in a Ray
Data actor pool (``map_batches`` + ``ActorPoolStrategy``) whose actors each
attach the node-shared graph once, zero-copy. Output: one row per mini-batch,
a packed ``MiniBatch`` in an Arrow table (:func:`gnnray.pipeline.batch.to_arrow`).

Train workers call :func:`sample` too, for evaluation, so sampling is the same
code wherever it runs.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import numpy as np
import pyarrow as pa
import ray
import torch

from gnnray.cpus import CpuPolicy
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
        # DGL takes seeds only in the graph's idtype: the dtype of its CSC, int32 below 2**31 edges.
        self._seed_dtype = graph.indices.dtype

    def sample(self, seeds: np.ndarray, epoch: int = -1) -> MiniBatch:
        """Sample the blocks of ``seeds`` (global node ids, any integer dtype).

        The batch's ids and blocks come in the graph's ``indices`` dtype
        (int32 for a compact graph), its labels as int64.
        """
        seeds_t = torch.from_numpy(np.ascontiguousarray(seeds, dtype=self._seed_dtype))
        fused = self._g.idtype != torch.int64 and self._fused_scratch()
        input_nodes, output_nodes, blocks = self._sampler.sample_blocks(self._g, seeds_t)
        if fused and any(m.dtype != self._g.idtype for ms in self._sampler.mapping.values() for m in ms):
            # DGL made its own (int64) scratch: this batch is right (a fresh one), the next ones would not be.
            self._sampler.fused, self._sampler.mapping = False, {}
        layers = []
        for block in blocks:
            # Local-id CSC is what the worker's message passing reads (in-edges),
            # and half the bytes of COO.
            indptr, indices, eids = block.adj_tensors("csc")
            layers.append(Layer(indptr, indices, block.num_src_nodes(), self._etypes(block, eids)))
        labels = torch.from_numpy(self._graph.label[output_nodes.numpy()])
        return MiniBatch(output_nodes, labels, input_nodes, layers, epoch=epoch)

    def _fused_scratch(self) -> bool:
        """Give DGL's fused sampling a scratch array of the graph's idtype; whether that path will run.

        DGL 2.1's fused CPU sampling (``NeighborSampler``'s path while DGL
        runs more than one OMP thread) keeps a node-sized node -> local id
        scratch array per process, allocated as int64 (``torch.LongTensor``)
        but read and written as the graph's idtype. On an int32 graph, its
        reset after each batch then misses most entries and later batches
        come out wrong (source ids past the block's sources, edges the graph
        lacks). An int32 array of ``-1`` under the key DGL looks up is what
        its kernel expects (half the memory, too). Allocated only when the
        fused path runs: single-threaded (sampler actors of one CPU) DGL
        samples without it.
        """
        import dgl

        s = self._sampler
        if not (s.fused and dgl.utils.get_num_threads() > 1):
            return False
        if s.g is not self._g:  # NeighborSampler drops its scratch when the graph changes
            s.g, s.mapping = self._g, {}
        key = f"__mapping{os.getpid()}"  # the key dgl.sampling.neighbor._sample_neighbors uses
        if key not in s.mapping:
            s.mapping[key] = [torch.full((self._g.num_nodes(),), -1, dtype=self._g.idtype)]
        return True

    def _etypes(self, block, eids: torch.Tensor):
        """Each of ``block``'s CSC edges' relation, or ``None`` for an untyped graph.

        The graph's edge ids are its CSC positions (:func:`~gnnray.data.store.to_dgl`
        gives none), so a sampled edge's relation is ``etype`` at its parent id.
        """
        import dgl

        if self._graph.etype is None:
            return None
        parent = block.edata[dgl.EID]  # in the graph's idtype, int32 or int64
        if eids.numel():
            parent = parent[eids.long()]
        return torch.from_numpy(self._graph.etype[parent.numpy()])


class SamplerActor:
    """The callable class of the sampler actor pool (one instance per actor).

    Args:
        graph: Handle of the node-shared graph; the actor keeps only views.
        fanouts: Neighbors per layer, input layer first.
        plan: Which seeds each row number stands for.
        run: Run name that tags the actor's metrics (:class:`gnnray.metrics.SamplerMetrics`).
        cpu: The job's CPU plan (:mod:`gnnray.cpus`); ``None`` leaves Ray's defaults.
    """

    def __init__(self, graph: GraphHandle, fanouts: tuple[int, ...], plan: SeedPlan, run: str = "gnnray",
                 cpu: Optional[CpuPolicy] = None):
        from gnnray.metrics import SamplerMetrics

        if cpu is not None:  # before the first sampling call: DGL's thread pool starts there
            self.cpu = cpu.apply_sampler(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))
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
