"""Checkpoints within an epoch (train worker): every ``--checkpoint-every`` steps and, in an elastic run, on a
preemption notice, so that a lost worker or a drained node costs at most a few steps (docs/elastic.md).

The training loop (``train/loop.py``) calls :class:`StepCheckpoints` after every step and at every epoch's end.
"""

from __future__ import annotations

import collections
import math
import time
from typing import Optional

from gnnray.config import JobConfig
from gnnray.errors import GnnrayError
from gnnray.train import checkpoint
from gnnray.train.report import log_event, report_position


class StepCheckpoints:
    """Checkpoints within an epoch: every ``--checkpoint-every`` steps and, in an elastic run, on a preemption notice.

    Every rank calls :meth:`after_step` after each step, so every rank takes
    part in the same ``ray.train.report`` calls: a checkpoint within an epoch
    is due after the same step on all ranks (a step count, or the notice that
    ``ray.train.get_preemption_info``, a barrier, gives every rank alike).
    The notice is asked for about every :data:`CHECK_S` seconds, a number of
    steps rank 0 sets at each epoch's end from its step time (the barrier is a
    round trip to Ray Train's synchronisation actor; its cost is in
    docs/elastic.md#preemption-no-step-lost-to-a-drained-node). Without ``--checkpoint-every`` a fixed run does nothing
    here.

    On a preemption notice rank 0 writes a checkpoint at once, and training
    goes on while the deadline is far; near it (:meth:`_near_deadline`, rank
    0's view given to all), a last checkpoint is written and every rank waits
    for Ray Train to restart the group without the drained node, so that no
    step is trained twice. A notice without a deadline holds right after the
    first checkpoint: Ray Train then restarts the group after its own default
    wait.
    """

    SAFETY_S = 5.0  # beside the measured step, checkpoint and evaluation times (_near_deadline)
    CHECK_S = 1.0  # how often to ask for a preemption notice; Ray Train's watcher looks every 5 s
    FIRST_CHECK_STEPS = 16  # until the first epoch's end has measured a step
    HOLD_PAST_DEADLINE_S = 120.0  # Ray Train restarts the group at the deadline; past this something is wrong

    def __init__(self, cfg: JobConfig, rank: int, world: int, model, optimizer, embedding, config: dict,
                 schedule: checkpoint.Schedule, run_dir: Optional[str], plan: list):
        self._every, self._elastic = cfg.run.checkpoint_every, cfg.train.elastic
        self._rank, self._world = rank, world
        self._model, self._optimizer, self._embedding, self._config = model, optimizer, embedding, config
        self._schedule, self._run_dir, self._plan = schedule, run_dir, plan
        self.best_val, self.restarts = 0.0, 0
        self._since = 0  # steps since the last checkpoint, the same on every rank
        self._steps, self._check_every = 0, self.FIRST_CHECK_STEPS  # steps of this group; same on every rank
        self._notice = None  # the preemption notice, once seen
        self._hold_after_epoch = False
        # Rank 0's recent step times and longest checkpoint and epoch end, for _near_deadline. The first step
        # of a group waits for the stream to start: not a step time.
        self._steps_s: collections.deque = collections.deque(maxlen=20)
        self._last_step_at = math.inf
        self._save_s = self._eval_s = 0.0

    def after_step(self, epoch: int, done: int, steps: int) -> None:
        """After step ``done`` (1-based) of ``epoch``'s ``steps``."""
        import ray.train

        now = time.monotonic()
        if now > self._last_step_at:
            self._steps_s.append(now - self._last_step_at)
        self._since += 1
        self._steps += 1
        within = done < steps  # the epoch's last step is checkpointed (or not) at the epoch's end
        noticed = False
        if self._elastic and self._notice is None and self._steps % self._check_every == 0:
            self._notice = ray.train.get_preemption_info()  # every rank at the same step: a barrier
            noticed = self._notice is not None
            if noticed and self._rank == 0 and self._run_dir:
                log_event(self._run_dir, "preempted", nodes=list(self._notice.preempted_node_ids),
                          deadline_ms=self._notice.deadline_ms, epoch=epoch, step=done, world_size=self._world)
        if within and (noticed or (self._every and self._since >= self._every)):
            self._save(epoch, done)
        if self._notice is not None and self._agreed_near_deadline():
            if not within:
                self._hold_after_epoch = True  # once the epoch-end checkpoint is written
            else:
                if self._since:
                    self._save(epoch, done)
                self._hold()
        self._last_step_at = time.monotonic()

    def at_epoch_end(self, last: bool) -> bool:
        """Whether rank 0 attaches a checkpoint to the epoch's report. With ``--checkpoint-every`` every rank
        learns it (they all count the steps since the last checkpoint), and in an elastic run the steps between
        two looks for a preemption notice."""
        due = self._rank == 0 and bool(self._schedule.due(final=last) or self._notice is not None
                                       or (self._every and self._since >= self._every))
        if self._every or self._elastic:
            import ray.train.collective

            step_s = sum(self._steps_s) / len(self._steps_s) if self._steps_s else 0.0
            check_every = max(1, min(1000, round(self.CHECK_S / step_s))) if step_s else self._check_every
            due, self._check_every = ray.train.collective.broadcast_from_rank_zero(
                (due, check_every) if self._rank == 0 else None)
        return bool(due)

    def epoch_ended(self, saved: bool, eval_s: float) -> None:
        """After the epoch's report; ``saved``: rank 0 attached a checkpoint to it."""
        self._eval_s = max(self._eval_s, eval_s)
        if saved:
            self._since = 0
            self._schedule.saved()
        if self._hold_after_epoch:
            self._hold()
        self._last_step_at = time.monotonic()

    def _save(self, epoch: int, done: int) -> None:
        started = time.monotonic()
        position = dict(epoch=epoch - 1, step=done, best_val_acc=self.best_val, world_size=self._world,
                        restarts=self.restarts, plan=self._plan)
        report_position(position, self._model, self._optimizer, self._rank, self._run_dir, self._embedding,
                        self._config)
        self._since = 0
        self._save_s = max(self._save_s, time.monotonic() - started)
        if self._rank == 0:
            self._schedule.saved()

    def _agreed_near_deadline(self) -> bool:
        import ray.train.collective

        near = self._near_deadline() if self._rank == 0 else None
        return bool(ray.train.collective.broadcast_from_rank_zero(near))

    def _near_deadline(self) -> bool:
        """Rank 0: whether the next step, a checkpoint and an evaluation might not fit before the deadline."""
        if self._notice.deadline_ms is None:
            return True
        left = self._notice.deadline_ms / 1000 - time.time()
        step_s = max(self._steps_s, default=0.0)
        return left < self.SAFETY_S + 3 * step_s + 2 * self._save_s + self._eval_s

    def _hold(self) -> None:
        """Wait, training nothing, until Ray Train ends this group at the deadline (then restarts it smaller)."""
        deadline = self._notice.deadline_ms / 1000 if self._notice.deadline_ms else time.time() + 120.0
        while time.time() < deadline + self.HOLD_PAST_DEADLINE_S:
            time.sleep(0.5)
        raise GnnrayError(f"rank {self._rank} waited {self.HOLD_PAST_DEADLINE_S:.0f} s past the preemption deadline "
                          f"of nodes {', '.join(n[:8] for n in self._notice.preempted_node_ids)} and Ray Train did "
                          f"not restart the worker group")
