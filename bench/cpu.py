"""Where the machine's CPU goes: per-process CPU-seconds from ``/proc``, grouped by what each process is.

:func:`snapshot` reads every process's ``utime + stime`` (all its threads)
and the machine's non-idle time from ``/proc/stat``; the difference of two
snapshots (:func:`between`) is the CPU each group used in that window. Groups
come from the command line Ray gives its processes (``ray::RayTrainWorker``,
``ray::MapWorker(...)``, ``ray::SplitCoordinator``, ...), so the table says
which part of the job took the time. A process that ended between the two
snapshots is missing from the second and counted only up to the first: the
windows here are steady epochs, where no process ends.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable, Iterator, Optional

_TICK = os.sysconf("SC_CLK_TCK")

# First match wins: (group, substring of the command line).
GROUPS = (
    ("train worker", "RayTrainWorker"),
    ("sampler actors", "SamplerActor"),
    ("Ray Data coordinator", "SplitCoordinator"),
    ("Ray Train actors", "TrainController"),
    ("Ray Train actors", "TrainStateActor"),
    ("Ray Train actors", "PlacementGroupCleaner"),
    ("Ray Train actors", "ray::_"),
    ("driver", "train_arxiv.py"),
    ("driver", "bench.dgl_loop"),
    ("driver", "bench/benchmark.py"),
    ("driver", "-m bench"),
    ("Ray daemons", "raylet"),
    ("Ray daemons", "gcs_server"),
    ("Ray daemons", "dashboard"),
    ("Ray daemons", "log_monitor"),
    ("Ray daemons", "monitor.py"),
    ("Ray daemons", "runtime_env"),
    ("Ray daemons", "ray::"),  # other Ray workers (idle, IDLE prestarted, metrics)
    ("Ray daemons", "ray/"),
)


def _group(cmdline: str) -> Optional[str]:
    return next((g for g, key in GROUPS if key in cmdline), None)


def machine_busy_s() -> float:
    """The machine's non-idle CPU-seconds since boot (all cores): user, nice, system, irq, softirq, steal."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / _TICK


def snapshot() -> dict:
    """``{"machine": busy_s, "procs": {pid: (group, cpu_s)}}`` for every process of a known group."""
    procs = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        group = _group(cmd)
        if group:
            procs[int(pid)] = (group, (int(stat[11]) + int(stat[12])) / _TICK)
    return dict(machine=machine_busy_s(), procs=procs)


def between(before: dict, after: dict) -> dict:
    """CPU-seconds per group between two snapshots, plus ``machine`` (all processes) and ``other``."""
    out: dict = {}
    for pid, (group, cpu) in after["procs"].items():
        start = before["procs"].get(pid, (group, 0.0))[1]
        out[group] = out.get(group, 0.0) + cpu - start
    out["machine"] = after["machine"] - before["machine"]
    out["other"] = out["machine"] - sum(v for k, v in out.items() if k != "machine")
    return out


@contextlib.contextmanager
def on_new_lines(path, snap: Callable[[], object], every_s: float = 0.1) -> Iterator[list]:
    """While the block runs, ``snap()`` each time a line is added to the file at ``path`` (a run's
    ``metrics.jsonl``, one line per epoch); yields the list the snapshots go to."""
    snaps: list = []
    stop = threading.Event()

    def watch() -> None:
        seen = 0
        while not stop.wait(every_s):
            try:
                n = open(path).read().count("\n")
            except OSError:
                continue
            if n > seen:
                seen = n
                snaps.append(snap())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield snaps
    finally:
        stop.set()
        watcher.join()
