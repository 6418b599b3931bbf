"""Reliability drills: processes and nodes die mid-run, a rank raises, memory over many epochs.

Each drill runs the real job on the session's cluster (CPU workers, a small
synthetic graph) and acts on it from outside: it waits for epochs in
``metrics.jsonl``, finds the job's processes in Ray's actor table and kills
them (only processes of this session's cluster, by pid).
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np
import torch
from ray import cloudpickle

from drills import (JOB_TIMEOUT_S, SMALL, JobThread, actor_ids, actor_restarts, actor_states, alive_actors,
                    check_epochs, killed_fixed_run, logged, resumed_run, wait_until)  # noqa: F401 (fixtures)

# The custom models below must reach the workers by value: tests/ is not on their path.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_train_worker_killed_mid_epoch(killed_fixed_run):
    """Drill 1: a train worker is killed mid-epoch; the run restores the last checkpoint and finishes.

    The run is drills.killed_fixed_run (2 workers, 3 epochs, the last worker killed 6 steps into epoch 1),
    shared with test_elastic.py's check of what it trained.
    """
    run = killed_fixed_run
    job = run.job
    assert job.error is None, repr(job.error)
    assert job.summary.restarts == 1 and job.summary.metrics["restarts"] == 1
    check_epochs(logged(run.storage, run.name), 3, restarts=1)


def test_sampler_actor_killed_is_replaced(ray_cluster, tmp_path):
    """Drill 2: the sampler actor is killed while it samples; Ray Data restarts it, training goes on untouched.

    The stream of all epochs is sampled ahead of training, so the actor is
    killed as soon as it is up, while it still has most rows to sample; a
    bigger, denser graph makes that take several seconds. The replacement is
    the same actor restarted by Ray or, rarely, a new one Ray Data's pool
    starts in its place (seen once in CI: the killed actor was not restarted,
    yet the run finished on a replacement).
    """
    epochs = 2
    earlier = actor_ids("SamplerActor")  # the session's earlier runs' actors
    job = JobThread(SMALL + ["--synthetic-nodes", "20000", "--synthetic-avg-degree", "30", "--fanouts", "15,15",
                             "--epochs", str(epochs), "--storage-path", str(tmp_path), "--name", "d2"])
    wait_until(lambda: bool(alive_actors("SamplerActor")), JOB_TIMEOUT_S, "the sampler actor", job)
    [sampler] = alive_actors("SamplerActor")
    assert not logged(tmp_path, "d2")  # still in epoch 0
    os.kill(sampler.pid, signal.SIGKILL)

    job.join()
    # --max-failures 0: had a train worker failed, the run would have raised.
    assert job.error is None, repr(job.error)
    assert job.summary.restarts == 0
    check_epochs(logged(tmp_path, "d2"), epochs, restarts=0)
    started = actor_ids("SamplerActor") - earlier - {sampler.actor_id}
    assert actor_restarts(sampler.actor_id) >= 1 or started, (
        f"the killed sampler actor was never replaced: {actor_states(actor_ids('SamplerActor') - earlier)}")


class _NodeOnlyJob:
    """The job's workers and actors on an added node that is removed mid-run.

    The head's CPUs are held by a placement group, so everything of the job
    that needs a CPU lands on the added node; the driver, and with it the
    graph's primary copy, stay on the head. After the node is removed the hold
    is released, so a restart fits on the head.
    """

    def __init__(self, cluster, ray):
        from ray.util.placement_group import placement_group

        self._cluster = cluster
        [head] = [n for n in ray.nodes() if n["NodeID"] == cluster.head_node.node_id]
        self.hold = placement_group([{"CPU": head["Resources"]["CPU"]}], strategy="STRICT_PACK")
        ray.get(self.hold.ready(), timeout=120)
        self.node = cluster.add_node(num_cpus=5)
        cluster.wait_for_nodes()
        self.node_id = self.node.node_id

    def remove_node(self) -> None:
        from ray.util.placement_group import remove_placement_group

        if self.node is not None:
            self._cluster.remove_node(self.node, allow_graceful=False)
            self.node = None
        if self.hold is not None:
            remove_placement_group(self.hold)
            self.hold = None


def test_node_lost_mid_run_is_named(cluster, ray_cluster, tmp_path):
    """Drill 3: the node running the workers is removed; without --max-failures the run ends naming the node.
    (A restart after a lost worker: drill 1 here, and test_losing_a_shard_node with its node's shard rebuilt.)"""
    import ray.train

    from gnnray.driver.failures import one_line as _one_line

    setup = _NodeOnlyJob(cluster, ray_cluster)
    try:
        job = JobThread(SMALL + ["--epochs", "3", "--max-failures", "0", "--storage-path", str(tmp_path),
                                 "--name", "d3"])
        wait_until(lambda: len(logged(tmp_path, "d3")) >= 1, JOB_TIMEOUT_S, "epoch 0", job)
        workers = alive_actors("RayTrainWorker")
        assert len(workers) == 2 and all(w.node_id == setup.node_id for w in workers), workers
        setup.remove_node()
        job.join()
    finally:
        setup.remove_node()
    assert isinstance(job.error, ray.train.TrainingFailedError), repr(job.error)
    assert f"({setup.node_id[:8]})" in _one_line(job.error), _one_line(job.error)
    assert "OwnerDiedError" not in str(job.error)
    # The race CI met: only a peer's connection error arrived, before the health check saw the dead rank.
    peer_only = ray.train.WorkerGroupError("", {1: RuntimeError("Connection closed by peer [127.0.0.1]:4007")})
    line = _one_line(peer_only)
    assert line.startswith("rank 1: Connection closed") and f"({setup.node_id[:8]}) of ranks 0, 1 is lost" in line, line


class _FailsOnRank1(torch.nn.Module):
    """A linear model whose third training step raises on rank 1 only (while rank 0 waits in DDP's all-reduce)."""

    def __init__(self, in_feats: int, num_classes: int):
        super().__init__()
        self.fc = torch.nn.Linear(in_feats, num_classes)
        self.steps = 0

    def forward(self, blocks, x):
        import ray.train

        if self.training:
            self.steps += 1
            if self.steps == 3 and ray.train.get_context().get_world_rank() == 1:
                raise RuntimeError("drill 11: a user error on rank 1")
        return self.fc(x[: blocks[-1].num_dst])


def test_exception_on_one_rank_ends_the_run(ray_cluster, tmp_path):
    """Drill 11: an exception on rank 1 ends the run with that error, not after a collective timeout (30 min)."""
    import ray.train

    from gnnray.driver.failures import one_line as _one_line

    job = JobThread(SMALL + ["--epochs", "2", "--max-failures", "0", "--storage-path", str(tmp_path), "--name", "d11"],
                    model_factory=lambda f, c, _cfg: _FailsOnRank1(f, c))
    job.join()  # bounded: JOB_TIMEOUT_S, far below the collective timeout
    assert isinstance(job.error, ray.train.TrainingFailedError), repr(job.error)
    line = _one_line(job.error)
    assert line.startswith("rank 1") and "drill 11: a user error on rank 1" in line, line
    assert "lost" not in line, line  # every node is alive: none is named
    assert not logged(tmp_path, "d11")


class _RefusedOnRank1(torch.nn.Module):
    """A linear model that rank 1's machine refuses as it is built, as a worker refuses an option it cannot serve
    (a structure its GPU cannot hold)."""

    def __init__(self, in_feats: int, num_classes: int):
        import ray.train

        from gnnray.errors import ConfigError

        super().__init__()
        if ray.train.get_context().get_world_rank() == 1:
            raise ConfigError("drill 11b: rank 1's machine cannot serve this option")
        self.fc = torch.nn.Linear(in_feats, num_classes)

    def forward(self, blocks, x):
        return self.fc(x[: blocks[-1].num_dst])


def test_an_option_a_rank_refuses_ends_the_run_in_one_line_without_restarts(ray_cluster, tmp_path):
    """A rank's ConfigError is the driver's bad-input error, raised after the first attempt: every restart would
    meet it again."""
    from gnnray.errors import ConfigError

    job = JobThread(SMALL + ["--epochs", "1", "--max-failures", "2", "--storage-path", str(tmp_path), "--name", "d11b"],
                    model_factory=lambda f, c, _cfg: _RefusedOnRank1(f, c))
    job.join()
    assert isinstance(job.error, ConfigError), repr(job.error)
    assert str(job.error) == "drill 11b: rank 1's machine cannot serve this option"  # not after 3 attempts: then
    # the driver would raise Ray Train's TrainingFailedError


def test_private_memory_flat_over_epochs(resumed_run):
    """Drill 12: over 8 epochs the train workers' private memory (``worker_uss_mb``) does not keep growing.

    The run is the one of drill 8 (tests/driver/drills.py). After the first epochs USS
    rises by ~2.5 MiB an epoch here while Ray's and the allocators' caches fill
    (over 40 epochs it levels off: +34 MiB by epoch 25, then ~0.1 MiB an
    epoch); keeping each step's mini-batch (~0.5 MiB, 29 steps) would add ~15.
    """
    assert resumed_run.job.error is None, repr(resumed_run.job.error)
    uss = [m["worker_uss_mb"] for m in logged(resumed_run.storage, resumed_run.name)]
    assert len(uss) == 8
    per_epoch = (uss[-1] - uss[2]) / (len(uss) - 3)
    assert per_epoch < 6.0, f"USS grew {per_epoch:.2f} MiB an epoch: {[round(u, 1) for u in uss]}"


def test_sampler_actor_memory_flat_over_epochs(ray_cluster):
    """Drill 12: a sampler actor's private memory does not grow with the epochs it samples.

    Sampler actors live while the stream of all epochs is sampled, ahead of
    training, so the drill drives one ``SamplerActor`` in a Ray worker process
    epoch by epoch, as Ray Data would, and reads its USS after each epoch.
    """
    import ray

    from gnnray.data.synthetic import make_synthetic
    from gnnray.store.handle import publish

    graph = make_synthetic(3000, 8, 16, 10, seed=0)
    handle = publish(graph)

    def uss_per_epoch(handle, train_idx, epochs: int) -> list[float]:
        import ctypes

        import psutil

        from gnnray.sampler.sampler import SamplerActor
        from gnnray.seeds import SeedPlan

        libc = ctypes.CDLL("libc.so.6")
        plan = SeedPlan.for_run(train_idx, 32, 1, 0)
        actor = SamplerActor(handle, (5, 5), plan)
        uss = []
        for epoch in range(epochs):
            rows = np.arange(epoch * plan.rows_per_epoch, (epoch + 1) * plan.rows_per_epoch)
            for block in np.array_split(rows, max(1, len(rows) // 16)):  # 16-row blocks, as Ray Data hands them out
                actor({"row": block})
            libc.malloc_trim(0)  # freed allocator caches are not growth
            uss.append(psutil.Process().memory_full_info().uss / 2**20)
        return uss

    uss = ray.get(ray.remote(num_cpus=0.5)(uss_per_epoch).remote(handle, graph.train_idx, 12), timeout=300)
    per_epoch = (uss[-1] - uss[2]) / (len(uss) - 3)
    assert per_epoch < 0.5, f"USS grew {per_epoch:.2f} MiB an epoch: {[round(u, 2) for u in uss]}"
