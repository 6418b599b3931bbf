"""With stage 7 (train worker): sampled evaluation of a split, each rank taking every ``world``-th node.

Its node's :class:`~gnnray.sampler.sampler.EvaluationSampler` actor, one
shared by the node's workers, samples each chunk of seeds, at most
:attr:`Evaluator.requests` chunks ahead; the worker gathers the features as in
training (:class:`Prefetcher`). A rank with few seeds to evaluate
(:data:`SAMPLE_HERE_SEEDS`) samples them itself: the actor's start would cost more.

Chunks are sized by the rows they gather, not by their seeds: a chunk of
4,096 seeds with fanouts 15,10,5 samples most of a products-sized graph
(about 2 M rows, 0.8 GB of features), and the prefetcher holds several. Each
chunk is meant to gather at most :attr:`Evaluator.max_rows` rows
(``--eval-rows``, by default from the feature table: :func:`row_bound`): the
first one takes the seeds that many rows can hold at worst (every sampled
neighbor new), each next one as many as the rows per seed of the last batch
allow. Fewer seeds sample more rows each (on arxiv with fanouts 10,10,10, 212 a
seed for 117 seeds, 29.5 for 4,096), so that estimate alone grew chunks over
twenty batches, sampling 1.6x the rows. So chunks first double, one request at
a time, until one comes back over the bound or they reach
``--eval-batch-size``: since a neighborhood of twice the seeds holds at most
twice the rows, a dropped chunk sampled at most twice the bound's ids (and
gathered nothing). Later evaluations start from the estimate the largest chunk
gave, and do not double again.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import numpy as np
import torch

from gnnray.batch import MiniBatch
from gnnray.config import JobConfig
from gnnray.data.graph import Graph
from gnnray.sampler.sampler import make_sampler, rows_per_seed_at_most, start_evaluation_sampler
from gnnray.store.handle import GraphHandle
from gnnray.train.embedding import NodeEmbedding
from gnnray.train.feature_reader import FeatureReader, LocalRows
from gnnray.train.prefetch import HostSlot, Prefetcher


# A rank's validation and test seeds at most this many are sampled in the worker: about 0.5 s of one core at
# products' fanouts (15,10,5), a tenth of what starting the node's sampler actor costs.
SAMPLE_HERE_SEEDS = 10_000


class Evaluator:
    """Sampled evaluation of a split: each rank takes every ``world``-th node, so the ranks cover each node once.

    Evaluation streams under a bound, as training does: at most
    :attr:`requests` chunks are being sampled, and the :class:`Prefetcher`
    holds at most ``--prefetch`` prepared batches and one in preparation, so
    no more than :attr:`max_in_flight` batches are alive at once, the one the
    model computes included. :attr:`peak_in_flight` counts the most seen.

    Args:
        graph: The node-shared graph (splits, labels; features unless ``features`` is given).
        handle: The same graph's handle, for the node's sampler actor (started here if no worker of the node
            started it yet, without waiting). Without it (no Ray: tests, tools), or with few seeds to evaluate,
            this process samples.
        stack: The driver's software stack, which the sampler actor checks on its node.
    """

    def __init__(self, graph: Graph, cfg: JobConfig, rank: int, world: int, device,
                 embedding: Optional[NodeEmbedding] = None, features: Optional[FeatureReader] = None,
                 handle: Optional[GraphHandle] = None, stack: Optional[dict] = None):
        self._graph, self._cfg, self._rank, self._world, self._device = graph, cfg, rank, world, device
        self._features = features if features is not None else LocalRows(graph.feat)
        self._embedding = embedding
        fanouts = cfg.sampler.evaluation_fanouts
        if handle is not None and not self._samples_here():
            self._sampler = start_evaluation_sampler(handle, fanouts, int(cfg.sampler.cpus_per_actor),
                                                     cfg.sampler.backend, cfg.run.seed, stack)
        else:
            self._sampler = _Here(graph, fanouts, cfg)
        self._slot = HostSlot(pin=False)  # reused by one-batch splits, see _batches
        self.requests = cfg.train.prefetch + 1
        self.max_in_flight = self.requests + cfg.train.prefetch + 2
        self.requested = self.consumed = self.peak_in_flight = 0
        self.max_rows = cfg.train.eval_rows or row_bound(graph.num_nodes, cfg.train.prefetch + 2)
        self._first_seeds = max(1, self.max_rows // rows_per_seed_at_most(graph, fanouts))
        self._doubling = True  # until a chunk comes back over the bound or chunks reach --eval-batch-size
        self.peak_rows = self.resampled = 0  # the most rows a batch gathered; batches over the bound, dropped

    def _samples_here(self) -> bool:
        """Whether this worker samples its evaluation itself: the native sampler, with so few seeds to evaluate
        (:data:`SAMPLE_HERE_SEEDS`) that an actor's start, a process importing torch (3-7 CPU-seconds), would
        cost more than the sampling."""
        if self._cfg.sampler.backend != "native":
            return False
        if self._worker_samples():  # the plan samples training batches here: evaluation's too
            return True
        seeds = sum(len(self._graph.split(s)[self._rank::self._world]) for s in ("valid", "test"))
        return seeds <= SAMPLE_HERE_SEEDS

    def _worker_samples(self) -> bool:
        """Whether this is a CPU worker that samples its own training batches: then evaluation's are sampled and
        gathered at idle priority too (:class:`~gnnray.train.prefetch.Prefetcher`'s ``idle``)."""
        return self._cfg.sampler.sample_on == "device" and torch.device(self._device).type == "cpu"

    def accuracy(self, model, split: str) -> float:
        """The split's accuracy over every rank's share: correct and total counts summed across ranks (a
        metrics library would cost each worker process seconds of imports for this one sum)."""
        ids = self._graph.split(split)[self._rank::self._world]
        counts = torch.zeros(2, dtype=torch.int64, device=self._device)  # correct, total
        net = getattr(model, "module", model)  # no DDP hooks needed without backward
        net.eval()
        with torch.no_grad(), self._batches(ids) as batches:
            for mb in batches:
                self.peak_in_flight = max(self.peak_in_flight, self.requested - self.consumed)
                self.consumed += 1
                pred = net(mb.layers, model_input(mb, self._embedding)).argmax(1)
                counts[0] += (pred == mb.labels).sum()
                counts[1] += mb.labels.shape[0]
        if self._world > 1:
            import torch.distributed as dist

            dist.all_reduce(counts)
        correct, total = counts.tolist()
        return correct / total if total else 0.0

    def _packed(self, ids: np.ndarray) -> Iterator[np.ndarray]:
        """Packed batches of ``ids``, chunk by chunk, with at most :attr:`requests` being sampled at a time; each
        chunk's seeds from the rows per seed of the last batch received (module docstring). A batch over
        :attr:`max_rows` rows is dropped and its seeds sampled again in smaller chunks (accuracy does not depend
        on the order): the bound holds, unless one seed alone samples more."""
        import collections

        import ray

        pending: collections.deque = collections.deque()  # (seeds, the sampler's result)
        todo: collections.deque = collections.deque([ids] if len(ids) else [])  # seeds not yet requested
        get = ray.get if not isinstance(self._sampler, _Here) else (lambda packed: packed)
        size, largest = self._chunk_seeds(), 0
        while todo or pending:
            if todo and len(pending) < (1 if self._doubling else self.requests):
                chunk, rest = todo[0][:size], todo[0][size:]
                todo[0] = rest
                if not len(rest):
                    todo.popleft()
                pending.append((chunk, self._sampler.sample.remote(chunk)))
                self.requested += 1
                continue
            chunk, ref = pending.popleft()
            packed = get(ref)
            rows = int(packed[4])  # MiniBatch.pack's header: magic, epoch, layers, seeds, input nodes
            fit, grow = self._chunk_seeds(len(chunk), rows), self._doubling and rows <= self.max_rows
            size = self._chunk_seeds(len(chunk), rows, 2 * len(chunk) if grow else 0)
            self._doubling = grow and size < self._cfg.train.eval_batch_size
            if rows > self.max_rows and len(chunk) > 1:
                # A smaller chunk samples more rows a seed than this one: the last chunk under the bound sizes
                # better (its estimate errs low).
                size = min(size, self._first_seeds) if largest else size
                todo.appendleft(chunk)
                self.consumed += 1  # out of flight, not computed
                self.resampled += 1
                continue
            self.peak_rows = max(self.peak_rows, rows)
            if len(chunk) >= largest:  # the next call starts where this one's full chunks arrived, not at worst
                largest, self._first_seeds = len(chunk), fit
            yield packed

    def _chunk_seeds(self, seeds: int = 0, rows: int = 0, doubled: int = 0) -> int:
        """Seeds of the next chunk: those :attr:`max_rows` rows hold at ``rows / seeds`` rows per seed (at worst,
        before any batch came back), or ``doubled`` if more, at most ``--eval-batch-size``."""
        fit = self._first_seeds if not rows else int(0.9 * self.max_rows * seeds / rows)
        return max(1, min(self._cfg.train.eval_batch_size, max(fit, doubled)))

    def _batches(self, ids: np.ndarray):
        """The mini-batches of ``ids``, prepared ahead on a thread when there are several.

        A single batch has nothing to overlap with: it is prepared here, as
        the thread would, which spares starting and joining a thread each
        epoch (a wait for the scheduler on a busy machine).
        """
        packed = self._packed(ids)
        if len(ids) > self._chunk_seeds():
            return Prefetcher(packed, self._features, self._device, self._cfg.train.prefetch,
                              idle=self._worker_samples())
        return contextlib.nullcontext(self._prepare(p) for p in packed)

    def _prepare(self, packed: np.ndarray) -> MiniBatch:
        ids = self._slot.ids(packed.shape[0], packed.dtype)
        ids.numpy()[:] = packed  # a store view, read-only: this is the one copy
        mb = MiniBatch.unpack(ids)
        mb.x = self._slot.gather(self._features, mb.input_nodes.numpy())
        return mb.to(self._device)


ROWS_AT_LEAST = 2**17  # an evaluation batch may hold this many rows whatever the graph's size


def row_bound(num_nodes: int, slots: int) -> int:
    """Rows an evaluation batch gathers at most by default: ``slots`` prepared batches (the prefetcher's), each
    in buffers that grow by a quarter beyond their need, together hold at most half the feature table's rows (the
    table is in the object store once per node; evaluation adds at most half as much again), or
    :data:`ROWS_AT_LEAST` each."""
    return max(ROWS_AT_LEAST, int(num_nodes / (2 * 1.25 * slots)))


class _Here:
    """Sampling in this process, called as the actor is (``sample.remote``): without Ray, or for few seeds."""

    def __init__(self, graph: Graph, fanouts, cfg: JobConfig):
        self._sampler = make_sampler(graph, fanouts, cfg.sampler.backend, cfg.run.seed)  # one thread
        self.sample = self  # so that ``sample.remote(seeds)`` reads as for the actor

    def remote(self, seeds: np.ndarray) -> np.ndarray:
        return self._sampler.draw(seeds).pack(self._sampler.id_dtype)


def model_input(mb: MiniBatch, embedding: Optional[NodeEmbedding]) -> torch.Tensor:
    """The model's input for ``mb``: its features, then its input nodes' embeddings if the job learns them."""
    if embedding is None:
        return mb.x
    return torch.cat([mb.x, embedding(mb.input_nodes).to(mb.x.device)], dim=1)
