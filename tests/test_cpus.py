"""The CPU plan: its rule on nodes of any size, containers' cpusets and quotas (faked cgroup files, and real
cgroups made for the test where the machine allows), and each process reading back what the plan says it uses
(runs sharing a host: tests/test_leases.py)."""

from __future__ import annotations

import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from gnnray import leases
from gnnray.cpus import JOB_ENV, SAMPLER_NICE, CpuPlan, CpuPolicy, NodeCpus, node_cores, node_cpus, samplers_per_node


def _whole(cores: int) -> NodeCpus:
    return NodeCpus(tuple(range(cores)))


@pytest.mark.parametrize("cores, trainers, samplers, gpu, split, threads, first, last", [
    (2, 1, 1, False, False, 2, (0, 1), (0, 1)),  # this machine: the worker shares both cores with the actor
    (2, 2, 1, False, False, 1, (0,), (1,)),  # two DDP workers: a core each, the actor between them
    (2, 4, 2, False, False, 1, None, None),  # more workers than cores: no pinning
    (16, 2, 2, False, True, 7, tuple(range(7)), tuple(range(7, 14))),  # actors get cores 14-15
    (96, 8, 16, True, True, 2, (0, 1), (14, 15)),  # a GPU node: few host threads per worker
    (8, 1, 8, True, False, 2, (0, 1), (0, 1)),  # GPU, actors fill the node: shared
])
def test_plan_on_nodes_of_any_size(cores, trainers, samplers, gpu, split, threads, first, last):
    plan = CpuPlan(_whole(cores), trainers, samplers, gpu)
    assert plan.split == split
    assert plan.trainer_threads() == threads
    assert plan.trainer_cores(0) == first and plan.trainer_cores(trainers - 1) == last
    pinned = [c for r in range(trainers) for c in plan.trainer_cores(r) or ()]
    assert len(pinned) == len(set(pinned)) <= cores  # no core is given to two workers
    if split:
        assert cores - len(pinned) >= samplers  # every actor has a core no worker is pinned to
    assert f"{cores} cores" in plan.line()


def test_threads_override_and_pool_spread():
    assert CpuPlan(_whole(16), 2, 2, threads=3).trainer_threads() == 3
    assert samplers_per_node(16, 1) == 16 and samplers_per_node(16, 5) == 4 and samplers_per_node(1, 4) == 1
    assert 1 <= node_cores() <= os.cpu_count()


def _fake(tmp_path: Path, proc_cgroup: str, files: dict) -> tuple[str, str]:
    """A fake ``/proc/self`` (its ``cgroup`` file) and a fake cgroup mount holding ``files``."""
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(proc_cgroup)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return str(root), str(proc)


def test_container_cpuset_pins_within_its_own_cpus(tmp_path):
    """``docker --cpuset-cpus 8-15`` (cgroup v2, its own namespace): the workers get ids 8-15, not 0-7,
    whatever this process's own affinity is."""
    root, proc = _fake(tmp_path, "0::/\n", {"cpuset.cpus.effective": "8-15", "cpu.max": "max 100000"})
    node = node_cpus(root, proc)
    assert node == NodeCpus(tuple(range(8, 16))) and node.pinnable
    plan = CpuPlan(node, 2, 2)
    assert plan.trainer_threads() == 3 and plan.trainer_cores(0) == (8, 9, 10) and plan.trainer_cores(1) == (11, 12, 13)
    assert "cores 8-10 for the first" in plan.line()


def test_kubernetes_cpu_limit_sets_threads_and_does_not_pin(tmp_path):
    """A pod with a 4-CPU limit on a 64-core host (v2 ``cpu.max``, under its pod's cgroup): every host core is
    in the mask, so pinning would put every pod on the same low cores; the threads come from the quota."""
    root, proc = _fake(tmp_path, "0::/kubepods/pod1/ctr\n", {
        "cpuset.cpus.effective": "0-63", "kubepods/pod1/cpu.max": "800000 100000",
        "kubepods/pod1/ctr/cpu.max": "400000 100000", "kubepods/pod1/ctr/cpuset.cpus.effective": "0-63"})
    node = node_cpus(root, proc)
    assert node.ids == tuple(range(64)) and node.quota == 4 and node.cores == 4 and not node.pinnable
    plan = CpuPlan(node, 1, 1)
    assert plan.split and plan.trainer_threads() == 3 and plan.trainer_cores(0) is None  # a core for the actor
    assert "4 cores (quota 4 of 64)" in plan.line() and "not pinned" in plan.line()
    assert CpuPlan(node, 2, 1).trainer_threads() == 2


def test_cgroup_v1_quota_is_the_smallest_up_to_the_mount(tmp_path):
    """cgroup v1 (``cpu,cpuacct`` mounted together, a host path only partly under the mount): the tightest
    quota on the way up counts, rounded down; the cpuset comes from the nearest level that has one."""
    root, proc = _fake(tmp_path, "5:cpuset:/docker/abc\n4:cpu,cpuacct:/docker/abc\n2:memory:/docker/abc\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000",
        "cpu,cpuacct/docker/cpu.cfs_quota_us": "250000", "cpu,cpuacct/docker/cpu.cfs_period_us": "100000",
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "-1", "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
        "cpuset/cpuset.effective_cpus": "0-7", "cpuset/docker/cpuset.effective_cpus": "2-5"})
    node = node_cpus(root, proc)
    assert node == NodeCpus((2, 3, 4, 5), 2.5) and node.cores == 2 and not node.pinnable
    # The same container seen without its host path (a namespaced mount): the mount's top is the container.
    root, proc = _fake(tmp_path / "ns", "4:cpu,cpuacct:/docker/abc\n3:cpuset:/docker/abc\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "300000", "cpu,cpuacct/cpu.cfs_period_us": "100000",
        "cpuset/cpuset.effective_cpus": "4-6"})
    node = node_cpus(root, proc)
    assert node == NodeCpus((4, 5, 6), 3.0) and node.pinnable
    assert CpuPlan(node, 1, 1).trainer_cores(0) == (4, 5)  # core 6 left to the sampler actor


def test_without_cgroup_files_the_process_mask_counts(tmp_path, monkeypatch):
    """No cpuset to read: the process's affinity gives the ids (a faked mask of 8-11), never 0..N-1."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {11, 9, 8, 10})
    root, proc = _fake(tmp_path, "0::/\n", {})
    assert node_cpus(root, proc) == NodeCpus((8, 9, 10, 11))
    assert CpuPlan(node_cpus(root, proc), 2, 0).trainer_cores(1) == (10, 11)
    root, proc = _fake(tmp_path / "none", "", {})  # no /proc/self/cgroup entries at all
    assert node_cpus(root, proc).ids == (8, 9, 10, 11)


CPUSET_FILES = [Path("/sys/fs/cgroup/cpuset/cpuset.effective_cpus"), Path("/sys/fs/cgroup/cpuset.cpus.effective")]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not any(p.exists() for p in CPUSET_FILES),
                    reason="needs 2 CPUs and a cgroup cpuset file (v1 cpuset mount or v2 cpuset controller)")
def test_a_narrowed_mask_does_not_narrow_the_node():
    """A process pinned to one core (``taskset``, or a worker after the plan pinned it) still plans for the
    node's whole set, read from the cgroup: the same plan in every process of the node."""
    every = os.sched_getaffinity(0)
    node = node_cpus()
    os.sched_setaffinity(0, {max(every)})
    try:
        assert node_cpus() == node and len(node.ids) >= 2
    finally:
        os.sched_setaffinity(0, every)


def _probe(ray, env: dict):
    """A Ray actor that applies one part of the plan to its own process and reads it back."""

    class Probe:  # defined here: cloudpickle ships it by value (the tests' modules are not on workers' path)
        def pid(self) -> int:
            return os.getpid()

        def trainer(self, policy: CpuPolicy, local_rank: int, local_world: int) -> dict:
            return self._with_pools(policy.apply_trainer(local_rank, local_world))

        def sampler(self, policy: CpuPolicy, threads: int) -> dict:
            return self._with_pools(policy.apply_sampler(threads))

        @staticmethod
        def _with_pools(used: dict) -> dict:
            import threadpoolctl

            # The OpenMP runtimes as they report themselves (torch's libgomp; DGL's only where DGL is loaded).
            used["openmp"] = [p["num_threads"] for p in threadpoolctl.threadpool_info()
                              if p["internal_api"] == "openmp"]
            return used

    # Its own lease directory: a probe of an earlier test may still hold its cores while it exits.
    env = dict(env, **{leases.LEASE_DIR_ENV: tempfile.mkdtemp(prefix="gnnray-probe-")})
    return ray.remote(num_cpus=0, runtime_env={"env_vars": env})(Probe).remote()


def test_each_process_uses_what_the_plan_says(ray_cluster):
    """A train worker's and a sampler actor's threads, cores, niceness and OpenMP wait policy, read back inside
    the process after applying the plan, equal the plan's (and differ from Ray's defaults, so this can fail)."""
    ray = ray_cluster
    policy = CpuPolicy(True, samplers_per_node=1)

    alone = ray.get(_probe(ray, JOB_ENV).trainer.remote(policy, 0, 1))  # one worker: every core's threads
    threads = CpuPlan(node_cpus(), 1, 1).trainer_threads()
    assert alone["torch_threads"] == threads and set(alone["openmp"]) == {threads}
    assert alone["omp_wait_policy"] == "PASSIVE"
    second = ray.get(_probe(ray, JOB_ENV).trainer.remote(policy, 1, 2))  # the second of two: its own cores
    assert tuple(second["cores"]) == (CpuPlan(node_cpus(), 2, 1).trainer_cores(1) or tuple(alone["cores"]))

    probe = _probe(ray, JOB_ENV)
    before = ray.get(probe.sampler.remote(CpuPolicy(False, 1), 1))  # plan off: Ray's defaults, nothing changed
    sampler = ray.get(probe.sampler.remote(policy, 1))
    assert sampler["nice"] == before["nice"] + SAMPLER_NICE
    # The native sampler's threads are its own (numba's): its process loads neither torch nor an OpenMP runtime.
    assert sampler["torch_threads"] is None and sampler["openmp"] == [], sampler

    off = ray.get(_probe(ray, {}).trainer.remote(CpuPolicy(False, 1), 0, 1))  # Ray's defaults: one thread
    assert off["omp_wait_policy"] == "default" and off["torch_threads"] == 1
    assert threads == 1 or alone["torch_threads"] != off["torch_threads"]


def _v1_controller(name: str) -> Path | None:
    """This machine's cgroup v1 mount of ``name`` if a child cgroup can be made in it (root, writable)."""
    base = Path("/sys/fs/cgroup") / name
    if not (base / "cgroup.procs").exists() or not os.access(base, os.W_OK):
        return None
    return base


class _Cgroup:
    """A v1 cgroup made for the test; the processes moved into it are moved back before it is removed."""

    def __init__(self, base: Path, settings: dict):
        self.path = base / f"gnnray-test-{uuid.uuid4().hex[:8]}"
        self.path.mkdir()
        for name, value in settings.items():
            (self.path / name).write_text(value)

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))  # every thread of the process, not one task

    def remove(self) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                (self.path.parent / "cgroup.procs").write_text(pid)
            except OSError:  # the process has exited meanwhile
                pass
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


CPUSET, CPU = _v1_controller("cpuset"), _v1_controller("cpu")
NO_CGROUPS = "needs root and a writable cgroup v1 cpuset/cpu mount to make a cgroup for the test"


@pytest.mark.skipif(CPUSET is None or len(os.sched_getaffinity(0)) < 2, reason=NO_CGROUPS + ", and 2 CPUs")
def test_a_ray_worker_in_a_real_cpuset_is_pinned_within_it(ray_cluster):
    """A Ray worker moved into a cgroup whose cpuset is only the highest CPU (as ``--cpuset-cpus`` does to a
    container) plans one core, that one, and pins to it: pinning to core 0 would fail with EINVAL."""
    ray = ray_cluster
    last = max(os.sched_getaffinity(0))
    group = _Cgroup(CPUSET, {"cpuset.cpus": str(last), "cpuset.mems": (CPUSET / "cpuset.mems").read_text()})
    probe = _probe(ray, JOB_ENV)
    try:
        group.add(ray.get(probe.pid.remote()))
        used = ray.get(probe.trainer.remote(CpuPolicy(True, samplers_per_node=1), 0, 1))
        assert used["cores"] == [last] and used["torch_threads"] == 1 and set(used["openmp"]) == {1}
    finally:
        ray.kill(probe)
        group.remove()


@pytest.mark.skipif(CPU is None or len(os.sched_getaffinity(0)) < 2, reason=NO_CGROUPS + ", and 2 CPUs")
def test_a_ray_worker_under_a_real_cpu_quota_takes_its_threads_from_it(ray_cluster):
    """A Ray worker moved into a cgroup with a one-CPU CFS quota (a Kubernetes CPU limit of 1) on this
    machine's cores: one thread, and no pinning, although every core is in its mask."""
    ray = ray_cluster
    every = sorted(os.sched_getaffinity(0))
    group = _Cgroup(CPU, {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"})
    probe = _probe(ray, JOB_ENV)
    try:
        group.add(ray.get(probe.pid.remote()))
        used = ray.get(probe.trainer.remote(CpuPolicy(True, samplers_per_node=1), 0, 1))
        assert used["torch_threads"] == 1 and set(used["openmp"]) == {1}
        assert used["cores"] == every  # not pinned to a subset
    finally:
        ray.kill(probe)
        group.remove()
