"""Stage 5 (train worker thread): packed rows become device-ready mini-batches, ahead of time.

Input: an iterator of packed mini-batches (``MiniBatch.pack`` output) and the
node-shared feature array. A background thread copies each row into a reused
host buffer (pinned when the device is a GPU), unpacks it, gathers its input
features there, and, on a GPU, starts the host-to-device copy on a side CUDA
stream of the worker's own GPU, so the copy overlaps the current step's
compute. What crosses is what is stored: ids and labels in the packed dtype,
features in theirs (float16 stays float16); the device widens them, on the side
stream. Output: :class:`MiniBatch` es on the device (labels int64, features
float32), in input order.

On a CPU worker that samples its own batches the thread runs at idle priority
(``idle``, Linux's ``SCHED_IDLE``): it takes only the time the step leaves a
core idle (its Python between kernels, single-threaded ops), and a thread of
the step's OpenMP team that wakes takes its core back at once. At normal
priority it would deschedule team threads, and a team waits for its slowest
thread; sampling on the step's thread between steps leaves those idle
moments unused (docs/cpu-plan.md).

With features placed on the device (``placed``, :mod:`gnnray.train.placement`)
the thread gathers nothing: only the batch's structure and ids cross (plus, with
``--feature-shards``, the rows fetched from other nodes), and the rows are
gathered on the device, on the side stream.

With learnable embeddings (``--embedding-dim``) the thread also reads the
batch's embedding rows (``embedding.prefetch``, from the owners with
``--feature-shards``) and, on a GPU, copies them to the device beside the
features; taking the batch brings them up to date (``embedding.complete``: rows
a step updated since are read again, and only those cross again) on the
consumer's thread, inside the time counted as ``data_wait``.

Torch and numpy only (no Ray, no DGL): this runs on any train worker.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Iterable, Iterator, Optional, Union

import numpy as np
import torch

from gnnray.batch import MiniBatch
from gnnray.train.feature_reader import FeatureReader, LocalRows

_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class HostSlot:
    """Reusable host buffers for one in-flight mini-batch.

    Reuse matters: gathering into fresh memory costs about twice as much,
    mostly page faults (docs/performance.md#the-data-path-and-why).
    """

    def __init__(self, pin: bool):
        self._pin = pin
        self._ids = torch.empty(0, dtype=torch.int64)
        self._feat = torch.empty(0, dtype=torch.float32)
        self._rows = torch.empty(0, dtype=torch.float32)  # embedding rows on their way to the GPU
        self._pos = torch.empty(0, dtype=torch.int64)  # positions of host-supplied rows (placed features)
        self.copied: Optional[torch.cuda.Event] = None  # set once a copy from this slot is queued

    def _grow(self, buf: torch.Tensor, numel: int, dtype: np.dtype) -> torch.Tensor:
        if buf.numel() >= numel and buf.numpy().dtype == dtype:
            return buf
        like = torch.from_numpy(np.empty(0, dtype))
        return torch.empty(int(numel * 1.25) + 1024, dtype=like.dtype, pin_memory=self._pin)

    def ids(self, n: int, dtype: np.dtype) -> torch.Tensor:
        self._ids = self._grow(self._ids, n, np.dtype(dtype))
        return self._ids[:n]

    def pos(self, pos: np.ndarray) -> torch.Tensor:
        """A copy of int64 ``pos`` in this slot's reused buffer."""
        self._pos = self._grow(self._pos, pos.shape[0], np.dtype(np.int64))
        out = self._pos[: pos.shape[0]]
        out.numpy()[:] = pos
        return out

    def feat(self, rows: int, dim: int, dtype: np.dtype = np.dtype(np.float32)) -> torch.Tensor:
        self._feat = self._grow(self._feat, rows * dim, np.dtype(dtype))
        return self._feat[: rows * dim].view(rows, dim)

    def host_rows(self, host) -> tuple:
        """Copies of a batch's host-supplied rows (a :class:`~gnnray.train.placement.HostRows`) in this slot's
        reused buffers: ``(positions, rows)``, ready to cross to the device."""
        rows = self.feat(host.rows.shape[0], host.rows.shape[1], host.rows.dtype)
        rows.numpy()[:] = host.rows
        return self.pos(host.pos), rows

    def rows(self, rows: np.ndarray) -> torch.Tensor:
        """A copy of float32 ``rows`` in this slot's reused buffer."""
        n, dim = rows.shape
        self._rows = self._grow(self._rows, n * dim, np.dtype(np.float32))
        out = self._rows[: n * dim].view(n, dim)
        out.numpy()[:] = rows
        return out

    def gather(self, feat: Union[np.ndarray, FeatureReader], ids: np.ndarray, stored: bool = False) -> torch.Tensor:
        """Rows ``ids`` of ``feat`` (a table or a reader), into this slot's reused buffer (valid until the next):
        float32, or with ``stored`` in the table's own dtype (to be widened on the device)."""
        reader = feat if isinstance(feat, FeatureReader) else LocalRows(feat)
        x = self.feat(ids.shape[0], reader.dim, reader.dtype if stored else np.dtype(np.float32))
        reader.gather(ids, x.numpy())
        return x


class Prefetcher:
    """Iterate mini-batches prepared ``depth`` steps ahead on a background thread.

    A yielded batch stays valid until the next call to ``next``: its host
    buffers are then reused. ``depth + 1`` host buffers in all: the thread
    fills one as soon as the consumer hands its last one back (on CPU each is
    a whole batch's features, 252 MB at products shape).

    Args:
        rows: Packed mini-batches (1-D int32 or int64 numpy arrays), read in order.
        feat: Node features: a ``(num_nodes, F)`` float32 or float16 table
            (read-only is fine) or a :class:`~gnnray.train.feature_reader.FeatureReader`
            (sharded features: remote rows are fetched here, on this thread).
        device: Where batches are delivered.
        depth: Batches prepared ahead of the consumer (at least 1).
        embedding: The job's learnable embedding (``train.embedding.EmbeddingTable``), if any: its rows are
            looked up here and appended to each batch's ``x``, which is then the model's whole input.
        placed: Features held on the device (:func:`gnnray.train.placement.place`): then only the ids (and
            rows the host alone has, fetched from other nodes) cross, and the rows are gathered there.
        idle: Run the thread at idle priority (the module docstring): for work that must not take a core
            from the step, and that nothing else on the node's cores would starve.
    """

    def __init__(self, rows: Iterable[np.ndarray], feat: Union[np.ndarray, FeatureReader], device: torch.device,
                 depth: int = 2, embedding=None, placed=None, idle: bool = False):
        self._embedding, self._placed, self._idle = embedding, placed, idle
        self._device = torch.device(device)
        self._cuda = self._device.type == "cuda"
        if self._cuda and self._device.index is None:  # the caller's current GPU, named: the thread sets it
            self._device = torch.device("cuda", torch.cuda.current_device())
        self._feat = feat if isinstance(feat, FeatureReader) else LocalRows(feat)
        self._slots = [HostSlot(pin=self._cuda) for _ in range(depth + 1)]
        self._free: queue.Queue = queue.Queue()  # slots the consumer handed back (or never had)
        for slot in self._slots:
            self._free.put(slot)
        self._held: Optional[HostSlot] = None  # the slot of the batch the consumer was last given
        self._stream = torch.cuda.Stream(self._device) if self._cuda else None
        self._queue: queue.Queue = queue.Queue()  # bounded by the free slots
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(iter(rows),), name="gnnray-prefetch", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[MiniBatch]:
        return self

    def __next__(self) -> MiniBatch:
        if self._stop.is_set():
            raise StopIteration
        if self._held is not None:  # the last batch given is done with: its slot may be filled again
            self._free.put(self._held)
            self._held = None
        item = self._queue.get()
        if item is _END:
            self._queue.put(_END)  # stay exhausted on later calls
            self._drop_slots()
            raise StopIteration
        if isinstance(item, _Failure):
            self._queue.put(item)
            raise item.exc
        mb, ready, lookup, self._held = item
        return self._deliver(mb, ready, lookup)

    def _deliver(self, mb: MiniBatch, ready, lookup) -> MiniBatch:
        """``mb`` ready for the consumer's stream, its embedding rows brought up to date."""
        if ready is not None:
            current = torch.cuda.current_stream(self._device)
            current.wait_event(ready)
            # Tensors allocated on the side stream are used on this one: tell
            # the caching allocator, or it may hand their memory out too early.
            for t in _tensors(mb):
                t.record_stream(current)
            if lookup is not None:
                lookup.device_rows.record_stream(current)
        if lookup is not None:  # here, not on the thread: it must follow the steps taken before this batch
            mb.x = torch.cat([mb.x, self._embedding.complete(lookup).to(self._device)], dim=1)
        return mb

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread; batches not yet consumed are dropped.

        A thread blocked inside its source (e.g. a Ray Data shard waiting on
        a dead actor) cannot be interrupted: after ``timeout`` seconds it is
        left behind (it is a daemon) so that the error being raised, if any,
        reaches the caller instead of hanging here.
        """
        self._stop.set()
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                self._thread.join(timeout=0.05)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _put(self, item) -> bool:
        if self._stop.is_set():
            return False
        self._queue.put(item)
        return True

    def _take_slot(self) -> Optional[HostSlot]:
        """A slot the consumer is done with; ``None`` once closed."""
        while not self._stop.is_set():
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                pass
        return None

    def _drop_slots(self) -> None:
        """Let go of the host buffers (a batch's features each), before what follows the last epoch
        (evaluation) allocates its own."""
        self._slots = []
        while True:
            try:
                self._free.get_nowait()
            except queue.Empty:
                return

    def _run(self, rows: Iterator[np.ndarray]) -> None:
        try:
            if self._cuda:
                # A new thread starts on GPU 0: without this, every rank of a multi-GPU node would create a
                # context there (pinned buffers, events) beside its own.
                torch.cuda.set_device(self._device)
            for i, packed in enumerate(rows):
                slot = self._take_slot()
                if slot is None or not self._put((*self._prepare(packed, slot), slot)):
                    return
                if i == 0 and self._idle:  # the consumer waits for the first batch: at normal priority, no core
                    idle_priority()        # another process of a starting run keeps busy delays it
            self._put(_END)
        except BaseException as exc:  # handed to the consumer, raised there
            self._put(_Failure(exc))

    def _prepare(self, packed: np.ndarray, slot: HostSlot):
        if slot.copied is not None:
            slot.copied.synchronize()  # the last copy out of this slot must finish before we overwrite it
        ids = slot.ids(packed.shape[0], packed.dtype)
        ids.numpy()[:] = packed  # rows arrive as read-only views; this is the one copy
        mb = MiniBatch.unpack(ids)
        host = None
        if self._placed is None:
            mb.x = slot.gather(self._feat, mb.input_nodes.numpy(), stored=self._cuda)
        else:  # gathered on the device; the host supplies only the rows it alone has (from other nodes)
            host = self._placed.host_rows(mb.input_nodes.numpy())
            if host is not None:
                host = slot.host_rows(host)
        lookup = self._embedding.prefetch(mb.input_nodes.numpy()) if self._embedding is not None else None
        if not self._cuda:
            mb = mb.to("cpu")  # labels int64 (a few bytes); the rest stays as it is
            if self._placed is not None:
                mb.x = self._placed.gather(mb.input_nodes, host)
            return mb, None, lookup
        rows = slot.rows(lookup.rows) if lookup is not None else None
        with torch.cuda.stream(self._stream):
            mb = mb.to(self._device, non_blocking=True)
            if self._placed is not None:
                host = None if host is None else tuple(t.to(self._device, non_blocking=True) for t in host)
                mb.x = self._placed.gather(mb.input_nodes, host)
            else:
                mb.x = mb.x.float()  # float16 crossed as such; widened here, on the side stream
            if lookup is not None:
                lookup.device_rows = rows.to(self._device, non_blocking=True)
            slot.copied = torch.cuda.Event()
            slot.copied.record(self._stream)
        return mb, slot.copied, lookup


def idle_priority() -> None:
    """Run the calling thread (and the threads it starts: the gather's OpenMP team) only on cores nothing else
    wants: Linux's ``SCHED_IDLE``; elsewhere (no such policy) it keeps its priority."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def _tensors(mb: MiniBatch) -> list[torch.Tensor]:
    out = [mb.seeds, mb.labels, mb.input_nodes, mb.x]
    for layer in mb.layers:
        out += [layer.indptr, layer.indices, layer.etype]
    return [t for t in out if t is not None]
