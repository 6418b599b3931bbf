"""With stage 7 (train worker): layer-wise full-neighbor inference, each rank a slice of every layer's nodes.

Sampled evaluation recomputes each node's neighborhood with ``--eval-fanouts``;
layer-wise inference (as DGL's ``inference`` and PyG's multi-GPU example) is
exact and cheaper: layer ``i`` is computed once for *all* nodes, each with
*all* its in-neighbors, from layer ``i - 1``'s output for all nodes.

Where it runs: on the train workers after the last epoch (``--eval layerwise``,
:mod:`gnnray.train.loop`), on their devices; with world size 1 in one Ray task
for ``jobs/predict.py`` and a finished run resumed (:mod:`gnnray.inference.layerwise_task`).

How: rank ``r`` of ``W`` takes nodes ``[r N / W, (r + 1) N / W)`` in chunks of
``--inference-batch-size``. A chunk's block is rows ``[a, b)`` of the
node-shared CSC (:func:`full_block`): torch alone, no sampler, no DGL. Its
input rows are gathered from the previous layer's table (layer 0: the
features and, with ``--embedding-dim``, the embedding rows). Each rank puts
its slice of a layer's output in the object store (numpy) and the ranks
exchange the refs (:func:`_share`): slices of ranks on the same node are read
zero-copy, another node's once per node (Ray pulls an object to a node once).
No process writes a file. The last layer's predictions are counted per split
and summed over the ranks.

Memory per node: the object store holds each hidden layer's table
(``N x width`` float32) from its layer to the end of the evaluation: a ref
passed between processes outside Ray's own calls stays pinned while its
owner (the rank that put it) lives, and the worker group ends right after.

With ``--feature-shards K`` the tables are sharded instead (``shards=``,
:mod:`gnnray.train.layerwise_hidden`): the ranks compute the feature shards' node ranges,
each chunk goes to its range's shard server, and the next layer fetches the
rows it needs from the servers: a shard node holds its range of two tables,
2 x table / K, and no node holds a table whole.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from gnnray.batch import Layer
from gnnray.data.graph import Graph
from gnnray.train.feature_reader import FeatureReader, take_rows
from gnnray.train.layerwise_hidden import Tables

_SPLITS = ("train", "valid", "test")


def supports_layerwise(model: torch.nn.Module) -> bool:
    """Whether ``model`` exposes ``num_layers`` and ``layer(i, layer, h)`` (the built-in models do)."""
    model = getattr(model, "module", model)  # DDP
    return callable(getattr(model, "layer", None)) and isinstance(getattr(model, "num_layers", None), int)


def full_block(graph: Graph, a: int, b: int) -> tuple[Layer, Optional[np.ndarray]]:
    """The full-neighbor block of destination nodes ``[a, b)``: rows ``a..b`` of the graph's CSC, in local ids.

    Returns the block and its source nodes' global ids: the chunk's nodes
    first, in order, then their other in-neighbors, each once (sorted). The
    ids are ``None`` when the chunk is the whole graph: the sources are then
    all nodes in order, and the CSC is used as it is.
    """
    lo, hi = int(graph.indptr[a]), int(graph.indptr[b])
    nbr = torch.from_numpy(graph.indices[lo:hi].astype(np.int64))
    indptr = torch.from_numpy(graph.indptr[a:b + 1].astype(np.int64) - lo)
    etype = None if graph.etype is None else torch.from_numpy(graph.etype[lo:hi].astype(np.int64))
    if a == 0 and b == graph.num_nodes:
        return Layer(indptr, nbr, graph.num_nodes, etype), None
    uniq, inverse = torch.unique(nbr, return_inverse=True)
    outside = (uniq < a) | (uniq >= b)
    local = torch.where(outside, (b - a) + torch.cumsum(outside, 0) - 1, uniq - a)
    src = torch.cat([torch.arange(a, b), uniq[outside]])
    return Layer(indptr, local[inverse], int(src.shape[0]), etype), src.numpy()


class SliceRows(FeatureReader):
    """A table whose rows are held as slices ``(first node id, rows)`` covering the nodes, read by global id."""

    def __init__(self, slices: Sequence[tuple[int, np.ndarray]]):
        super().__init__()
        slices = sorted([(int(lo), rows) for lo, rows in slices if len(rows)], key=lambda s: s[0])
        self._starts = np.array([lo for lo, _ in slices] or [0], dtype=np.int64)
        self._parts = [rows for _, rows in slices]
        self.dim = int(self._parts[0].shape[1]) if self._parts else 0

    def whole(self) -> Optional[np.ndarray]:
        """The table as one array, when one slice holds it all."""
        return self._parts[0] if len(self._parts) == 1 and self._starts[0] == 0 else None

    def gather(self, ids, out):
        ids = np.asarray(ids, dtype=np.int64)
        if len(self._parts) == 1:
            take_rows(self._parts[0], ids - self._starts[0], out)
        else:
            part = np.searchsorted(self._starts, ids, side="right") - 1
            order = np.argsort(part, kind="stable")
            bounds = np.searchsorted(part[order], np.arange(len(self._parts) + 1))
            for k, rows in enumerate(self._parts):
                p = order[bounds[k]:bounds[k + 1]]
                if len(p):
                    take_rows(rows, ids[p] - self._starts[k], out, rows=p)
        s = self._stats
        s.batches, s.rows, s.local_rows = s.batches + 1, s.rows + len(ids), s.local_rows + len(ids)


class EmbeddingRows(FeatureReader):
    """The current rows of a train worker's embedding table (``train.embedding.EmbeddingTable``)."""

    def __init__(self, embedding):
        super().__init__()
        self._embedding, self.dim = embedding, int(embedding.dim)

    def gather(self, ids, out):
        with torch.no_grad():
            out[:] = self._embedding(torch.from_numpy(np.asarray(ids, dtype=np.int64))).numpy()


@dataclass
class Predictions:
    """What :func:`infer` computed on this rank.

    Attributes:
        ranges: The ``(lo, hi, shard)`` node ranges this rank computed, in order (``shard`` is ``None``
            without ``--feature-shards``); ``pred`` and ``last_input`` hold their nodes in that order.
        pred: Predicted class of each node of the ranges.
        correct, total: Per split (train, valid, test), summed over the ranks.
        last_input: With ``keep_input``, the output layer's input rows of the ranges' nodes.
        seconds: Wall time, this rank.
    """

    ranges: list
    pred: np.ndarray
    correct: np.ndarray
    total: np.ndarray
    last_input: Optional[np.ndarray]
    seconds: float

    @property
    def accuracy(self) -> dict:
        return {s: float(self.correct[k] / self.total[k]) if self.total[k] else float("nan")
                for k, s in enumerate(_SPLITS)}


def infer(model: torch.nn.Module, graph: Graph, inputs: Sequence[FeatureReader], batch_size: int, device,
          rank: int = 0, world: int = 1, keep_input: bool = False, shards=None) -> Predictions:
    """Predict this rank's nodes with layer-wise full-neighbor inference; every rank calls it.

    Args:
        model: A model with ``num_layers`` and ``layer(i, layer, h)`` on ``device`` (DDP-wrapped or not).
        graph: The node-shared graph (structure, labels, splits).
        inputs: Readers whose rows, side by side, are layer 0's input (features, then embedding rows).
        batch_size: Destination nodes per chunk.
        device: Where the layers run.
        rank, world: This rank and the number of ranks (a torch.distributed group when above 1).
        keep_input: Also return the output layer's input rows of the slice (``jobs/predict.py --embeddings``).
        shards: With ``--feature-shards``, the feature shards (``ShardedFeatures``): their servers then hold
            the hidden tables, a node range each (:mod:`gnnray.train.layerwise_hidden`), instead of every node whole.
    """
    start = time.perf_counter()
    net = getattr(model, "module", model)
    training = net.training
    net.eval()
    n = graph.num_nodes
    tables = None
    if shards is None:
        ranges = [(rank * n // world, (rank + 1) * n // world, None)]
    else:
        tables = Tables(shards, rank, world, device)
        ranges = tables.ranges
    readers = [r for r in inputs if r.dim > 0]
    failed = True
    try:
        with torch.no_grad():
            for i in range(net.num_layers):
                last = i == net.num_layers - 1
                keep = None if last or tables is None else functools.partial(tables.keep, i)
                out, width = _layer(net, i, graph, readers, ranges, batch_size, device, keep)
                if last:
                    break
                readers = [_share(out, ranges[0][0], rank, world) if tables is None else tables.reader(i, width)]
        last_input = None
        if keep_input:
            ids = np.concatenate([np.arange(lo, hi) for lo, hi, _ in ranges] or [np.zeros(0, dtype=np.int64)])
            last_input = np.empty((len(ids), sum(r.dim for r in readers)), dtype=np.float32)
            _gather(readers, ids, last_input)
        pred = out.argmax(1)
        correct, total = _counts(graph, pred, ranges, world, device)  # after every rank's last read: a barrier
        failed = False
    finally:
        net.train(training)
        if tables is not None:
            tables.close(failed)
    return Predictions(ranges, pred, correct, total, last_input, time.perf_counter() - start)


def _layer(net, i: int, graph: Graph, readers: list, ranges: list, batch_size: int, device,
           keep=None) -> tuple[Optional[np.ndarray], int]:
    """Layer ``i``'s output for the nodes of ``ranges``, chunk by chunk, and its width.

    The output is returned in range order or, with ``keep``, each chunk handed to ``keep(shard, lo, rows)``
    as soon as it is computed (``None`` returned).
    """
    total = sum(hi - lo for lo, hi, _ in ranges)
    chunks = [(a, min(a + batch_size, hi), k) for lo, hi, k in ranges for a in range(lo, hi, batch_size)]
    out, width, at = None, 0, 0
    for a, b, k in chunks or [(0, 0, None)]:  # no nodes: one empty chunk, for the output's width
        h = _chunk(net, i, graph, readers, a, b, device)
        width = h.shape[1]
        if keep is not None:
            if b > a:
                keep(k, a, h)
            continue
        if out is None:
            out = np.empty((total, width), dtype=np.float32)
        out[at:at + b - a] = h
        at += b - a
    return out, width


def _chunk(net, i: int, graph: Graph, readers: list, a: int, b: int, device) -> np.ndarray:
    """Layer ``i``'s output for nodes ``[a, b)``: their full-neighbor block, input rows gathered from ``readers``."""
    block, src = full_block(graph, a, b) if b > a else (Layer(torch.zeros(1, dtype=torch.int64),
                                                               torch.zeros(0, dtype=torch.int64), 0), None)
    whole = None
    if b > a and src is None and len(readers) == 1 and isinstance(readers[0], SliceRows):
        whole = readers[0].whole()
    if whole is not None:  # a chunk that is the whole graph reads the whole table in place
        x = torch.from_numpy(whole)
    else:
        x = torch.from_numpy(np.empty((block.num_src, sum(r.dim for r in readers)), dtype=np.float32))
        _gather(readers, np.arange(a, a + block.num_src) if src is None else src, x.numpy())
    block = Layer(block.indptr.to(device), block.indices.to(device), block.num_src,
                  None if block.etype is None else block.etype.to(device))
    return net.layer(i, block, x.to(device))[:b - a].float().cpu().numpy()


def _gather(readers: list, ids: np.ndarray, out: np.ndarray) -> None:
    """Rows ``ids`` of the readers, side by side, into ``out`` (float32, whatever each table stores)."""
    col = 0
    for r in readers:
        if len(readers) == 1:
            r.gather(ids, out)
        else:
            part = np.empty((len(ids), r.dim), dtype=np.float32)
            r.gather(ids, part)
            out[:, col:col + r.dim] = part
        col += r.dim


def _share(out: np.ndarray, lo: int, rank: int, world: int) -> SliceRows:
    """The layer's whole table, from every rank's slice: put in the object store, refs exchanged."""
    if world == 1:
        return SliceRows([(lo, out)])
    import ray
    import ray.cloudpickle
    import torch.distributed as dist

    ref = ray.put(out)
    del out  # from here the store's copy serves this rank too
    refs: list = [None] * world
    # Ray's pickler, not torch's: a ref pickled by it carries its owner, which ray.get needs.
    dist.all_gather_object(refs, ray.cloudpickle.dumps((lo, ref)))
    return SliceRows([(first, ray.get(r)) for first, r in map(ray.cloudpickle.loads, refs)])


def _counts(graph: Graph, pred: np.ndarray, ranges: list, world: int, device) -> tuple[np.ndarray, np.ndarray]:
    """Correct predictions and nodes per split in the ranges, summed over the ranks (the last all-reduce)."""
    counts = np.zeros((2, len(_SPLITS)), dtype=np.int64)
    at = np.cumsum([0] + [hi - lo for lo, hi, _ in ranges])
    for k, name in enumerate(_SPLITS):
        ids = graph.split(name)
        for (lo, hi, _), first in zip(ranges, at):
            mine = ids[(ids >= lo) & (ids < hi)]
            counts[:, k] += int(np.sum(pred[first + mine - lo] == graph.label[mine])), len(mine)
    if world > 1:  # also the barrier before any rank drops its slices or tables (owners must outlive the readers)
        import torch.distributed as dist

        total = torch.from_numpy(counts).to(device)
        dist.all_reduce(total)
        counts = total.cpu().numpy()
    return counts[0], counts[1]
