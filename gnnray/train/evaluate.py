"""With stage 7 (train worker): sampled evaluation of a split, each rank taking every ``world``-th node.

The worker samples nothing itself: its node's
:class:`~gnnray.pipeline.sampler.EvaluationSampler` actor, one shared by the
node's workers, samples each chunk of seeds, at most :attr:`Evaluator.requests` chunks ahead;
the worker gathers the features as in training (:class:`Prefetcher`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import numpy as np
import torch

from gnnray.config import JobConfig
from gnnray.data.graph import Graph
from gnnray.data.store import GraphHandle
from gnnray.pipeline.batch import MiniBatch
from gnnray.pipeline.features import FeatureReader, LocalRows
from gnnray.pipeline.prefetch import HostSlot, Prefetcher
from gnnray.pipeline.sampler import start_evaluation_sampler
from gnnray.train.embedding import NodeEmbedding


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
            started it yet, without waiting). Without
            it (no Ray: tests, tools) this process samples.
        stack: The driver's software stack, which the sampler actor checks on its node.
    """

    def __init__(self, graph: Graph, cfg: JobConfig, rank: int, world: int, device,
                 embedding: Optional[NodeEmbedding] = None, features: Optional[FeatureReader] = None,
                 handle: Optional[GraphHandle] = None, stack: Optional[dict] = None):
        self._graph, self._cfg, self._rank, self._world, self._device = graph, cfg, rank, world, device
        self._features = features if features is not None else LocalRows(graph.feat)
        self._embedding = embedding
        fanouts = cfg.sampler.evaluation_fanouts
        if handle is not None:
            self._sampler = start_evaluation_sampler(handle, fanouts, int(cfg.sampler.cpus_per_actor),
                                                     cfg.sampler.backend, cfg.run.seed, stack)
        else:
            self._sampler = _Here(graph, fanouts, cfg)
        self._slot = HostSlot(pin=False)  # reused by one-batch splits, see _batches
        self.requests = cfg.train.prefetch + 1
        self.max_in_flight = self.requests + cfg.train.prefetch + 2
        self.requested = self.consumed = self.peak_in_flight = 0

    def accuracy(self, model, split: str) -> float:
        from torchmetrics.classification import MulticlassAccuracy

        ids = self._graph.split(split)[self._rank::self._world]
        size = self._cfg.train.eval_batch_size
        chunks = [ids[i:i + size] for i in range(0, len(ids), size)]
        acc = MulticlassAccuracy(self._graph.num_classes, average="micro", validate_args=False).to(self._device)
        net = getattr(model, "module", model)  # no DDP hooks needed without backward
        net.eval()
        with torch.no_grad(), self._batches(chunks) as batches:
            for mb in batches:
                self.peak_in_flight = max(self.peak_in_flight, self.requested - self.consumed)
                self.consumed += 1
                acc.update(net(mb.layers, model_input(mb, self._embedding)).argmax(1), mb.labels)
        return float(acc.compute())  # synchronised across ranks by torchmetrics

    def _packed(self, chunks: list[np.ndarray]) -> Iterator[np.ndarray]:
        """The chunks' packed batches, in order, with at most :attr:`requests` being sampled at a time."""
        import collections

        import ray

        pending: collections.deque = collections.deque()
        get = ray.get if not isinstance(self._sampler, _Here) else (lambda packed: packed)
        for chunk in chunks:
            if len(pending) == self.requests:
                yield get(pending.popleft())
            pending.append(self._sampler.sample.remote(chunk))
            self.requested += 1
        while pending:
            yield get(pending.popleft())

    def _batches(self, chunks: list[np.ndarray]):
        """The chunks' mini-batches, prepared ahead on a thread when there are several.

        A single batch has nothing to overlap with: it is prepared here, as
        the thread would, which spares starting and joining a thread each
        epoch (a wait for the scheduler on a busy machine).
        """
        packed = self._packed(chunks)
        if len(chunks) > 1:
            return Prefetcher(packed, self._features, self._device, self._cfg.train.prefetch)
        return contextlib.nullcontext(self._prepare(p) for p in packed)

    def _prepare(self, packed: np.ndarray) -> MiniBatch:
        ids = self._slot.ids(packed.shape[0], packed.dtype)
        ids.numpy()[:] = packed  # a store view, read-only: this is the one copy
        mb = MiniBatch.unpack(ids)
        mb.x = self._slot.gather(self._features, mb.input_nodes.numpy())
        return mb.to(self._device)


class _Here:
    """Sampling in this process, called as the actor is (``sample.remote``); without Ray only."""

    def __init__(self, graph: Graph, fanouts, cfg: JobConfig):
        from gnnray.pipeline.sampler import make_sampler

        self._sampler = make_sampler(graph, fanouts, cfg.sampler.backend, cfg.run.seed)
        self.sample = self  # so that ``sample.remote(seeds)`` reads as for the actor

    def remote(self, seeds: np.ndarray) -> np.ndarray:
        return self._sampler.sample(seeds).pack(self._sampler.id_dtype)


def model_input(mb: MiniBatch, embedding: Optional[NodeEmbedding]) -> torch.Tensor:
    """The model's input for ``mb``: its features, then its input nodes' embeddings if the job learns them."""
    if embedding is None:
        return mb.x
    return torch.cat([mb.x, embedding(mb.input_nodes).to(mb.x.device)], dim=1)
