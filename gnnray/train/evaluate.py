"""With stage 7 (train worker): sampled evaluation of a split, each rank taking every ``world``-th node."""

from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np
import torch

from gnnray.config import JobConfig
from gnnray.data.graph import Graph
from gnnray.pipeline.batch import MiniBatch
from gnnray.pipeline.features import FeatureReader, LocalRows
from gnnray.pipeline.prefetch import HostSlot, Prefetcher
from gnnray.pipeline.sampler import Sampler
from gnnray.train.embedding import NodeEmbedding


class Evaluator:
    """Sampled evaluation of a split: each rank takes every ``world``-th node, so the ranks cover each node once."""

    def __init__(self, graph: Graph, cfg: JobConfig, rank: int, world: int, device,
                 embedding: Optional[NodeEmbedding] = None, features: Optional[FeatureReader] = None):
        self._graph, self._cfg, self._rank, self._world, self._device = graph, cfg, rank, world, device
        self._features = features if features is not None else LocalRows(graph.feat)
        self._embedding = embedding
        self._sampler = Sampler(graph, cfg.sampler.evaluation_fanouts)
        self._slot = HostSlot(pin=False)  # reused by one-batch splits, see _batches

    def accuracy(self, model, split: str) -> float:
        from torchmetrics.classification import MulticlassAccuracy

        ids = self._graph.split(split)[self._rank::self._world]
        chunks = [ids[i:i + self._cfg.train.eval_batch_size] for i in range(0, len(ids), self._cfg.train.eval_batch_size)]
        acc = MulticlassAccuracy(self._graph.num_classes, average="micro").to(self._device)
        net = getattr(model, "module", model)  # no DDP hooks needed without backward
        net.eval()
        with torch.no_grad(), self._batches(chunks) as batches:
            for mb in batches:
                acc.update(net(mb.blocks(), model_input(mb, self._embedding)).argmax(1), mb.labels)
        return float(acc.compute())  # synchronised across ranks by torchmetrics

    def _batches(self, chunks: list[np.ndarray]):
        """The chunks' mini-batches, prepared ahead on a thread when there are several.

        A single batch has nothing to overlap with: it is prepared here, as
        the thread would, which spares starting and joining a thread each
        epoch (a wait for the scheduler on a busy machine).
        """
        packed = (self._sampler.sample(chunk).pack(self._sampler.id_dtype) for chunk in chunks)
        if len(chunks) > 1:
            return Prefetcher(packed, self._features, self._device, self._cfg.train.prefetch)
        return contextlib.nullcontext(self._prepare(p) for p in packed)

    def _prepare(self, packed: np.ndarray) -> MiniBatch:
        mb = MiniBatch.unpack(torch.from_numpy(packed))
        mb.x = self._slot.gather(self._features, mb.input_nodes.numpy())
        return mb.to(self._device)


def model_input(mb: MiniBatch, embedding: Optional[NodeEmbedding]) -> torch.Tensor:
    """The model's input for ``mb``: its features, then its input nodes' embeddings if the job learns them."""
    if embedding is None:
        return mb.x
    return torch.cat([mb.x, embedding(mb.input_nodes).to(mb.x.device)], dim=1)
