"""Tests of gnnray.train.prefetch: ordered, correct, exception-transparent, closable background preparation."""

from __future__ import annotations

import itertools
import os
import threading
import time

import numpy as np
import pytest
import torch

from gnnray.batch import Layer, MiniBatch
from gnnray.train.prefetch import Prefetcher

NUM_NODES, FEAT_DIM = 60, 5


@pytest.fixture(scope="module")
def feat() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((NUM_NODES, FEAT_DIM)).astype(np.float32)


def make_packed(i: int, num_seeds: int, num_extra: int = 3, epoch: int = 0) -> np.ndarray:
    """A packed one-layer mini-batch whose seeds identify it (``i`` is the batch number)."""
    rng = np.random.default_rng(i)
    ids = rng.permutation(NUM_NODES)[: num_seeds + num_extra]
    seeds, input_nodes = ids[:num_seeds], ids
    indptr = np.arange(0, 2 * num_seeds + 1, 2)  # two in-edges per destination
    indices = rng.integers(0, len(input_nodes), 2 * num_seeds)
    layer = Layer(torch.from_numpy(indptr), torch.from_numpy(indices), len(input_nodes))
    mb = MiniBatch(torch.from_numpy(seeds), torch.from_numpy(seeds % 3), torch.from_numpy(input_nodes), [layer],
                   epoch=epoch)
    packed = mb.pack()
    packed.flags.writeable = False  # rows arrive from Ray Data as read-only views
    return packed


def expected(packed: np.ndarray) -> MiniBatch:
    return MiniBatch.unpack(torch.from_numpy(packed.copy()))


def check(mb: MiniBatch, packed: np.ndarray, feat: np.ndarray) -> None:
    want = expected(packed)
    assert mb.epoch == want.epoch
    assert torch.equal(mb.seeds.cpu(), want.seeds)
    assert torch.equal(mb.labels.cpu(), want.labels)
    assert torch.equal(mb.input_nodes.cpu(), want.input_nodes)
    for a, b in zip(mb.layers, want.layers):
        assert a.num_src == b.num_src
        assert torch.equal(a.indptr.cpu(), b.indptr)
        assert torch.equal(a.indices.cpu(), b.indices)
    assert mb.x is not None
    assert mb.x.dtype == torch.float32
    assert tuple(mb.x.shape) == (want.input_nodes.shape[0], feat.shape[1])
    assert np.array_equal(mb.x.cpu().numpy(), feat[want.input_nodes.numpy()])


def close_or_fail(p: Prefetcher, timeout: float = 30.0) -> None:
    """Close ``p`` on a helper thread so a hang fails the test instead of blocking it."""
    closer = threading.Thread(target=p.close, daemon=True)
    closer.start()
    closer.join(timeout)
    assert not closer.is_alive(), "Prefetcher.close() hung"
    assert p._thread is None or not p._thread.is_alive(), "prefetch thread still alive after close()"


def test_batches_in_order_with_features(feat):
    rows = [make_packed(i, num_seeds=1 + i % 7, epoch=i // 4) for i in range(12)]
    p = Prefetcher(iter(rows), feat, "cpu", depth=2)
    got = 0
    for i, mb in enumerate(p):
        check(mb, rows[i], feat)
        got += 1
    assert got == len(rows)
    close_or_fail(p)


def test_last_batch_then_stop_iteration_again_and_again(feat):
    rows = [make_packed(i, 4) for i in range(3)]
    p = Prefetcher(rows, feat, "cpu", depth=2)
    for i in range(3):
        check(next(p), rows[i], feat)
    with pytest.raises(StopIteration):
        next(p)
    with pytest.raises(StopIteration):
        next(p)
    close_or_fail(p)


def test_empty_source_stops_immediately(feat):
    p = Prefetcher([], feat, "cpu", depth=2)
    with pytest.raises(StopIteration):
        next(p)
    with pytest.raises(StopIteration):
        next(p)
    assert list(p) == []
    close_or_fail(p)


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("k", [0, 1, 5])
def test_source_exception_reaches_consumer_after_good_batches(feat, k):
    rows = [make_packed(i, 3) for i in range(k)]

    def source():
        yield from rows
        raise Boom(f"source failed after {k} rows")

    p = Prefetcher(source(), feat, "cpu", depth=2)
    for i in range(k):
        check(next(p), rows[i], feat)
    with pytest.raises(Boom, match=f"source failed after {k} rows"):
        next(p)
    with pytest.raises(Boom):  # stays failed, never hangs or pretends to have ended
        next(p)
    close_or_fail(p)


def test_bad_row_raises_value_error_to_consumer(feat):
    good = make_packed(0, 3)
    bad = np.arange(20, dtype=np.int64)  # wrong magic
    p = Prefetcher([good, bad, make_packed(1, 3)], feat, "cpu", depth=2)
    check(next(p), good, feat)
    with pytest.raises(ValueError, match="magic"):
        next(p)
    close_or_fail(p)


def _infinite(slow: bool):
    for i in itertools.count():
        if slow:
            time.sleep(0.002)
        yield make_packed(i % 50, 2 + i % 5)


@pytest.mark.parametrize("slow", [False, True], ids=["fast-source", "slow-source"])
def test_close_stops_thread_when_consumer_stops_early(feat, slow):
    p = Prefetcher(_infinite(slow), feat, "cpu", depth=2)
    for _ in range(3):
        next(p)
    close_or_fail(p)


def test_close_before_consuming_anything(feat):
    p = Prefetcher(_infinite(False), feat, "cpu", depth=1)
    close_or_fail(p)
    close_or_fail(p)  # idempotent


def test_context_manager_closes(feat):
    with Prefetcher(_infinite(False), feat, "cpu", depth=2) as p:
        next(p)
    assert not p._thread.is_alive()


def test_buffer_reuse_keeps_current_batch_intact(feat):
    sizes = [1, 20, 3, 15, 2, 25, 1, 8, 30, 4, 12, 2, 27, 5, 9, 1, 18, 6, 22, 3]
    rows = [make_packed(i, s, num_extra=(i * 7) % 10) for i, s in enumerate(sizes)]
    p = Prefetcher(rows, feat, "cpu", depth=1)
    held = next(p)
    for i in range(1, len(rows) + 1):
        time.sleep(0.002)  # let the background thread run ahead into its other buffers
        check(held, rows[i - 1], feat)  # batch i-1 is intact until the next call
        if i < len(rows):
            held = next(p)
    with pytest.raises(StopIteration):
        next(p)
    close_or_fail(p)


def test_the_thread_lets_go_of_its_buffers_after_the_last_row(feat):
    """After the last row the prefetcher holds no host buffers (evaluation after the last epoch allocates its
    own); a test that inspects them keeps its own references first (the CUDA tests below do)."""
    rows = [make_packed(i, 4) for i in range(3)]
    p = Prefetcher(rows, feat, "cpu", depth=2)
    slots = list(p._slots)
    assert len(list(p)) == 3
    assert p._slots == [] and any(s._feat.numel() > 0 for s in slots)
    close_or_fail(p)


@pytest.mark.parametrize("depth", [1, 2])
def test_it_fills_depth_plus_one_buffers(feat, depth):
    """The consumer's batch and ``depth`` ahead: a buffer is filled again once the consumer hands it back, so a
    long stream uses ``depth + 1`` of them (on CPU each holds a batch's features: 252 MB at products shape)."""
    rows = [make_packed(i % 50, 3) for i in range(40)]
    p = Prefetcher(rows, feat, "cpu", depth=depth)
    slots = list(p._slots)
    for i, mb in enumerate(p):
        time.sleep(0.001)  # the thread runs as far ahead as it may
        check(mb, rows[i], feat)
    assert sum(s._feat.numel() > 0 for s in slots) == depth + 1
    close_or_fail(p)


def test_read_only_features_are_fine(feat):
    ro = feat.copy()
    ro.flags.writeable = False
    rows = [make_packed(i, 4) for i in range(3)]
    with Prefetcher(rows, ro, "cpu", depth=2) as p:
        for i, mb in enumerate(p):
            check(mb, rows[i], ro)


def test_empty_batch(feat):
    rows = [make_packed(0, 0, num_extra=0), make_packed(1, 3)]
    with Prefetcher(rows, feat, "cpu") as p:
        first = next(p)
        assert first.num_seeds == 0
        assert tuple(first.x.shape) == (0, FEAT_DIM)
        check(next(p), rows[1], feat)


NO_GPU = "needs a CUDA GPU; this machine has none (CPU only)"


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_cuda_delivery(feat):
    rows = [make_packed(i, 1 + (i * 5) % 23, num_extra=i % 4) for i in range(16)]
    p = Prefetcher(rows, feat, "cuda", depth=2)
    slots = list(p._slots)  # the thread lets go of them after the last row
    n = 0
    for i, mb in enumerate(p):
        for t in (mb.seeds, mb.labels, mb.input_nodes, mb.x, *[t for l in mb.layers for t in (l.indptr, l.indices)]):
            assert t.is_cuda
        # compute on the consumer's stream, as the train loop does
        assert torch.equal((mb.x * 1.0).cpu(), torch.from_numpy(feat[expected(rows[i]).input_nodes.numpy()]))
        check(mb, rows[i], feat)
        n += 1
    assert n == len(rows)
    used = [s for s in slots if s._feat.numel() > 0]
    assert used
    for slot in used:
        assert slot._feat.is_pinned()
        assert slot._ids.is_pinned()
    close_or_fail(p)


# About 20-50 ms of GPU time per batch (clock rates 1-2.5 GHz): far longer than the consumer takes to launch its kernel.
SLEEP_CYCLES = 50_000_000


def make_wide_packed(i: int, num_nodes: int, num_input: int, num_seeds: int = 8) -> np.ndarray:
    """A packed one-layer mini-batch with many input nodes: megabytes of features per batch."""
    rng = np.random.default_rng(1000 + i)
    input_nodes = rng.choice(num_nodes, num_input, replace=False)
    indptr = np.arange(0, 2 * num_seeds + 1, 2)
    indices = rng.integers(0, num_input, 2 * num_seeds)
    layer = Layer(torch.from_numpy(indptr), torch.from_numpy(indices), num_input)
    seeds = torch.from_numpy(input_nodes[:num_seeds])
    return MiniBatch(seeds, seeds % 3, torch.from_numpy(input_nodes), [layer]).pack()


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_cuda_consumer_stream_waits_for_the_copy():
    """A kernel launched on the consumer's stream right after ``next`` reads the batch's copied data.

    The batch is copied on the Prefetcher's side stream; ``__next__`` makes the
    consumer's current stream wait on the copy's event (``current.wait_event(ready)``).
    To make the race certain, the source enqueues a GPU sleep on the side
    stream before each row, so each copy lands only after that sleep (tens of
    milliseconds; the copies of rows read ahead queue behind one another).
    The consumer then at once launches ``mb.x * 1.0`` (and ``input_nodes + 0``)
    on its current stream and compares the results with the host's.

    With the wait, those kernels run after the copy: the results are exact.
    Without it, they run while the side stream still sleeps, reading device
    memory the copy has not written yet: fresh memory or the memory of an
    earlier, already-consumed batch (other nodes), so ``torch.equal`` fails on
    the first batch at the latest. ``.cpu()`` synchronises only the consumer's
    stream (PyTorch's side streams do not synchronise with it implicitly), so
    it cannot hide the missing wait.
    """
    num_nodes, num_input, dim = 50_000, 20_000, 32  # 2.5 MiB of features per batch
    feat = np.random.default_rng(7).standard_normal((num_nodes, dim)).astype(np.float32)
    rows = [make_wide_packed(i, num_nodes, num_input) for i in range(6)]
    holder: dict = {}
    started = threading.Event()

    def delayed(source):
        # Runs on the prefetch thread, right before the Prefetcher prepares (and copies) each row.
        assert started.wait(60), "the test never handed over the Prefetcher"
        stream = holder["p"]._stream
        assert stream is not None
        with torch.cuda.stream(stream):
            # Warm the caching allocator on the side stream, so that the copies' allocations need no
            # cudaMalloc (which could synchronise the device and so let the copy land early).
            torch.empty(8 * num_input * dim, dtype=torch.float32, device="cuda")  # large pool: features
            torch.empty(1024, dtype=torch.int64, device="cuda")  # small pool (one 2 MiB segment): ids
        for row in source:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SLEEP_CYCLES)  # the row's copy queues behind this on the side stream
            yield row

    p = Prefetcher(delayed(rows), feat, "cuda", depth=2)
    holder["p"] = p
    started.set()
    n = 0
    for i, mb in enumerate(p):
        # Launched on the consumer's current stream at once, before anything synchronises.
        x_read, ids_read = mb.x * 1.0, mb.input_nodes + 0
        want = expected(rows[i])
        assert torch.equal(ids_read.cpu(), want.input_nodes), f"batch {i}: input_nodes read before the copy landed"
        assert torch.equal(x_read.cpu(), torch.from_numpy(feat[want.input_nodes.numpy()])), (
            f"batch {i}: features read before the copy landed")
        n += 1
    assert n == len(rows)
    close_or_fail(p)


def test_float16_features_arrive_as_float32(feat):
    """A float16 table is widened (on the host here, on a GPU after the copy): the model gets float32."""
    half = feat.astype(np.float16)
    rows = [make_packed(i, 4) for i in range(3)]
    with Prefetcher(rows, half, "cpu", depth=2) as p:
        for i, mb in enumerate(p):
            check(mb, rows[i], half.astype(np.float32))


def test_int32_rows_deliver_int64_labels(feat):
    rows = [MiniBatch.unpack(torch.from_numpy(make_packed(i, 5))).to("cpu").pack(np.int32) for i in range(3)]
    with Prefetcher(rows, feat, "cpu", depth=2) as p:
        for i, mb in enumerate(p):
            assert mb.labels.dtype == torch.int64 and mb.seeds.dtype == torch.int32
            check(mb, rows[i], feat)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_cuda_float16_crosses_as_float16_and_labels_as_packed(feat):
    """What crosses PCIe is what is stored: the pinned buffers hold float16 features and int32 ids and labels;
    the device widens them."""
    half = feat.astype(np.float16)
    rows = [MiniBatch.unpack(torch.from_numpy(make_packed(i, 5))).to("cpu").pack(np.int32) for i in range(6)]
    with Prefetcher(rows, half, "cuda", depth=2) as p:
        slots = list(p._slots)  # the thread lets go of them after the last row
        for i, mb in enumerate(p):
            assert mb.x.is_cuda and mb.x.dtype == torch.float32 and mb.labels.dtype == torch.int64
            check(mb, rows[i], half.astype(np.float32))
        used = [s for s in slots if s._feat.numel() > 0]
        assert used and all(s._feat.dtype == torch.float16 and s._feat.is_pinned() for s in used)
        assert all(s._ids.dtype == torch.int32 and s._ids.is_pinned() for s in used)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_cuda_thread_works_on_the_prefetchers_gpu(feat):
    """The prefetch thread sets its device: on GPU k it makes no context on GPU 0 (the last GPU here; on a
    one-GPU machine this checks only that the thread names it)."""
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    seen = []

    def source():
        for i in range(3):
            seen.append(torch.cuda.current_device())  # runs on the prefetch thread
            yield make_packed(i, 3)

    with Prefetcher(source(), feat, dev, depth=1) as p:
        for mb in p:
            assert mb.x.device == dev
    assert seen == [dev.index] * 3
    assert p._stream.device == dev


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason=NO_GPU))])
def test_embedding_rows_ahead_are_brought_up_to_date(device):
    """Rows read (on a GPU: and copied) on the prefetch thread are brought up to date when the batch is taken:
    the table ends as with lookups at each step on the CPU."""
    from gnnray.train.embedding import NodeEmbedding

    dim, batches = 4, 10
    rows = [make_packed(i, 5, num_extra=25) for i in range(batches)]  # 30 of 60 nodes each: rows are shared
    target = torch.from_numpy(np.random.default_rng(1).standard_normal((NUM_NODES, FEAT_DIM + dim),
                                                                       dtype=np.float32))

    def loss(x, ids):
        return ((x - target.to(x.device)[ids.long().to(x.device)]) ** 2).sum()

    # The reference: lookups at each step, on the CPU.
    feats = np.random.default_rng(2).standard_normal((NUM_NODES, FEAT_DIM)).astype(np.float32)
    now = NodeEmbedding(NUM_NODES, dim, 0.1, 0)
    for r in rows:
        mb = expected(r)
        x = torch.cat([torch.from_numpy(feats[mb.input_nodes.numpy()]), now(mb.input_nodes)], dim=1)
        loss(x, mb.input_nodes).backward()
        now.step()
    ahead = NodeEmbedding(NUM_NODES, dim, 0.1, 0)
    stale, complete = [], ahead.complete
    ahead.complete = lambda lookup: (stale.append(lookup.version < ahead._version), complete(lookup))[1]
    on_device = []
    with Prefetcher(rows, feats, device, depth=3, embedding=ahead) as p:
        for mb in p:
            time.sleep(0.05)  # let the thread read the next batches' rows before this step lands
            on_device.append(ahead._rows.device.type == device)
            loss(mb.x, mb.input_nodes).backward()
            ahead.step()
    assert all(on_device) and len(on_device) == batches
    assert sum(stale) >= 1  # some rows were read ahead of a step that changed them
    np.testing.assert_allclose(ahead.store.weight.numpy(), now.store.weight.numpy(), rtol=0, atol=1e-6)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's SCHED_IDLE policy only")
@pytest.mark.parametrize("idle", [False, True])
def test_an_idle_prefetcher_prepares_after_the_first_batch_at_idle_priority(feat, idle):
    """A CPU worker's own sampling: the first batch (the step waits for it) at normal priority, every later one
    at idle priority, on the thread alone; a prefetcher not asked for it keeps its priority throughout."""
    rows = [make_packed(i, num_seeds=1 + i % 5) for i in range(6)]
    policies = []

    def source():
        for row in rows:
            policies.append(os.sched_getscheduler(0))  # the preparing thread's policy
            yield row

    with Prefetcher(source(), feat, "cpu", depth=1, idle=idle) as p:
        for i, mb in enumerate(p):
            check(mb, rows[i], feat)
    assert len(policies) == len(rows) and policies[0] != os.SCHED_IDLE
    assert set(policies[1:]) == ({os.SCHED_IDLE} if idle else {policies[0]})
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the consumer's thread keeps its own
