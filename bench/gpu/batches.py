"""What the GPU bench's rows share: synthetic sampled batches, its sizes, the models, timers and sync counts."""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Callable

import numpy as np
import torch

from bench.harness import free_port, median_s as _median_s

REL_TOL = 1e-4  # device against CPU, relative to the largest CPU value (float32, summation orders differ)
RELATIONS = 3  # of the typed batches the relational models get

# Sizes: an arxiv-like batch (1024 seeds, fanouts 15,10,5, 128 features, 3 x 256), and the smoke test's.
FULL = dict(batch=1024, fanouts=(15, 10, 5), in_feats=128, hidden=256, classes=40, heads=4, reps=10,
            prefetch_batches=30, prefetch_inputs=100_000, ddp_steps=10, graph_nodes=169_343, graph_edges=2_330_000)
SMOKE = dict(batch=32, fanouts=(4, 3), in_feats=16, hidden=16, classes=5, heads=2, reps=2,
             prefetch_batches=6, prefetch_inputs=2_000, ddp_steps=3, graph_nodes=500, graph_edges=3_000)


def synthetic_batch(rng: np.random.Generator, batch: int, fanouts, num_classes: int, num_relations: int = 1,
                    epoch: int = 0):
    """A sampled-looking :class:`MiniBatch` on the CPU (no features): per layer each destination gets 0 to
    ``fanout`` in-edges from sources numbered after the destinations; each edge a relation if ``num_relations > 1``."""
    from gnnray.batch import Layer, MiniBatch

    sizes, layers = [batch], []
    for fanout in reversed(tuple(fanouts)):
        n_dst = sizes[-1]
        indptr = np.zeros(n_dst + 1, dtype=np.int64)
        np.cumsum(rng.integers(0, fanout + 1, n_dst), out=indptr[1:])
        nnz = int(indptr[-1])
        num_src = n_dst + max(1, nnz * 2 // 3)  # sampled neighbors repeat across destinations
        etype = torch.from_numpy(rng.integers(0, num_relations, nnz)) if num_relations > 1 else None
        layers.append(Layer(torch.from_numpy(indptr), torch.from_numpy(rng.integers(0, num_src, nnz)), num_src,
                            etype))
        sizes.append(num_src)
    layers.reverse()
    input_nodes = torch.from_numpy(rng.permutation(2 * sizes[-1])[:sizes[-1]])  # distinct global ids
    labels = torch.from_numpy(rng.integers(0, num_classes, batch))
    return MiniBatch(input_nodes[:batch].clone(), labels, input_nodes, layers, epoch=epoch)


def synthetic_rows(rng: np.random.Generator, n: int, batch: int, fanouts, num_classes: int, feat_dim: int,
                   feat_dtype=np.float32) -> tuple[list, np.ndarray]:
    """``n`` packed :func:`synthetic_batch` es and a feature table that covers their input nodes."""
    mbs = [synthetic_batch(rng, batch, fanouts, num_classes) for _ in range(n)]
    num_nodes = max(int(mb.input_nodes.max()) + 1 for mb in mbs)
    feat = rng.standard_normal((num_nodes, feat_dim), dtype=np.float32).astype(feat_dtype)
    return [mb.pack() for mb in mbs], feat


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def median_s(fn: Callable[[], object], dev: torch.device, reps: int) -> float:
    """Median seconds of ``fn`` (after one warm-up call), the device's queued work included."""
    return _median_s(fn, reps, lambda: sync(dev))


def count_syncs(fn) -> int:
    """Host syncs while ``fn()`` runs, by torch's sync debug mode (0 without CUDA)."""
    if not torch.cuda.is_available():
        fn()
        return 0
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Not "synchroniz" alone: the mode's own first notice ("... does not yet detect all synchronizing operations").
    return sum("called a synchronizing CUDA operation" in str(w.message) for w in seen)


def timed_epoch(*args, **kwargs) -> dict:
    """``train_epoch`` and its seconds."""
    from gnnray.train.step import train_epoch

    t = time.perf_counter()
    return dict(train_epoch(*args, **kwargs), seconds=time.perf_counter() - t)


def per_step(epoch: Callable[[int], dict], k: int = 4) -> dict:
    """Host syncs and seconds a step, and the loss, of ``epoch(steps)``: epochs of ``2k`` less ``k`` steps after a
    warm-up, so the epoch's own read-back at its end cancels."""
    epoch(k)  # warm-up: the allocator's first blocks, Adam's state
    syncs = (count_syncs(lambda: epoch(2 * k)) - count_syncs(lambda: epoch(k))) / k
    last = epoch(2 * k)
    return dict(host_syncs_per_step=syncs if torch.cuda.is_available() else None, step_s=last["seconds"] / (2 * k),
                loss=last["loss"])


@contextlib.contextmanager
def one_rank_group(dev: torch.device):
    """A one-rank default process group: NCCL on CUDA, gloo on the CPU."""
    import torch.distributed as dist

    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1, **({"device_id": dev} if dev.type == "cuda" else {}))
    try:
        yield
    finally:
        dist.destroy_process_group()


def build(name: str, z: dict):
    from gnnray.models.model import build_model

    return build_model(z["in_feats"], z["classes"], len(z["fanouts"]), z["hidden"], 0.0, name=name,
                       heads=z["heads"], num_relations=RELATIONS if name.startswith("r") else 1)
