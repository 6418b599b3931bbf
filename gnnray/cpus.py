"""The CPU plan: how many threads, which cores and what priority each of the job's processes gets on its node.

Ray hands out logical CPUs, not cores. It sets ``OMP_NUM_THREADS`` from an
actor's ``num_cpus`` (so a train worker of one CPU computes on one thread
however many cores sit idle), starts every worker at nice 15 and clears any
inherited affinity; a local cluster even advertises more CPUs than the
machine has. So the job decides for itself, from the node's real cores:

- **Train workers** compute on the node's cores divided between the workers
  on it, less one core per sampler actor when the node has cores to spare
  for them (``split``); otherwise they share every core (``share``). Each
  worker is pinned to its own cores when the node has at least one core per
  worker, so its OpenMP threads are not moved or crowded by its neighbours
  (DGL's and PyG's ``enable_cpu_affinity`` do the same for their loops). A
  GPU worker needs few threads: its compute is on the device.
- **Sampler actors** sample on their ``num_cpus`` threads, one niceness level
  set below the train workers (nice +4 on Ray's 15), so on a shared node the
  kernel gives contended cores to the step that everything waits for.
- **Every process** of the job waits passively in OpenMP (``OMP_WAIT_POLICY``),
  so a thread that finished its share of a parallel region sleeps instead
  of spinning on a core another process needs. Both OpenMP runtimes (torch's
  and DGL's own copy) read it when they load, so it travels in the job's
  runtime environment (:func:`job_env`) rather than being set in code.

docs/performance.md has each part measured on and off.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

# Environment of every process of the job (train workers, sampler actors, Ray Data's and Ray Train's actors).
JOB_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
SAMPLER_NICE = 4  # added to Ray's nice 15: below the train workers, above nothing else of the job
_MIN_CPU_TRAINER_THREADS = 2  # a CPU train worker keeps at least this many cores before samplers get their own
_GPU_TRAINER_THREADS = 2  # the step runs on the device; the host needs the loop and the prefetch thread


def node_cores() -> int:
    """The cores this process may use: its affinity, capped by its cgroup's CPU quota (containers)."""
    cores = len(os.sched_getaffinity(0))
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


@dataclass(frozen=True)
class CpuPlan:
    """The plan for one node.

    Attributes:
        cores: The node's real cores (:func:`node_cores`).
        trainers: Train workers on the node.
        samplers: Sampler actors expected on the node.
        gpu: Whether the train workers compute on GPUs.
        threads: Threads per train worker; 0 derives them from the cores.
    """

    cores: int
    trainers: int
    samplers: int
    gpu: bool = False
    threads: int = 0

    @property
    def split(self) -> bool:
        """Whether every sampler actor gets a core of its own beside the train workers' cores."""
        least = _GPU_TRAINER_THREADS if self.gpu else _MIN_CPU_TRAINER_THREADS
        return self.cores >= self.samplers + max(1, self.trainers) * least

    def trainer_threads(self) -> int:
        if self.threads:
            return self.threads
        free = self.cores - (self.samplers if self.split else 0)
        per = max(1, free // max(1, self.trainers))
        return min(per, _GPU_TRAINER_THREADS) if self.gpu else per

    def trainer_cores(self, local_rank: int) -> Optional[tuple[int, ...]]:
        """The cores train worker ``local_rank`` is pinned to, or ``None`` (any) when the workers outnumber them."""
        t = self.trainer_threads()
        if self.trainers * t > self.cores:
            return None
        return tuple(range(local_rank * t, (local_rank + 1) * t))

    def line(self) -> str:
        """The plan in one line, as the driver prints it."""
        cores = self.trainer_cores(0)
        where = f"cores {cores[0]}-{cores[-1]} for the first" if cores else "any core"
        return (f"cpu plan: {self.cores} cores, {'split' if self.split else 'shared'}: {self.trainers} train "
                f"worker(s) x {self.trainer_threads()} threads ({where}), sampler actors at nice +{SAMPLER_NICE}; "
                f"OpenMP waits passively (--cpu-plan off: Ray's defaults)")


@dataclass(frozen=True)
class CpuPolicy:
    """What the driver hands every process so that it can make its node's :class:`CpuPlan`.

    Attributes:
        enabled: ``--cpu-plan``; off leaves Ray's defaults.
        samplers_per_node: Sampler actors expected on a node (the pool's
            maximum on a one-node cluster, spread evenly over larger ones).
        gpu: Whether the train workers use GPUs.
        threads: ``--trainer-threads`` (0: from the plan).
    """

    enabled: bool
    samplers_per_node: int
    gpu: bool = False
    threads: int = 0

    def plan(self, trainers: int) -> CpuPlan:
        return CpuPlan(node_cores(), trainers, self.samplers_per_node, self.gpu, self.threads)

    def apply_trainer(self, local_rank: int, local_world: int) -> dict:
        """In a train worker, before its first parallel region: threads and cores; what it now uses."""
        if self.enabled:
            plan = self.plan(local_world)
            cores = plan.trainer_cores(local_rank)
            if cores:
                os.sched_setaffinity(0, cores)
            set_threads(plan.trainer_threads())
        return readback()

    def apply_sampler(self, threads: int) -> dict:
        """In a sampler actor, before it samples: ``threads`` threads, priority below the train workers."""
        if self.enabled:
            os.nice(SAMPLER_NICE)
            set_threads(threads)
        return readback()


def set_threads(n: int) -> None:
    """Set torch's and DGL's thread pools (two separate OpenMP runtimes) to ``n`` threads."""
    import dgl.utils
    import torch

    torch.set_num_threads(n)
    dgl.utils.set_num_threads(n)


def readback() -> dict:
    """What this process uses now: its threads per pool, cores, niceness and OpenMP wait policy."""
    import dgl.utils
    import torch

    return dict(torch_threads=torch.get_num_threads(), dgl_threads=dgl.utils.get_num_threads(),
                cores=sorted(os.sched_getaffinity(0)), nice=os.getpriority(os.PRIO_PROCESS, 0),
                omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "default"))


def samplers_per_node(actors_max: int, nodes: int) -> int:
    """Sampler actors to expect on a node: the whole pool on one node, an even share on more."""
    return max(1, math.ceil(actors_max / max(1, nodes)))
