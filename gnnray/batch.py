"""The one batch type every stage hands to the next.

A :class:`MiniBatch` is born in a sampler actor (seeds + sampled blocks), travels
through Ray Data as one flat int64 array (:meth:`MiniBatch.pack`), is rebuilt in
the train worker (:meth:`MiniBatch.unpack`), gets its input features gathered
there and is moved to the device with :meth:`MiniBatch.to`.

Why one flat int64 array per batch: every part (ids, labels, CSC offsets and
indices) is int64, so packing is one ``np.concatenate`` and unpacking is slicing
(views, no copy). It travels as a single Arrow tensor column of one row, the
cheapest encoding measured (``docs/performance.md``); pickled dicts cost 5-10x.
Features are not shipped: the worker gathers them from the node-shared feature
array, which keeps a batch ~15x smaller.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

import numpy as np
import torch

_MAGIC = 0x6E6E7231  # "gnr1": rejects rows that are not packed mini-batches
_FIXED_HEADER = 5  # magic, epoch, num_layers, num_seeds, num_input_nodes


class Layer(NamedTuple):
    """One message-flow graph (block) in CSC form, in local node ids.

    Destination node ``j`` receives messages from source nodes
    ``indices[indptr[j]:indptr[j + 1]]``; destination nodes are the first
    ``num_dst`` source nodes (DGL's block convention).
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    num_src: int

    @property
    def num_dst(self) -> int:
        return int(self.indptr.shape[0] - 1)


@dataclass
class MiniBatch:
    """A sampled mini-batch.

    Attributes:
        seeds: Global ids of the output (seed) nodes, ``(B,)``.
        labels: Labels of the seeds, ``(B,)``.
        input_nodes: Global ids of the first layer's source nodes, ``(S,)``;
            ``seeds`` is their prefix.
        layers: Blocks from the input layer to the output layer.
        epoch: Data epoch the seeds were drawn for (``-1`` for evaluation).
        x: Input features of ``input_nodes``, ``(S, F)``; set by the worker.
    """

    seeds: torch.Tensor
    labels: torch.Tensor
    input_nodes: torch.Tensor
    layers: list[Layer]
    epoch: int = -1
    x: Optional[torch.Tensor] = None

    @property
    def num_seeds(self) -> int:
        return int(self.seeds.shape[0])

    def blocks(self) -> list:
        """The layers as DGL blocks, on the device their tensors are on."""
        import dgl

        return [
            dgl.create_block(
                ("csc", (layer.indptr, layer.indices, layer.indices.new_empty(0))),
                num_src_nodes=layer.num_src,
                num_dst_nodes=layer.num_dst,
                device=layer.indptr.device,
            )
            for layer in self.layers
        ]

    def to(self, device, non_blocking: bool = False) -> "MiniBatch":
        """Return a copy on ``device`` (``non_blocking`` needs pinned memory to overlap)."""

        def move(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return replace(
            self,
            seeds=move(self.seeds),
            labels=move(self.labels),
            input_nodes=move(self.input_nodes),
            layers=[Layer(move(l.indptr), move(l.indices), l.num_src) for l in self.layers],
            x=move(self.x),
        )

    def pack(self) -> np.ndarray:
        """Encode as one flat int64 array (see the module docstring)."""
        header = [_MAGIC, self.epoch, len(self.layers), self.num_seeds, int(self.input_nodes.shape[0])]
        for layer in self.layers:
            header += [layer.num_src, layer.num_dst, int(layer.indices.shape[0])]
        parts = [np.asarray(header, dtype=np.int64), self.seeds.numpy(), self.labels.numpy(), self.input_nodes.numpy()]
        for layer in self.layers:
            parts += [layer.indptr.numpy(), layer.indices.numpy()]
        return np.concatenate([p.astype(np.int64, copy=False) for p in parts])

    @staticmethod
    def unpack(packed: torch.Tensor) -> "MiniBatch":
        """Decode :meth:`pack`'s output; every tensor is a view into ``packed``."""
        if packed.dtype != torch.int64 or packed.dim() != 1 or packed.shape[0] < _FIXED_HEADER:
            raise ValueError("not a packed MiniBatch: expected a 1-D int64 array")
        magic, epoch, num_layers, num_seeds, num_input = packed[:_FIXED_HEADER].tolist()
        if magic != _MAGIC:
            raise ValueError("not a packed MiniBatch: bad magic number")
        if min(num_layers, num_seeds, num_input) < 0 or packed.shape[0] < _FIXED_HEADER + 3 * num_layers:
            raise ValueError("packed MiniBatch is truncated or corrupt")
        shapes = packed[_FIXED_HEADER:_FIXED_HEADER + 3 * num_layers].view(num_layers, 3).tolist()
        pos = _FIXED_HEADER + 3 * num_layers

        def take(n: int) -> torch.Tensor:
            nonlocal pos
            pos += n
            return packed[pos - n:pos]

        seeds, labels, input_nodes = take(num_seeds), take(num_seeds), take(num_input)
        layers = [Layer(take(num_dst + 1), take(nnz), num_src) for num_src, num_dst, nnz in shapes]
        if pos > packed.shape[0]:
            raise ValueError("packed MiniBatch is truncated")
        if pos < packed.shape[0]:
            raise ValueError(f"packed MiniBatch has {packed.shape[0] - pos} trailing values")
        return MiniBatch(seeds, labels, input_nodes, layers, epoch=epoch)
