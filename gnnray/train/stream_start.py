"""Where a worker group's stream starts, and the checkpoint that holds the model of that point: one rule, read by
every rank.

Three processes meet here. Before each attempt of a fixed run the driver
decides (:meth:`StreamStart.after`) and hands the start to the ranks in their
``WorkerSetup``; an elastic run's start is decided in Ray Train's
dataset-manager actor when it makes a group's stream (``controller/split.py``),
by the same rule, and logged to the run's ``workers.jsonl``. Every rank reads
the decision back (:meth:`StreamStart.of`) and restores that checkpoint: model
and stream cannot disagree. Torch-free, so that the driver and Ray Train's
controller side import it as the ranks do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from gnnray.errors import GnnrayError
from gnnray.seeds import plan_key

if TYPE_CHECKING:
    from gnnray.config import JobConfig
    from gnnray.train.checkpoint import CheckpointInfo
    from gnnray.train.setup import WorkerSetup


def next_position(info: Optional[CheckpointInfo], plan: Optional[list] = None) -> tuple[int, int]:
    """``(epoch, step)`` where training continues after checkpoint ``info`` (``(0, 0)`` without one).

    A checkpoint within an epoch written under another seed plan than ``plan``
    (``seeds.plan_key``: another ``--batch-size`` or ``--num-workers``)
    continues at the start of its epoch: its step count means other seeds now.
    """
    if info is None:
        return 0, 0
    if info.step and plan is not None and info.metrics.get("plan") != plan:
        return info.epoch + 1, 0
    return info.epoch + 1, info.step


@dataclass(frozen=True)
class StreamStart:
    """Where this worker group's stream starts and the checkpoint that holds the model of that point.

    Attributes:
        epoch, step: The stream's first step.
        checkpoint: The checkpoint to restore (``None``: start fresh).
        restarts: Restarts before this group (driver restarts, or Ray Train's in an elastic run).
    """

    epoch: int
    step: int
    checkpoint: Optional[str]
    restarts: int

    @staticmethod
    def after(latest: Optional[CheckpointInfo], cfg: JobConfig, num_train: int, restarts: int = 0) -> StreamStart:
        """The start after checkpoint ``latest`` (``None``: fresh) under this run's seed plan for ``num_train``
        training seeds: the driver's for a fixed run, the dataset manager's for an elastic group."""
        epoch, step = next_position(latest, plan_key(num_train, cfg.sampler.batch_size, cfg.train.num_workers))
        return StreamStart(epoch, step, latest.path if latest else None, restarts)

    @staticmethod
    def of(setup: WorkerSetup, world: int, events: Callable[[str], list]) -> StreamStart:
        """What a rank reads: the driver's choice (a fixed run), or the start this elastic group's stream logged
        in the run's ``workers.jsonl`` when it was made (``events(run_dir)`` reads it)."""
        if not setup.cfg.train.elastic:
            return StreamStart(setup.first_epoch, setup.first_step, setup.resume_from, setup.restarts)
        start = [e for e in events(setup.run_dir) if e["event"] == "start"][-1]
        if start["world_size"] != world:
            raise GnnrayError(f"the stream was made for {start['world_size']} workers and this worker group has "
                              f"{world}: does another run of --name {setup.cfg.run.name!r} write to {setup.run_dir}?")
        return StreamStart(start["epoch"], start["step"], start["checkpoint"], start["attempt"])
