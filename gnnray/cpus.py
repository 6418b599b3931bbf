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
  :class:`gnnray.pipeline.pick.Threads`), one niceness level set below the
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

Runs sharing a host (:func:`host_share`, :func:`lease_cores`). Each local
run starts its own Ray cluster, and every cluster's plan would see the whole
host: two runs would pin their first workers to the same cores, with threads
for every core each. So local runs register on the host (:func:`register_run`:
a file under :func:`lease_dir` that the driver holds locked), and a worker
plans for its run's share of the node's cores, one part per run registered
and alive. A worker pins only cores it holds a lease on (a lock on one file
per CPU id); a core leased by another process (a run that planned alone before
this one registered) is skipped for a free one, and with too few free cores
the worker is not pinned: it cannot tell that those cores are its own. Both
are ``flock`` locks, which the kernel drops when their process ends, however
it ends: a crashed run leaves no stale claim behind.

docs/performance.md#where-the-figures-come-from has each part measured on and off.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import math
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

# Environment of every process of the job (train workers, sampler actors, Ray Data's and Ray Train's actors).
JOB_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
SAMPLER_NICE = 4  # added to Ray's nice 15: below the train workers, above nothing else of the job
_MIN_CPU_TRAINER_THREADS = 2  # a CPU train worker keeps at least this many cores before samplers get their own
_GPU_TRAINER_THREADS = 2  # the step runs on the device; the host needs the loop and the prefetch thread
CGROUP_ROOT = "/sys/fs/cgroup"  # where cgroup v2, or v1's controllers (cpu/, cpuset/), are mounted
LEASE_DIR_ENV = "GNNRAY_CPU_DIR"  # where runs register and cores are leased (default: lease_dir())
RUN_ENV = "GNNRAY_HOST_RUN"  # the local run a process belongs to (set by register_run, inherited by its cluster)
LEASE_WAIT_S = 2.0  # a core held by a process still exiting (an earlier attempt's worker) is waited for this long


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
        return (f"cpu plan: {self.cores} cores{quota}, {'split' if self.split else 'shared'}: {self.trainers} "
                f"train worker(s) x {self.trainer_threads()} threads ({where}), sampler actors at nice "
                f"+{SAMPLER_NICE}; OpenMP waits passively (--cpu-plan off: Ray's defaults)")


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
            set_threads(threads)
        return readback()


def set_threads(n: int) -> None:
    """Set torch's thread pool (its OpenMP runtime) to ``n`` threads.

    The sampler's own threads are its own (:class:`gnnray.pipeline.pick.Threads`), sized by its actor's CPUs.
    """
    import torch

    torch.set_num_threads(n)


def readback() -> dict:
    """What this process uses now: torch's threads, its cores, niceness and OpenMP wait policy."""
    import torch

    return dict(torch_threads=torch.get_num_threads(), cores=sorted(os.sched_getaffinity(0)),
                nice=os.getpriority(os.PRIO_PROCESS, 0), omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "default"))


def samplers_per_node(actors_max: int, nodes: int) -> int:
    """Sampler actors to expect on a node: the whole pool on one node, an even share on more."""
    return max(1, math.ceil(actors_max / max(1, nodes)))


# Runs sharing a host (module docstring). The open files hold the locks: closing one releases its lock.
_registered: list = []  # [name, fd] of this process's registration as a local run
_leased: list = []  # (cpu id, fd) of the cores this process holds


def lease_dir() -> str:
    """Where local runs register and cores are leased: ``$GNNRAY_CPU_DIR``, or ``gnnray-cpus`` in the temp dir."""
    return os.environ.get(LEASE_DIR_ENV) or os.path.join(tempfile.gettempdir(), "gnnray-cpus")


def _open_lock(name: str) -> int:
    """A file of :func:`lease_dir` opened for locking (made if missing, writable by every user of the host)."""
    directory = lease_dir()
    if not os.path.isdir(directory):
        os.makedirs(directory, exist_ok=True)
        with contextlib.suppress(OSError):  # shared by every user's runs, as /tmp is
            os.chmod(directory, 0o1777)
    fd = os.open(os.path.join(directory, name), os.O_RDWR | os.O_CREAT, 0o666)
    with contextlib.suppress(OSError):  # fails on another user's file: theirs to set
        os.fchmod(fd, 0o666)
    return fd


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def register_run() -> Optional[str]:
    """Register this process as a local run on the host until it exits; its name, also in ``$GNNRAY_HOST_RUN``
    for the processes of its cluster (``None`` if the lease directory cannot be used: the run then plans alone).
    Called by the driver before its local cluster starts."""
    if not _registered:
        name = f"run-{time.time_ns()}-{os.getpid()}"
        try:  # locked before it gets its name: runs_on_host would take an unlocked run file for an ended run's
            fd = _open_lock("new-" + name)
            _try_lock(fd)
            os.rename(os.path.join(lease_dir(), "new-" + name), os.path.join(lease_dir(), name))
        except OSError:
            return None
        _registered[:] = [name, fd]
    os.environ[RUN_ENV] = _registered[0]
    return _registered[0]


def runs_on_host() -> list:
    """Names of the local runs registered and alive on this host, oldest first; the files of ended runs
    (their lock free) are removed."""
    try:
        names = sorted(n for n in os.listdir(lease_dir()) if n.startswith("run-"))
    except OSError:
        return []
    alive = []
    for name in names:
        try:
            fd = os.open(os.path.join(lease_dir(), name), os.O_RDWR)
        except OSError:
            continue  # removed meanwhile, or not ours to open: ended or unknowable
        try:
            if _try_lock(fd):  # nobody holds it: that run has ended
                os.unlink(os.path.join(lease_dir(), name))
            else:
                alive.append(name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return sorted(alive, key=lambda n: int(n.split("-")[1]))


def host_share(node: NodeCpus, run: Optional[str] = None) -> NodeCpus:
    """This run's part of ``node`` when several local runs share the host: its ids cut into one contiguous
    part per run (oldest run first), the quota divided alike. ``run`` defaults to ``$GNNRAY_HOST_RUN``; a
    process of no registered run (a cluster joined by address) counts as one more run."""
    run = os.environ.get(RUN_ENV) if run is None else run
    runs = runs_on_host()
    if run not in runs:
        runs.append(run)
    n = min(len(runs), len(node.ids))
    if n <= 1:
        return node
    i = min(runs.index(run), n - 1)
    ids = node.ids[i * len(node.ids) // n:(i + 1) * len(node.ids) // n]
    return NodeCpus(ids, node.quota / n if node.quota else 0.0, len(runs))


def lease_cores(cores: tuple, ids: tuple, wait_s: float = LEASE_WAIT_S) -> Optional[tuple]:
    """Lease ``cores`` for this process (until it exits or leases again): those cores if free (waiting up to
    ``wait_s`` for them), else as many others of ``ids`` that are free; ``None`` if fewer are free, or the lease
    files cannot be used (then nothing is pinned)."""
    _release([fd for _, fd in _leased])  # a second plan in this process replaces the first
    _leased.clear()
    deadline = time.monotonic() + wait_s
    try:
        held = _lock_first(cores, len(cores))
        while len(held) < len(cores) and time.monotonic() < deadline:
            _release([fd for _, fd in held])
            time.sleep(0.1)
            held = _lock_first(cores, len(cores))
        if len(held) < len(cores):
            _release([fd for _, fd in held])
            held = _lock_first(ids, len(cores))
    except OSError:
        return None
    if len(held) < len(cores):
        _release([fd for _, fd in held])
        return None
    _leased.extend(held)
    return tuple(cpu for cpu, _ in held)


def _lock_first(ids: tuple, count: int) -> list:
    """``(cpu, fd)`` of the first ``count`` of ``ids`` whose lease this process could take."""
    held: list = []
    try:
        for cpu in ids:
            if len(held) == count:
                break
            fd = _open_lock(f"cpu-{cpu}")
            if _try_lock(fd):
                held.append((cpu, fd))
            else:
                os.close(fd)
    except OSError:
        _release([fd for _, fd in held])
        raise
    return held


def _release(fds: list) -> None:
    list(map(os.close, fds))
