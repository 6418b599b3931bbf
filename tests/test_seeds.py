"""Tests of gnnray.seeds: per-epoch seed batches, and equal steps per rank through the real pipeline."""

from __future__ import annotations

import threading
from collections import defaultdict

import numpy as np
import pytest
import torch

from conftest import tiny_graph
from gnnray.batch import MiniBatch
from gnnray.seeds import epoch_batches, seed_dataset, steps_per_epoch


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


def test_seed_dataset_rejects_bad_epochs(ray_cluster):
    with pytest.raises(ValueError):
        seed_dataset(np.arange(10), 4, 2, first_epoch=3, num_epochs=3, seed=0)
    with pytest.raises(ValueError):
        seed_dataset(np.arange(10), 4, 2, first_epoch=-1, num_epochs=3, seed=0)


def test_seed_dataset_rows(ray_cluster):
    ids = np.arange(1000, 1021, dtype=np.int64)  # 21 ids
    batch_size, workers = 4, 2
    steps = steps_per_epoch(len(ids), batch_size, workers)
    rows = seed_dataset(ids, batch_size=batch_size, num_workers=workers, first_epoch=1, num_epochs=3,
                        seed=7).take_all()
    assert len(rows) == steps * workers * 2
    epochs = [int(r["epoch"]) for r in rows]
    assert set(epochs) == {1, 2}
    width = len(rows[0]["seeds"])
    assert all(len(r["seeds"]) == width for r in rows)
    for epoch in (1, 2):
        mine = [np.asarray(r["seeds"]) for r in rows if int(r["epoch"]) == epoch]
        assert len(mine) == steps * workers
        real = [s[s >= 0] for s in mine]
        for r, s in zip(mine, real):  # padding is trailing
            assert (r[len(s):] == -1).all()
        assert sorted(np.concatenate(real).tolist()) == ids.tolist()
        expected = epoch_batches(ids, steps * workers, 7, epoch)
        assert sorted(map(tuple, (s.tolist() for s in real))) == sorted(map(tuple, (b.tolist() for b in expected)))
    # (seed, epoch) determines the rows: a second dataset replays them.
    again = seed_dataset(ids, batch_size=batch_size, num_workers=workers, first_epoch=2, num_epochs=3,
                         seed=7).take_all()
    assert sorted(tuple(r["seeds"].tolist()) for r in again) == \
        sorted(tuple(r["seeds"].tolist()) for r in rows if int(r["epoch"]) == 2)


def test_every_rank_gets_the_same_number_of_steps(ray_cluster):
    """Every rank takes the same number of optimizer steps each epoch, through the job's real pipeline."""
    import ray
    import ray.data

    from gnnray.graph_store import publish
    from gnnray.sampling import SamplerActor

    graph = tiny_graph()
    train_idx = np.arange(23, dtype=np.int64)  # 23 seeds, 3 ranks of batch 4: does not divide evenly
    batch_size, workers, epochs = 4, 3, 2
    steps = steps_per_epoch(len(train_idx), batch_size, workers)
    handle = publish(graph)
    ds = seed_dataset(train_idx, batch_size=batch_size, num_workers=workers, first_epoch=0, num_epochs=epochs,
                      seed=11)
    ds = ds.map_batches(SamplerActor, fn_constructor_kwargs=dict(graph=handle, fanouts=(2, 2)), batch_size=1,
                        batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=1), num_cpus=1)
    its = ds.streaming_split(workers, equal=True)

    got: dict[int, list[MiniBatch]] = defaultdict(list)
    errors: list[BaseException] = []

    def consume(rank, it):
        try:
            for b in it.iter_batches(batch_size=1, batch_format="numpy"):
                assert b["packed"].shape[0] == 1
                got[rank].append(MiniBatch.unpack(torch.from_numpy(np.array(b["packed"][0]))))
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
