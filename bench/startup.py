"""Start-up: seconds from the command to the first training step, and when each part of the way ends.

``python -m bench.startup [--runs N] [-- JOB OPTIONS]``: each run is ``jobs/train_arxiv.py`` in a new process
starting a new local cluster; the milestones come from its graph line, Ray's session logs and rank 0's progress file.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

from bench.cpu import machine_busy_s, tree
from bench.harness import REPO, write_json

JOB = REPO / "jobs" / "train_arxiv.py"
DEFAULT_OPTIONS = ["--dataset", "synthetic", "--epochs", "1", "--num-workers", "1", "--sampler-actors", "1",
                   "--eval", "sampled"]
PROGRESS_FILE = ".progress"  # gnnray.run_storage.PROGRESS_FILE, read here without importing gnnray

# Milestones in the order a run normally reaches them, with what each one means.
MILESTONES = {
    "graph_line": "driver printed its graph line (graph loaded, Ray connected)",
    "ray_connected": "driver connected to Ray (a local cluster: started)",
    "controller_launched": "Ray Train controller process launched (trainer.fit called)",
    "controller_running": "controller running (its first log line)",
    "worker_group_started": "train worker group started",
    "train_fn_launched": "train function launched on the workers",
    "first_step": "first training step done (rank 0's progress file)",
}


def _log_time(text: str) -> float:
    """Seconds since the epoch of a log timestamp ``YYYY-mm-dd HH:MM:SS,mmm`` (local time)."""
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


_STAMP = re.compile(r"^\[?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")  # Ray's logs: bracketed; Ray Data's: plain


def _lines(path: str) -> list[str]:
    return Path(path).read_text(errors="replace").splitlines() if os.path.isfile(path) else []


def _first(path: str, needle: str) -> Optional[float]:
    """Time of the first stamped line of ``path`` containing ``needle``."""
    return next((_log_time(m.group(1)) for line in _lines(path) if needle in line for m in [_STAMP.match(line)] if m),
                None)


def _json_first(paths: list[str], needle: str = "", head: int = 0) -> Optional[float]:
    """Earliest line containing ``needle`` (of the first ``head`` lines) in Ray Train's JSON-lines logs."""
    times = []
    for path in paths:
        for line in _lines(path)[:head or None]:
            with contextlib.suppress(ValueError, KeyError):
                if needle in line:
                    times.append(_log_time(json.loads(line)["asctime"]))
    return min(times, default=None)


def session_logs(tmpdir: str, driver_pid: int) -> Optional[str]:
    """The logs directory of the session the driver ``driver_pid`` connected to."""
    found = glob.glob(os.path.join(tmpdir, "ray", "session_*", "logs", f"python-core-driver-*_{driver_pid}.log"))
    return os.path.dirname(found[0]) if found else None


def worker_processes(logs: str, job_hex: str) -> list[dict]:
    """Every worker process of the job: its actor and when the raylet launched it."""
    launched = {}
    for line in _lines(os.path.join(logs, "raylet.out")):
        m = re.search(r"Started worker process with pid (\d+)", line)
        t = _STAMP.match(line)
        if m and t:
            launched[int(m.group(1))] = _log_time(t.group(1))
    out = []
    for path in glob.glob(os.path.join(logs, f"worker-*-{job_hex}-*.out")):
        pid = int(path.rsplit("-", 1)[1].split(".")[0])
        names = [line.split(":actor_name:", 1)[1] for line in _lines(path) if line.startswith(":actor_name:")]
        out.append(dict(pid=pid, actor=names[0] if names else None, launched=launched.get(pid)))
    return sorted(out, key=lambda p: p["launched"] or 0)


def milestones(logs: str, driver_pid: int, stdout_times: dict, first_step: Optional[float]) -> tuple[dict, list]:
    """Absolute times of :data:`MILESTONES` (``None`` where a run's logs do not show one) and its processes."""
    driver_log = glob.glob(os.path.join(logs, f"python-core-driver-*_{driver_pid}.log"))[0]
    job_hex = os.path.basename(driver_log).split("-")[3][:8]  # python-core-driver-<job id>ffff..._<pid>.log
    procs = worker_processes(logs, job_hex)

    def launched(prefix: str) -> Optional[float]:
        return min((p["launched"] for p in procs if (p["actor"] or "").startswith(prefix) and p["launched"]),
                   default=None)

    controller = glob.glob(os.path.join(logs, "train", "ray-train-sys-controller-*.log"))
    workers = glob.glob(os.path.join(logs, "train", "ray-train-sys-worker-*.log"))
    times = {
        "graph_line": stdout_times.get("graph"),
        "ray_connected": _first(driver_log, "Initializing worker at address"),
        "controller_launched": launched("TrainController"),
        "controller_running": _json_first(controller, head=1),
        "worker_group_started": _json_first(controller, "Started training worker group"),
        "train_fn_launched": _json_first(workers, "Launching training function"),
        "first_step": first_step,
    }
    return times, procs


class CpuWatch:
    """CPU-seconds of a process tree and of everything else while it ran, polled every ``every_s`` (a process's
    last fraction of a period is missed: "others" is slightly high)."""

    def __init__(self, root_pid: int, every_s: float = 0.25):
        self._root, self._every = root_pid, every_s
        self._seen: dict[int, float] = {}
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._busy0, self._self0 = machine_busy_s(), sum(os.times()[:2])
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            for pid, (cmd, cpu_s) in tree([self._root]).items():
                self._seen[pid] = max(self._seen.get(pid, 0.0), cpu_s)
                name = _process_name(cmd)
                if name != "ray::IDLE" or pid not in self.names:  # keep the actor it became
                    self.names[pid] = name

    def by_process(self) -> dict[str, float]:
        """CPU seconds per kind of process (a Ray worker by its actor, or ``ray::IDLE``)."""
        out: collections.Counter = collections.Counter()
        for pid, cpu in self._seen.items():
            out[self.names.get(pid, "?")] += cpu
        return {name: round(cpu, 2) for name, cpu in out.most_common()}

    def stop(self) -> tuple[float, float]:
        """(CPU seconds of the tree, CPU seconds of everything else) since the start."""
        self._stop.set()
        self._thread.join()
        mine = sum(self._seen.values())
        watching = sum(os.times()[:2]) - self._self0  # this process's polling, not the others'
        return mine, max(0.0, machine_busy_s() - self._busy0 - mine - watching)


def _process_name(cmd: str) -> str:
    """``ray::Actor`` for a Ray worker, else the program and its first telling argument."""
    if cmd.startswith("ray::"):
        return cmd.split()[0].split(".")[0]  # ray::TrainController.run -> ray::TrainController
    words = [os.path.basename(c) for c in cmd.split()[:3] if not c.startswith("-")]
    return " ".join(w for w in words if w and not w.startswith("python"))[:40] or "?"


def run_once(options: list[str], env: dict, workdir: str, name: str, timeout: float = 900) -> dict:
    """One run of the job; its milestones (seconds since the command) and processes."""
    run_dir = os.path.join(workdir, "runs", name)
    cmd = [sys.executable, str(JOB), *options, "--name", name, "--storage-path", os.path.join(workdir, "runs")]
    start = time.time()
    stdout_times: dict = {"start": start}
    first_step: list = []
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watch = CpuWatch(proc.pid)
    output: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            output.append(line)
            if line.startswith("graph ") and "graph" not in stdout_times:
                stdout_times["graph"] = time.time()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    progress = os.path.join(run_dir, PROGRESS_FILE)
    while proc.poll() is None and time.time() - start < timeout:
        if not first_step and os.path.exists(progress):
            first_step.append(time.time())
            mine_s, others_s = watch.stop()  # up to the first step: what start-up had of the machine
        time.sleep(0.02)
    if not first_step:
        mine_s, others_s = watch.stop()
    if proc.poll() is None:
        proc.kill()
    reader.join(10)
    exit_time = time.time()
    if proc.returncode:
        raise RuntimeError(f"the job exited with {proc.returncode}:\n{''.join(output[-20:])}")
    logs = session_logs(env["RAY_TMPDIR"], proc.pid)
    if logs is None:
        raise RuntimeError(f"no Ray session logs of driver {proc.pid} under {env['RAY_TMPDIR']}")
    times, procs = milestones(logs, proc.pid, stdout_times, first_step[0] if first_step else None)
    rel = {k: (round(v - start, 2) if v else None) for k, v in times.items()}
    # Others' share of the machine until the first step: near 0 on an idle machine, 0.5 when another job
    # kept one of two cores busy.
    until = (first_step[0] if first_step else exit_time) - start
    others_share = others_s / (until * (os.cpu_count() or 1))
    return dict(milestones=rel, total_s=round(exit_time - start, 2), logs=logs, cpu_s=round(mine_s, 1),
                cpu_by_process=watch.by_process(),
                others_cpu_s=round(others_s, 1), others_share=round(others_share, 3),
                processes=[dict(p, launched=p["launched"] and round(p["launched"] - start, 2)) for p in procs])


def summary(runs: list[dict]) -> dict:
    """Median of each milestone over ``runs`` (those that reached it)."""
    values = {k: [r["milestones"][k] for r in runs if r["milestones"].get(k) is not None] for k in MILESTONES}
    return {k: round(statistics.median(v), 2) if v else None for k, v in values.items()}


def table(medians: dict, runs: int) -> str:
    lines = [f"{'milestone':<22} {'s':>7}  (median of {runs} runs, seconds since the command)"]
    for key, what in MILESTONES.items():
        v = medians.get(key)
        lines.append(f"{key:<22} {'-' if v is None else f'{v:7.2f}':>7}  {what}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs (each a new process and a new cluster)")
    p.add_argument("--json", default=None, help="also write every run's milestones and processes here")
    p.add_argument("--label", default="", help="a note stored with the results (e.g. what was changed)")
    p.add_argument("job", nargs="*", help="after --: the job's options, after its defaults")
    args = p.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="gnnray-startup-")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = workdir
    runs = []
    for i in range(args.runs):
        runs.append(run_once(DEFAULT_OPTIONS + args.job, env, workdir, f"startup{i}"))
        m = runs[-1]["milestones"]
        print(f"run {i}: first_step={m['first_step']}s others_share={runs[-1]['others_share']} "
              + " ".join(f"{k}={v}" for k, v in m.items() if k != "first_step"), flush=True)
    print(table(summary(runs), len(runs)))
    write_json(args.json, dict(label=args.label, options=DEFAULT_OPTIONS + args.job, runs=runs, median=summary(runs),
                               load=os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
