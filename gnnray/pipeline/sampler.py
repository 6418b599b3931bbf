"""Stage 4 (sampler actor): seed batches become sampled mini-batches.

Input: rows of the seeds dataset (row numbers of a ``SeedPlan``). Runs in a Ray
Data actor pool (``map_batches`` + ``ActorPoolStrategy``) whose actors each
attach the node-shared graph once, zero-copy. Output: one row per mini-batch,
a packed ``MiniBatch`` in an Arrow table (:func:`gnnray.pipeline.batch.to_arrow`).

Train workers sample for evaluation through their node's
:class:`EvaluationSampler` actor, so sampling is the same code wherever it
runs and no train worker imports DGL.

torch, pandas and the batch module are imported where used: Ray Data's split
coordinator unpickles :class:`SamplerActor` (so imports this module) and
never samples; at start-up that import would cost it seconds of CPU.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional, Sequence, Union

import numpy as np
import pyarrow as pa
import ray

from gnnray.config import Fanouts
from gnnray.cpus import CpuPolicy
from gnnray.data.graph import Graph
from gnnray.data.store import GraphHandle, to_graphbolt
from gnnray.data.typed import fanout_table
from gnnray.pipeline.seeds import SeedPlan, SeedReader

if TYPE_CHECKING:
    from gnnray.pipeline.batch import MiniBatch


class Sampler:
    """Neighbor sampling with GraphBolt over a node-shared graph.

    GraphBolt's ``FusedCSCSamplingGraph`` (:func:`~gnnray.data.store.to_graphbolt`)
    reads the store's arrays in place, each in its own dtype: int32
    ``indices`` even where the edge count needs an int64 ``indptr``, which
    DGL's ``dgl.graph`` refuses. GraphBolt also samples with torch's threads
    (the CPU plan sets them) and keeps no node-sized scratch per process.

    On a typed graph each relation of a node is sampled apart, with its own
    fanout (:func:`fanout_table`): GraphBolt does it given one fanout per
    relation, over in-edges grouped by relation (the typed CSC's layout).

    Args:
        graph: The graph, usually read-only views on the object store.
        fanouts: Neighbors per layer, input layer first; ``-1`` takes all. A
            :class:`~gnnray.config.Fanouts` or a list of ints (per relation on a typed graph).
    """

    def __init__(self, graph: Graph, fanouts: Union[Fanouts, Sequence[int]]):
        import torch

        from gnnray.pipeline.batch import id_dtype

        self._graph = graph
        self._g = to_graphbolt(graph)
        self._fanouts = [torch.tensor(f) for f in reversed(fanout_table(fanouts, graph))]  # output layer first
        self.id_dtype = id_dtype(graph.num_nodes)  # what to pack this graph's batches as
        # GraphBolt takes seeds only in the dtype of indices (int32 below 2**31 nodes); sampled ids come in it.
        self._seed_dtype = graph.indices.dtype

    def sample(self, seeds: np.ndarray, epoch: int = -1) -> MiniBatch:
        """Sample the blocks of ``seeds`` (global node ids, any integer dtype).

        The batch's ids and blocks come in the graph's ``indices`` dtype
        (int32 below 2**31 nodes), its labels as int64. A block's sources
        start with its destinations, in order (DGL's block convention).
        """
        import pandas as pd
        import torch

        from gnnray.pipeline.batch import Layer, MiniBatch

        output_nodes = nodes = torch.from_numpy(np.ascontiguousarray(seeds, dtype=self._seed_dtype))
        layers = []
        for fanout in self._fanouts:
            # The private call returns GraphBolt's C++ subgraph: the picked edges' relations come with it, where
            # the public sample_neighbors splits them into a dict of subgraphs per relation.
            sub = self._g._sample_neighbors(nodes, fanout, replace=False)
            # The block's sources: its destinations first, in order (they are unique), then the new ids as they
            # appear. pandas' hash-table factorize does that on one thread (a sampler actor's) in a fraction of
            # the time of GraphBolt's unique_and_compact (bench/structure.py).
            codes, src = pd.factorize(np.concatenate([nodes.numpy(), sub.indices.numpy()]))
            local = torch.from_numpy(codes[nodes.shape[0]:].astype(src.dtype))
            # Offsets come in indptr's dtype (int64 past 2**31 edges); within a batch they fit the ids' dtype.
            layers.append(Layer(sub.indptr.to(nodes.dtype), local, int(src.shape[0]), sub.type_per_edge))
            nodes = torch.from_numpy(src)
        layers.reverse()
        labels = torch.from_numpy(self._graph.label[output_nodes.numpy()])
        return MiniBatch(output_nodes, labels, nodes, layers, epoch=epoch)


class SamplerActor:
    """The callable class of the sampler actor pool (one instance per actor).

    Args:
        graph: Handle of the node-shared graph; the actor keeps only views.
        fanouts: Neighbors per layer, input layer first.
        plan: Which seeds each row number stands for.
        run: Run name that tags the actor's metrics (:class:`gnnray.metrics.SamplerMetrics`).
        cpu: The job's CPU plan (:mod:`gnnray.cpus`); ``None`` leaves Ray's defaults.
    """

    def __init__(self, graph: GraphHandle, fanouts: Union[Fanouts, Sequence[int]], plan: SeedPlan,
                 run: str = "gnnray", cpu: Optional[CpuPolicy] = None):
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
        from gnnray.pipeline.batch import to_arrow

        return to_arrow(batches, self._sampler.id_dtype)


class EvaluationSampler:
    """A node's evaluation sampler: a Ray actor shared by the train workers of its node, seeds in, packed batches out.

    The train worker imports no DGL: GraphBolt samples here, over the same
    node-shared graph (zero-copy). Packed batches are numpy arrays, so they
    cross the object store without a copy. Start it with
    :func:`start_evaluation_sampler` when the worker starts, so that its
    imports (torch, DGL) overlap training.
    """

    def __init__(self, graph: GraphHandle, fanouts: Union[Fanouts, Sequence[int]], threads: int = 1):
        from gnnray.cpus import set_threads

        set_threads(max(1, threads))  # before the first sampling call: DGL's thread pool starts there
        self._sampler = Sampler(graph.get(), fanouts)

    def sample(self, seeds: np.ndarray) -> np.ndarray:
        """The packed mini-batch (:meth:`MiniBatch.pack`) of ``seeds``."""
        return self._sampler.sample(seeds).pack(self._sampler.id_dtype)


def start_evaluation_sampler(graph: GraphHandle, fanouts: Union[Fanouts, Sequence[int]], threads: int = 1):
    """This node's :class:`EvaluationSampler` for ``graph`` and ``fanouts``: its handle, without waiting.

    In a placement group (a Ray Train worker group's, new at each restart),
    the first worker of a node to ask starts it and owns it (it ends with
    that worker's group); the group's other workers on the node get the same
    actor by its name, which holds the group, so a node pays for one more
    process importing torch and DGL, not one per worker, and a restarted
    group never gets the actor of one going away. Elsewhere (a driver, a
    tool) each call starts its own actor, which ends with its last handle.
    It reserves no CPU, so it fits beside the job's workers and sampler
    actors; it works while evaluation runs, when training does not. The
    placement is soft: a node that cannot take it leaves Ray to place it.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    context = ray.get_runtime_context()
    node, group = context.get_node_id(), context.get_placement_group_id()
    options = dict(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True))
    if group:
        options.update(get_if_exists=True, name=f"gnnray-evaluation-sampler:{group}:{node}:{graph._ref[0].hex()}:"
                                                f"{Fanouts.of_value(fanouts)}:{threads}")
    return ray.remote(EvaluationSampler).options(**options).remote(graph, fanouts, threads)
