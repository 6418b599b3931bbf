"""Stage 4 (sampler actor): seed batches become sampled mini-batches.

Input: rows of the seeds dataset (row numbers of a ``SeedPlan``). Runs in a Ray
Data actor pool (``map_batches`` + ``ActorPoolStrategy``) whose actors each
attach the node-shared graph once, zero-copy. Output: one row per mini-batch,
a packed ``MiniBatch`` in an Arrow table (:func:`gnnray.batch.to_arrow`).

Train workers sample for evaluation through their node's
:class:`EvaluationSampler` actor, so sampling is the same code wherever it
runs, off the worker's cores.

The sampler is gnnray's own (:class:`Sampler`, kernels in :mod:`.pick`);
``--sampler graphbolt`` swaps in DGL's GraphBolt (:mod:`.graphbolt`, the
``dgl`` extra, torch 2.2.1 only). The kernels (numba) are imported where
used: Ray Data's split coordinator unpickles :class:`SamplerActor` (so
imports this module) and never samples; at start-up that import would cost it
seconds of CPU.
"""

from __future__ import annotations

import time
import zlib
from typing import Optional, Sequence, Union

import numpy as np
import pyarrow as pa
import ray

from gnnray.batch import Layer, MiniBatch, check_fits, id_dtype, to_arrow
from gnnray.config import Fanouts
from gnnray.cpus import CpuPolicy
from gnnray.data.graph import Graph
from gnnray.data.typed import fanout_table
from gnnray.seeds import SeedPlan, SeedReader
from gnnray.store.handle import GraphHandle

BACKENDS = ("native", "graphbolt")


class Sampler:
    """Uniform neighbor sampling without replacement over a node-shared graph, GraphBolt's semantics.

    Each layer picks, for every destination, ``min(fanout, in-degree)`` of
    its in-edges (all with ``-1``), each relation of a typed graph apart with
    its own fanout (:func:`fanout_table`), from the CSC arrays in place and in
    their own dtypes (int32 ``indices`` beside an int64 ``indptr`` past 2**31
    edges). The picked sources are then numbered locally: the destinations
    first, in order, then new ids as they first appear (DGL's block convention).

    A batch's draw depends only on ``seed``, its epoch and its batch number
    (:func:`~gnnray.sampler.pick.batch_key`), not on ``threads``. Numbering
    uses a node-sized table of this process (4 bytes a node below 2**31 nodes,
    its pages touched as nodes are first met): a pass over each layer's picks,
    where a hash map was slower (docs/performance.md#sampling).

    Args:
        graph: The graph, usually read-only views on the object store.
        fanouts: Neighbors per layer, input layer first; ``-1`` takes all. A
            :class:`~gnnray.config.Fanouts` or a list of ints (per relation on a typed graph).
        seed: The run's seed.
        threads: Threads that pick (each a range of a layer's destinations); numbering runs on one.
    """

    def __init__(self, graph: Graph, fanouts: Union[Fanouts, Sequence[int]], seed: int = 0, threads: int = 1):
        from gnnray.sampler import pick

        self._graph, self._seed = graph, int(seed)
        self._fanouts = [np.asarray(f, np.int64) for f in reversed(fanout_table(fanouts, graph))]  # output first
        # A typed graph without relations has no edges to draw apart.
        self._etype = graph.etype if graph.typed and graph.edge_types else None
        self.id_dtype = id_dtype(graph.num_nodes)  # what to pack this graph's batches as
        self._dtype = graph.indices.dtype  # sampled ids come in it
        self._threads = pick.Threads(threads)
        self._table: Optional[np.ndarray] = None

    @property
    def threads(self) -> int:
        return self._threads.threads

    def sample(self, seeds: np.ndarray, epoch: int = -1, batch: Optional[int] = None) -> MiniBatch:
        """Sample the blocks of ``seeds`` (unique global node ids, any integer dtype).

        ``batch`` numbers the batch within its epoch (a stream row); without
        it (evaluation) the seeds themselves name it. The batch's ids and
        blocks come in the graph's ``indices`` dtype (int32 below 2**31
        nodes), its labels as int64.
        """
        return self.draw(seeds, epoch, batch).tensors()

    def draw(self, seeds: np.ndarray, epoch: int = -1, batch: Optional[int] = None) -> MiniBatch:
        """:meth:`sample` over numpy arrays, without importing torch: what a sampler actor packs."""
        from gnnray.sampler import pick

        g = self._graph
        nodes = seeds_in = np.ascontiguousarray(seeds, dtype=self._dtype)
        if batch is None:  # the ids name it, whatever their dtype: int32 and int64 copies of a graph draw alike
            batch = zlib.crc32(np.ascontiguousarray(seeds, dtype=np.int64))
        if self._table is None:  # zeroed pages: memory is taken as nodes are first met
            self._table = np.zeros(g.num_nodes, np.int32 if g.num_nodes < 2**31 else np.int64)
        layers = []
        for i, fanout in enumerate(self._fanouts):
            key = pick.batch_key(self._seed, epoch, batch, i)
            offsets, picked, etype = pick.sample_layer(g.indptr, g.indices, nodes, fanout, self._etype, key,
                                                       self._threads)
            check_fits(offsets[-1], self._dtype)  # offsets are narrowed to the ids' dtype: a cast would wrap
            local = np.empty(picked.shape[0], self._dtype)
            src = np.empty(nodes.shape[0] + picked.shape[0], self._dtype)
            src = src[:pick.relabel(nodes, picked, self._table, local, src)]
            if g.typed and etype is None:
                etype = np.empty(0, g.etype.dtype)
            layers.append(Layer(offsets.astype(self._dtype), local, int(src.shape[0]), etype))
            nodes = src
        layers.reverse()
        return MiniBatch(seeds_in, g.label[seeds_in], nodes, layers, epoch=epoch)


def make_sampler(graph: Graph, fanouts: Union[Fanouts, Sequence[int]], backend: str = "native", seed: int = 0,
                 threads: int = 1):
    """The ``--sampler`` backend's sampler: :class:`Sampler`, or GraphBolt's (``dgl`` extra)."""
    if backend == "graphbolt":
        from gnnray.sampler.graphbolt import GraphBoltSampler

        return GraphBoltSampler(graph, fanouts, threads)
    return Sampler(graph, fanouts, seed, threads)


def max_in_degree(graph: Graph, chunk: int = 1 << 22) -> int:
    """The graph's largest in-degree, a chunk of ``indptr`` at a time (a whole diff of papers100M's is 0.9 GB)."""
    return max((int(np.diff(graph.indptr[i:i + chunk + 1]).max()) for i in range(0, graph.num_nodes, chunk)),
               default=0)


def layer_fanouts_at_most(graph: Graph, fanouts) -> list[int]:
    """Each layer's edges per destination at most, input layer first: its fanouts (all relations', on a typed
    graph) summed, a fanout of -1 or above the largest in-degree counting as that degree, and the sum at most
    that degree."""
    most = max_in_degree(graph)
    unlisted = max(1, graph.num_relations) - len(fanouts.relations)  # relations on the default list
    return [min(most, sum(f if 0 <= f <= most else most
                          for f in [layer] * max(0, unlisted) + [fs[i] for _, fs in fanouts.relations]))
            for i, layer in enumerate(fanouts.layers)]


def rows_per_seed_at_most(graph: Graph, fanouts) -> int:
    """Rows one seed can sample: each layer's fanouts all new nodes (:func:`layer_fanouts_at_most`)."""
    rows = frontier = 1
    for f in layer_fanouts_at_most(graph, fanouts):
        frontier *= f
        rows += frontier
    return min(rows, max(1, graph.num_nodes))


def packed_bytes_at_most(graph: Graph, fanouts, batch_size: int) -> int:
    """A packed mini-batch's bytes at most (:meth:`MiniBatch.pack`): from the seeds outward, every destination
    samples its fanouts (:func:`layer_fanouts_at_most`), every sampled edge brings a new node, and the graph's
    node count caps each layer's nodes; at the graph's id width.
    Products-shaped (fanouts 15,10,5, 1,024 seeds): 9.0 MB, against 6.5 MB sampled."""
    typed = graph.num_relations > 1
    dst, values = batch_size, 5 + 2 * batch_size  # header, seeds, labels
    for f in reversed(layer_fanouts_at_most(graph, fanouts)):
        edges = dst * f
        values += 3 + dst + 1 + edges * (2 if typed else 1)  # shape, offsets, indices (and relations)
        dst = min(max(1, graph.num_nodes), dst + edges)
    return (values + dst) * id_dtype(graph.num_nodes).itemsize  # and the input nodes


class SamplerActor:
    """The callable class of the sampler actor pool (one instance per actor).

    Args:
        graph: Handle of the node-shared graph; the actor keeps only views.
        fanouts: Neighbors per layer, input layer first.
        plan: Which seeds each row number stands for (its seed also seeds the draws).
        run: Run name that tags the actor's metrics (:class:`gnnray.metrics.SamplerMetrics`).
        cpu: The job's CPU plan (:mod:`gnnray.cpus`); ``None`` leaves Ray's defaults.
        backend: ``--sampler``.
        stack: The driver's software stack: the actor refuses to start on a node with another
            (:func:`gnnray.stack.check_here`).
    """

    def __init__(self, graph: GraphHandle, fanouts: Union[Fanouts, Sequence[int]], plan: SeedPlan,
                 run: str = "gnnray", cpu: Optional[CpuPolicy] = None, backend: str = "native",
                 stack: Optional[dict] = None):
        from gnnray.metrics import SamplerMetrics
        from gnnray.stack import check_here

        check_here(stack, "a sampler actor")

        threads = _assigned_cpus()
        if cpu is not None:  # before the first sampling call: thread pools start there
            self.cpu = cpu.apply_sampler(threads)
        self._sampler = make_sampler(graph.get(), fanouts, backend, plan.seed, threads)
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
            mb = self._sampler.draw(seeds, epoch=epoch, batch=row)
            batches.append(mb)
            self._metrics.batch(sum(int(layer.indices.shape[0]) for layer in mb.layers), time.perf_counter() - start)
        return to_arrow(batches, self._sampler.id_dtype)


def _assigned_cpus() -> int:
    """The CPUs Ray gave this actor (its sampler's threads); 1 outside an actor (tests, tools)."""
    try:
        return max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
    except AssertionError:  # not a worker process
        return 1


class EvaluationSampler:
    """A node's evaluation sampler: a Ray actor shared by the train workers of its node, seeds in, packed batches out.

    It samples off the train workers' cores, over the same node-shared graph
    (zero-copy). Packed batches are numpy arrays, so they cross the object
    store without a copy. Start it with :func:`start_evaluation_sampler` when
    the worker starts, so that its imports overlap training.
    """

    def __init__(self, graph: GraphHandle, fanouts: Union[Fanouts, Sequence[int]], threads: int = 1,
                 backend: str = "native", seed: int = 0, stack: Optional[dict] = None):
        from gnnray.cpus import set_sampler_threads
        from gnnray.stack import check_here

        check_here(stack, "the evaluation sampler")
        set_sampler_threads(max(1, threads))
        self._sampler = make_sampler(graph.get(), fanouts, backend, seed, max(1, threads))

    def sample(self, seeds: np.ndarray) -> np.ndarray:
        """The packed mini-batch (:meth:`MiniBatch.pack`) of ``seeds``."""
        return self._sampler.draw(seeds).pack(self._sampler.id_dtype)


def start_evaluation_sampler(graph: GraphHandle, fanouts: Union[Fanouts, Sequence[int]], threads: int = 1,
                             backend: str = "native", seed: int = 0, stack: Optional[dict] = None):
    """This node's :class:`EvaluationSampler` for ``graph`` and ``fanouts``: its handle, without waiting.

    In a placement group (a Ray Train worker group's, new at each restart),
    the first worker of a node to ask starts it and owns it (it ends with
    that worker's group); the group's other workers on the node get the same
    actor by its name, which holds the group, so a node pays for one more
    process importing torch, not one per worker, and a restarted
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
                                                f"{Fanouts.of_value(fanouts)}:{threads}:{backend}:{seed}")
    return ray.remote(EvaluationSampler).options(**options).remote(graph, fanouts, threads, backend, seed, stack)
