"""The train stream's split over the ranks, made and started by the driver, handed to Ray Train as its ``DataConfig``.

Ray Train splits a dataset only when rank 0 first asks for its shard, once
the workers have started and imported everything: only then would the split
coordinator and the sampler actors start, and sample the first batch. Made
by the driver just before ``trainer.fit()``, they start while Ray Train starts
its controller and workers, and the first batches (within ``--max-ahead``)
are waiting when the workers ask.

This module imports no torch: Ray Train's dataset manager unpickles the
config, and should not pay for more than it uses.
"""

from __future__ import annotations

from ray.train import DataConfig


class StartedSplit(DataConfig):
    """Ray Train's ``DataConfig`` for the stream: split equally (every rank the same row count), epoch started.

    The stream spans the whole run, so it has one epoch: each rank's first
    ``start_epoch`` gets the one the driver started.

    No locality hints (the workers' nodes are not known yet): on several
    nodes a rank may read batches sampled on another node.

    Args:
        stream: The dataset of packed mini-batches (``gnnray.pipeline.stream``).
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

    def shutdown(self) -> None:
        """End the stream: its coordinator, and with it the sampler actors (after an attempt, failed or not)."""
        import ray

        ray.kill(self._coordinator)

    def __deepcopy__(self, memo):  # Ray Train copies its config: the splits are handles, one set of them
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
