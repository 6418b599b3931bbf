"""Helpers of the reliability drills (tests/driver/test_faults.py, test_resume.py, test_bad_input.py).

The drills run the real job on the session's cluster, in a thread of the test
process (so a custom model can be passed) or as a subprocess, and act on it
from outside: wait for epochs in ``metrics.jsonl``, find the job's processes
in Ray's actor table, kill them.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

from gnnray.train import checkpoint
from gnnray.config import parse_args
from gnnray.driver.fit import run
from gnnray.train.report import METRICS_LOG

REPO = Path(__file__).resolve().parents[2]
# Small and quick, but with enough steps (1800 train seeds / (32 x 2)) that an
# epoch lasts long enough to be interrupted; --eval sampled skips the
# layer-wise inference pass after training; a checkpoint every epoch, so that
# a restart repeats at most the interrupted epoch (check_epochs).
SMALL = ["--dataset", "synthetic", "--synthetic-nodes", "3000", "--synthetic-feat-dim", "16", "--fanouts", "5,5",
         "--batch-size", "32", "--hidden", "16", "--num-workers", "2", "--sampler-actors", "1,1", "--eval", "sampled",
         "--checkpoint-interval", "0"]
JOB_TIMEOUT_S = 420  # a bound, not a speed claim: runs take 30-120 s here on 2 busy cores


def logged(storage: Path, name: str) -> list[dict]:
    """The epochs' metrics rank 0 logged so far (complete lines only)."""
    path = storage / name / METRICS_LOG
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


class JobThread:
    """``gnnray.driver.fit.run`` in a background thread of this process (it shares the session's Ray connection)."""

    def __init__(self, argv: list[str], model_factory: Optional[Callable] = None):
        self.summary = None
        self.error: Optional[BaseException] = None
        self.started = time.monotonic()
        self.ended: Optional[float] = None
        cfg = parse_args(argv)
        self._thread = threading.Thread(target=self._run, args=(cfg, model_factory), daemon=True)
        self._thread.start()

    def _run(self, cfg, model_factory) -> None:
        try:
            self.summary = run(cfg, model_factory=model_factory)
        except BaseException as e:  # handed to the test
            self.error = e
        finally:
            self.ended = time.monotonic()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float = JOB_TIMEOUT_S) -> "JobThread":
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the job did not end within {timeout:.0f} s"
        return self


def wait_until(condition: Callable[[], bool], timeout: float, what: str,
               job: Optional[JobThread] = None) -> None:
    """Poll ``condition`` every 0.1 s; fail after ``timeout`` s, or at once if ``job`` ended first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if job is not None and not job.alive():
            raise AssertionError(f"the job ended before {what}: {job.error!r}")
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.1)


@dataclass(frozen=True)
class Actor:
    """An alive actor of the session's cluster."""

    actor_id: str
    class_name: str
    pid: int
    node_id: str


def alive_actors(class_part: str) -> list[Actor]:
    """Alive actors whose class name contains ``class_part``, with their pids, from the cluster's actor table.

    ``ray.util.state.list_actors`` answers through the dashboard, which the
    test cluster may lack (its port is taken when other Ray clusters run on
    the machine); the GCS actor table behind it is always there.
    """
    import ray._private.state

    table = ray._private.state.actors()
    return [Actor(a["ActorID"], a["ActorClassName"], int(a["Pid"]), a["Address"]["NodeID"])
            for a in table.values()
            if a["State"] == "ALIVE" and class_part in a["ActorClassName"] and a["Pid"]]


def actor_restarts(actor_id: str) -> int:
    """How many times Ray restarted the actor."""
    import ray._private.state

    return int(ray._private.state.actors(actor_id)["NumRestarts"])


def check_epochs(epochs_logged: list[dict], epochs: int, restarts: int) -> None:
    """Every epoch is logged; after each restart only the interrupted epoch may be logged again.

    ``restarts`` in each line says which attempt logged it; within an attempt
    epochs follow each other, and an attempt starts at the epoch after the last
    one the previous attempt logged or, when that epoch's checkpoint was lost
    with the crash, at that epoch itself.
    """
    seq = [(m["restarts"], m["epoch"]) for m in epochs_logged]
    assert sorted({e for _, e in seq}) == list(range(epochs)), seq
    assert [r for r, _ in seq] == sorted(r for r, _ in seq) and seq[-1][0] == restarts, seq
    for (r0, e0), (r1, e1) in zip(seq, seq[1:]):
        assert e1 == e0 + 1 or (r1 == r0 + 1 and e1 == e0), f"epoch {e0} -> {e1} (attempts {r0}, {r1}): {seq}"


def subprocess_env(ray) -> dict:
    """Environment that joins a subprocess's driver to the session's cluster."""
    return dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address, PYTHONUNBUFFERED="1")


def job_command(args: list[str]) -> list[str]:
    return [sys.executable, str(REPO / "jobs" / "train_arxiv.py"), *args]


def own_stderr(err: str) -> str:
    """``err`` without the lines Ray forwards from other processes' logs (``(Name pid=N) ...``)."""
    ray_line = re.compile(r"^(\x1b\[\d+m)?\([^)]*(pid=|raylet|gcs_server)")
    return "\n".join(line for line in err.splitlines() if not ray_line.match(line))


def write_checkpoints(run_dir: Path, args: list[str], epochs: list[int]) -> list[Path]:
    """Checkpoints as rank 0 writes them (same model, optimizer and format), without training."""
    from gnnray.data.load import load_graph
    from gnnray.train.model import model_for

    cfg = parse_args(args)
    graph = load_graph(cfg.data)
    torch.manual_seed(0)
    model = model_for(graph.feat_dim, graph.num_classes, cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.train.lr)
    dirs = []
    for epoch in epochs:
        d = run_dir / f"checkpoint_2026-01-01_00-00-{epoch:02d}.000000"  # Ray's naming: by time
        d.mkdir(parents=True)
        checkpoint.save(str(d), model, optimizer, dict(epoch=epoch, loss=1.0, best_val_acc=0.5, restarts=0))
        dirs.append(d)
    return dirs


def drop_key(d: Path, key: str) -> None:
    """Rewrite state.pt without ``key``, meta.json consistent with it: complete files, corrupt content."""
    state = checkpoint.load_state(str(d))
    del state[key]
    torch.save(state, d / checkpoint.STATE_FILE)
    meta = json.loads((d / checkpoint.META_FILE).read_text())
    meta["state_bytes"] = os.path.getsize(d / checkpoint.STATE_FILE)
    (d / checkpoint.META_FILE).write_text(json.dumps(meta))


@dataclass(frozen=True)
class ResumedRun:
    """The run of :func:`resumed_run`: its storage path and name, the corrupt checkpoint, the finished job."""

    storage: Path
    name: str
    corrupt: Path
    job: JobThread


_RUNS: dict = {}  # resumed_run's result: two test modules import the fixture, the run happens once


@pytest.fixture(scope="session")
def resumed_run(ray_cluster, tmp_path_factory) -> ResumedRun:
    """One run serves two drills: it resumes past a corrupt checkpoint (drill 8), then runs 8 epochs (drill 12).

    Checkpoints of epochs 0 and 1 are written as rank 0 would; epoch 1's
    lacks its optimizer state. Features of 64 and fanouts 10,10 make each
    step's mini-batch ~0.5 MiB, so memory kept per step would show.
    """
    if "resumed" not in _RUNS:
        _RUNS["resumed"] = _resumed_run(tmp_path_factory)
    return _RUNS["resumed"]


def _resumed_run(tmp_path_factory) -> ResumedRun:
    storage, name = tmp_path_factory.mktemp("resumed"), "resumed"
    args = SMALL + ["--synthetic-feat-dim", "64", "--fanouts", "10,10", "--storage-path", str(storage),
                    "--name", name]
    _, newest = write_checkpoints(storage / name, args, [0, 1])
    drop_key(newest, "optimizer")
    job = JobThread(args + ["--epochs", "9"]).join()
    return ResumedRun(storage, name, newest, job)
