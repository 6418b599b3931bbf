"""Tests of gnnray.pipeline.seeds: per-epoch seed batches, the row stream, and equal steps per rank through the real pipeline."""

from __future__ import annotations

import threading
from collections import defaultdict

import numpy as np
import pytest
import torch

from conftest import tiny_graph
from gnnray.pipeline.batch import MiniBatch, from_arrow
from gnnray.pipeline.seeds import SeedPlan, SeedReader, epoch_batches, seed_dataset, steps_per_epoch


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
    import gnnray.pipeline.seeds

    plan = SeedPlan.for_run(np.arange(1000, 1061, dtype=np.int64), batch_size=4, num_workers=2, seed=7)
    ds = seed_dataset(plan, first_epoch=1, num_epochs=4)
    rows = [int(r["row"]) for r in ds.take_all()]
    assert rows == list(range(plan.rows_per_epoch, 4 * plan.rows_per_epoch))  # epochs 1-3, in order
    # Several small blocks, so that several sampler actors get work.
    per_block = gnnray.pipeline.seeds.ROWS_PER_BLOCK
    assert len(rows) > 2 * per_block
    assert ds.materialize().num_blocks() == -(-len(rows) // per_block)


def test_seed_dataset_caps_its_block_count(ray_cluster, monkeypatch):
    """Long runs get larger blocks instead of more of them (each block is one put on the driver)."""
    import gnnray.pipeline.seeds

    monkeypatch.setattr(gnnray.pipeline.seeds, "_MAX_BLOCKS", 5)
    plan = SeedPlan.for_run(np.arange(100), batch_size=4, num_workers=2, seed=0)  # 26 rows per epoch
    ds = seed_dataset(plan, first_epoch=0, num_epochs=4)
    assert ds.num_blocks() == 5
    assert [int(r["row"]) for r in ds.take_all()] == list(range(4 * 26))


def test_every_rank_gets_the_same_number_of_steps(ray_cluster):
    """Every rank takes the same number of optimizer steps each epoch, through the job's real pipeline."""
    import ray
    import ray.data

    from gnnray.data.store import publish
    from gnnray.pipeline.sampler import SamplerActor

    graph = tiny_graph()
    train_idx = np.arange(23, dtype=np.int64)  # 23 seeds, 3 ranks of batch 4: does not divide evenly
    batch_size, workers, epochs = 4, 3, 2
    steps = steps_per_epoch(len(train_idx), batch_size, workers)
    handle = publish(graph)
    plan = SeedPlan.for_run(train_idx, batch_size=batch_size, num_workers=workers, seed=11)
    ds = seed_dataset(plan, first_epoch=0, num_epochs=epochs)
    ds = ds.map_batches(SamplerActor, fn_constructor_kwargs=dict(graph=handle, fanouts=(2, 2), plan=plan),
                        batch_size=None, batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=2),
                        num_cpus=1)
    its = ds.streaming_split(workers, equal=True)

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

    counts = [len(got[r]) for r in range(workers)]
    assert counts == [steps * epochs] * workers
    for epoch in range(epochs):
        seeds = [s for r in range(workers) for mb in got[r] if mb.epoch == epoch for s in mb.seeds.tolist()]
        assert sorted(seeds) == train_idx.tolist(), f"epoch {epoch}"
    for r in range(workers):
        for mb in got[r]:
            assert mb.num_seeds <= batch_size
            assert mb.labels.tolist() == graph.label[mb.seeds.numpy()].tolist()
