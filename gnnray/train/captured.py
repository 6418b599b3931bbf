"""Stage 7's step captured as one CUDA graph (train worker, a lone GPU rank): forward, loss, backward and Adam
replayed as one launch, so a step costs its kernels rather than the Python that queues them.

A graph replays fixed shapes, so batches are padded. The first :data:`MEASURED` batches run eagerly and their
sizes set one padded shape (mean + 5 standard deviations per size, as NVIDIA's MLPerf GNN pads); each later
batch is copied into static buffers of that shape (:func:`pad_into`), where nothing real changes: padded
destinations take padded edges from a padded source, padded input rows are zeros and padded seeds carry the
loss's ``ignore_index``. A batch larger than the padding runs eagerly, as every batch does without capture.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from gnnray.batch import Layer, MiniBatch

MEASURED = 20  # eager batches whose sizes set the padding
WARMUP = 2  # padded eager steps on a side stream before capture, as torch's whole-network capture asks
QUANTUM = 64  # padded sizes are multiples of this (a batch of 1024 seeds pads to 1088)
IGNORE = -100  # cross_entropy's default ignore_index: a padded seed's label


def refusal(device, world: int, model: nn.Module, embedding) -> Optional[str]:
    """Why this rank's step cannot be captured (``None``: it can)."""
    if torch.device(device).type != "cuda":
        return "not on a GPU"
    if world > 1:
        return "DDP's all-reduce runs between the ranks' steps"
    if embedding is not None:
        return "--embedding-dim updates its rows on the host"
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return "the model's batch norm would count padded rows"
    return None


@dataclass(frozen=True)
class Shape:
    """A batch's sizes: seeds, each layer's sources (layer 0's are the input nodes) and edges. Layer ``l``'s
    destinations are layer ``l + 1``'s sources, the last layer's the seeds."""

    seeds: int
    srcs: tuple[int, ...]
    edges: tuple[int, ...]

    @classmethod
    def of(cls, mb: MiniBatch) -> "Shape":
        return cls(mb.num_seeds, tuple(int(l.num_src) for l in mb.layers),
                   tuple(int(l.indices.shape[0]) for l in mb.layers))

    def dst(self, layer: int) -> int:
        return self.srcs[layer + 1] if layer + 1 < len(self.srcs) else self.seeds

    def holds(self, other: "Shape") -> bool:
        """Whether a batch of shape ``other`` pads to this one: a padded source and destination must remain."""
        return (other.seeds < self.seeds and all(o < s for o, s in zip(other.srcs, self.srcs))
                and all(o <= s for o, s in zip(other.edges, self.edges)))


def padded(shapes: list[Shape], sigmas: float = 5.0, quantum: int = QUANTUM) -> Shape:
    """One shape that holds nearly every batch like ``shapes``: each size's mean + ``sigmas`` deviations, plus one,
    rounded up to ``quantum``; a layer's sources at least its destinations (they are their prefix)."""
    def bound(values: list[int]) -> int:
        mean = sum(values) / len(values)
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        return int(math.ceil((max(max(values), mean + sigmas * sd) + 1) / quantum) * quantum)

    seeds = bound([s.seeds for s in shapes])
    srcs = [bound([s.srcs[l] for s in shapes]) for l in range(len(shapes[0].srcs))]
    for l in range(len(srcs) - 1, -1, -1):
        srcs[l] = max(srcs[l], srcs[l + 1] if l + 1 < len(srcs) else seeds)
    return Shape(seeds, tuple(srcs), tuple(bound([s.edges[l] for s in shapes]) for l in range(len(srcs))))


class Padded:
    """Static buffers of one :class:`Shape` on the device, and :meth:`load` to copy a batch into them."""

    def __init__(self, shape: Shape, like: MiniBatch):
        self.shape = shape
        dev = like.x.device
        self.x = torch.zeros((shape.srcs[0], *like.x.shape[1:]), dtype=like.x.dtype, device=dev)
        self.labels = torch.full((shape.seeds,), IGNORE, dtype=torch.int64, device=dev)
        self.layers = []
        for l, layer in enumerate(like.layers):
            etype = (None if layer.etype is None
                     else torch.zeros(shape.edges[l], dtype=layer.etype.dtype, device=dev))
            self.layers.append(Layer(torch.zeros(shape.dst(l) + 1, dtype=layer.indptr.dtype, device=dev),
                                     torch.zeros(shape.edges[l], dtype=layer.indices.dtype, device=dev),
                                     shape.srcs[l], etype))

    def load(self, mb: MiniBatch) -> None:
        """Copy ``mb`` in: real rows first, then padding that changes none of them (no host sync)."""
        s = self.shape
        rows = mb.x.shape[0]
        self.x[:rows].copy_(mb.x)
        self.x[rows:].zero_()
        for l, (real, static) in enumerate(zip(mb.layers, self.layers)):
            dst, nnz = real.num_dst, int(real.indices.shape[0])
            static.indptr[:dst + 1].copy_(real.indptr)
            static.indptr[dst + 1:].fill_(nnz)  # padded destinations have no edges...
            static.indptr[-1:].fill_(s.edges[l])  # ...but the last, which takes the padded edges
            static.indices[:nnz].copy_(real.indices)
            static.indices[nnz:].fill_(s.srcs[l] - 1)  # from the last source: padded, so no real degree moves
            if static.etype is not None:
                static.etype[:nnz].copy_(real.etype)
                static.etype[nnz:].zero_()
        self.labels[:mb.num_seeds].copy_(mb.labels)
        self.labels[mb.num_seeds:].fill_(IGNORE)


def padded_loss(model: nn.Module, buffers: Padded, sums: torch.Tensor) -> torch.Tensor:
    """The loss over the real seeds of the batch in ``buffers``; adds (loss x seeds, correct, seeds) to ``sums``."""
    logits = model(buffers.layers, buffers.x)
    loss = F.cross_entropy(logits, buffers.labels, ignore_index=IGNORE)
    real = buffers.labels != IGNORE
    seeds = real.sum()
    sums[0] += loss.detach() * seeds
    sums[1] += ((logits.detach().argmax(1) == buffers.labels) & real).sum()
    sums[2] += seeds
    return loss


class CapturedStep:
    """One optimizer step per call of :meth:`step`, replayed from a CUDA graph once the padding is known.

    ``sums`` (loss x seeds, correct, seeds; float64 on the device) is where every step adds its metrics, captured
    or not: the graph writes to the tensor it was captured with, so the epoch zeroes it rather than replacing it.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device,
                 on_failure: Optional[Callable[[str], None]] = None):
        self.model, self.optimizer, self.device = model, optimizer, torch.device(device)
        self.on_failure = on_failure  # told why, if capture fails (the run's event log; not the console)
        self.sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        self.seen: list[Shape] = []
        self.buffers: Optional[Padded] = None
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.warm = 0
        self.side: Optional[torch.cuda.Stream] = None  # warm-up and capture on one stream (its library handles)
        self.replays = self.eager = 0
        self.failed = ""  # why capture failed, if it did: every step is then eager

    def step(self, mb: MiniBatch) -> bool:
        """Train on ``mb`` if it fits the padding (``True``); ``False``: the caller steps eagerly."""
        shape = Shape.of(mb)
        if self.buffers is None:
            if mb.num_seeds:
                self.seen.append(shape)
            if len(self.seen) < MEASURED:
                self.eager += 1
                return False
            self.buffers = Padded(padded(self.seen), mb)
            logging.getLogger(__name__).info("captured step: padded to %s", self.buffers.shape)
        if self.failed or not mb.num_seeds or not self.buffers.shape.holds(shape):
            self.eager += 1
            return False
        self.buffers.load(mb)
        if self.graph is None and self.warm < WARMUP:
            self._warm_up()
        else:
            if self.graph is None and not self._capture():
                self.eager += 1
                return False
            self.graph.replay()
            self.replays += 1
        return True

    def _train(self) -> None:
        padded_loss(self.model, self.buffers, self.sums).backward()
        self.optimizer.step()

    def _warm_up(self) -> None:
        """A real step on a side stream: what the graph will read and write is allocated before capture."""
        self.side = self.side or torch.cuda.Stream(self.device)
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side):
            self.optimizer.zero_grad(set_to_none=True)
            self._train()
        torch.cuda.current_stream(self.device).wait_stream(self.side)
        self.warm += 1

    def _capture(self) -> bool:
        """Capture the step (nothing runs until a replay); on failure say why, and step eagerly from then on."""
        # Gradients set to None: the captured backward then writes them afresh at each replay, not adds to them.
        # thread_local: the prefetch thread keeps copying while this thread captures.
        self.optimizer.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self.side, capture_error_mode="thread_local"):
                self._train()
        except RuntimeError as e:  # an op that cannot be captured: the run goes on, as it would without capture
            self.failed = str(e).splitlines()[0] if str(e) else type(e).__name__
            logging.getLogger(__name__).info("captured step: capture failed, every step eager: %s", self.failed)
            if self.on_failure:
                self.on_failure(self.failed)
            self.optimizer.zero_grad(set_to_none=True)
            return False
        self.graph = graph
        return True
