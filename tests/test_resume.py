"""Resume drills: a driver killed mid-run and resubmitted; corrupt or partial checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from drills import (JOB_TIMEOUT_S, REPO, SMALL, JobThread, alive_actors, job_command, logged, subprocess_env,
                    wait_until)
from gnnray import checkpoint
from gnnray.config import parse_args
from gnnray.errors import CheckpointError
from gnnray.job import _resume_point, main


def test_driver_killed_then_resubmitted(ray_cluster, tmp_path):
    """Drill 4: the driver process is killed after epoch 1; the same --name and --storage-path resume the run."""
    args = SMALL + ["--epochs", "4", "--storage-path", str(tmp_path), "--name", "d4"]
    out = open(tmp_path / "driver.log", "w")
    driver = subprocess.Popen(job_command(args), cwd=REPO, env=subprocess_env(ray_cluster), stdout=out,
                              stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: len(logged(tmp_path, "d4")) >= 2 or driver.poll() is not None, JOB_TIMEOUT_S, "epoch 1")
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        driver.kill()  # SIGKILL: no cleanup in the driver
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
        out.close()
    # Ray ends the dead driver's job: its workers and actors exit and free their CPUs.
    wait_until(lambda: not alive_actors("RayTrainWorker") and not alive_actors("SamplerActor"), 120,
               "the killed driver's workers to exit")
    first = [m["epoch"] for m in logged(tmp_path, "d4")]
    assert first[:2] == [0, 1] and first == list(range(len(first)))

    job = JobThread(args).join()
    assert job.error is None, repr(job.error)
    epochs = [m["epoch"] for m in logged(tmp_path, "d4")]
    resumed = epochs[len(first):]
    # It resumed after the last checkpoint the killed driver's run completed
    # (the epoch being checkpointed when it was killed may run again).
    assert resumed and resumed[0] in (first[-1], first[-1] + 1) and resumed == list(range(resumed[0], 4)), epochs
    assert job.summary.metrics["epoch"] == 3 and job.summary.restarts == 0

    # Another name in the same storage path starts fresh.
    assert _resume_point(parse_args(args[:-1] + ["d4-other"]), str(tmp_path / "d4-other")) is None
    assert _resume_point(parse_args(args), str(tmp_path / "d4")).epoch == 3


# ----------------------------------------------------------------------------- drill 8: damaged checkpoints

def _write_checkpoints(run_dir: Path, args: list[str], epochs: list[int]) -> list[Path]:
    """Checkpoints as rank 0 writes them (same model, optimizer and format), without training."""
    from gnnray.datasets import load_graph
    from gnnray.train_loop import default_model

    cfg = parse_args(args)
    graph = load_graph(cfg.data)
    torch.manual_seed(0)
    model = default_model(graph.feat_dim, graph.num_classes, cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.train.lr)
    dirs = []
    for epoch in epochs:
        d = run_dir / f"checkpoint_2026-01-01_00-00-{epoch:02d}.000000"  # Ray's naming: by time
        d.mkdir(parents=True)
        checkpoint.save(str(d), model, optimizer, dict(epoch=epoch, loss=1.0, best_val_acc=0.5, restarts=0))
        dirs.append(d)
    return dirs


def _drop_key(d: Path, key: str) -> None:
    """Rewrite state.pt without ``key``, meta.json consistent with it: complete files, corrupt content."""
    state = checkpoint.load_state(str(d))
    del state[key]
    torch.save(state, d / checkpoint.STATE_FILE)
    meta = json.loads((d / checkpoint.META_FILE).read_text())
    meta["state_bytes"] = os.path.getsize(d / checkpoint.STATE_FILE)
    (d / checkpoint.META_FILE).write_text(json.dumps(meta))


def _truncate(d: Path) -> None:
    data = (d / checkpoint.STATE_FILE).read_bytes()
    (d / checkpoint.STATE_FILE).write_bytes(data[: len(data) // 3])


def _garbage_same_size(d: Path) -> None:
    size = os.path.getsize(d / checkpoint.STATE_FILE)
    (d / checkpoint.STATE_FILE).write_bytes(b"\x00" * size)


@pytest.mark.parametrize("damage, kind, reason", [
    (_truncate, "incomplete", "partly written"),
    (lambda d: _drop_key(d, "optimizer"), "corrupt", "lacks 'optimizer'"),
    (_garbage_same_size, "corrupt", "does not load"),
])
def test_damaged_newest_checkpoint_falls_back(tmp_path, capsys, damage, kind, reason):
    """Drill 8: the driver resumes from the newest good checkpoint and says which one it skipped and why."""
    args = SMALL + ["--storage-path", str(tmp_path), "--name", "d8"]
    good, newest = _write_checkpoints(tmp_path / "d8", args, [0, 1])
    damage(newest)
    latest = _resume_point(parse_args(args), str(tmp_path / "d8"))
    assert latest is not None and latest.path == str(good) and latest.epoch == 0
    out = capsys.readouterr().out
    assert f"skipping {kind} checkpoint {newest}" in out and reason in out, out


def test_only_checkpoint_corrupt_stops_before_training(ray_cluster, tmp_path, capsys):
    """Drill 8: with no good checkpoint left the job stops with the bad one's name, before any worker starts."""
    args = SMALL + ["--storage-path", str(tmp_path), "--name", "d8"]
    [only] = _write_checkpoints(tmp_path / "d8", args, [0])
    _drop_key(only, "model")
    with pytest.raises(CheckpointError, match="lacks 'model'"):
        _resume_point(parse_args(args), str(tmp_path / "d8"))
    workers_before = {a.actor_id for a in alive_actors("RayTrainWorker")}
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("gnnray: error: run 'd8' cannot resume") and str(only) in err and "Traceback" not in err
    assert {a.actor_id for a in alive_actors("RayTrainWorker")} <= workers_before


def test_only_checkpoint_partly_written_starts_fresh(tmp_path, capsys):
    """A crash while the first checkpoint was saved leaves nothing to resume: the run starts over."""
    args = SMALL + ["--storage-path", str(tmp_path), "--name", "d8"]
    [only] = _write_checkpoints(tmp_path / "d8", args, [0])
    (only / checkpoint.META_FILE).unlink()
    assert _resume_point(parse_args(args), str(tmp_path / "d8")) is None
    assert "skipping incomplete checkpoint" in capsys.readouterr().out


def test_resume_past_corrupt_checkpoint_end_to_end(ray_cluster, tmp_path):
    """Drill 8 end to end: the newest checkpoint lacks its optimizer; the run resumes from the one before."""
    args = SMALL + ["--storage-path", str(tmp_path), "--name", "d8e"]
    _, newest = _write_checkpoints(tmp_path / "d8e", args, [0, 1])
    _drop_key(newest, "optimizer")
    job = JobThread(args + ["--epochs", "3"]).join()
    assert job.error is None, repr(job.error)
    assert [m["epoch"] for m in logged(tmp_path, "d8e")] == [1, 2]  # epoch 1 again: its checkpoint was bad
    assert job.summary.metrics["epoch"] == 2 and job.summary.checkpoint != str(newest)
