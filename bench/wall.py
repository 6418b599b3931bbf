"""Wall time of whole runs, start-up included: ``jobs/train_arxiv.py`` as a user starts it, against the DGL loop.

Ours: ``python jobs/train_arxiv.py OPTIONS --epochs E`` in a new process,
with the options of figure 3's job (:func:`job_argv`: the same graph, model,
fanouts, batch size, workers, CPUs, ``--max-ahead`` and ``--eval sampled``),
timed from process start to exit. It starts its own local Ray cluster (the
benchmark's is shut down before), loads and publishes the graph, starts the
train worker and sampler actors, trains, validates each epoch, tests after
the last and prints its summary. Baseline: ``python -m bench.dgl_loop`` with
the same configuration (:func:`bench.dgl_loop.end_to_end`: imports, loading
the graph, model and ``DataLoader``, the same epochs, validation and test),
with the ``DataLoader`` that was faster in figure 3's rounds (``num_workers``
0 or 1). Both with the environment the benchmark was started with.

A short and a longer run (``wall_epochs``); a third row shows what each
added epoch costs, ``(long - short) / (E_long - E_short)``, which start-up
does not. Ratios are ours / baseline: below 1 is faster.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import typing
from pathlib import Path

from bench.common import REPO, Result, Row, Settings, attempt, compare, job_config
from bench.dgl_loop import RESULT
from gnnray.config import DataConfig, JobConfig

FIGURE = "wall time"
# The environment this process was started with (read before it starts Ray, which adds to it), less any
# RAY_ADDRESS: a user's run on one machine starts its own cluster.
USER_ENV = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}


def job_argv(cfg: JobConfig) -> list[str]:
    """The ``jobs/train_arxiv.py`` options that give ``cfg``: every field that differs from its default."""
    from gnnray.config import flag_of, parse_args

    argv = []
    for section in dataclasses.fields(cfg):
        part = getattr(cfg, section.name)
        hints, default = typing.get_type_hints(type(part)), type(part)()
        for f in dataclasses.fields(part):
            value = getattr(part, f.name)
            if value == getattr(default, f.name):
                continue
            if hints[f.name] is bool:
                argv.append(flag_of(f))
                continue
            text = {True: "yes", False: "no"}[value] if isinstance(value, bool) else (
                ",".join(map(str, value)) if isinstance(value, tuple) else str(value))
            argv += [flag_of(f), text]
    if parse_args(argv) != cfg:
        raise RuntimeError(f"job options {argv} do not give the benchmark's configuration")
    return argv


def timed(name: str, cmd: list[str]) -> tuple[float, str]:
    """Run ``cmd`` from the repository root; its wall time from start to exit, and its output."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=USER_ENV, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - start
    if proc.returncode:
        tail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise RuntimeError(f"{name} exited with {proc.returncode}: {tail}")
    return wall, proc.stdout


def ours(cfg: JobConfig) -> dict:
    from gnnray.train.report import METRICS_LOG

    argv = job_argv(cfg)
    wall, out = timed("train_arxiv.py", [sys.executable, str(REPO / "jobs" / "train_arxiv.py"), *argv])
    with open(Path(cfg.run.storage_path) / cfg.run.name / METRICS_LOG) as f:
        epochs = [json.loads(line) for line in f if line.strip()]
    summary = [line for line in out.splitlines() if line.startswith("best_val_acc=")]
    return dict(wall_s=wall, argv=argv, summary=summary[-1] if summary else None, epochs=epochs,
                outside_epochs_s=wall - sum(m["epoch_time"] for m in epochs))


def dgl(cfg: JobConfig, cores: int, loader_workers: int) -> dict:
    spec = dict(job=dataclasses.asdict(cfg), cores=cores, loader_workers=loader_workers)
    wall, out = timed("bench.dgl_loop", [sys.executable, "-m", "bench.dgl_loop", json.dumps(spec)])
    result = json.loads([line for line in out.splitlines() if line.startswith(RESULT)][-1][len(RESULT):])
    return dict(wall_s=wall, **result, outside_epochs_s=wall - sum(m["epoch_time"] for m in result["epochs"]))


def faster_loader(rows: list[Row]) -> int:
    """The DGL ``DataLoader``'s ``num_workers`` that gave more seeds/s in figure 3 (0 if not measured)."""
    rates = next((r.detail["dgl_seeds_per_s"] for r in rows if r.detail.get("dgl_seeds_per_s")), {0: 0.0})
    return max(rates, key=rates.get)


def bench_wall(data: DataConfig, s: Settings, workdir: Path, loader_workers: int) -> list[Row]:
    runs = {}
    for epochs in s.wall_epochs:
        cfg = job_config(data, dataclasses.replace(s, epochs=epochs), workdir, f"bench-wall-{epochs}")
        for side, fn in (("ours", lambda: ours(cfg)), ("dgl", lambda: dgl(cfg, s.cores, loader_workers))):
            runs[side, epochs] = attempt(fn)
            if not isinstance(runs[side, epochs], Exception):
                print(f"[wall] {side}, {epochs} epoch(s): {runs[side, epochs]['wall_s']:.1f} s", flush=True)
    base = f"DGL num_workers={loader_workers}"
    rows = [compare(f"{FIGURE}, {e}-epoch run with start-up (vs {base})", "", runs["ours", e],
                    runs["dgl", e], "wall_s", show="{:.1f} s") for e in s.wall_epochs]
    short, long = s.wall_epochs[0], s.wall_epochs[-1]
    if long > short:
        added = {side: added_epoch(runs[side, short], runs[side, long], long - short) for side in ("ours", "dgl")}
        rows.append(compare(f"{FIGURE} per added epoch (vs {base})", "", added["ours"], added["dgl"], "wall_s",
                            show="{:.1f} s"))
    return rows


def added_epoch(short: Result, long: Result, more: int) -> Result:
    """Seconds per epoch between a short and a long run: the runs' cost without their start-up."""
    for r in (short, long):
        if isinstance(r, Exception):
            return r
    return dict(wall_s=(long["wall_s"] - short["wall_s"]) / more)
