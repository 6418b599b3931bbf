"""``prefetch float32|float16``: a batch's time with the ``Prefetcher`` against the larger of its copy and compute."""

from __future__ import annotations

import time

import numpy as np
import torch

from bench.gpu.batches import sync, synthetic_rows


def prefetch_overlap(device: str, batches: int = 20, input_nodes: int = 100_000, feat_dim: int = 128,
                     feat_dtype=np.float32) -> dict:
    """Per-batch times of the host side (gather + copy), of compute sized to take as long, and of both with and
    without the Prefetcher (full overlap would halve the serial time)."""
    from gnnray.batch import MiniBatch
    from gnnray.train.prefetch import HostSlot, Prefetcher

    dev = torch.device(device)
    # One layer: about input_nodes sources for min(1024, input_nodes / 4) seeds.
    seeds = min(1024, input_nodes // 4)
    packed, feat = synthetic_rows(np.random.default_rng(0), batches, seeds, (3 * input_nodes // seeds,), 10,
                                  feat_dim, feat_dtype)
    w = torch.randn(feat_dim, feat_dim, device=dev)

    def compute(mb, reps):
        h = mb.x
        for _ in range(reps):
            h = torch.tanh(h @ w)
        return h

    def per_batch(fn) -> float:
        sync(dev)
        t = time.perf_counter()
        fn()
        sync(dev)
        return (time.perf_counter() - t) / batches

    def host_only():
        with Prefetcher(packed, feat, dev, depth=2) as it:
            for _ in it:
                sync(dev)

    per_batch(host_only)  # warm-up: pinned buffers, the allocator
    copy_s = per_batch(host_only)
    with Prefetcher(packed[:1], feat, dev, depth=1) as it:
        resident = next(it)
        resident.x = resident.x.clone()
    unit = per_batch(lambda: [compute(resident, 1) for _ in range(batches)])
    reps = max(1, round(copy_s / max(unit, 1e-6)))
    compute_s = per_batch(lambda: [compute(resident, reps) for _ in range(batches)])

    def serial():
        slot = HostSlot(pin=False)
        for p in packed:
            mb = MiniBatch.unpack(torch.from_numpy(p.copy()))
            mb.x = slot.gather(feat, mb.input_nodes.numpy())  # widened on the host, as before the Prefetcher
            compute(mb.to(dev), reps)
            sync(dev)

    def overlapped():
        with Prefetcher(packed, feat, dev, depth=2) as it:
            for mb in it:
                assert mb.x.dtype == torch.float32 and mb.labels.dtype == torch.int64
                compute(mb, reps)

    serial_s, prefetch_s = per_batch(serial), per_batch(overlapped)
    return dict(device=str(dev), feat_dtype=np.dtype(feat_dtype).name, copy_s=copy_s, compute_s=compute_s,
                reps=reps, serial_s=serial_s, prefetch_s=prefetch_s,
                prefetch_over_bound=prefetch_s / max(copy_s, compute_s),
                # On a CPU the thread and the compute share the cores: no target there.
                met=prefetch_s <= 1.1 * max(copy_s, compute_s) if dev.type == "cuda" else None)


def median_run(runs: list) -> dict:
    """The run whose ratio is the median of ``runs`` (one run's timings are noisy), with every ratio kept."""
    runs = sorted(runs, key=lambda r: r["prefetch_over_bound"])
    return dict(runs[len(runs) // 2], ratios=[r["prefetch_over_bound"] for r in runs])
