"""Figure 5: how much of the host-to-device copy the ``Prefetcher`` hides behind compute; n/a without a GPU."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from bench.common import Row, Settings, verdict

FIGURE, TARGET = "GPU prefetch s/batch (overlap)", "<= 1.1 x max(copy, compute)"


def synthetic_batches(batches: int, input_nodes: int, feat_dim: int) -> tuple[list, np.ndarray]:
    """Packed mini-batches of ``input_nodes`` random input nodes each, and features for twice as many nodes."""
    import torch

    from gnnray.pipeline.batch import Layer, MiniBatch

    rng = np.random.default_rng(0)
    num_nodes = 2 * input_nodes
    feat = rng.standard_normal((num_nodes, feat_dim), dtype=np.float32)
    packed = []
    for _ in range(batches):
        nodes = torch.from_numpy(rng.integers(0, num_nodes, input_nodes))
        layer = Layer(torch.arange(0, 10 * 1025, 10), torch.from_numpy(rng.integers(0, input_nodes, 10 * 1024)),
                      input_nodes)
        packed.append(MiniBatch(nodes[:1024], torch.zeros(1024, dtype=torch.int64), nodes, [layer]).pack())
    return packed, feat


def prefetch_overlap(device: str, batches: int = 20, input_nodes: int = 100_000, feat_dim: int = 128) -> dict:
    """Per-batch times of the host side (gather + copy), of compute, and of both with and without the Prefetcher.

    The compute step (matmuls on the batch's features) is sized to take about
    as long as the copy, so full overlap would halve the serial time.
    """
    import torch

    from gnnray.pipeline.batch import MiniBatch
    from gnnray.pipeline.prefetch import HostSlot, Prefetcher

    dev = torch.device(device)
    packed, feat = synthetic_batches(batches, input_nodes, feat_dim)
    w = torch.randn(feat_dim, feat_dim, device=dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def compute(mb, reps):
        h = mb.x
        for _ in range(reps):
            h = torch.tanh(h @ w)
        return h

    def per_batch(fn) -> float:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - t) / batches

    def host_only():
        with Prefetcher(packed, feat, dev, depth=2) as it:
            for _ in it:
                sync()

    copy_s = per_batch(host_only)
    with Prefetcher(packed[:1], feat, dev, depth=1) as it:
        resident = next(it)
        resident = dataclasses.replace(resident, x=resident.x.clone())
    one = per_batch(lambda: [compute(resident, 1) for _ in range(batches)])
    reps = max(1, round(copy_s / max(one, 1e-6)))
    compute_s = per_batch(lambda: [compute(resident, reps) for _ in range(batches)])

    def serial():
        slot = HostSlot(pin=False)
        for p in packed:
            mb = MiniBatch.unpack(torch.from_numpy(p.copy()))
            mb.x = slot.gather(feat, mb.input_nodes.numpy())
            compute(mb.to(dev), reps)
            sync()

    def overlapped():
        with Prefetcher(packed, feat, dev, depth=2) as it:
            for mb in it:
                compute(mb, reps)

    return dict(device=str(dev), copy_s=copy_s, compute_s=compute_s, reps=reps, serial_s=per_batch(serial),
                prefetch_s=per_batch(overlapped))


def bench_gpu(s: Settings) -> list[Row]:
    import torch

    if not torch.cuda.is_available():
        return [Row(FIGURE, ours="n/a (no GPU)", baseline="n/a", ratio="-", target=TARGET, met="n/a")]
    r = prefetch_overlap("cuda", batches=10 if s.quick else 30)
    bound = max(r["copy_s"], r["compute_s"])
    return [Row(FIGURE, ours=f"{1000 * r['prefetch_s']:.1f} ms", baseline=f"{1000 * r['serial_s']:.1f} ms serial",
                ratio=f"{r['serial_s'] / r['prefetch_s']:.2f}x faster", target=TARGET,
                met=verdict(r["prefetch_s"] <= 1.1 * bound), detail=r)]
