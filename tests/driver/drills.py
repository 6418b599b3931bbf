"""Helpers of the reliability drills (tests/driver/test_faults.py, test_resume.py, test_bad_input.py, test_elastic.py).

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
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pytest
import torch
from ray import cloudpickle

from gnnray import ray_internals, run_storage
from gnnray.config import parse_args
from gnnray.driver.fit import run
from gnnray.run_storage import METRICS_LOG, WORKERS_LOG
from gnnray.seeds import SeedPlan
from gnnray.train import checkpoint

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # RecordingModel reaches the workers by value

REPO = Path(__file__).resolve().parents[2]
# Small and quick, but with enough steps (1800 train seeds / (32 x 2)) that an
# epoch lasts long enough to be interrupted; --eval sampled skips the
# layer-wise inference pass after training; a checkpoint every epoch, so that
# a restart repeats at most the interrupted epoch (check_epochs).
SMALL = ["--dataset", "synthetic", "--synthetic-nodes", "3000", "--synthetic-feat-dim", "16", "--fanouts", "5,5",
         "--batch-size", "32", "--hidden", "16", "--num-workers", "2", "--sample-on", "actors", "--sampler-actors", "1,1", "--eval", "sampled",
         "--checkpoint-interval", "0"]
EVERY = 4  # --checkpoint-every of the recorded drills
JOB_TIMEOUT_S = 420  # a bound, not a speed claim: runs take 30-120 s here on 2 busy cores


def logged(storage_path, name: str) -> list[dict]:
    """The epochs' metrics rank 0 logged so far (complete lines only), in a directory or an object store."""
    try:
        text = run_storage.read_bytes(run_storage.join(str(storage_path), name, METRICS_LOG)).decode()
    except FileNotFoundError:
        return []
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


def actor_ids(class_part: str) -> set[str]:
    """The ids of every actor, alive or dead, whose class name contains ``class_part``."""
    return {a["ActorID"] for a in ray_internals.actor_table().values() if class_part in a["ActorClassName"]}


def actor_states(actor_ids: set[str]) -> list[tuple]:
    """(id, state, restarts, death cause) of each of ``actor_ids``, for a failure's message."""
    rows = (ray_internals.actor_table(a) for a in sorted(actor_ids))
    return [(r["ActorID"][:8], r["State"], r["NumRestarts"], str(r["DeathCause"]).strip()) for r in rows]


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
    from gnnray.models.model import model_for

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


_RUNS: dict = {}  # the shared runs' results: two test modules import each fixture, the run happens once


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


# ----------------------------------------------------------------------------- recorded steps (test_elastic.py)


class RecordingModel(torch.nn.Module):
    """The job's model; each training step first waits while ``pause-W`` exists (W: its world size) and sleeps
    the seconds ``slow-W`` holds, then records the seeds' features with world size and rank."""

    def __init__(self, in_feats: int, num_classes: int, cfg, record_dir: str):
        super().__init__()
        from gnnray.models.model import model_for

        self.net = model_for(in_feats, num_classes, cfg)
        self.record_dir = record_dir

    def forward(self, blocks, x):
        if self.training:
            import ray.train

            ctx = ray.train.get_context()
            world, rank = ctx.get_world_size(), ctx.get_world_rank()
            while os.path.exists(os.path.join(self.record_dir, f"pause-{world}")):
                time.sleep(0.2)
            slow = os.path.join(self.record_dir, f"slow-{world}")
            if os.path.exists(slow):
                time.sleep(float(open(slow).read()))
            seeds = x[: blocks[-1].num_dst].detach().cpu().numpy().copy()
            np.save(os.path.join(self.record_dir, f"{time.time():.6f}_{os.getpid()}_{world}_{rank}.npy"), seeds)
        return self.net(blocks, x)


@dataclass(frozen=True)
class Step:
    """A training step one rank recorded: when, in which process and group size, and the plan's (epoch, step)."""

    time: float
    pid: int
    world: int
    rank: int
    epoch: int
    step: int


def recorded_steps(record_dir: Path, args: list[str]) -> list[Step]:
    """Every recorded step, in time order, located in the plan of its world size (its seeds must be exactly the
    plan's piece for that rank, or this fails): an elastic run's plans for 1-3 workers, a fixed run's own."""
    from gnnray.data.load import load_graph

    cfg = parse_args(args)
    graph = load_graph(cfg.data, cfg.run.seed)
    node_of = {graph.feat[i].tobytes(): int(i) for i in graph.train_idx}
    b, most, seed = cfg.sampler.batch_size, cfg.train.workers_max, cfg.run.seed
    plans = ({w: SeedPlan.elastic(graph.train_idx, b, most, w, seed) for w in range(1, most + 1)}
             if cfg.train.elastic else {most: SeedPlan.for_run(graph.train_idx, b, most, seed)})
    where = {}  # (world, rank, seeds) -> (epoch, step)
    for world, plan in plans.items():
        for epoch in range(cfg.train.epochs):
            for j, piece in enumerate(plan.batches(epoch)):
                where[(world, j % world, tuple(sorted(piece.tolist())))] = (epoch, j // world)
    steps = []
    for path in sorted(record_dir.glob("*.npy")):
        t, pid, world, rank = path.stem.split("_")
        seeds = tuple(sorted(node_of[row.tobytes()] for row in np.load(path)))
        key = (int(world), int(rank), seeds)
        assert key in where, f"{path.name}: rank {rank} of {world} trained seeds that are not its piece of any step"
        steps.append(Step(float(t), int(pid), int(world), int(rank), *where[key]))
    return sorted(steps, key=lambda s: s.time)


def attempts(steps: list[Step], steps_per_epoch: int) -> list[tuple[int, list[int]]]:
    """Each worker group's world size and the global steps (``epoch * steps_per_epoch + step``) it trained, in
    order. Groups follow each other in time; every rank of a group trains the same steps (the last one may be
    missing on some ranks: the group was ended during it)."""
    groups: list[tuple[int, dict, dict]] = []  # (world, rank -> its pid, rank -> its global steps)
    for s in steps:
        g = s.epoch * steps_per_epoch + s.step
        if not groups or s.world != groups[-1][0] or groups[-1][1].get(s.rank, s.pid) != s.pid:
            groups.append((s.world, {}, defaultdict(list)))  # a new worker group: new processes
        groups[-1][1][s.rank] = s.pid
        groups[-1][2][s.rank].append(g)
    out = []
    for world, _, ranks in groups:
        longest = max(ranks.values(), key=len)
        assert longest == list(range(longest[0], longest[0] + len(longest))), f"group of {world}: {longest}"
        for rank in range(world):
            mine = ranks.get(rank, [])
            assert mine == longest[:len(mine)] and len(longest) - len(mine) <= 1, (world, rank, mine, longest)
        out.append((world, longest))
    return out


def steps_per_epoch(args: list[str]) -> int:
    """Steps per epoch of the run of ``args`` on the 3000-node synthetic graph (1800 training seeds)."""
    from gnnray.seeds import steps_per_epoch as steps

    cfg = parse_args(args)
    return steps(1800, cfg.sampler.batch_size, cfg.train.workers_max)


def replays(groups: list[tuple[int, list[int]]]) -> list[int]:
    """Steps each worker group trained that the next one trained again (at each resize or restart)."""
    return [max(0, a[-1] - b[0] + 1) for (_, a), (_, b) in zip(groups, groups[1:])]


def events(run_dir) -> list[dict]:
    """The lines of an elastic run's workers.jsonl, in a directory or an object store."""
    try:
        log = run_storage.read_bytes(run_storage.join(str(run_dir), WORKERS_LOG))
        return [json.loads(line) for line in log.splitlines()]
    except FileNotFoundError:
        return []

def recorded_steps_fast(record_dir: Path) -> list[Step]:
    """World size and time of each recorded step (no plan lookup): for waiting on a world size."""
    out = []
    for path in record_dir.glob("*.npy"):
        t, pid, world, rank = path.stem.split("_")
        out.append(Step(float(t), int(pid), int(world), int(rank), -1, -1))
    return out


def killed_mid_epoch(tmp_path: Path, args: list[str], workers: int):
    """Run ``args`` with the recording model; kill a train worker 6 steps into epoch 1; return the job, its steps
    and the console."""
    import io
    import signal
    from contextlib import redirect_stdout

    records = tmp_path / "records"
    records.mkdir()
    per_epoch = steps_per_epoch(args)
    out = io.StringIO()
    with redirect_stdout(out):
        job = JobThread(args, model_factory=lambda f, c, cfg: RecordingModel(f, c, cfg, str(records)))
        wait_until(lambda: sum(s.rank == 0 for s in recorded_steps_fast(records)) >= per_epoch + 6, JOB_TIMEOUT_S,
                   "6 steps into epoch 1", job)
        found = alive_actors("RayTrainWorker")
        assert len(found) == workers, found
        os.kill(found[-1].pid, signal.SIGKILL)
        job.join()
    print(out.getvalue())
    assert job.error is None, repr(job.error)
    return job, attempts(recorded_steps(records, args), per_epoch), out.getvalue()


@dataclass(frozen=True)
class KilledRun:
    """The run of :func:`killed_fixed_run`: its arguments, storage path and name, the job, its worker groups
    (:func:`attempts`) and console."""

    args: list
    storage: Path
    name: str
    job: JobThread
    groups: list
    out: str


@pytest.fixture(scope="session")
def killed_fixed_run(ray_cluster, tmp_path_factory) -> KilledRun:
    """One run serves two drills: a fixed run (2 workers, 3 epochs, --checkpoint-every 4, --max-failures 1)
    whose last train worker is killed 6 steps into epoch 1. Drill 1 (test_faults.py) checks that it restores
    and finishes; test_elastic.py that it resumes within the epoch, each rank training its piece of the plan."""
    if "killed" not in _RUNS:
        storage, name = tmp_path_factory.mktemp("killed"), "fixed"
        args = SMALL + ["--checkpoint-every", str(EVERY), "--max-failures", "1", "--epochs", "3",
                        "--storage-path", str(storage), "--name", name]
        job, groups, out = killed_mid_epoch(storage, args, 2)
        _RUNS["killed"] = KilledRun(args, storage, name, job, groups, out)
    return _RUNS["killed"]
