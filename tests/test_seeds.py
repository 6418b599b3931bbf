"""Tests of gnnray.seeds: per-epoch seed batches, the row stream, and equal steps per rank through the real pipeline."""

from __future__ import annotations

import threading
from collections import defaultdict

import numpy as np
import pytest
import torch

from conftest import tiny_graph
from gnnray.batch import MiniBatch, from_arrow
from gnnray.seeds import SeedPlan, SeedReader, epoch_batches, seed_dataset, steps_per_epoch


@pytest.mark.parametrize("num_seeds, batch_size, workers, expected", [
    (24, 4, 3, 2),   # divisible
    (100, 10, 2, 5),
    (23, 4, 3, 2),   # not divisible: rounds up
    (25, 4, 3, 3),
    (1, 4, 3, 1),
    (2, 4, 3, 1),    # split smaller than the workers
    (0, 4, 3, 1),    # empty split still steps once
    (169_343, 1024, 2, 83),
])
def test_steps_per_epoch(num_seeds, batch_size, workers, expected):
    assert steps_per_epoch(num_seeds, batch_size, workers) == expected
    # enough room for every seed
    assert expected * workers * batch_size >= num_seeds


@pytest.mark.parametrize("n, batch_size, workers", [(21, 4, 2), (23, 4, 3), (24, 4, 3), (2, 4, 3), (100, 7, 1)])
def test_epoch_batches_cover_every_id_once(n, batch_size, workers):
    ids = np.arange(100, 100 + n, dtype=np.int64)
    num_batches = steps_per_epoch(n, batch_size, workers) * workers
    batches = epoch_batches(ids, num_batches, seed=7, epoch=1)
    assert len(batches) == num_batches
    sizes = [len(b) for b in batches]
    assert max(sizes) - min(sizes) <= 1
    assert max(sizes) <= batch_size
    joined = np.concatenate(batches)
    assert sorted(joined.tolist()) == ids.tolist()


def test_epoch_batches_deterministic_and_different_across_epochs():
    ids = np.arange(50)
    a = epoch_batches(ids, 6, seed=3, epoch=2)
    b = epoch_batches(ids, 6, seed=3, epoch=2)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    c = epoch_batches(ids, 6, seed=3, epoch=3)
    assert np.concatenate(a).tolist() != np.concatenate(c).tolist()
    d = epoch_batches(ids, 6, seed=4, epoch=2)
    assert np.concatenate(a).tolist() != np.concatenate(d).tolist()
    # shuffled, not sorted
    assert np.concatenate(a).tolist() != ids.tolist()


def test_seed_plan_rows_and_reader():
    ids = np.arange(1000, 1021, dtype=np.int64)  # 21 ids, 2 ranks of batch 4: 3 steps, 6 rows per epoch
    plan = SeedPlan.for_run(ids, batch_size=4, num_workers=2, seed=7)
    assert plan.rows_per_epoch == steps_per_epoch(21, 4, 2) * 2 == 6
    reader = SeedReader(plan)
    for epoch in (0, 1, 5):
        got = [reader.seeds(epoch * 6 + j) for j in range(6)]
        assert {e for e, _ in got} == {epoch}
        assert [b.tolist() for _, b in got] == [b.tolist() for b in epoch_batches(ids, 6, 7, epoch)]
        assert sorted(np.concatenate([b for _, b in got]).tolist()) == ids.tolist()
    # Going back to an earlier epoch (a restarted actor re-reads rows) still gives its seeds.
    assert reader.seeds(3)[1].tolist() == plan.batches(0)[3].tolist()


def test_seed_dataset_rejects_bad_epochs(ray_cluster):
    plan = SeedPlan.for_run(np.arange(10), 4, 2, 0)
    with pytest.raises(ValueError):
        seed_dataset(plan, first_epoch=3, num_epochs=3)
    with pytest.raises(ValueError):
        seed_dataset(plan, first_epoch=-1, num_epochs=3)


def test_seed_dataset_rows(ray_cluster):
    import gnnray.seeds

    plan = SeedPlan.for_run(np.arange(1000, 1061, dtype=np.int64), batch_size=4, num_workers=2, seed=7)
    ds = seed_dataset(plan, first_epoch=1, num_epochs=4)
    rows = [int(r["row"]) for r in ds.take_all()]
    assert sorted(rows) == list(range(plan.rows_per_epoch, 4 * plan.rows_per_epoch))  # epochs 1-3, each row once
    # Blocks of 16 steps of one rank, rank 0 first: rank r's rows are the pieces r of the steps, in order.
    per_block = gnnray.seeds.ROWS_PER_BLOCK
    blocks = [rows[i:i + per_block] for i in range(0, 2 * per_block, per_block)]
    first = plan.rows_per_epoch  # the first row of epoch 1 (step 0, piece 0)
    assert blocks == [list(range(first + r, first + r + 2 * per_block, 2)) for r in (0, 1)]
    assert ds.materialize().num_blocks() == 2 * -(-(3 * plan.steps) // per_block)  # one block per rank per group


def test_seed_dataset_caps_its_block_count(ray_cluster, monkeypatch):
    """Long runs get larger blocks instead of more of them (each block is one put on the driver)."""
    import gnnray.seeds

    monkeypatch.setattr(gnnray.seeds, "_MAX_BLOCKS", 5)
    plan = SeedPlan.for_run(np.arange(100), batch_size=4, num_workers=2, seed=0)  # 26 rows per epoch
    ds = seed_dataset(plan, first_epoch=0, num_epochs=4)
    assert ds.num_blocks() <= 5
    assert sorted(int(r["row"]) for r in ds.take_all()) == list(range(4 * 26))


@pytest.mark.parametrize("row_bytes, rows", [(0, 16), (64 << 10, 16), (6_500_000, 5), (9_000_000, 3),
                                              (200 << 20, 1)])
def test_blocks_of_large_batches_hold_fewer(row_bytes, rows):
    """A block is at most about BLOCK_BYTES of packed batches: the read-ahead keeps blocks in the object store,
    three per actor and two per worker (products-shaped batches of 6.5 MB: 96 of them took 0.6 GB)."""
    from gnnray.seeds import block_rows, stream_rows

    plan = SeedPlan.for_run(np.arange(4000), batch_size=10, num_workers=2, seed=0, row_bytes=row_bytes)
    assert block_rows(plan, 0, 3) == rows
    blocks = stream_rows(plan, 0, 3)
    assert {len(b) for b in blocks[:-2]} == {rows}
    assert np.array_equal(np.sort(np.concatenate(blocks)), np.arange(3 * plan.rows_per_epoch))


def test_fixed_plan_is_the_plan_of_before():
    """A fixed run's rows hold the seeds they always held: the permutation cut into steps x N batches."""
    ids = np.arange(500, 713, dtype=np.int64)
    plan = SeedPlan.for_run(ids, batch_size=8, num_workers=3, seed=5)
    assert (plan.steps, plan.ranks, plan.rows_per_epoch) == (9, 3, 27)
    for epoch in (0, 4):
        before = np.array_split(np.random.default_rng([5, epoch]).permutation(ids), 27)
        assert [b.tolist() for b in plan.batches(epoch)] == [b.tolist() for b in before]


def test_elastic_plan_has_one_epoch_order_for_any_world_size():
    """Global batches of --batch-size x MAX: the same steps, each with the same seeds, for W = 1, 2, 3."""
    ids = np.arange(1000, 1250, dtype=np.int64)
    plans = {w: SeedPlan.elastic(ids, batch_size=10, max_workers=3, world_size=w, seed=3) for w in (1, 2, 3)}
    assert {p.steps for p in plans.values()} == {steps_per_epoch(250, 10, 3)} == {9}
    for epoch in (0, 2):
        steps = {w: [p.step_seeds(epoch, k).tolist() for k in range(p.steps)] for w, p in plans.items()}
        assert steps[1] == steps[2] == steps[3]
        assert sorted(sum(steps[1], [])) == ids.tolist()  # every seed once per epoch
        assert max(len(s) for s in steps[1]) <= 30  # the global batch
        for w, p in plans.items():  # each step cut into W near-equal pieces, one per rank
            pieces = p.batches(epoch)
            assert len(pieces) == p.steps * w
            sizes = [len(x) for x in pieces[:w]]
            assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(steps[1][0])
    # ... and a different order from a fixed run's at MAX (whose batches are cut from the epoch at once).
    assert SeedPlan.for_run(ids, 10, 3, 3).batches(0)[1].tolist() != plans[3].batches(0)[1].tolist()


@pytest.mark.parametrize("world, epoch, step", [(1, 0, 0), (2, 1, 4), (3, 1, 8), (2, 2, 1)])
def test_stream_from_a_step_covers_exactly_the_rest(world, epoch, step):
    """A stream resumed after ``step`` steps of ``epoch`` holds exactly the steps after them, each rank its pieces."""
    from gnnray.seeds import stream_rows

    ids = np.arange(250, dtype=np.int64)
    plan = SeedPlan.elastic(ids, batch_size=10, max_workers=3, world_size=world, seed=3)
    blocks = stream_rows(plan, epoch, 3, step)
    rows = np.concatenate(blocks)
    first = epoch * plan.rows_per_epoch + step * world
    assert sorted(rows.tolist()) == list(range(first, 3 * plan.rows_per_epoch))
    # Blocks go to the ranks in turn: rank r's k-th row is piece r of the k-th step after the checkpoint.
    for r in range(world):
        mine = np.concatenate(blocks[r::world])
        assert mine.tolist() == list(range(first + r, 3 * plan.rows_per_epoch, world))
    with pytest.raises(ValueError):
        stream_rows(plan, 0, 3, plan.steps)


@pytest.mark.parametrize("world, epoch, step", [(1, 0, 0), (2, 1, 4), (3, 0, 7), (2, 2, 1)])
def test_a_rank_computes_the_rows_the_stream_would_hand_it(world, epoch, step):
    """A fixed run that samples in its workers reads no stream: each rank's own rows are the stream's rows for
    it, in the same order, from the same resume point."""
    from gnnray.seeds import rank_rows, stream_rows

    plan = SeedPlan.for_run(np.arange(250, dtype=np.int64), batch_size=10, num_workers=world, seed=3)
    blocks = stream_rows(plan, epoch, 3, step)
    for r in range(world):
        assert list(rank_rows(plan, r, epoch, 3, step)) == np.concatenate(blocks[r::world]).tolist()


@pytest.mark.parametrize("workers, world, first_epoch, first_step", [("3", 3, 0, 0), ("1,3", 2, 0, 7)])
def test_every_rank_trains_its_own_piece_of_every_step(ray_cluster, workers, world, first_epoch, first_step):
    """Through the job's real stream and Ray Data's equal split: every rank takes the same number of steps, and
    its k-th batch is its piece of the k-th step of the plan (a fixed run from the start, an elastic one of 2
    workers resumed after step 7), so the steps done are always the plan's first ones."""
    import ray.data

    from gnnray.config import parse_args
    from gnnray.driver.stream import execution_options, minibatch_stream
    from gnnray.store.handle import publish

    graph = tiny_graph(num_nodes=400, num_edges=2000)
    train_idx = np.arange(230, dtype=np.int64)  # 230 seeds in batches of 4 per rank: does not divide evenly
    epochs = 2
    cfg = parse_args(["--num-workers", workers, "--batch-size", "4", "--epochs", str(epochs), "--fanouts", "2,2",
                      "--sampler-actors", "2"])
    if cfg.train.elastic:
        plan = SeedPlan.elastic(train_idx, 4, cfg.train.workers_max, world, seed=11)
    else:
        plan = SeedPlan.for_run(train_idx, batch_size=4, num_workers=world, seed=11)
    ds = minibatch_stream(cfg, publish(graph), plan, first_epoch, first_step=first_step)
    ds.context.execution_options = execution_options()
    its = ds.streaming_split(world, equal=True)

    got: dict[int, list[MiniBatch]] = defaultdict(list)
    errors: list[BaseException] = []

    def consume(rank, it):
        try:
            for block in it.iter_batches(batch_size=None, batch_format="pyarrow"):  # as train_loop reads
                got[rank] += [MiniBatch.unpack(torch.from_numpy(p.copy())) for p in from_arrow(block)]
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(r, it), daemon=True) for r, it in enumerate(its)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "streaming_split consumers hung"
    assert not errors, errors

    steps = [(e, k) for e in range(first_epoch, epochs) for k in range(plan.steps)][first_step:]
    assert [len(got[r]) for r in range(world)] == [len(steps)] * world
    for r in range(world):
        for (epoch, k), mb in zip(steps, got[r]):
            assert mb.epoch == epoch
            assert mb.seeds.tolist() == plan.batches(epoch)[k * world + r].tolist(), (r, epoch, k)
            assert mb.labels.tolist() == graph.label[mb.seeds.numpy()].tolist()
    for epoch in range(first_epoch, epochs):  # every seed of an epoch once, from the resumed step on
        seeds = sorted(s for r in range(world) for mb in got[r] if mb.epoch == epoch for s in mb.seeds.tolist())
        done = first_step if epoch == first_epoch else 0
        assert seeds == sorted(np.concatenate([plan.step_seeds(epoch, k) for k in range(done, plan.steps)]).tolist())
