"""Stage 3 (driver plans, sampler actors draw): the stream of seed batches.

Input: the training split's node ids. Output: a :class:`SeedPlan` (which
seeds each step samples) and a Ray Data dataset with one row per (epoch,
step, rank) holding only the row's number, ``row = epoch * rows_per_epoch +
j``, covering every epoch of the run in order. The sampler actor turns a row
number into its seeds with :meth:`SeedReader.seeds`.

Why row numbers and not seeds: the dataset is built from in-memory blocks
(``ray.data.from_blocks``), so it runs no Ray tasks. Computing the seeds in
read tasks made every task receive and shuffle the whole split, costing as
much CPU as sampling the row; an actor shuffles each epoch once and then only
slices (docs/performance.md).

One dataset spans all epochs so the sampler actor pool starts once per run,
not once per epoch (a pool's start is dominated by importing torch and DGL). Each epoch is a fresh permutation seeded by (run seed, epoch), so a
resumed run replays exactly the seeds it would have drawn.

Every epoch has ``steps * num_workers`` rows (all seeds, none dropped, batches
differing by at most one seed), so an equal split gives every rank the same
number of steps and DDP never waits on a rank that ran out of data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# A block is one sampler-actor call: Ray Data's fixed work per call is spread
# over its rows, and 16 was where larger blocks stopped helping
# (docs/performance.md). Blocks are also the units the pool shares out, so
# they stay small: one block per epoch left all but one actor idle.
ROWS_PER_BLOCK = 16
# ...but at most this many blocks: each is one ray.put on the driver, so a
# long run on a large graph still builds its stream in seconds.
_MAX_BLOCKS = 4096


def steps_per_epoch(num_seeds: int, batch_size: int, num_workers: int) -> int:
    """Optimizer steps each rank takes per epoch."""
    return max(1, math.ceil(num_seeds / (batch_size * num_workers)))


def epoch_batches(ids: np.ndarray, num_batches: int, seed: int, epoch: int) -> list[np.ndarray]:
    """Shuffle ``ids`` for ``epoch`` and cut them into ``num_batches`` near-equal batches."""
    rng = np.random.default_rng([seed, epoch])
    return np.array_split(rng.permutation(ids), num_batches)


@dataclass(frozen=True)
class SeedPlan:
    """Which seeds each row of the stream samples: row ``j`` of epoch ``e`` is batch ``j`` of that epoch.

    Attributes:
        train_idx: The training split's node ids.
        rows_per_epoch: Batches per epoch, ``steps_per_epoch * num_workers``.
        seed: The run's seed; with the epoch it fixes the shuffle.
    """

    train_idx: np.ndarray
    rows_per_epoch: int
    seed: int

    @staticmethod
    def for_run(train_idx: np.ndarray, batch_size: int, num_workers: int, seed: int) -> "SeedPlan":
        return SeedPlan(train_idx, steps_per_epoch(len(train_idx), batch_size, num_workers) * num_workers, seed)

    def batches(self, epoch: int) -> list[np.ndarray]:
        """All of ``epoch``'s seed batches, in row order."""
        return epoch_batches(self.train_idx, self.rows_per_epoch, self.seed, epoch)


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

    :data:`ROWS_PER_BLOCK`, or more for a run so long that it would need
    more than :data:`_MAX_BLOCKS` blocks. The read-ahead limit is computed
    from this same number (:func:`gnnray.pipeline.stream.read_ahead_rows`).
    """
    return max(ROWS_PER_BLOCK, math.ceil((num_epochs - first_epoch) * plan.rows_per_epoch / _MAX_BLOCKS))


def seed_dataset(plan: SeedPlan, first_epoch: int, num_epochs: int):
    """Return the Ray Data dataset of row numbers for epochs ``first_epoch .. num_epochs - 1``, in blocks of
    :func:`block_rows` rows.

    Raises:
        ValueError: ``first_epoch`` is not before ``num_epochs``.
    """
    import pyarrow as pa
    import ray

    if not 0 <= first_epoch < num_epochs:
        raise ValueError(f"first_epoch {first_epoch} must be in [0, {num_epochs})")
    rows = np.arange(first_epoch * plan.rows_per_epoch, num_epochs * plan.rows_per_epoch, dtype=np.int64)
    per_block = block_rows(plan, first_epoch, num_epochs)
    # from_blocks, not from_arrow: from_arrow runs a Ray task per block to read its metadata.
    return ray.data.from_blocks([pa.table({"row": rows[i:i + per_block]}) for i in range(0, len(rows), per_block)])
