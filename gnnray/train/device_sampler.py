"""Stage 4 on the train worker's device (``--sample-on device``): seeds in, a sampled ``MiniBatch`` of device tensors out.

The same semantics as the sampler actors' :class:`~gnnray.sampler.sampler.Sampler`
(GraphBolt's): each destination keeps ``min(fanout, in-degree)`` of its
in-edges, uniformly without replacement, all with ``-1``, each relation of a
typed graph apart with its own fanout; picked sources are numbered locally,
the destinations first, then new ids as they first appear. The batch is the
one :class:`~gnnray.batch.MiniBatch` of CSC ``Layer`` s, in the same
dtypes, its tensors on the device.

Why vectorised torch and not a loop: the device runs it. Every candidate
in-edge gets a random 32-bit key; one sort by (relation run, key) puts each
run's edges in a uniformly random order, and the first ``k`` of a run are a
uniform ``k``-subset. That pays for every in-edge of the layer's nodes, which
a GPU does at memory speed, where the CPU's loop (:mod:`.pick`) pays per pick.
Numbering uses ``torch.unique`` over the layer's ids, so no node-sized table
is kept on the device.

The graph's CSC (and labels, and relation codes) is copied to the device
once; draws are seeded by (run seed, epoch, batch, layer) as the actors' are,
but from torch's generator: the same distribution, not the same picks.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Optional, Sequence, Union

import numpy as np
import torch

from gnnray.batch import Layer, MiniBatch, check_fits, id_dtype
from gnnray.config import Fanouts, JobConfig
from gnnray.data.graph import Graph
from gnnray.data.typed import fanout_table
from gnnray.sampler.pick import batch_key
from gnnray.sampler.sampler import Sampler
from gnnray.seeds import SeedPlan, SeedReader
from gnnray.train.prefetch import HostSlot, Prefetcher

_KEY_BITS = 32  # random bits a candidate edge gets; runs are numbered in the bits above


class DeviceSampler:
    """Uniform neighbour sampling without replacement, in torch on ``device``.

    Args:
        graph: The graph (read-only numpy views are fine: its arrays are copied to ``device`` once).
        fanouts: Neighbours per layer, input layer first; ``-1`` takes all (per relation on a typed graph).
        device: Where the CSC lives and batches are sampled (a GPU, or the CPU).
        seed: The run's seed.
    """

    def __init__(self, graph: Graph, fanouts: Union[Fanouts, Sequence[int]], device: Union[str, torch.device],
                 seed: int = 0):
        self.device = torch.device(device)
        self._seed = int(seed)
        self._num_nodes = graph.num_nodes
        self.id_dtype = id_dtype(graph.num_nodes)
        self._ids = torch.from_numpy(np.empty(0, graph.indices.dtype)).dtype  # sampled ids come in it

        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

        self._indptr, self._indices = put(graph.indptr), put(graph.indices)
        self._label = put(graph.label)
        typed = graph.typed and bool(graph.edge_types)
        self._etype = put(graph.etype).long() if typed else None  # long: it indexes the fanouts
        self._codes = torch.from_numpy(np.empty(0, graph.etype.dtype)).dtype if graph.typed else None
        # Per layer, output layer first: one fanout per relation code (one entry when untyped).
        self._fanouts = [torch.tensor(f, dtype=torch.int64, device=self.device)
                         for f in reversed(fanout_table(fanouts, graph))]

    def sample(self, seeds: Union[torch.Tensor, np.ndarray], epoch: int = -1, batch: Optional[int] = None
               ) -> MiniBatch:
        """The blocks of ``seeds`` (unique global ids, any integer dtype, any device: moved here first).

        ``batch`` numbers the batch within its epoch; without it (evaluation) the seeds' sum names it.
        """
        seeds = torch.as_tensor(seeds).to(self.device).to(self._ids)
        if batch is None:
            batch = int(seeds.long().sum()) * 0x9E3779B1 + int(seeds.shape[0])
        nodes, layers = seeds, []
        for i, fanout in enumerate(self._fanouts):
            gen = torch.Generator(self.device)
            gen.manual_seed(batch_key(self._seed, epoch, batch, i) & (2**63 - 1))
            offsets, picked, etype = self._pick(nodes, fanout, gen)
            local, src = _relabel(nodes, picked)
            layers.append(Layer(offsets.to(self._ids), local.to(self._ids), int(src.shape[0]), etype))
            nodes = src.to(self._ids)
        layers.reverse()
        return MiniBatch(seeds, self._label[seeds.long()].long(), nodes, layers, epoch=epoch)

    def _pick(self, nodes: torch.Tensor, fanout: torch.Tensor, gen: torch.Generator):
        """One layer: CSC offsets (int64), the picked sources' global ids and, typed, their relation codes.

        Sizes are read back to the host as few times as the shapes need (each read waits for the device):
        untyped, once for the candidates and the picks together, then once in :func:`_relabel`.
        """
        dev, n = self.device, nodes.shape[0]
        nodes = nodes.long()
        start = self._indptr[nodes].long()
        degree = self._indptr[nodes + 1].long() - start
        if self._etype is None:  # runs are destinations: every size is known from the degrees
            take = torch.where((fanout < 0) | (degree <= fanout), degree, fanout)
            total, picks = torch.stack([degree.sum(), take.sum()]).tolist()
        else:
            total = int(degree.sum())
        # Every candidate in-edge: its destination's row and its position in the CSC.
        row = torch.repeat_interleave(torch.arange(n, device=dev), degree, output_size=total)
        first = torch.cumsum(degree, 0) - degree
        pos = start[row] + (torch.arange(total, device=dev) - first[row])
        # Runs: a destination's in-edges of one relation (sorted by relation in the CSC); untyped, one per node.
        if self._etype is None:
            run, size, run_start = row, degree, first
        else:
            code = self._etype[pos]
            new = torch.ones(total, dtype=torch.bool, device=dev)
            new[1:] = (row[1:] != row[:-1]) | (code[1:] != code[:-1])
            run = torch.cumsum(new, 0) - 1
            run_fanout = fanout[code[new]]
            size = torch.zeros(run_fanout.shape[0], dtype=torch.int64, device=dev)
            size.index_add_(0, run, torch.ones_like(run))
            take = torch.where((run_fanout < 0) | (size <= run_fanout), size, run_fanout)
            picks = int(take.sum())
            run_start = torch.cumsum(size, 0) - size
        check_fits(picks, np.dtype(self.id_dtype))
        # Within each run, a uniformly random order (stable sort keeps runs in place), then its first `take`:
        # positions run_start[r] + j, j < take[r], of the sorted order.
        key = torch.randint(0, 2**_KEY_BITS, (total,), generator=gen, device=dev, dtype=torch.int64)
        order = torch.sort((run << _KEY_BITS) | key, stable=True).indices
        runs = torch.arange(take.shape[0], device=dev)
        of_pick = torch.repeat_interleave(runs, take, output_size=picks)
        take_start = torch.cumsum(take, 0) - take
        chosen = order[run_start[of_pick] + (torch.arange(picks, device=dev) - take_start[of_pick])]
        picked_pos = pos[chosen]
        if self._etype is None:
            counts = take
        else:
            counts = torch.zeros(n, dtype=torch.int64, device=dev)
            counts.index_add_(0, row[chosen], torch.ones_like(chosen))
        offsets = torch.zeros(n + 1, dtype=torch.int64, device=dev)
        torch.cumsum(counts, 0, out=offsets[1:])
        etype = None
        if self._codes is not None:  # in the graph's code dtype, as the actors' batches carry them
            etype = (self._etype[picked_pos] if self._etype is not None
                     else torch.empty(0, dtype=torch.int64, device=dev)).to(self._codes)
        return offsets, self._indices[picked_pos], etype

    def __repr__(self) -> str:
        return f"DeviceSampler(device={self.device}, layers={len(self._fanouts)})"


def _relabel(nodes: torch.Tensor, picked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Number ``picked`` locally: ``nodes`` (unique) are ``0..n-1``, new ids follow in order of first appearance.

    Returns the picked edges' local ids and the layer's sources (global ids, numbered order).
    """
    n = nodes.shape[0]
    both = torch.cat([nodes.long(), picked.long()])
    ids, inverse = torch.unique(both, return_inverse=True)
    where = torch.arange(both.shape[0], device=both.device)
    first = torch.full((ids.shape[0],), both.shape[0], dtype=torch.int64, device=both.device)
    first = first.scatter_reduce(0, inverse, where, reduce="amin")
    order = torch.argsort(first)  # first appearances are distinct, so the order is exact
    number = torch.empty_like(order)
    number[order] = torch.arange(order.shape[0], device=both.device)
    return number[inverse[n:]], ids[order]


class DeviceBatches(Prefetcher):
    """A rank's seed rows as sampled mini-batches on the device, features in ``x`` (``--sample-on device``).

    On a GPU the seeds go to the device first and are sampled there, on the
    :class:`~gnnray.train.prefetch.Prefetcher`'s thread and side stream, so
    that sampling the next batches overlaps the current step's compute (the
    sampler's few reads of sizes wait for the side stream only). On a CPU
    worker the native sampler (:class:`~gnnray.sampler.sampler.Sampler`, one
    thread) samples on the prefetch thread at idle priority (``idle``): in the
    time the step leaves a core idle, never taking one from the step's OpenMP
    team. Features are gathered where they are placed: on the device from a placed table (``placed``),
    else on the host for the batch's ``input_nodes`` and copied. The same
    batches the actors' stream yields (labels int64, features float32).

    Args:
        rows: The rank's stream rows (row numbers of ``plan``), in order.
        plan: The run's seed plan: a row's epoch and seeds.
        sampler: The device's sampler (a GPU's :class:`DeviceSampler`, or the CPU's native sampler).
        feat: The node features (a table, or a reader of sharded ones).
        device: Where batches are delivered.
        depth: Batches sampled ahead.
        placed: Features held on the device (:func:`gnnray.train.placement.place`), or ``None``.
        idle: The thread at idle priority (:class:`~gnnray.train.prefetch.Prefetcher`).
    """

    def __init__(self, rows: Iterable[int], plan, sampler, feat, device: torch.device, depth: int = 2,
                 placed=None, idle: bool = False):
        self._seeds, self._sampler = SeedReader(plan), sampler  # before the thread starts
        super().__init__(rows, feat, device, depth=depth, placed=placed, idle=idle)

    def _prepare(self, row, slot: HostSlot):
        if slot.copied is not None:
            slot.copied.synchronize()  # the last copy out of this slot must finish before we overwrite it
        epoch, seeds = self._seeds.seeds(int(row))
        with torch.cuda.stream(self._stream) if self._cuda else contextlib.nullcontext():
            mb = self._sampler.sample(seeds, epoch=epoch, batch=int(row))
            placed = self._placed
            if placed is None:  # the table is on the host: its rows for the batch's inputs, copied
                x = slot.gather(self._feat, mb.input_nodes.cpu().numpy(), stored=self._cuda)
                mb.labels = mb.labels.long()  # the native sampler's are the graph's dtype
                mb.x = x.to(self._device, non_blocking=True).float()
            else:
                host = None
                if placed.host_supplied:  # with shards: rows only other nodes hold
                    copied = slot.host_rows(placed.host_rows(mb.input_nodes.cpu().numpy()))
                    host = tuple(t.to(self._device, non_blocking=True) for t in copied)
                mb.x = placed.gather(mb.input_nodes, host)
            if self._cuda:
                slot.copied = torch.cuda.Event()
                slot.copied.record(self._stream)
        return mb, slot.copied, None


def device_batches(rows: Iterable[int], graph: Graph, cfg: JobConfig, world: int, feat,
                   device: torch.device, placed=None) -> DeviceBatches:
    """This rank's :class:`DeviceBatches` over its stream ``rows``, with the seed plan the driver streamed: on a
    GPU the graph's CSC moved there, on a CPU the native sampler over the node's zero-copy graph."""
    s = cfg.sampler
    plan = (SeedPlan.elastic(graph.train_idx, s.batch_size, cfg.train.workers_max, world, cfg.run.seed)
            if cfg.train.elastic else SeedPlan.for_run(graph.train_idx, s.batch_size, world, cfg.run.seed))
    if device.type == "cpu":  # torch's draw pays per candidate edge (47x the native sampler's time here)
        sampler = Sampler(graph, s.fanouts, cfg.run.seed, threads=1)
        return DeviceBatches(rows, plan, sampler, feat, device, depth=cfg.train.prefetch, placed=placed, idle=True)
    return DeviceBatches(rows, plan, DeviceSampler(graph, s.fanouts, device, cfg.run.seed), feat, device,
                         depth=cfg.train.prefetch, placed=placed)
