"""The CPU plan: how many threads, which cores and what priority each of the job's processes gets on its node.

Ray hands out logical CPUs, not cores. It sets ``OMP_NUM_THREADS`` from an
actor's ``num_cpus`` (so a train worker of one CPU computes on one thread
however many cores sit idle), starts every worker at nice 15 and clears any
inherited affinity; a local cluster even advertises more CPUs than the
machine has. So the job decides for itself, from the node's real cores:

- **Train workers** compute on the node's cores divided between the workers
  on it, less one core per sampler actor when the node has cores to spare
  for them (``split``); otherwise they share every core (``shared``). Each
  worker is pinned to its own cores when the node has at least one core per
  worker, so its OpenMP threads are not moved or crowded by its neighbours
  (DGL's and PyG's ``enable_cpu_affinity`` do the same for their loops). A
  GPU worker needs few threads: its compute is on the device.
- **Sampler actors** sample on their ``num_cpus`` threads (the sampler's own,
  :class:`gnnray.sampler.pick.Threads`), one niceness level set below the
  train workers (nice +4 on Ray's 15), so on a shared node the kernel gives
  contended cores to the step that everything waits for.
- **Every process** of the job waits passively in OpenMP (``OMP_WAIT_POLICY``),
  so a thread that finished its share of a parallel region sleeps instead
  of spinning on a core another process needs. OpenMP runtimes (torch's, and
  DGL's own copy with ``--sampler graphbolt``) read it when they load, so it
  travels in the job's runtime environment (:data:`JOB_ENV`) rather than being
  set in code.

In a container the node is what the container may use: the CPU ids of its
cpuset and the CPU time of its CFS quota (a Kubernetes CPU limit, ``docker
--cpus``), both read from the cgroup (:func:`node_cpus`). Workers are pinned
only within the cpuset, and only when the quota does not cut it down: with a
quota below the set (every host core allowed, a fraction of their time),
the cores are shared with other containers, so the workers are not pinned
and their threads come from the quota.

Where the plan is made: in each train worker, for its own node
(:meth:`CpuPolicy.apply_trainer`); the driver's line only shows its node.
A process's own affinity mask is not the node's: Ray resets the mask of the
processes it starts (a ``taskset`` on the driver does not reach them), and a
worker that pinned itself sees only its own cores. The cgroup's cpuset is
the same for every process of the container and none of them can widen it,
so the plan reads the set from there and falls back to the process's mask
only where no cpuset file can be read.

Runs sharing a host: a worker plans for its run's share of the node's cores and pins only cores it
holds a lease on (:mod:`gnnray.leases`).

docs/performance.md#where-the-figures-come-from has each part measured on and off.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from dataclasses import dataclass
from typing import Optional

from gnnray.leases import host_share, lease_cores

# Environment of every process of the job (train workers, sampler actors, Ray Data's and Ray Train's actors).
JOB_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
SAMPLER_NICE = 4  # added to Ray's nice 15: below the train workers, above nothing else of the job
_MIN_CPU_TRAINER_THREADS = 2  # a CPU train worker keeps at least this many cores before samplers get their own
_GPU_TRAINER_THREADS = 2  # the step runs on the device; the host needs the loop and the prefetch thread
CGROUP_ROOT = "/sys/fs/cgroup"  # where cgroup v2, or v1's controllers (cpu/, cpuset/), are mounted


@dataclass(frozen=True)
class NodeCpus:
    """What the node's processes may use.

    Attributes:
        ids: The CPU ids they may run on (the container's cpuset, or the
            process's affinity where no cpuset can be read).
        quota: CPUs' worth of time per period from the CFS quota; 0 when none is set.
    """

    ids: tuple[int, ...]
    quota: float = 0.0
    runs: int = 1  # local runs sharing the host: ids and quota are this run's share (host_share)

    @property
    def cores(self) -> int:
        """Cores' worth to plan for: the ids, cut down to the quota (rounded down: threads beyond the
        quota would have the kernel throttle the whole container for the rest of each period)."""
        return min(len(self.ids), max(1, math.floor(self.quota))) if self.quota else len(self.ids)

    @property
    def pinnable(self) -> bool:
        """Whether the ids are the container's own: a quota below them shares them with other containers."""
        return self.cores == len(self.ids)


def node_cpus(root: str = CGROUP_ROOT, proc: str = "/proc/self") -> NodeCpus:
    """This node's CPUs as its containers see them: the cgroup's cpuset and the smallest CPU quota from the
    process's cgroup up to the root (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``).

    ``root`` is where the cgroup filesystems are mounted and ``proc`` the process's ``/proc`` entry (tests
    pass fakes of both)."""
    groups = _cgroups(proc)
    ids = None
    if "cpuset" in groups:  # v1
        ids = _first(root, "cpuset", groups["cpuset"], ("cpuset.effective_cpus", "cpuset.cpus"))
    elif "" in groups:  # v2
        ids = _first(root, "", groups[""], ("cpuset.cpus.effective",))
    cpus = tuple(_cpu_list(ids)) if ids else tuple(sorted(os.sched_getaffinity(0)))
    quotas = []
    if "cpu" in groups:  # v1
        for d in _up(root, "cpu", groups["cpu"]):
            quota, period = _read(d, "cpu.cfs_quota_us"), _read(d, "cpu.cfs_period_us")
            if quota and period and int(quota) > 0:
                quotas.append(int(quota) / int(period))
    elif "" in groups:  # v2
        for d in _up(root, "", groups[""]):
            limit = (_read(d, "cpu.max") or "max").split()
            if limit[0] != "max":
                quotas.append(int(limit[0]) / int(limit[1]))
    return NodeCpus(cpus, min(quotas, default=0.0))


def node_cores() -> int:
    """Cores' worth this node's processes may use (:attr:`NodeCpus.cores`)."""
    return node_cpus().cores


def _cgroups(proc: str) -> dict:
    """The process's cgroup per controller (``""``: the v2 hierarchy), from ``/proc/<pid>/cgroup``."""
    groups = {}
    for line in (_read(proc, "cgroup") or "").splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            groups[name] = path
    return groups


def _up(root: str, controller: str, path: str) -> list:
    """The process's cgroup directory and each above it that exists under the mount. Inside a container
    the mount is the container's own cgroup, so a host path missing under it leads to the mount's top."""
    base = os.path.join(root, controller) if controller else root
    if controller and not os.path.isdir(base):  # v1 mounted as cpu,cpuacct
        base = next((os.path.join(root, n) for n in sorted(os.listdir(root)) if controller in n.split(",")), base)
    parts = [p for p in path.split("/") if p]
    dirs = [os.path.join(base, *parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dirs if os.path.isdir(d)]


def _first(root: str, controller: str, path: str, names: tuple) -> Optional[str]:
    """The nearest non-empty value of the first of ``names`` from the process's cgroup upwards."""
    for d in _up(root, controller, path):
        for name in names:
            value = _read(d, name)
            if value:
                return value
    return None


def _read(directory: str, name: str) -> Optional[str]:
    try:
        with open(os.path.join(directory, name)) as f:
            return f.read().strip()
    except OSError:
        return None


def _cpu_list(text: str) -> list:
    """CPU ids from the kernel's list format, ``0-3,8,10-11``."""
    ids = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        ids.extend(range(int(lo), int(hi or lo) + 1))
    return ids


@dataclass(frozen=True)
class CpuPlan:
    """The plan for one node.

    Attributes:
        node: The node's CPUs (:func:`node_cpus`).
        trainers: Train workers on the node.
        samplers: Sampler actors expected on the node.
        gpu: Whether the train workers compute on GPUs.
        threads: Threads per train worker; 0 derives them from the cores.
    """

    node: NodeCpus
    trainers: int
    samplers: int
    gpu: bool = False
    threads: int = 0

    @property
    def cores(self) -> int:
        return self.node.cores

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
        """The CPU ids train worker ``local_rank`` is pinned to, from the node's own; ``None`` (any) when the
        workers outnumber the cores or a quota shares the cores with other containers."""
        t = self.trainer_threads()
        if not self.node.pinnable or self.trainers * t > self.cores:
            return None
        return self.node.ids[local_rank * t:(local_rank + 1) * t]

    def line(self) -> str:
        """The plan in one line, as the driver prints it."""
        cores = self.trainer_cores(0)
        where = f"cores {_ranges(cores)} for the first" if cores else "not pinned"
        quota = f" (quota {self.node.quota:g} of {len(self.node.ids)})" if self.node.quota else ""
        if self.node.runs > 1:
            quota += f" (this run's share of a host shared by {self.node.runs} runs)"
        if self.samplers:
            share, samplers = ("split: " if self.split else "shared: "), f", sampler actors at nice +{SAMPLER_NICE}"
        else:
            share, samplers = "", ", no sampler actors"
        return (f"cpu plan: {self.cores} cores{quota}, {share}{self.trainers} train worker(s) x "
                f"{self.trainer_threads()} threads ({where}){samplers}; OpenMP waits passively (--cpu-plan off: "
                f"Ray's defaults)")


def _ranges(ids: tuple) -> str:
    """CPU ids in the kernel's list format: ``(8, 9, 10, 12)`` -> ``8-10,12``."""
    runs = [[i for _, i in run] for _, run in itertools.groupby(enumerate(ids), lambda p: p[1] - p[0])]
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


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

    def plan(self, trainers: int, node: Optional[NodeCpus] = None) -> CpuPlan:
        """The plan for ``trainers`` workers on this run's share of ``node`` (default: this node)."""
        return CpuPlan(host_share(node or node_cpus()), trainers, self.samplers_per_node, self.gpu, self.threads)

    def apply_trainer(self, local_rank: int, local_world: int) -> dict:
        """In a train worker, before its first parallel region: threads and cores; what it now uses."""
        import torch  # noqa: F401  (a train worker computes with it: its pool is read back even with the plan off)

        if self.enabled:
            node = node_cpus()
            plan = self.plan(local_world, node)
            cores = plan.trainer_cores(local_rank)
            cores = cores and lease_cores(cores, node.ids)
            if cores:
                try:
                    os.sched_setaffinity(0, cores)
                except OSError:  # the cpuset changed since it was read: unpinned, as readback() then records
                    pass
            set_threads(plan.trainer_threads())
        return readback()

    def apply_sampler(self, threads: int) -> dict:
        """In a sampler actor, before it samples: ``threads`` threads, priority below the train workers."""
        if self.enabled:
            os.nice(SAMPLER_NICE)
            set_sampler_threads(threads)
        return readback()


def set_threads(n: int) -> None:
    """Set torch's thread pool (its OpenMP runtime) to ``n`` threads.

    The sampler's own threads are its own (:class:`gnnray.sampler.pick.Threads`), sized by its actor's CPUs.
    """
    import torch

    torch.set_num_threads(n)


def set_sampler_threads(n: int) -> None:
    """:func:`set_threads` in a sampler's process, where torch is loaded: GraphBolt's (DGL imports torch). The
    native sampler's threads are numba's, and its process never imports torch (about 280 MB and seconds of CPU)."""
    if "torch" in sys.modules:
        set_threads(n)


def readback() -> dict:
    """What this process uses now: torch's threads (``None`` where torch is not loaded), its cores, niceness and
    OpenMP wait policy."""
    torch = sys.modules.get("torch")
    return dict(torch_threads=torch.get_num_threads() if torch else None, cores=sorted(os.sched_getaffinity(0)),
                nice=os.getpriority(os.PRIO_PROCESS, 0), omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "default"))


def samplers_per_node(actors_max: int, nodes: int) -> int:
    """Sampler actors to expect on a node: the whole pool on one node, an even share on more."""
    return max(1, math.ceil(actors_max / max(1, nodes)))
