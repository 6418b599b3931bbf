"""Where the machine's CPU goes: per-process CPU-seconds from ``/proc``, grouped by what each process is.

The difference of two :func:`snapshot` s is the CPU each group used in between (a process that ended in
between counts up to the first: the windows are steady epochs); :func:`tree` lists a process tree's.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable, Iterator, Optional

_TICK = os.sysconf("SC_CLK_TCK")

# First match wins, in this order: group, substrings of the command line.
GROUPS = {
    "train worker": ("RayTrainWorker",),
    "sampler actors": ("SamplerActor",),
    "Ray Data coordinator": ("SplitCoordinator",),
    "Ray Train actors": ("TrainController", "TrainStateActor", "PlacementGroupCleaner", "ray::_"),
    "driver": ("train_arxiv.py", "bench.dgl_loop", "-m bench"),
    # Then the rest of Ray: its daemons and other workers (idle, IDLE prestarted, metrics).
    "Ray daemons": ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "runtime_env", "ray::", "ray/"),
}


def _group(cmdline: str) -> Optional[str]:
    return next((g for g, keys in GROUPS.items() for key in keys if key in cmdline), None)


def machine_busy_s() -> float:
    """The machine's non-idle CPU-seconds since boot (all cores): user, nice, system, irq, softirq, steal."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / _TICK


def processes() -> dict:
    """``{pid: (parent pid, command line, CPU-seconds of all its threads)}`` of every process."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # ended meanwhile
        out[int(pid)] = (int(stat[1]), cmd, (int(stat[11]) + int(stat[12])) / _TICK)
    return out


def snapshot() -> dict:
    """``{"machine": busy_s, "procs": {pid: (group, cpu_s)}}`` for every process of a known group."""
    procs = {pid: (_group(cmd), cpu) for pid, (_, cmd, cpu) in processes().items()}
    return dict(machine=machine_busy_s(), procs={pid: v for pid, v in procs.items() if v[0]})


def tree(roots: list) -> dict:
    """``{pid: (command line, CPU-seconds)}`` of ``roots`` and every live process descended from them."""
    procs, out, todo = processes(), {}, list(roots)
    kids: dict = {}
    for pid, (parent, _, _) in procs.items():
        kids.setdefault(parent, []).append(pid)
    while todo:
        pid = todo.pop()
        if pid in procs and pid not in out:
            out[pid] = procs[pid][1:]
            todo.extend(kids.get(pid, ()))
    return out


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
    """While the block runs, ``snap()`` each time a line is added to ``path`` (a run's ``metrics.jsonl``, a line
    an epoch); yields the list of snapshots."""
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
