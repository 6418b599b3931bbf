"""The train stream's split over the ranks, handed to Ray Train as its ``DataConfig``: code that Ray Train's
controller side runs on the run's behalf.

Why a folder of its own: this code is made by the driver but runs in Ray
Train's processes. Ray Train unpickles the config in its controller and calls
``configure`` in its dataset-manager actor (on the controller's node) when
rank 0 first asks for its shard; an elastic run's :class:`ElasticSplit`
builds each worker group's stream there (``driver/stream.py``, from the start
that :class:`~gnnray.train.stream_start.StreamStart` decides). So it imports
no torch at module level, and what it needs it imports when it runs.

Ray Train splits a dataset only when rank 0 first asks for its shard, once
the workers have started and imported everything: only then would the split
coordinator and the sampler actors start, and sample the first batch. Made
by the driver just before ``trainer.fit()`` (:mod:`gnnray.driver.attempt`),
they start while Ray Train starts its controller and workers, and the first
batches (within ``--max-ahead``) are waiting when the workers ask.
"""

from __future__ import annotations

import time
from typing import Callable

from ray.train import DataConfig


class StartedSplit(DataConfig):
    """Ray Train's ``DataConfig`` for the stream: split equally (every rank the same row count), epoch started.

    The stream spans the whole run, so it has one epoch: each rank's first
    ``start_epoch`` gets the one the driver started.

    No locality hints (the workers' nodes are not known yet): on several
    nodes a rank may read batches sampled on another node.

    Args:
        stream: The dataset of packed mini-batches (``gnnray.driver.stream``).
        num_workers: Ray Train workers (ranks).
        execution_options: How the ranks consume it (Ray Data's ``ExecutionOptions``).
    """

    def __init__(self, stream, num_workers: int, execution_options):
        super().__init__(datasets_to_split=["train"])
        stream.set_name("train")
        stream.context.execution_options = execution_options
        self._splits = stream.streaming_split(num_workers, equal=True)
        self._coordinator = self._splits[0]._coord_actor
        for i, split in enumerate(self._splits):
            split._coord_actor = _EpochStarted(self._coordinator, self._coordinator.start_epoch.remote(i))

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        if world_size != len(self._splits):
            raise ValueError(f"the stream was split {len(self._splits)} ways for {world_size} workers")
        return [{"train": split} for split in self._splits]

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """End the stream (after an attempt, failed or not): the sampler actors first, then their owner.

        Killed first, the coordinator takes its actors down with it while
        they still sample ahead, or are still being created: the GCS then
        kills workers that are already exiting (its "Failed to kill actor
        ... Socket closed" line on every driver's console), and an actor
        may get SIGTERM inside a finalizer. So its executor releases them,
        and the coordinator goes once they have exited.
        """
        import ray

        deadline = time.monotonic() + timeout_s
        try:
            ray.get(self._coordinator.shutdown_executor.remote(), timeout=timeout_s)
            wait_until_gone(owned_by(self._coordinator), deadline)
        except Exception:  # noqa: BLE001  (a coordinator already dead or stuck: the kill below ends it)
            pass
        ray.kill(self._coordinator)

    def __deepcopy__(self, memo):  # Ray Train copies its config: the splits are handles, one set of them
        return self


class ElasticSplit(DataConfig):
    """An elastic run's ``DataConfig``: at every worker-group start, the stream for that group, from the newest
    checkpoint.

    Ray Train calls ``configure`` once per worker-group start (the first, and
    every resize or restart), with the new group's world size, in a dataset
    manager actor of its own (on the controller's node), when rank 0 first
    asks for its shard. It finds the newest valid checkpoint in the run's
    directory, builds the seed plan for that world size (the global batch
    stays ``--batch-size x MAX``) and the stream from the checkpoint's step,
    with a sampler pool sized for the world size, and starts it (as
    :class:`StartedSplit`). It appends where the stream starts to the run's
    ``workers.jsonl``; every rank reads it back
    (:meth:`gnnray.train.stream_start.StreamStart.of`) and restores that
    checkpoint: one decision, so model and stream cannot
    disagree. The previous group's stream ends with its dataset manager (Ray
    Train shuts its executor down and drops the actor, which owns the split
    coordinator and with it the sampler actors).

    Args:
        cfg: The job configuration.
        graph: Handle of the node-shared graph (the sampler actors read it).
        train_idx: The training split's node ids (the plan's).
        run_dir: The run's directory: checkpoints and ``workers.jsonl``.
        cpu: The job's CPU plan, which each sampler actor applies.
    """

    def __init__(self, cfg, graph, train_idx, run_dir: str, cpu=None, stack=None):
        super().__init__(datasets_to_split=["train"])
        self._cfg, self._graph, self._train_idx, self._run_dir, self._cpu = cfg, graph, train_idx, run_dir, cpu
        self._stack = stack

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        from gnnray.driver.console import quiet_ray
        from gnnray.driver.stream import execution_options, minibatch_stream
        from gnnray.seeds import SeedPlan
        from gnnray.train import checkpoint
        from gnnray.train.report import events, log_event
        from gnnray.train.stream_start import StreamStart

        cfg = self._cfg
        quiet_ray(cfg.run.verbose)  # this process's Ray Data logs, and the stream's, as the driver keeps its own
        latest, _ = checkpoint.latest_valid(self._run_dir, ("embedding",) if cfg.data.embedding_dim else ())
        log = events(self._run_dir)
        fit = max((i for i, e in enumerate(log) if e["event"] == "fit"), default=-1)
        start = StreamStart.after(latest, cfg, len(self._train_idx),
                                  restarts=sum(1 for e in log[fit + 1:] if e["event"] == "start"))
        log_event(self._run_dir, "start", world_size=world_size, epoch=start.epoch, step=start.step,
                  attempt=start.restarts, checkpoint=start.checkpoint)
        if start.epoch >= cfg.train.epochs:  # finished before this group started: its ranks return at once
            return [{"train": None} for _ in range(world_size)]
        plan = SeedPlan.elastic(self._train_idx, cfg.sampler.batch_size, cfg.train.workers_max, world_size,
                                cfg.run.seed)
        stream = minibatch_stream(cfg, self._graph, plan, start.epoch, cpu=self._cpu, first_step=start.step,
                                  stack=self._stack)
        return StartedSplit(stream, world_size, execution_options()).configure(datasets, world_size, None, None)

    def __deepcopy__(self, memo):  # Ray Train copies its config: nothing here changes
        return self


def split_by_driver():
    """What Ray Train gets as the dataset ``train``: nothing to split, and nothing heavy to unpickle.

    The stream reaches the ranks through :class:`StartedSplit`; Ray Train
    needs the dataset's name, and calls this (a dataset factory) once.
    """
    return None


class _EpochStarted:
    """A split coordinator's handle whose first ``start_epoch`` returns the epoch the driver started."""

    def __init__(self, coordinator, epoch_ref):
        self._coordinator, self._epoch_ref = coordinator, epoch_ref

    @property
    def start_epoch(self):
        if self._epoch_ref is None:
            return self._coordinator.start_epoch
        ref, self._epoch_ref = self._epoch_ref, None
        return _Started(ref)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_coordinator", "_epoch_ref"):  # looked up while unpickling
            raise AttributeError(name)
        return getattr(self._coordinator, name)


class _Started:
    """``start_epoch`` of an epoch already started: ``.remote(split)`` gives its id."""

    def __init__(self, ref):
        self._ref = ref

    def remote(self, *args):
        return self._ref


def owned_by(actor) -> Callable[[dict], bool]:
    """A test on GCS actor-table entries: is the entry an actor that ``actor`` created and that dies with it?

    Detached actors (Ray Data's shared trackers) outlive their creator: they are not counted.
    """
    from gnnray import ray_internals

    address = ray_internals.actor_table(actor._actor_id.hex()).get("Address", {})
    where = (address.get("IPAddress"), address.get("Port"))
    return lambda entry: (not entry["IsDetached"]
                          and (entry["OwnerAddress"]["IPAddress"], entry["OwnerAddress"]["Port"]) == where)


def wait_until_gone(matches: Callable[[dict], bool], deadline: float, poll_s: float = 0.1) -> bool:
    """Wait until no actor the GCS knows and ``matches`` accepts is still alive, pending or restarting."""
    from gnnray import ray_internals

    while True:
        live = [a for a in ray_internals.actor_table().values() if a["State"] != "DEAD" and matches(a)]
        if not live or time.monotonic() > deadline:
            return not live
        time.sleep(poll_s)
