"""Stage 3 (driver plans, sampler actors draw): the stream of seed batches.

Input: the training split's node ids. Output: a :class:`SeedPlan` (which
seeds each step samples) and a Ray Data dataset with one row per (epoch,
step, rank) holding only the row's number, ``row = epoch * rows_per_epoch +
j``, covering every epoch of the run step by step. The sampler actor turns a
row number into its seeds with :meth:`SeedReader.seeds`.

Why row numbers and not seeds: the dataset is built from in-memory blocks
(``ray.data.from_blocks``), so it runs no Ray tasks. Computing the seeds in
read tasks made every task receive and shuffle the whole split, costing as
much CPU as sampling the row; an actor shuffles each epoch once and then only
slices (docs/performance.md#the-data-path-and-why).

One dataset spans all epochs so the sampler actor pool starts once per run,
not once per epoch (a pool's start is dominated by importing torch and DGL). Each epoch is a fresh permutation seeded by (run seed, epoch), so a
resumed run replays exactly the seeds it would have drawn.

Every epoch has ``steps * ranks`` rows (all seeds, none dropped, batches
differing by at most one seed), so an equal split gives every rank the same
number of steps and DDP never waits on a rank that ran out of data. Row ``j``
of an epoch is piece ``j % ranks`` of step ``j // ranks``; the stream hands
rank ``r`` exactly the pieces ``r`` of steps in order (:func:`seed_dataset`),
so after ``k`` steps the ranks have taken exactly the epoch's first
``k * ranks`` rows, and a checkpoint within an epoch resumes at row
``k * ranks``: the rows before it are not sampled again.

Two plans. A fixed run (``--num-workers N``) cuts each epoch's permutation
into ``steps * N`` batches of ``--batch-size`` at most, as gnnray always did.
An elastic run (``--num-workers MIN,MAX``) keeps the *global* batch constant:
the permutation is cut into ``steps`` global batches of ``--batch-size x MAX``
at most, the same whatever the world size ``W``, and each global batch into
``W`` near-equal pieces, one per rank. An epoch then has the same steps and
the same order of global batches for any ``W``, and a resize within an epoch
resumes at the next global batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import numpy as np

if TYPE_CHECKING:
    from gnnray.config import JobConfig

# A block is one sampler-actor call: Ray Data's fixed work per call is spread
# over its rows, and 16 was where larger blocks stopped helping
# (docs/performance.md#the-data-path-and-why). Blocks are also the units the pool shares out, so
# they stay small: one block per epoch left all but one actor idle.
ROWS_PER_BLOCK = 16
# ...and of at most about this many bytes of packed batches: the read-ahead holds blocks in the object store
# (three per actor, two per worker), and a dense graph's batch is megabytes (products-shaped: 6.5 MB, so 96
# batches written ahead took 0.6 GB), while a call that samples megabytes has spread its fixed work already.
BLOCK_BYTES = 32 * 2**20
# ...but at most this many blocks: each is one ray.put on the driver, so a
# long run on a large graph still builds its stream in seconds.
_MAX_BLOCKS = 4096


def steps_per_epoch(num_seeds: int, batch_size: int, num_workers: int) -> int:
    """Optimizer steps each rank takes per epoch."""
    return max(1, math.ceil(num_seeds / (batch_size * num_workers)))


def plan_key(num_seeds: int, batch_size: int, num_workers: tuple) -> list:
    """What a step within an epoch means for ``--num-workers`` (``(N,)`` or ``(MIN, MAX)``): a checkpoint within
    an epoch resumes at its step only under the same key (another plan orders the epoch's seeds otherwise)."""
    steps = steps_per_epoch(num_seeds, batch_size, num_workers[-1])
    return ["global", steps] if len(num_workers) == 2 else ["fixed", steps, num_workers[0]]


def epoch_batches(ids: np.ndarray, num_batches: int, seed: int, epoch: int) -> list[np.ndarray]:
    """Shuffle ``ids`` for ``epoch`` and cut them into ``num_batches`` near-equal batches."""
    rng = np.random.default_rng([seed, epoch])
    return np.array_split(rng.permutation(ids), num_batches)


@dataclass(frozen=True)
class SeedPlan:
    """Which seeds each row of the stream samples: row ``j`` of epoch ``e`` is batch ``j`` of that epoch.

    Attributes:
        train_idx: The training split's node ids.
        steps: Optimizer steps per epoch; every rank takes one row per step.
        ranks: Rows per step: the world size the stream is split for.
        seed: The run's seed; with the epoch it fixes the shuffle.
        global_batches: An elastic run's plan: the permutation is cut into
            ``steps`` global batches, each into ``ranks`` pieces (see the
            module docstring); otherwise into ``steps * ranks`` batches at once.
        row_bytes: A packed mini-batch's bytes at most, where known
            (:func:`gnnray.sampler.sampler.packed_bytes_at_most`); it sizes the stream's blocks (0: unknown).
    """

    train_idx: np.ndarray
    steps: int
    ranks: int
    seed: int
    global_batches: bool = False
    row_bytes: int = 0

    @property
    def rows_per_epoch(self) -> int:
        return self.steps * self.ranks

    @staticmethod
    def for_run(train_idx: np.ndarray, batch_size: int, num_workers: int, seed: int, row_bytes: int = 0
                ) -> "SeedPlan":
        """A fixed run's plan: ``num_workers`` ranks of ``batch_size`` seeds each."""
        return SeedPlan(train_idx, steps_per_epoch(len(train_idx), batch_size, num_workers), num_workers, seed,
                        row_bytes=row_bytes)

    @staticmethod
    def elastic(train_idx: np.ndarray, batch_size: int, max_workers: int, world_size: int, seed: int) -> "SeedPlan":
        """An elastic run's plan for ``world_size`` ranks: global batches of ``batch_size x max_workers`` seeds."""
        return SeedPlan(train_idx, steps_per_epoch(len(train_idx), batch_size, max_workers), world_size, seed, True)

    def batches(self, epoch: int) -> list[np.ndarray]:
        """All of ``epoch``'s seed batches, in row order."""
        if not self.global_batches:
            return epoch_batches(self.train_idx, self.rows_per_epoch, self.seed, epoch)
        return [piece for batch in epoch_batches(self.train_idx, self.steps, self.seed, epoch)
                for piece in np.array_split(batch, self.ranks)]

    def step_seeds(self, epoch: int, step: int) -> np.ndarray:
        """The seeds all ranks together train at ``step`` of ``epoch``."""
        return np.concatenate(self.batches(epoch)[step * self.ranks:(step + 1) * self.ranks])


class SeedReader:
    """Seeds of rows of a :class:`SeedPlan`, shuffling each epoch once (rows arrive epoch by epoch)."""

    def __init__(self, plan: SeedPlan):
        self._plan = plan
        self._epoch, self._batches = -1, []

    def seeds(self, row: int) -> tuple[int, np.ndarray]:
        """Return ``row``'s epoch and seed node ids."""
        epoch = row // self._plan.rows_per_epoch
        if epoch != self._epoch:
            self._epoch, self._batches = epoch, self._plan.batches(epoch)
        return epoch, self._batches[row % self._plan.rows_per_epoch]


def block_rows(plan: SeedPlan, first_epoch: int, num_epochs: int) -> int:
    """Rows per seed block of the stream for epochs ``first_epoch .. num_epochs - 1``.

    :data:`ROWS_PER_BLOCK`, fewer where that many would hold more than
    :data:`BLOCK_BYTES` (``plan.row_bytes``), or more for a run so long that
    it would need more than :data:`_MAX_BLOCKS` blocks. The read-ahead limit
    is computed from this same number (:func:`gnnray.driver.stream.read_ahead_rows`).
    """
    rows = min(ROWS_PER_BLOCK, max(1, BLOCK_BYTES // plan.row_bytes)) if plan.row_bytes else ROWS_PER_BLOCK
    groups = max(1, _MAX_BLOCKS // plan.ranks)  # a group of steps is one block per rank
    return max(rows, math.ceil((num_epochs - first_epoch) * plan.steps / groups))


def stream_rows(plan: SeedPlan, first_epoch: int, num_epochs: int, first_step: int = 0) -> list[np.ndarray]:
    """The stream's row numbers from step ``first_step`` of ``first_epoch`` to the end of ``num_epochs - 1``, as
    the blocks the stream is made of, in order.

    Each block holds :func:`block_rows` consecutive steps of one rank: for
    every group of that many steps, one block per rank, rank 0 first. Ray
    Data's equal split hands blocks of one size out in order, each to the
    rank that has had the fewest rows (the lowest on a tie), so rank ``r``
    gets the blocks of rank ``r``: its ``k``-th row is piece ``r`` of the
    ``k``-th step (tested in tests/test_seeds.py).
    """
    if not 0 <= first_epoch < num_epochs or not 0 <= first_step < plan.steps:
        raise ValueError(f"first_epoch {first_epoch} must be in [0, {num_epochs}) and first_step {first_step} in "
                         f"[0, {plan.steps})")
    per_block = block_rows(plan, first_epoch, num_epochs)
    steps = np.arange(first_epoch * plan.steps + first_step, num_epochs * plan.steps, dtype=np.int64)
    return [group * plan.ranks + r for i in range(0, len(steps), per_block)
            for group in [steps[i:i + per_block]] for r in range(plan.ranks)]


def rank_rows(plan: SeedPlan, rank: int, first_epoch: int, num_epochs: int, first_step: int = 0) -> Iterator[int]:
    """The rows :func:`stream_rows` hands rank ``rank``, in order, computed where the rank runs: a fixed run that
    samples in its workers needs no stream (piece ``rank`` of every step from ``first_step`` of ``first_epoch``)."""
    first = first_epoch * plan.steps + first_step
    return (step * plan.ranks + rank for step in range(first, num_epochs * plan.steps))


def seed_dataset(plan: SeedPlan, first_epoch: int, num_epochs: int, first_step: int = 0):
    """Return the Ray Data dataset of row numbers from step ``first_step`` of ``first_epoch`` to the end of epoch
    ``num_epochs - 1``, in the blocks of :func:`stream_rows`.

    Raises:
        ValueError: ``first_epoch`` is not before ``num_epochs``, or ``first_step`` not within an epoch.
    """
    import pyarrow as pa
    import ray

    # from_blocks, not from_arrow: from_arrow runs a Ray task per block to read its metadata.
    return ray.data.from_blocks([pa.table({"row": rows})
                                 for rows in stream_rows(plan, first_epoch, num_epochs, first_step)])


def streams(cfg: "JobConfig") -> bool:
    """Whether the run's workers read a Ray Data stream: sampler actors' batches, or an elastic group's seed rows
    (its start is the split's to say). A fixed run that samples in its workers computes its own rows."""
    return cfg.sampler.sample_on != "device" or cfg.train.elastic
