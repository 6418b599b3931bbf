"""Tests of gnnray.checkpoint: save/restore and choosing the newest valid checkpoint on resume."""

from __future__ import annotations

import json
import os

import pytest
import torch

from gnnray import run_storage
from gnnray.errors import CheckpointError
from gnnray.train import checkpoint
from gnnray.train.stream_start import next_position
from s3_server import STORAGE_KINDS


def trained_model(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    return model, opt


def save_epoch(directory, epoch: int, seed: int = 0, **extra):
    run_storage.make_dirs(str(directory))
    model, opt = trained_model(seed)
    metrics = dict(epoch=epoch, best_val_acc=0.5 + epoch / 100, loss=1.25, **extra)
    checkpoint.save(str(directory), model, opt, metrics)
    return model, opt, metrics


def test_save_read_info_load_state(tmp_path):
    d = tmp_path / "checkpoint_000003"
    model, opt, metrics = save_epoch(d, 3, test_acc=0.75)
    assert sorted(os.listdir(d)) == [checkpoint.META_FILE, checkpoint.STATE_FILE]  # no temporary files left

    info = checkpoint.read_info(str(d))
    assert info is not None
    assert info.path == str(d)
    assert info.epoch == 3
    assert info.metrics == metrics

    state = checkpoint.load_state(str(d))
    assert state["epoch"] == 3
    assert state["best_val_acc"] == pytest.approx(metrics["best_val_acc"])
    fresh = torch.nn.Linear(4, 3)
    fresh.load_state_dict(state["model"])
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    fresh_opt.load_state_dict(state["optimizer"])
    want, got = opt.state_dict(), fresh_opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for k, s in want["state"].items():
        assert torch.equal(got["state"][k]["exp_avg"], s["exp_avg"])
        assert torch.equal(got["state"][k]["exp_avg_sq"], s["exp_avg_sq"])
        assert int(got["state"][k]["step"]) == int(s["step"]) == 1

    meta = json.loads((d / checkpoint.META_FILE).read_text())
    assert meta["state_bytes"] == (d / checkpoint.STATE_FILE).stat().st_size


def test_latest_valid_picks_highest_epoch(tmp_path):
    # Names do not sort like epochs: the epoch in meta.json decides.
    save_epoch(tmp_path / "checkpoint_b", 2)
    save_epoch(tmp_path / "checkpoint_c", 0)
    save_epoch(tmp_path / "checkpoint_a", 10)
    save_epoch(tmp_path / "checkpoint_d", 5)
    (tmp_path / "metrics.jsonl").write_text("{}\n")  # not a checkpoint
    save_epoch(tmp_path / "other_dir", 99)  # not named checkpoint_*: ignored
    best, bad = checkpoint.latest_valid(str(tmp_path))
    assert best is not None
    assert best.epoch == 10
    assert best.path == str(tmp_path / "checkpoint_a")
    assert bad == []


def test_checkpoints_within_epochs_order_by_step_and_resume_after_it(tmp_path):
    """A checkpoint within an epoch is (last completed epoch, steps done of the next); the furthest one wins."""
    save_epoch(tmp_path / "checkpoint_z", 1)  # end of epoch 1
    save_epoch(tmp_path / "checkpoint_a", 1, step=7)  # step 7 of epoch 2 (older name: names do not decide)
    save_epoch(tmp_path / "checkpoint_b", 1, step=3)
    best, bad = checkpoint.latest_valid(str(tmp_path))
    assert (best.path, best.epoch, best.step, bad) == (str(tmp_path / "checkpoint_a"), 1, 7, [])
    assert next_position(best) == (2, 7)
    assert next_position(checkpoint.read_info(str(tmp_path / "checkpoint_z"))) == (2, 0)
    assert next_position(None) == (0, 0)
    state = checkpoint.load_state(best.path)
    assert (state["epoch"], state["step"]) == (1, 7)
    # Within the first epoch: no epoch completed yet.
    save_epoch(tmp_path / "first" / "checkpoint_x", -1, step=2)
    first, _ = checkpoint.latest_valid(str(tmp_path / "first"))
    assert next_position(first) == (0, 2)


def test_step_of_another_plan_restarts_its_epoch(tmp_path):
    """A step means other seeds under another --batch-size or --num-workers: resume at the epoch's start."""
    save_epoch(tmp_path / "checkpoint_a", 1, step=7, plan=["global", 19])
    info = checkpoint.read_info(str(tmp_path / "checkpoint_a"))
    assert next_position(info, ["global", 19]) == (2, 7)
    assert next_position(info, ["global", 38]) == (2, 0)
    assert next_position(info, ["fixed", 19, 3]) == (2, 0)


def test_state_and_meta_of_different_steps_is_corrupt(tmp_path):
    d = tmp_path / "checkpoint_a"
    save_epoch(d, 1, step=4)
    meta = json.loads((d / checkpoint.META_FILE).read_text())
    meta["step"] = 5
    (d / checkpoint.META_FILE).write_text(json.dumps(meta))
    assert "step 4" in checkpoint.corrupt_reason(str(d)) and "step 5" in checkpoint.corrupt_reason(str(d))


# Damage as a crash (or a torn copy) leaves it, in a directory or an object store (``d``: a path or a URI).
def truncate_state(d):
    p = run_storage.join(str(d), checkpoint.STATE_FILE)
    data = run_storage.read_bytes(p)
    run_storage.write_bytes(p, data[: len(data) // 2])


def remove_meta(d):
    run_storage.delete(run_storage.join(str(d), checkpoint.META_FILE))


def corrupt_meta(d):
    run_storage.write_bytes(run_storage.join(str(d), checkpoint.META_FILE), b'{"epoch": 3, "state_by')


def meta_without_fields(d):
    run_storage.write_bytes(run_storage.join(str(d), checkpoint.META_FILE), json.dumps({"epoch": 3}).encode())


def remove_state(d):
    run_storage.delete(run_storage.join(str(d), checkpoint.STATE_FILE))


def only_temporary_files(d):
    # a crash before the first rename
    for name in (checkpoint.STATE_FILE, checkpoint.META_FILE):
        data = run_storage.read_bytes(run_storage.join(str(d), name))
        run_storage.write_bytes(run_storage.join(str(d), name + ".tmp"), data)
        run_storage.delete(run_storage.join(str(d), name))


@STORAGE_KINDS
@pytest.mark.parametrize("damage", [truncate_state, remove_meta, corrupt_meta, meta_without_fields, remove_state,
                                    only_temporary_files])
def test_damaged_newest_checkpoint_is_skipped(storage_path, damage):
    run = storage_path
    for epoch in (1, 2, 3):
        save_epoch(run_storage.join(run, f"checkpoint_00000{epoch}"), epoch)
    damage(run_storage.join(run, "checkpoint_000003"))
    assert checkpoint.read_info(run_storage.join(run, "checkpoint_000003")) is None
    best, bad = checkpoint.latest_valid(run)
    assert best is not None and best.epoch == 2
    assert best.path == run_storage.join(run, "checkpoint_000002")
    assert bad == [run_storage.join(run, "checkpoint_000003")]


def test_several_damaged_checkpoints_all_listed(tmp_path):
    save_epoch(tmp_path / "checkpoint_000001", 1)
    for epoch, damage in [(2, truncate_state), (3, remove_meta), (4, corrupt_meta)]:
        d = tmp_path / f"checkpoint_00000{epoch}"
        save_epoch(d, epoch)
        damage(d)
    best, bad = checkpoint.latest_valid(str(tmp_path))
    assert best.epoch == 1
    assert sorted(bad) == [str(tmp_path / f"checkpoint_00000{e}") for e in (2, 3, 4)]


def test_all_damaged_gives_none(tmp_path):
    save_epoch(tmp_path / "checkpoint_000001", 1)
    remove_meta(tmp_path / "checkpoint_000001")
    best, bad = checkpoint.latest_valid(str(tmp_path))
    assert best is None
    assert bad == [str(tmp_path / "checkpoint_000001")]


def test_empty_or_missing_run_dir(tmp_path):
    assert checkpoint.latest_valid(str(tmp_path)) == (None, [])
    assert checkpoint.latest_valid(str(tmp_path / "missing")) == (None, [])
    (tmp_path / "checkpoint_file").write_text("not a directory")
    assert checkpoint.latest_valid(str(tmp_path)) == (None, [])


def test_read_info_missing_directory(tmp_path):
    assert checkpoint.read_info(str(tmp_path / "nope")) is None


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_schedule_waits_the_interval_since_the_last_checkpoint():
    clock = _Clock()
    schedule = checkpoint.Schedule(10.0, clock)
    clock.now += 9.5
    assert not schedule.due()  # counted from the schedule's start: the attempt's
    clock.now += 0.5
    assert schedule.due()
    schedule.saved()
    clock.now += 9.0
    assert not schedule.due() and schedule.due(final=True)  # the last epoch always writes one
    clock.now += 1.0
    assert schedule.due()


def test_schedule_interval_zero_writes_every_time():
    schedule = checkpoint.Schedule(0.0, _Clock())
    assert all(schedule.due() for _ in range(3))


def test_schedule_epochs_that_write_a_checkpoint():
    """Epochs of 4 s with a 10 s interval over 8 epochs: every third, and the last."""
    clock = _Clock()
    schedule = checkpoint.Schedule(10.0, clock)
    written = []
    for epoch in range(8):
        clock.now += 4.0
        if schedule.due(final=epoch == 7):
            schedule.saved()
            written.append(epoch)
    assert written == [2, 5, 7]


def _with_embedding(directory, bounds, n=10, dim=3):
    """A checkpoint whose embedding is in shards ``bounds``; row ``i`` of the table is all ``i``."""
    import numpy as np

    run_storage.make_dirs(str(directory))
    shards = []
    for lo, hi in bounds:
        w = np.repeat(np.arange(lo, hi, dtype=np.float32)[:, None], dim, axis=1)
        shards.append(checkpoint.write_rows(str(directory), lo, hi, {
            "weight": w, "exp_avg": -w, "exp_avg_sq": w * w, "step": np.arange(lo, hi, dtype=np.int32)}))
    model, opt = trained_model()
    checkpoint.save(str(directory), model, opt, {"epoch": 1, "best_val_acc": 0.5},
                    embedding={"num_nodes": n, "dim": dim, "shards": shards})


@STORAGE_KINDS
def test_embedding_rows_read_across_any_shards(storage_path):
    """A reader takes its rows from whichever saved shards overlap them: K=3 files read as K=2 ranges."""
    import numpy as np

    d = run_storage.join(storage_path, "checkpoint_e")
    _with_embedding(d, [(0, 3), (3, 7), (7, 10)])
    assert checkpoint.read_info(str(d)) is not None
    assert checkpoint.corrupt_reason(str(d), ("embedding",)) is None  # the table is in its files, not state.pt
    for lo, hi in ((0, 5), (5, 10), (2, 9)):
        rows = checkpoint.read_rows(str(d), lo, hi)
        np.testing.assert_array_equal(rows["weight"][:, 0], np.arange(lo, hi))
        np.testing.assert_array_equal(rows["exp_avg"][:, 1], -np.arange(lo, hi))
        assert rows["step"].tolist() == list(range(lo, hi)) and rows["step"].dtype == np.int32
    assert checkpoint.embedding_info(str(d))["dim"] == 3


@STORAGE_KINDS
def test_damaged_embedding_shards(storage_path):
    """A shard file cut short makes the checkpoint incomplete; shards that leave rows out make it corrupt."""
    d = run_storage.join(storage_path, "checkpoint_short")
    _with_embedding(d, [(0, 5), (5, 10)])
    path = run_storage.join(d, checkpoint.EMBEDDING_DIR, "rows-000000000005-000000000010", "exp_avg.npy")
    run_storage.write_bytes(path, run_storage.read_bytes(path)[:-4])
    assert checkpoint.read_info(d) is None

    gap = run_storage.join(storage_path, "checkpoint_gap")
    _with_embedding(gap, [(0, 4), (5, 10)])
    assert "do not cover rows 0-10" in checkpoint.corrupt_reason(gap, ("embedding",))
    latest, bad = checkpoint.latest_valid(storage_path, ("embedding",))
    assert latest is None and sorted(bad) == [gap, d]


_UNPICKLED = []


def _ran_on_load():
    _UNPICKLED.append(True)
    return "ran"


class _Payload:
    """What a writer of the run's bucket could put into ``state.pt``: unpickling it calls a function."""

    def __reduce__(self):
        return _ran_on_load, ()


def test_checkpoint_carrying_a_pickled_object_is_refused(tmp_path, monkeypatch):
    """Only tensors, dicts and numbers are unpickled, whatever torch's default (the env var restores torch < 2.6's
    default of unpickling anything); such a checkpoint is skipped as corrupt, the older good one resumed."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    save_epoch(tmp_path / "checkpoint_000001", 1)
    bad = tmp_path / "checkpoint_000002"
    run_storage.make_dirs(str(bad))
    model, opt = trained_model()
    checkpoint.save(str(bad), model, opt, dict(epoch=2, best_val_acc=0.5), extra={"payload": _Payload()})
    _UNPICKLED.clear()

    with pytest.raises(CheckpointError, match="objects other than tensors.*not loaded"):
        checkpoint.load_state(str(bad))
    assert "objects other than tensors" in checkpoint.corrupt_reason(str(bad))
    latest, skipped = checkpoint.latest_valid(str(tmp_path))
    assert latest.epoch == 1 and skipped == [str(bad)]
    assert checkpoint.load_state(latest.path)["epoch"] == 1  # a normal checkpoint still loads
    assert _UNPICKLED == []
