"""Sampling that keeps pace with the step (driver): where batches are sampled, and how many actors sample them.

Two pure rules, so that the plan is testable without a cluster or a GPU:

- :func:`sample_on`: ``--sample-on auto`` picks the train worker's device
  (:mod:`.device_sampler`) where the worker has a GPU, the graph's CSC fits a
  share of its memory, and the node's CPU cores per GPU could not sample a
  batch per step; otherwise the sampler actors, as on every CPU worker.
- :func:`actors_for_pace`: actors = ceil(seeds/s the steps need / one actor's
  seeds/s), capped by the cores the node can give them.

One actor's pace is the native sampler's seeds/s on one core, measured by
the driver on the run's graph and fanouts (:func:`measured_pace`); without
a measurement, the products-shaped graph's (:data:`SEEDS_PER_CORE`), the
densest graph measured.
"""

from __future__ import annotations

import math
from typing import Optional

# Seeds per CPU-second of the native sampler on one thread, on the products-shaped graph (1M nodes, average
# in-degree 50, 48M edges; fanouts 15,10,5, batches of 1024, 484k input nodes a batch): 15,852 measured on a
# shared 2-core host (docs/performance.md has 19,966 on the 2.4M-node graph).
SEEDS_PER_CORE = 16_000
# Steps/s a GPU's step can reach: the step ceiling measured on an H200 at products shape is 3.5 ms; taking
# 4 ms keeps the rule on the safe side of what any GPU here needs.
GPU_STEP_S = 0.004
# Share of a GPU's memory the graph's structure may take: the model, its activations and (with
# --feature-placement) the feature table need the rest.
CSC_SHARE = 0.25


def sample_on(requested: str, use_gpu: bool, csc_bytes: int, gpu_bytes: Optional[int], cores_per_gpu: float,
              batch_size: int, seeds_per_core: float = SEEDS_PER_CORE, step_s: float = GPU_STEP_S
              ) -> tuple[str, str]:
    """``("actors" | "device", why)`` for ``--sample-on requested``.

    Args:
        requested: ``auto``, ``actors`` or ``device``.
        use_gpu: Whether the train workers have a GPU.
        csc_bytes: The graph's ``indptr`` + ``indices`` (+ relation codes) bytes.
        gpu_bytes: One worker's GPU memory, if known; ``None`` (unknown) never picks the device.
        cores_per_gpu: CPU cores a GPU node has per GPU, for its sampler actors.
        batch_size: Seeds per batch per worker.
        seeds_per_core, step_s: One core's sampling pace and the GPU's step time.
    """
    if requested != "auto":
        return requested, "--sample-on " + requested
    if not use_gpu:
        return "actors", "CPU workers: the actors sample beside the trainer"
    if gpu_bytes is None or csc_bytes > CSC_SHARE * gpu_bytes:
        return "actors", "the graph's structure does not fit a quarter of the GPU's memory"
    need = batch_size / step_s
    if cores_per_gpu * seeds_per_core >= need:
        return "actors", f"{cores_per_gpu:g} cores per GPU sample {cores_per_gpu * seeds_per_core:,.0f} seeds/s"
    return "device", (f"{cores_per_gpu:g} cores per GPU sample {cores_per_gpu * seeds_per_core:,.0f} seeds/s, "
                      f"the GPU's steps need {need:,.0f}")


def actors_for_pace(step_s: float, batch_size: int, cores: int, seeds_per_actor: float = SEEDS_PER_CORE) -> int:
    """Sampler actors (one core each) a train worker needs to get a batch of ``batch_size`` seeds every ``step_s``
    seconds: ceil(needed seeds/s / one actor's), at least 1 and at most ``cores``."""
    if step_s <= 0:
        return max(1, cores)
    need = batch_size / step_s
    return max(1, min(int(cores), math.ceil(need / seeds_per_actor)))


def measured_pace(graph, fanouts, batch_size: int, seed: int = 0, batches: int = 3) -> float:
    """Seeds per CPU-second of gnnray's native sampler on one core of this process's node, on ``graph`` with the
    run's ``fanouts``: ``batch_size`` over the median time of ``batches`` batches of training seeds (after one
    unmeasured batch). Graphs differ by an order of magnitude (on one H200 machine's core, arxiv structure with
    fanouts 10,10,10: 405,000 seeds/s; the products-shaped graph with 15,10,5: 35,000), so the plan measures."""
    import statistics
    import time

    import numpy as np

    from gnnray.pipeline.sampler import make_sampler

    sampler = make_sampler(graph, fanouts, seed=seed)
    rng = np.random.default_rng(seed)
    size = min(batch_size, len(graph.train_idx))
    times = []
    for _ in range(batches + 1):
        seeds = rng.choice(graph.train_idx, size, replace=False)
        started = time.process_time()
        sampler.sample(seeds)
        times.append(time.process_time() - started)
    return size / max(statistics.median(times[1:]), 1e-6)


def csc_bytes(graph) -> int:
    """What the device sampler holds of ``graph`` on the device: its CSC, labels and relation codes."""
    return sum(a.nbytes for a in (graph.indptr, graph.indices, graph.label, graph.etype) if a is not None)


def gpu_bytes() -> Optional[int]:
    """This process's first GPU's memory, where it sees one (the driver on a GPU node); ``None`` elsewhere."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def check_device_sampling(cfg) -> None:
    """Refuse what ``--sample-on device`` does not serve, in one line."""
    from gnnray.errors import ConfigError

    s = cfg.sampler
    if s.sample_on != "device":
        return
    if s.backend != "native":
        raise ConfigError(f"--sample-on device samples with gnnray's own semantics in torch; --sampler {s.backend} "
                          f"runs in sampler actors only: use --sample-on actors, or leave --sampler native")
    if cfg.data.embedding_dim:
        raise ConfigError("--sample-on device does not look up --embedding-dim rows yet (the sampler actors' "
                          "prefetch thread does): use --sample-on actors")
