"""Sampling that keeps pace with the step (driver): where batches are sampled, and how a CPU node's cores are shared.

Pure rules, so that the plan is testable without a cluster or a GPU:

- :func:`sample_on`: ``--sample-on auto`` on GPU workers picks the train
  worker's device (:mod:`.device_sampler`) where the node's CPU cores per GPU
  could not sample a batch per step (:func:`keeps_pace`) and the graph's CSC
  fits a share of the GPU workers' memory, as a GPU node reports it
  (:func:`gpu_bytes`, run there by the driver); otherwise the sampler actors.
  The GPU's step is not measured before training: the rule assumes
  :data:`GPU_STEP_S` and says so. On CPU workers it follows
  :func:`plan_cpu_node`.
- :func:`~gnnray.train.gpu_budget.gpu_budget`: one budget of each worker's own GPU, measured in the
  worker (:mod:`gnnray.train.gpu_budget`, torch-free, so that the plan uses the worker's own share and count).
- :func:`plan_cpu_node`: a CPU node's cores as one budget, ARGO's choice made
  from the measured paces: train workers per node (one per
  :data:`THREADS_AT_MOST` cores: beyond that a worker's step hardly speeds
  up), then where sampling runs. Where the node's sampling needs less than a
  core, each worker samples its own batches on one thread at idle priority,
  in the time its step leaves a core idle: an actor's core would idle, and an
  actor sharing the workers' cores stalls their OpenMP teams. Otherwise the
  actors get the cores the sampling needs and the workers the rest.
- :func:`actors_for_pace`: actors = ceil(seeds/s the steps need / one actor's
  seeds/s), capped by the cores the node can give them: the sampler pool
  beside GPU workers, where ``--sampler-actors`` is not given.

The paces: sampling is measured by the driver on the run's graph and fanouts
(:func:`measure`: one core's seconds a batch, and the batch's layer sizes);
a CPU step is estimated from those sizes (:func:`step_gflop`) at
:data:`CORE_GFLOPS`. Without a measurement, the products-shaped graph's
(:data:`SEEDS_PER_CORE`), the densest graph measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from gnnray.errors import ConfigError, size_text
from gnnray.train.gpu_budget import CSC_SHARE

# Seeds per CPU-second of the native sampler on one thread, on the products-shaped graph (1M nodes, average
# in-degree 50, 48M edges; fanouts 15,10,5, batches of 1024, 484k input nodes a batch): 15,852 measured on a
# shared 2-core host (docs/performance.md has 19,966 on the 2.4M-node graph).
SEEDS_PER_CORE = 16_000
# The GPU step the pace rule assumes (nothing measures the run's own before training): the step ceiling measured
# on an H200 at products shape is 3.5 ms; taking 4 ms keeps the rule on the safe side of what any GPU here needs.
GPU_STEP_S = 0.004
# One core's rate on a CPU training step, forward, backward and Adam, in GFLOP/s of the step's matrix products and
# aggregations (step_gflop): 46 measured on one core of the 2-core development host, arxiv-shaped SAGE step
# (docs/cpu-plan.md#the-budget); taken lower, so that a step is rather over- than under-estimated.
CORE_GFLOPS = 40.0
# Threads past which one train worker's step hardly speeds up: DGL's CPU training stops improving beyond 16
# cores (the ARGO example's measurements on 64- and 112-core Xeons). A node gets a worker per this many cores.
THREADS_AT_MOST = 16


def sample_on(requested: str, csc_bytes: int, gpu_bytes: Optional[int], cores_per_gpu: float,
              batch_size: int, seeds_per_core: float = SEEDS_PER_CORE, step_s: float = GPU_STEP_S,
              unknown: str = "the GPU workers' memory is unknown") -> tuple[str, str]:
    """``("actors" | "device", why)`` for ``--sample-on requested`` on GPU workers (CPU workers: :func:`plan_cpu_node`).

    Args:
        requested: ``auto``, ``actors`` or ``device``.
        csc_bytes: What the device sampler holds on the device (:func:`gnnray.train.gpu_budget.csc_bytes`).
        gpu_bytes: The GPU workers' smallest GPU memory, if known; ``None`` (unknown) never picks the device.
        cores_per_gpu: CPU cores a GPU node has per GPU, for its sampler actors.
        batch_size: Seeds per batch per worker.
        seeds_per_core, step_s: One core's sampling pace and the GPU's step time (assumed, :data:`GPU_STEP_S`).
        unknown: Why ``gpu_bytes`` is ``None``, as the plan line says it.
    """
    if requested != "auto":
        return requested, "--sample-on " + requested
    have, need = cores_per_gpu * seeds_per_core, batch_size / step_s
    pace = (f"{cores_per_gpu:g} cores per GPU sample {have:,.0f} seeds/s, the GPU's steps need {need:,.0f} "
            f"({step_assumed(step_s)})")
    if keeps_pace(cores_per_gpu, batch_size, seeds_per_core, step_s):
        return "actors", pace
    if gpu_bytes is None:
        return "actors", f"{pace}; {unknown}"
    fits = f"{size_text(csc_bytes)} of structure against a GPU's {size_text(gpu_bytes)}"
    if csc_bytes > CSC_SHARE * gpu_bytes:
        return "actors", f"{pace}; the graph's structure does not fit a quarter of the GPU's memory ({fits})"
    return "device", f"{pace}; the graph's structure fits a quarter of the GPU's memory ({fits})"


def keeps_pace(cores_per_gpu: float, batch_size: int, seeds_per_core: float = SEEDS_PER_CORE,
               step_s: float = GPU_STEP_S) -> bool:
    """Whether a GPU node's cores per GPU sample a batch per GPU step: then the actors serve, and no GPU's memory
    needs asking."""
    return cores_per_gpu * seeds_per_core >= batch_size / step_s


def step_assumed(step_s: float) -> str:
    """What the pace rule took for the GPU's step, as the plan line says it: no step is measured before training."""
    if step_s == GPU_STEP_S:
        return f"a GPU step assumed {step_s * 1e3:g} ms: the products-shaped step's ceiling on an H200, rounded up"
    return f"a GPU step assumed {step_s * 1e3:g} ms"


def speedup(threads: int) -> float:
    """How many times faster a step runs on ``threads`` threads than on one: Amdahl's law with the serial share
    that makes :data:`THREADS_AT_MOST` threads twice as slow as perfect (8x at 16, 12x at 64, 14x at 128)."""
    return threads / (1 + (threads - 1) / (THREADS_AT_MOST - 1))


@dataclass(frozen=True)
class Paces:
    """What one core does for one train worker's batch: sample it (measured) and train on it (estimated).

    Attributes:
        sample_s: One core's seconds to sample a batch (the native sampler, this graph and fanouts).
        step_s: One core's seconds for a training step on it (:func:`step_gflop` at :data:`CORE_GFLOPS`).
        gflop: The step's work that estimate comes from.
    """

    sample_s: float
    step_s: float
    gflop: float = 0.0


@dataclass(frozen=True)
class CpuNodePlan:
    """A CPU node's cores as one budget (:func:`plan_cpu_node`).

    Attributes:
        cores: The node's cores (its share, for a run sharing its host).
        workers: Train workers on the node.
        threads: torch threads a worker computes on.
        sampler_cores: Cores of the node's sampler actors (one actor a core); 0: each worker samples its own
            batches (on a thread at idle priority).
        need: Cores the node's sampling needs beside the workers' steps, at their pace.
        paces: What the plan was made from.
    """

    cores: int
    workers: int
    threads: int
    sampler_cores: int
    need: float
    paces: Paces

    @property
    def in_workers(self) -> bool:
        return self.sampler_cores == 0

    def why(self) -> str:
        """The plan's reason, as the driver prints it."""
        p = self.paces
        step = p.step_s / speedup(self.threads)
        est = f"estimated from its {p.gflop:.1f} GFLOP at {CORE_GFLOPS:g} GFLOP/s a core" if p.gflop else "assumed"
        head = (f"a batch takes {p.sample_s * 1e3:.1f} ms of one core to sample, a step about {step * 1e3:.0f} ms "
                f"on {self.threads} threads ({est}): {self.workers} worker(s) need {self.need:.2f} cores of sampling")
        if self.in_workers:
            return head + ", less than one"
        return head + f": {self.sampler_cores} core(s) of sampler actors beside them"


def plan_cpu_node(cores: int, paces: Paces, workers: int = 0) -> CpuNodePlan:
    """The node's train workers, their threads and its sampler cores (module docstring).

    Args:
        cores: The node's cores.
        paces: One core's sampling and step times for a batch.
        workers: Train workers the run puts on the node; 0: one per :data:`THREADS_AT_MOST` cores.
    """
    cores = max(1, int(cores))
    workers = workers or math.ceil(cores / THREADS_AT_MOST)

    def need(threads: int) -> float:  # cores that keep sampling at the workers' pace
        return workers * paces.sample_s * speedup(threads) / max(paces.step_s, 1e-9)

    threads = max(1, cores // workers)
    if need(threads) < 1 or cores <= workers:
        return CpuNodePlan(cores, workers, threads, 0, need(threads), paces)
    samplers = min(cores - workers, math.ceil(need(threads)))
    threads = max(1, (cores - samplers) // workers)
    samplers = max(1, min(cores - workers, math.ceil(need(threads))))
    return CpuNodePlan(cores, workers, max(1, (cores - samplers) // workers), samplers, need(threads), paces)


def step_gflop(layers: Sequence[tuple], in_feats: int, hidden: int, classes: int) -> float:
    """GFLOP of one training step of a SAGE-shaped model over a batch whose layers (input layer first) have
    ``(destinations, edges)``: per layer two dense products of its destinations (self and neighbours) and one
    aggregation over its edges, forward; backward twice that."""
    dims = [in_feats] + [hidden] * (len(layers) - 1) + [classes]
    flop = sum(4 * dst * d_in * d_out + edges * d_in for (dst, edges), d_in, d_out in zip(layers, dims, dims[1:]))
    return 3 * flop / 1e9


def actors_for_pace(step_s: float, batch_size: int, cores: int, seeds_per_actor: float = SEEDS_PER_CORE) -> int:
    """Sampler actors (one core each) a train worker needs to get a batch of ``batch_size`` seeds every ``step_s``
    seconds: ceil(needed seeds/s / one actor's), at least 1 and at most ``cores``."""
    if step_s <= 0:
        return max(1, cores)
    need = batch_size / step_s
    return max(1, min(int(cores), math.ceil(need / seeds_per_actor)))


def measured_pace(graph, fanouts, batch_size: int, seed: int = 0, batches: int = 3) -> float:
    """Seeds per CPU-second of gnnray's native sampler on one core of this process's node, on ``graph`` with the
    run's ``fanouts`` (:func:`measure`). Graphs differ by an order of magnitude (on one H200 machine's core,
    arxiv structure with fanouts 10,10,10: 405,000 seeds/s; the products-shaped graph with 15,10,5: 35,000),
    so the plan measures."""
    seconds, _ = measure(graph, fanouts, batch_size, seed, batches)
    return min(batch_size, len(graph.train_idx)) / max(seconds, 1e-6)


def measure(graph, fanouts, batch_size: int, seed: int = 0, batches: int = 3) -> tuple[float, list]:
    """One core's seconds to sample a batch of ``batch_size`` training seeds (the median of ``batches``, after one
    unmeasured batch), and the last batch's layers as ``(destinations, edges)``, input layer first."""
    import statistics
    import time

    import numpy as np

    from gnnray.sampler.sampler import make_sampler

    sampler = make_sampler(graph, fanouts, seed=seed)
    rng = np.random.default_rng(seed)
    size = min(batch_size, len(graph.train_idx))
    times = []
    for _ in range(batches + 1):
        seeds = rng.choice(graph.train_idx, size, replace=False)
        started = time.process_time()
        mb = sampler.draw(seeds)
        times.append(time.process_time() - started)
    layers = [(int(layer.indptr.shape[0]) - 1, int(layer.indices.shape[0])) for layer in mb.layers]
    return max(statistics.median(times[1:]), 1e-6), layers


def gpu_bytes() -> Optional[int]:
    """The total memory of this process's first visible GPU (in a Ray task with GPUs, the one Ray gave it), from
    the CUDA driver: no torch to import, no context made. ``None`` without a driver or GPU.

    The driver calls it in a task on each GPU node (:func:`gnnray.driver.preflight.gpu_memory`): its own node,
    a CPU head node in the usual cluster, has no GPU to ask. Not Ray's vendored NVML: private Ray stays in
    ``ray_internals.py``, and NVML numbers GPUs without ``CUDA_VISIBLE_DEVICES``.
    """
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    device, size = ctypes.c_int(), ctypes.c_size_t()
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), 0) or \
            cuda.cuDeviceTotalMem_v2(ctypes.byref(size), device):
        return None
    return int(size.value)


def check_device_sampling(cfg) -> None:
    """Refuse what ``--sample-on device`` does not serve, in one line."""
    s = cfg.sampler
    if s.sample_on != "device":
        return
    if s.backend != "native":
        raise ConfigError(f"--sample-on device samples with gnnray's own semantics in torch; --sampler {s.backend} "
                          f"runs in sampler actors only: use --sample-on actors, or leave --sampler native")
    if cfg.data.embedding_dim:
        raise ConfigError("--sample-on device does not look up --embedding-dim rows yet (the sampler actors' "
                          "prefetch thread does): use --sample-on actors")
