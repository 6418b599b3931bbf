"""Start-up: the driver starts Ray before it imports torch, and the stream starts before the ranks ask for it."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from drills import REPO


def test_driver_modules_import_no_torch_and_no_ray_train():
    """What runs before Ray starts stays light: torch is imported in a thread while Ray starts."""
    code = ("import sys, gnnray.driver.cli, gnnray.driver.fit, gnnray.driver.attempt, gnnray.driver.launch, "
            "gnnray.driver.plans, gnnray.driver.pace, gnnray.driver.stream, gnnray.train.stream_start; "
            "print(sorted(m for m in ('torch', 'dgl', 'numba', 'ray.train', 'ray.data') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def _counting_dataset(ray, rows: int, counter):
    """``rows`` ids through an actor pool that tells ``counter`` about each call."""
    import ray.data

    class Count:
        def __call__(self, batch):
            counter.add.remote(len(batch["id"]))
            return batch

    return ray.data.range(rows, override_num_blocks=rows // 5).map_batches(
        Count, batch_size=None, compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0)


def test_started_split_samples_before_the_ranks_ask_and_splits_equally(ray_cluster):
    import ray.data

    from gnnray.controller.split import StartedSplit

    @ray_cluster.remote(num_cpus=0)
    class Counter:
        def __init__(self):
            self.rows = 0

        def add(self, n):
            self.rows += n

        def get(self):
            return self.rows

    counter = Counter.remote()
    config = StartedSplit(_counting_dataset(ray_cluster, 40, counter), 2, ray.data.ExecutionOptions(preserve_order=True))
    # Nobody reads yet: the stream runs anyway (Ray Data's default budget lets it run to the end here).
    deadline = time.monotonic() + 120
    while ray_cluster.get(counter.get.remote()) == 0:
        assert time.monotonic() < deadline, "the stream did not start before a rank asked for it"
        time.sleep(0.2)

    splits = [shard["train"] for shard in config.configure({"train": None}, 2, None, None)]
    with pytest.raises(ValueError, match="split 2 ways for 3 workers"):
        config.configure({"train": None}, 3, None, None)

    @ray_cluster.remote(num_cpus=0)
    def read(split, epochs):  # as a rank reads its shard: pickled to another process, iterated per epoch
        return [sorted(int(i) for b in split.iter_batches(batch_size=None) for i in b["id"]) for _ in range(epochs)]

    first, second = ray_cluster.get([read.remote(s, 2) for s in splits])
    for epoch in range(2):  # the driver's epoch, then one the ranks start themselves
        assert len(first[epoch]) == len(second[epoch]) == 20
        assert sorted(first[epoch] + second[epoch]) == list(range(40))


@pytest.mark.parametrize("datasets, local", [(False, True), (True, False)])
def test_the_trainer_starts_only_the_controller_callbacks_the_run_needs(ray_cluster, tmp_path, datasets, local):
    """No dataset manager for a run without a stream, no placement-group cleaner on a cluster this process
    started (each would be one more process importing Ray Train); both otherwise, as Ray Train has them."""
    import ray.data
    import ray.train
    from ray.train.v2._internal.callbacks import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    from gnnray import ray_internals

    given = dict(datasets={"train": ray.data.range(4)}) if datasets else {}
    trainer = ray_internals.lean_trainer(local)(
        lambda: None, scaling_config=ray.train.ScalingConfig(num_workers=1),
        run_config=ray.train.RunConfig(name="lean", storage_path=str(tmp_path)), **given)
    kinds = {type(c) for c in trainer._create_default_callbacks()}
    assert (DatasetsCallback in kinds) == datasets
    assert (PlacementGroupCleanerCallback in kinds) == (not local)


@pytest.mark.parametrize("local", [True, False])
def test_a_fixed_run_asks_an_autoscaler_for_its_workers_only_on_a_cluster_it_did_not_start(ray_cluster, tmp_path,
                                                                                           monkeypatch, local):
    """A cluster this process started has no autoscaler: its fixed worker group sends no resource request, and
    Ray Data's autoscaling coordinator (one more process importing Ray Data) is never asked for."""
    import types

    import ray.train
    from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy, ResizeDecision
    from ray.train.v2._internal.execution.scaling_policy import autoscaling_coordinator_client as client
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from gnnray import ray_internals

    asked = []

    def no_coordinator():  # Ray Train logs a failed request and goes on
        asked.append(True)
        raise LookupError("the autoscaling coordinator was asked for")

    monkeypatch.setattr(client, "get_or_create_autoscaling_coordinator", no_coordinator)
    given = {}
    monkeypatch.setattr(DataParallelTrainer, "_initialize_and_run_controller", lambda self, **kw: given.update(kw))
    scaling = ray.train.ScalingConfig(num_workers=2)
    trainer = ray_internals.lean_trainer(local)(
        lambda: None, scaling_config=scaling, run_config=ray.train.RunConfig(name="lean", storage_path=str(tmp_path)))
    trainer._initialize_and_run_controller(scaling_policy=FixedScalingPolicy(scaling))
    policy = given["scaling_policy"]
    policy.after_controller_start(types.SimpleNamespace(run_id="r1"))
    decision = policy.make_decision_for_non_running_worker_group()
    policy.before_controller_abort()
    assert isinstance(decision, ResizeDecision) and decision.num_workers == 2
    assert bool(asked) == (not local)
