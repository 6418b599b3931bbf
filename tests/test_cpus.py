"""The CPU plan: its rule on nodes of any size, and each process reading back what the plan says it uses."""

from __future__ import annotations

import os

import pytest

from gnnray.cpus import JOB_ENV, SAMPLER_NICE, CpuPlan, CpuPolicy, node_cores, samplers_per_node


@pytest.mark.parametrize("cores, trainers, samplers, gpu, split, threads, first, last", [
    (2, 1, 1, False, False, 2, (0, 1), (0, 1)),  # this machine: the worker shares both cores with the actor
    (2, 2, 1, False, False, 1, (0,), (1,)),  # two DDP workers: a core each, the actor between them
    (2, 4, 2, False, False, 1, None, None),  # more workers than cores: no pinning
    (16, 2, 2, False, True, 7, tuple(range(7)), tuple(range(7, 14))),  # actors get cores 14-15
    (96, 8, 16, True, True, 2, (0, 1), (14, 15)),  # a GPU node: few host threads per worker
    (8, 1, 8, True, False, 2, (0, 1), (0, 1)),  # GPU, actors fill the node: shared
])
def test_plan_on_nodes_of_any_size(cores, trainers, samplers, gpu, split, threads, first, last):
    plan = CpuPlan(cores, trainers, samplers, gpu)
    assert plan.split == split
    assert plan.trainer_threads() == threads
    assert plan.trainer_cores(0) == first and plan.trainer_cores(trainers - 1) == last
    pinned = [c for r in range(trainers) for c in plan.trainer_cores(r) or ()]
    assert len(pinned) == len(set(pinned)) <= cores  # no core is given to two workers
    if split:
        assert cores - len(pinned) >= samplers  # every actor has a core no worker is pinned to
    assert f"{cores} cores" in plan.line()


def test_threads_override_and_pool_spread():
    assert CpuPlan(16, 2, 2, threads=3).trainer_threads() == 3
    assert samplers_per_node(16, 1) == 16 and samplers_per_node(16, 5) == 4 and samplers_per_node(1, 4) == 1
    assert 1 <= node_cores() <= os.cpu_count()


def _probe(ray, env: dict):
    """A Ray actor that applies one part of the plan to its own process and reads it back."""

    class Probe:  # defined here: cloudpickle ships it by value (the tests' modules are not on workers' path)
        def trainer(self, policy: CpuPolicy, local_rank: int, local_world: int) -> dict:
            return self._with_pools(policy.apply_trainer(local_rank, local_world))

        def sampler(self, policy: CpuPolicy, threads: int) -> dict:
            return self._with_pools(policy.apply_sampler(threads))

        @staticmethod
        def _with_pools(used: dict) -> dict:
            import threadpoolctl

            # torch's libgomp as the OpenMP runtime itself reports it (DGL's pool is read by dgl.utils).
            used["openmp"] = [p["num_threads"] for p in threadpoolctl.threadpool_info()
                              if p["internal_api"] == "openmp"]
            return used

    return ray.remote(num_cpus=0, runtime_env={"env_vars": env})(Probe).remote()


def test_each_process_uses_what_the_plan_says(ray_cluster):
    """A train worker's and a sampler actor's threads, cores, niceness and OpenMP wait policy, read back inside
    the process after applying the plan, equal the plan's (and differ from Ray's defaults, so this can fail)."""
    ray = ray_cluster
    policy = CpuPolicy(True, samplers_per_node=1)

    alone = ray.get(_probe(ray, JOB_ENV).trainer.remote(policy, 0, 1))  # one worker: every core's threads
    threads = CpuPlan(node_cores(), 1, 1).trainer_threads()
    assert alone["torch_threads"] == alone["dgl_threads"] == threads and set(alone["openmp"]) == {threads}
    assert alone["omp_wait_policy"] == "PASSIVE"
    second = ray.get(_probe(ray, JOB_ENV).trainer.remote(policy, 1, 2))  # the second of two: its own cores
    assert tuple(second["cores"]) == (CpuPlan(node_cores(), 2, 1).trainer_cores(1) or tuple(alone["cores"]))

    probe = _probe(ray, JOB_ENV)
    before = ray.get(probe.sampler.remote(CpuPolicy(False, 1), 1))  # plan off: Ray's defaults, nothing changed
    sampler = ray.get(probe.sampler.remote(policy, 1))
    assert sampler["nice"] == before["nice"] + SAMPLER_NICE
    assert sampler["torch_threads"] == sampler["dgl_threads"] == 1 and set(sampler["openmp"]) == {1}

    off = ray.get(_probe(ray, {}).trainer.remote(CpuPolicy(False, 1), 0, 1))  # Ray's defaults: one thread
    assert off["omp_wait_policy"] == "default" and off["torch_threads"] == 1
    assert threads == 1 or alone["torch_threads"] != off["torch_threads"]
