"""The one batch type every stage hands to the next, and its wire format.

A :class:`MiniBatch` is born in a sampler actor (seeds + sampled blocks), travels
through Ray Data as one flat integer array in an Arrow row (:func:`to_arrow`),
is rebuilt in the train worker (:func:`from_arrow`, :meth:`MiniBatch.unpack`),
gets its input features gathered there and is moved to the device with
:meth:`MiniBatch.to`. Only numpy is imported here, torch where a batch
becomes tensors and pyarrow where rows are packed into or read from a table:
the train worker's code runs without Ray and DGL, and a sampler actor, whose
batches hold numpy arrays until they are packed, without torch (importing it
costs a process seconds of CPU and about 280 MB of its own memory).

Why one flat integer array per batch: every part (ids, labels, CSC offsets
and indices) is an integer, so packing is one ``np.concatenate`` and unpacking
is slicing (views, no copy). The array is int32 for graphs under 2**31 nodes
(:func:`id_dtype`): local ids always fit, and half the bytes halves the copies
Ray Data makes of every row (sizes in docs/performance.md#the-data-path-and-why).

Why an Arrow ``large_list`` column (:func:`to_arrow` / :func:`from_arrow`): a
sampler actor emits several mini-batches per call as one table whose values
are one buffer, and a train worker reads whole blocks and slices rows out of
them zero-copy. Ray Data's tensor columns cost several times more per row:
rows of different lengths become variable-shaped tensors, re-encoded at every
step (docs/performance.md#the-data-path-and-why). Features are not shipped: the worker gathers them
from the node-shared feature array, which keeps a batch many times smaller.

Typed graphs: each layer also carries each sampled edge's relation
(``Layer.etype``, aligned with its ``indices``), packed after the layer's
indices under a second magic number; an untyped batch packs exactly as
before. Input nodes' types are not packed: a model that needs them reads
``Graph.ntype`` at ``input_nodes``, as features are gathered.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterator, NamedTuple, Optional, Sequence

import numpy as np

from gnnray.errors import ConfigError

if TYPE_CHECKING:
    import pyarrow as pa
    import torch

_MAGIC = 0x6E6E7231  # "gnr1": rejects rows that are not packed mini-batches
_MAGIC_TYPED = 0x6E6E7431  # "gnt1": as gnr1, plus each layer's edge types after its indices
_FIXED_HEADER = 5  # magic, epoch, num_layers, num_seeds, num_input_nodes
_COLUMN = "packed"


def id_dtype(num_nodes: int) -> np.dtype:
    """The packing dtype for a graph of ``num_nodes`` nodes: int32 while its global ids fit."""
    return np.dtype(np.int32 if num_nodes < 2**31 else np.int64)


def check_fits(largest: int, dtype: np.dtype, what: str = "a mini-batch's layer") -> None:
    """Raise if ``largest`` (a count or offset about to be narrowed to ``dtype``) does not fit it.

    Global ids fit :func:`id_dtype` by construction; a batch's own counts
    (sampled edges, hence CSC offsets) do not, and a cast would wrap silently.
    """
    if int(largest) > np.iinfo(dtype).max:
        raise ConfigError(f"{what} has {int(largest):,} sampled edges or nodes, more than {np.dtype(dtype).name} "
                         f"offsets hold ({np.iinfo(dtype).max:,}); lower --batch-size or --fanouts")


class Layer(NamedTuple):
    """One message-flow graph (block) in CSC form, in local node ids.

    Destination node ``j`` receives messages from source nodes
    ``indices[indptr[j]:indptr[j + 1]]``; destination nodes are the first
    ``num_dst`` source nodes (DGL's block convention).
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    num_src: int
    etype: Optional[torch.Tensor] = None  # typed graphs: each edge's relation, aligned with indices

    @property
    def num_dst(self) -> int:
        return int(self.indptr.shape[0] - 1)


@dataclass
class MiniBatch:
    """A sampled mini-batch.

    Attributes:
        seeds: Global ids of the output (seed) nodes, ``(B,)``.
        labels: Labels of the seeds, ``(B,)``: int64 from the sampler and after :meth:`to`, the
            packed dtype straight out of :meth:`unpack`.
        input_nodes: Global ids of the first layer's source nodes, ``(S,)``;
            ``seeds`` is their prefix.
        layers: Blocks from the input layer to the output layer.
        epoch: Data epoch the seeds were drawn for (``-1`` for evaluation).
        x: Input features of ``input_nodes``, ``(S, F)``; set by the worker.

    Its arrays are torch tensors, except in a sampler actor, where they are numpy
    arrays until packed (:meth:`tensors` makes them tensors, zero-copy).
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

    def to(self, device, non_blocking: bool = False) -> "MiniBatch":
        """Return a copy on ``device`` (``non_blocking`` needs pinned memory to overlap), its labels int64.

        Labels cross in their packed dtype and are widened there, on the
        device: the loss wants int64, and a cast on the host would be one more
        copy, into pageable memory, per batch.
        """
        mb = self._apply(lambda t: t.to(device, non_blocking=non_blocking))
        mb.labels = mb.labels.long()
        return mb

    def tensors(self) -> "MiniBatch":
        """The same batch over torch tensors: views of its numpy arrays (a sampler's batch), or itself."""
        import torch

        return self._apply(lambda a: torch.from_numpy(a) if isinstance(a, np.ndarray) else a)

    def _apply(self, fn) -> "MiniBatch":
        """A copy with ``fn`` applied to each of its arrays."""

        def each(a):
            return None if a is None else fn(a)

        return replace(self, seeds=each(self.seeds), labels=each(self.labels), input_nodes=each(self.input_nodes),
                       layers=[Layer(each(l.indptr), each(l.indices), l.num_src, each(l.etype)) for l in self.layers],
                       x=each(self.x))

    def pack(self, dtype: np.dtype = np.int64) -> np.ndarray:
        """Encode as one flat ``dtype`` array (pass :func:`id_dtype` of the graph; see the module docstring)."""
        return np.concatenate(self._parts(dtype), dtype=dtype, casting="unsafe")

    @property
    def typed(self) -> bool:
        return bool(self.layers) and self.layers[0].etype is not None

    def _parts(self, dtype: np.dtype) -> list[np.ndarray]:
        """The arrays :meth:`pack` concatenates, once checked to fit ``dtype`` (ids fit it by :func:`id_dtype`;
        the counts and offsets are checked here, O(1) a layer: offsets grow, so the last is the largest)."""
        typed = self.typed
        header = [_MAGIC_TYPED if typed else _MAGIC, self.epoch, len(self.layers), self.num_seeds,
                  int(self.input_nodes.shape[0])]
        for layer in self.layers:
            header += [layer.num_src, layer.num_dst, int(layer.indices.shape[0])]
            check_fits(max(layer.num_src, int(layer.indices.shape[0]),
                           int(layer.indptr[-1]) if layer.indptr.shape[0] else 0), dtype)
        check_fits(max(header[1:]), dtype, "a mini-batch")
        # np.asarray: a view of a CPU tensor's memory, or the sampler's own array.
        parts = [np.asarray(header, dtype=np.int64), np.asarray(self.seeds), np.asarray(self.labels),
                 np.asarray(self.input_nodes)]
        for layer in self.layers:
            parts += [np.asarray(layer.indptr), np.asarray(layer.indices)] + ([np.asarray(layer.etype)] if typed else [])
        return parts

    @staticmethod
    def unpack(packed: torch.Tensor) -> "MiniBatch":
        """Decode :meth:`pack`'s output; every tensor is a view into ``packed`` (:meth:`to` makes labels int64)."""
        import torch

        if packed.dtype not in (torch.int32, torch.int64) or packed.dim() != 1 or packed.shape[0] < _FIXED_HEADER:
            raise ValueError("not a packed MiniBatch: expected a 1-D int32 or int64 array")
        magic, epoch, num_layers, num_seeds, num_input = packed[:_FIXED_HEADER].tolist()
        if magic not in (_MAGIC, _MAGIC_TYPED):
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
        typed = magic == _MAGIC_TYPED
        layers = [Layer(take(num_dst + 1), take(nnz), num_src, take(nnz) if typed else None)
                  for num_src, num_dst, nnz in shapes]
        if pos > packed.shape[0]:
            raise ValueError("packed MiniBatch is truncated")
        if pos < packed.shape[0]:
            raise ValueError(f"packed MiniBatch has {packed.shape[0] - pos} trailing values")
        return MiniBatch(seeds, labels, input_nodes, layers, epoch=epoch)


def to_arrow(batches: Sequence[MiniBatch], dtype: np.dtype) -> pa.Table:
    """Pack ``batches`` into a table of one ``large_list`` row each, with one copy of their data."""
    import pyarrow as pa  # here: a train worker's step needs torch and numpy only

    parts = [b._parts(dtype) for b in batches]
    lengths = [sum(len(p) for p in ps) for ps in parts]
    offsets = np.zeros(len(batches) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate([p for ps in parts for p in ps], dtype=dtype, casting="unsafe")
    return pa.table({_COLUMN: pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))})


def from_arrow(table: pa.Table) -> Iterator[np.ndarray]:
    """Yield the packed mini-batches of a :func:`to_arrow` table (or a slice of one) as zero-copy views."""
    for chunk in table.column(_COLUMN).chunks:
        offsets = chunk.offsets.to_numpy()  # already shifted by the chunk's slice offset
        values = chunk.values.to_numpy(zero_copy_only=True)
        for start, stop in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            yield values[start:stop]
