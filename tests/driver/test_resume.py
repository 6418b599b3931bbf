"""Resume drills: a driver killed mid-run and resubmitted; corrupt or partial checkpoints."""

from __future__ import annotations

import io
import os
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import psutil
import pytest
import torch

from drills import (JOB_TIMEOUT_S, REPO, SMALL, JobThread, alive_actors, drop_key, job_command, logged, own_stderr,
                    resumed_run, subprocess_env, wait_until, write_checkpoints)  # noqa: F401 (fixture)
from gnnray import run_storage
from gnnray.config import parse_args
from gnnray.driver.cli import main
from gnnray.driver.fit import _resume_point
from gnnray.driver.predict_job import main as predict
from gnnray.errors import CheckpointError
from gnnray.train import checkpoint


@pytest.mark.parametrize("storage_path", ["s3"], indirect=True)
def test_driver_killed_then_resubmitted(ray_cluster, storage_path, tmp_path, capsys):
    """Drill 4: the driver process is killed (SIGKILL) after epoch 1; the same --name and --storage-path resume
    the run from a bucket (a real S3 server: nothing of the run is on a shared disk, the drivers' epoch lines
    included); jobs/predict.py then reads the run from there and writes its output there. A directory's resume
    is the script run's (tests/test_job.py), through the same storage functions (tests/test_run_storage.py)."""
    # Epochs left after the kill (0.4-1 s each here): the run is still training when its driver dies.
    epochs = 20
    args = SMALL + ["--epochs", str(epochs), "--storage-path", storage_path, "--name", "d4"]
    out = open(tmp_path / "driver.log", "w")
    driver = subprocess.Popen(job_command(args), cwd=REPO, env=subprocess_env(ray_cluster), stdout=out,
                              stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: len(logged(storage_path, "d4")) >= 2 or driver.poll() is not None, JOB_TIMEOUT_S,
                   "epoch 1")
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        wait_until(lambda: "epoch=1 " in (tmp_path / "driver.log").read_text(), 30, "the driver's line of epoch 1")
        workers = [a.pid for a in alive_actors("RayTrainWorker")]
        driver.kill()  # SIGKILL: no cleanup in the driver
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
        out.close()
    # Ray ends the dead driver's job: its workers and actors exit and free their CPUs.
    wait_until(lambda: not alive_actors("RayTrainWorker") and not alive_actors("SamplerActor"), 120,
               "the killed driver's workers to exit")
    # Their processes too: Ray marks them dead before they exit, and rank 0 may still be logging an epoch.
    wait_until(lambda: not any(psutil.pid_exists(p) for p in workers), 60, "the workers' processes to end")
    first = [m["epoch"] for m in logged(storage_path, "d4")]
    assert first[:2] == [0, 1] and first == list(range(len(first)))

    job = JobThread(args).join()
    assert job.error is None, repr(job.error)
    done = [m["epoch"] for m in logged(storage_path, "d4")]
    resumed = done[len(first):]
    # It resumed after the last checkpoint the killed driver's run completed
    # (the epoch being checkpointed when it was killed may run again).
    assert resumed and resumed[0] in (first[-1], first[-1] + 1) and resumed == list(range(resumed[0], epochs)), done
    assert job.summary.metrics["epoch"] == epochs - 1 and job.summary.restarts == 0
    run_dir = run_storage.join(storage_path, "d4")
    assert job.summary.checkpoint.startswith(run_dir + "/checkpoint_")
    console = capsys.readouterr().out
    assert f"resuming run 'd4' from epoch {resumed[0]}" in console and f"epoch={epochs - 1} " in console, console

    # Another name in the same storage path starts fresh.
    assert _resume_point(parse_args(args[:-1] + ["d4-other"]), run_storage.join(storage_path, "d4-other")) is None
    assert _resume_point(parse_args(args), run_dir).epoch == epochs - 1

    # jobs/predict.py: the run's directory as --checkpoint, the output beside it.
    output = run_storage.join(storage_path, "preds", "d4.parquet")
    assert predict(["--checkpoint", run_dir, "--output", output]) == 0
    assert f"output={output}" in capsys.readouterr().out
    table = pq.read_table(io.BytesIO(run_storage.read_bytes(output)))
    assert table.column("id").to_pylist() == list(range(3000)) and table.num_rows == 3000


# ----------------------------------------------------------------------------- drill 8: damaged checkpoints

def _truncate(d: Path) -> None:
    data = (d / checkpoint.STATE_FILE).read_bytes()
    (d / checkpoint.STATE_FILE).write_bytes(data[: len(data) // 3])


def _garbage_same_size(d: Path) -> None:
    size = os.path.getsize(d / checkpoint.STATE_FILE)
    (d / checkpoint.STATE_FILE).write_bytes(b"\x00" * size)


@pytest.mark.parametrize("damage, kind, reason", [
    (_truncate, "incomplete", "partly written"),
    (lambda d: drop_key(d, "optimizer"), "corrupt", "lacks 'optimizer'"),
    (_garbage_same_size, "corrupt", "does not load"),
])
def test_damaged_newest_checkpoint_falls_back(tmp_path, capsys, damage, kind, reason):
    """Drill 8: the driver resumes from the newest good checkpoint and says which one it skipped and why."""
    args = SMALL + ["--storage-path", str(tmp_path), "--name", "d8"]
    good, newest = write_checkpoints(tmp_path / "d8", args, [0, 1])
    damage(newest)
    latest = _resume_point(parse_args(args), str(tmp_path / "d8"))
    assert latest is not None and latest.path == str(good) and latest.epoch == 0
    out = capsys.readouterr().out
    assert f"skipping {kind} checkpoint {newest}" in out and reason in out, out


def test_only_checkpoint_corrupt_stops_before_training(ray_cluster, tmp_path, capsys):
    """Drill 8: with no good checkpoint left the job stops with the bad one's name, before any worker starts."""
    args = SMALL + ["--storage-path", str(tmp_path), "--name", "d8"]
    [only] = write_checkpoints(tmp_path / "d8", args, [0])
    drop_key(only, "model")
    with pytest.raises(CheckpointError, match="lacks 'model'"):
        _resume_point(parse_args(args), str(tmp_path / "d8"))
    workers_before = {a.actor_id for a in alive_actors("RayTrainWorker")}
    assert main(args) == 2
    err = own_stderr(capsys.readouterr().err)
    assert err.startswith("gnnray: error: run 'd8' cannot resume") and str(only) in err and "Traceback" not in err
    assert {a.actor_id for a in alive_actors("RayTrainWorker")} <= workers_before


def test_only_checkpoint_partly_written_starts_fresh(tmp_path, capsys):
    """A crash while the first checkpoint was saved leaves nothing to resume: the run starts over."""
    args = SMALL + ["--storage-path", str(tmp_path), "--name", "d8"]
    [only] = write_checkpoints(tmp_path / "d8", args, [0])
    (only / checkpoint.META_FILE).unlink()
    assert _resume_point(parse_args(args), str(tmp_path / "d8")) is None
    assert "skipping incomplete checkpoint" in capsys.readouterr().out


def test_resume_past_corrupt_checkpoint_end_to_end(resumed_run):
    """Drill 8 end to end: the newest checkpoint lacks its optimizer state; the run resumes from the one before."""
    job = resumed_run.job
    assert job.error is None, repr(job.error)
    # Epoch 1 runs again: its checkpoint was the corrupt one.
    assert [m["epoch"] for m in logged(resumed_run.storage, resumed_run.name)] == list(range(1, 9))
    assert job.summary.metrics["epoch"] == 8 and job.summary.checkpoint != str(resumed_run.corrupt)
