"""The ``wall`` stage: whole runs as a user starts them, ours (``jobs/train_arxiv.py``, :func:`job_argv`) against
the DGL loop's script (``bench.dgl_loop``), each for a short and a long run: a steady epoch's seconds and machine
CPU-seconds are their difference over the extra epochs, start-up and the final test cancelled out; medians over
``--wall-repeats`` interleaved rounds. :mod:`bench.cpu` splits ours' steady epochs by process group.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
import typing
from pathlib import Path

from bench import cpu
from bench.harness import DGL_PYTHON, REPO, Result, Row, attempt, compare, medians, run_child
from bench.settings import Settings, epochs_of, job_config, metrics_log
from gnnray.config import DataConfig, JobConfig

FIGURE = "whole runs"
# This process's environment before Ray adds to it, less RAY_ADDRESS: a user's local run starts its own cluster.
USER_ENV = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
DGL_LOADERS = {"DGL num_workers=0": 0, "DGL num_workers=1": 1}


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
            if hints[f.name] is bool:  # a switch
                argv.append(flag_of(f))
            else:  # an optional bool is yes or no; a tuple, comma-separated
                argv += [flag_of(f), {True: "yes", False: "no"}[value] if isinstance(value, bool) else
                         ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    if parse_args(argv) != cfg:
        raise RuntimeError(f"job options {argv} do not give the benchmark's configuration")
    return argv


def ours(cfg: JobConfig) -> dict:
    """``jobs/train_arxiv.py`` with ``cfg``'s options, from the repository root: wall time, the machine's
    CPU-seconds, its plan and summary lines, and every process's CPU time at each epoch line (:mod:`bench.cpu`)."""
    argv = job_argv(cfg)
    with cpu.on_new_lines(metrics_log(cfg), cpu.snapshot) as snaps:
        start, busy = time.perf_counter(), cpu.machine_busy_s()
        proc = subprocess.run([sys.executable, str(REPO / "jobs" / "train_arxiv.py"), *argv], cwd=REPO, env=USER_ENV,
                              capture_output=True, text=True, timeout=3600)
        wall, busy = time.perf_counter() - start, cpu.machine_busy_s() - busy
    if proc.returncode:
        tail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise RuntimeError(f"train_arxiv.py exited with {proc.returncode}: {tail}")
    lines = proc.stdout.splitlines()
    if any("already finished" in line for line in lines):  # a resumed, finished run: nothing was measured
        raise RuntimeError(f"run {cfg.run.name!r} under {cfg.run.storage_path} had already finished")
    plan = [line for line in lines if line.startswith("cpu plan:")]
    summary = [line for line in lines if line.startswith("best_val_acc=")]
    return dict(wall_s=wall, cpu_s=busy, windows=[cpu.between(a, b) for a, b in zip(snaps, snaps[1:])], argv=argv,
                plan=plan[0] if plan else None, summary=summary[-1] if summary else None, epochs=epochs_of(cfg))


def dgl(cfg: JobConfig, cores: int, loader_workers: int) -> dict:
    spec = dict(job=dataclasses.asdict(cfg), cores=cores, loader_workers=loader_workers)
    start, busy = time.perf_counter(), cpu.machine_busy_s()
    r = run_child([DGL_PYTHON, "-m", "bench.dgl_loop", json.dumps(spec)], USER_ENV, what="bench.dgl_loop")
    return dict(r, wall_s=time.perf_counter() - start, cpu_s=cpu.machine_busy_s() - busy, windows=[])


def steady(short: Result, long: Result, more: int, seeds_per_epoch: int) -> Result:
    """A steady epoch from two run lengths: seconds, seeds/s and the machine's CPU-seconds (see the module)."""
    if failed := next((r for r in (short, long) if isinstance(r, Exception)), None):
        return failed
    epoch_s = (long["wall_s"] - short["wall_s"]) / more
    out = dict(epoch_s=epoch_s, seeds_per_s=seeds_per_epoch / epoch_s,
               cpu_s=(long["cpu_s"] - short["cpu_s"]) / more, start_s=short["wall_s"] - epoch_s * len(short["epochs"]),
               whole_s=long["wall_s"], short=short, long=long)
    # Where the time went in the long run's steady epochs: the windows between epoch lines start with epoch 1;
    # the last epoch is left out (the stream ends in it, so its last batches have no sampling beside them).
    out["by_process"] = median_by_group(long.get("windows", [])[:-1])
    return out


def median_by_group(ds: list) -> dict:
    """``{group: median over ds}`` of dicts of CPU-seconds by process group (a group a dict lacks counts 0)."""
    return {g: statistics.median(d.get(g, 0.0) for d in ds) for g in sorted({g for d in ds for g in d})}


def configurations(data: DataConfig, s: Settings, workdir: Path, epochs: int, round_: int = 0) -> dict:
    """Ours and the DGL loops, each a function running ``epochs`` epochs (names of each round's own: the same
    name would resume the last round's finished run)."""
    def cfg(name: str, workers: int = 1, **train) -> JobConfig:
        c = job_config(data, dataclasses.replace(s, epochs=epochs, workers=workers), workdir,
                       f"{name}-{epochs}-r{round_}")
        return dataclasses.replace(c, train=dataclasses.replace(c.train, **train))

    one = cfg("wall-1")
    runs = {
        ONE: lambda: ours(one),
        # Ray's defaults as a new user gets them: one thread per --cpus-per-worker 1.
        OFF: lambda: ours(cfg("wall-off", cpu_plan="off")),
        # The sampler actor whatever the plan would choose: what CPU runs did before the plan chose.
        ddp_name(s): lambda: ours(cfg("wall-ddp", workers=s.ddp_workers)),
    }
    for name, w in DGL_LOADERS.items():
        runs[name] = lambda w=w: dgl(one, s.cores, w)
    wanted = {SHORT_NAMES[n] or ddp_name(s) for n in s.wall_only}
    return {k: v for k, v in runs.items() if not s.wall_only or k in wanted}


ONE, OFF = "ours, 1 worker", "ours, 1 worker, --cpu-plan off"
# --wall-only's short names.
SHORT_NAMES = {"ours": ONE, "off": OFF, "ddp": None, "dgl0": "DGL num_workers=0", "dgl1": "DGL num_workers=1"}


def ddp_name(s: Settings) -> str:
    return f"ours, {s.ddp_workers} DDP workers"


def bench_wall(data: DataConfig, s: Settings, workdir: Path, train_seeds: int) -> list[Row]:
    """Every configuration for both run lengths, in ``s.wall_repeats`` interleaved rounds; the rows and the table."""
    short, long = s.wall_epochs[0], s.wall_epochs[-1]
    rounds = {name: [] for name in configurations(data, s, workdir, short)}
    for i in range(s.wall_repeats):
        for name in rounds:
            runs = {}
            for epochs in (short, long):
                runs[epochs] = attempt(configurations(data, s, workdir, epochs, i)[name])
                if not isinstance(runs[epochs], Exception):
                    r = runs[epochs]
                    print(f"[wall] round {i + 1}/{s.wall_repeats}: {name}, {epochs} epoch(s): {r['wall_s']:.1f} s, "
                          f"{r['cpu_s']:.1f} CPU-s", flush=True)
            rounds[name].append(steady(runs[short], runs[long], long - short, train_seeds))
    return rows_for({name: median_round(r, train_seeds) for name, r in rounds.items()}, s)


def median_round(rounds: list, seeds_per_epoch: int) -> Result:
    """The median over rounds of each figure of :func:`steady`; every round is kept under ``rounds``."""
    done = [r for r in rounds if not isinstance(r, Exception)]
    if not done:
        return rounds[0]
    out = medians(done, "epoch_s", "cpu_s", "start_s", "whole_s")
    out.update(seeds_per_s=seeds_per_epoch / out["epoch_s"], epoch_s_rounds=[r["epoch_s"] for r in done],
               cpu_s_rounds=[r["cpu_s"] for r in done], failed_rounds=len(rounds) - len(done), rounds=done)
    out["by_process"] = median_by_group([r.get("by_process", {}) for r in done])
    return out


def rows_for(results: dict, s: Settings) -> list[Row]:
    """The table's rows for the configurations that ran (``--wall-only`` may leave some out)."""
    dgl = {k: v for k, v in results.items() if k in DGL_LOADERS and not isinstance(v, Exception)}
    best_name = max(dgl, key=lambda k: dgl[k]["seeds_per_s"]) if dgl else "DGL num_workers=0"
    best = dgl.get(best_name, results.get(best_name))
    one, off, ddp = results.get(ONE), results.get(OFF), results.get(ddp_name(s))
    loop0 = results.get("DGL num_workers=0")
    wanted = [
        (one, best, f"{FIGURE}: steady seeds/s, 1 worker vs best DGL ({best_name})", ">= 1.1x", "seeds_per_s",
         lambda r: r >= 1.1, "{:.0f}"),
        (one, loop0, f"{FIGURE}: CPU-s per steady epoch (machine), 1 worker vs DGL num_workers=0", "<= 1.0x",
         "cpu_s", lambda r: r <= 1.0, "{:.1f}"),
        (one, loop0, f"{FIGURE}: whole {s.wall_epochs[-1]}-epoch run (median), 1 worker vs DGL num_workers=0",
         "<= 1.15x", "whole_s", lambda r: r <= 1.15, "{:.1f} s"),
        (ddp, best, f"{FIGURE}: steady seeds/s, {s.ddp_workers} DDP workers vs best DGL ({best_name})", ">= 1.0x",
         "seeds_per_s", lambda r: r >= 1.0, "{:.0f}"),
        (ddp, loop0, f"{FIGURE}: CPU-s per steady epoch, {s.ddp_workers} DDP workers vs DGL num_workers=0", "",
         "cpu_s", None, "{:.1f}"),
        (one, off, f"{FIGURE}: steady seeds/s, 1 worker, CPU plan on vs off", "", "seeds_per_s", None, "{:.0f}"),
        (one, off, f"{FIGURE}: CPU-s per steady epoch, 1 worker, CPU plan on vs off", "", "cpu_s", None, "{:.1f}"),
    ]
    wanted += [(one, r, f"{FIGURE}: steady seeds/s, 1 worker vs {name}", "", "seeds_per_s", None, "{:.0f}")
               for name, r in dgl.items() if name != best_name]
    wanted.append((one, loop0, f"{FIGURE}: outside the steady epochs (start-up, test), 1 worker vs DGL "
                   "num_workers=0", "", "start_s", None, "{:.1f} s"))
    rows = [compare(figure, target, ours_, base, key, meets, show=show)
            for ours_, base, figure, target, key, meets, show in wanted if ours_ is not None and base is not None]
    if isinstance(loop0, dict) and (waits := loop_waits(loop0)):
        w = statistics.median(waits)
        rows.append(Row(f"{FIGURE}: the most hiding batches can give on these cores, 1 / (1 - the DGL loop's share "
                        "of a training epoch spent getting its batches)", ours=f"{1 / (1 - w):.2f}x",
                        baseline=f"share {w:.3f}", ratio="-", target="-", met="-", detail=dict(waits=waits)))
    if rows:
        rows[0].detail["all"] = results
    return rows


def loop_waits(loop: dict) -> list:
    """The DGL loop's ``data_wait`` in each round's long run, epochs after the first (its batch time; none before
    the loop reported it)."""
    return [e["data_wait"] for r in loop.get("rounds", []) for e in r["long"].get("epochs", [])[1:]
            if "data_wait" in e]


def process_table(results: dict) -> str:
    """CPU-seconds per steady epoch by process group: ours beside the DGL loop (one process: its machine total)."""
    ours_ = [n for n, r in results.items() if isinstance(r, dict) and r.get("by_process")]
    loop = results.get("DGL num_workers=0")
    if not ours_:
        return ""
    groups = sorted({g for n in ours_ for g in results[n]["by_process"]} - {"machine", "other"})
    head = ours_ + (["DGL num_workers=0 (run difference)"] if isinstance(loop, dict) else [])
    lines = ["| CPU-s per steady epoch | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for g in groups + ["other", "machine"]:
        cells = [f"{results[n]['by_process'].get(g, 0.0):.1f}" for n in ours_]
        if isinstance(loop, dict):
            cells.append(f"{loop['cpu_s']:.1f}" if g == "machine" else "-")
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
