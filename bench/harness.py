"""The runner every benchmark uses: interleaved rounds beside the baseline, medians, the table of ratios, the JSON.

A figure is a median over rounds, the ratio is ours / baseline, and nothing asserts on a time."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional, Union

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench-results"  # where each benchmark writes its JSON unless told (--json)
DEFAULT_DATASET = REPO.parent / "shared" / "datasets" / "arxiv-structure"
# An environment with the dgl extra (torch 2.2.1) runs the DGL baselines: DGL cannot load beside a current torch.
DGL_PYTHON = os.environ.get("GNNRAY_DGL_PYTHON", sys.executable)
RESULT = "RESULT "  # a child process's last line: its figures as JSON (:func:`emit`, :func:`run_child`)
COLUMNS = ("figure", "ours", "baseline", "ratio", "target", "met")
Result = Union[dict, Exception]  # a measurement, or why it failed


@dataclasses.dataclass
class Row:
    """One line of the table; ``detail`` goes to the JSON only."""

    figure: str
    ours: str = ""
    baseline: str = ""
    ratio: str = ""
    target: str = ""
    met: str = ""
    detail: dict = dataclasses.field(default_factory=dict)


def verdict(ok: bool) -> str:
    return "yes" if ok else "NO"


def error_row(figure: str, target: str, exc: BaseException) -> Row:
    """A row showing the error's most telling line (a remote error's cause is at the end of its text)."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines() if line.strip()]
    causes = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line)]
    message = causes[-1] if causes else f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return Row(figure, ours=f"error: {message[:70]}", target=target, met="error",
               detail={"error": traceback.format_exception(type(exc), exc, exc.__traceback__)})


def attempt(fn: Callable[[], dict]) -> Result:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - shown in the rows that need it
        return exc


def guarded(figure: str, target: str, fn: Callable[[], list]) -> list[Row]:
    """Run one stage; a failure is its error row. Its rows get its wall time and the load average around it."""
    load, start = os.getloadavg()[0], time.perf_counter()
    try:
        rows = fn()
    except Exception as exc:  # noqa: BLE001 - a failing stage must not hide the others
        rows = [error_row(figure, target, exc)]
    for r in rows:
        r.detail.update(stage_s=time.perf_counter() - start, load_avg_1min=(load, os.getloadavg()[0]))
    return rows


def compare(figure: str, target: str, ours: Result, base: Result, key: str,
            meets: Optional[Callable[[float], bool]] = None, show: str = "{:.0f}") -> Row:
    """``ours[key]`` against ``base[key]``, ratio ours / baseline; ``meets(ratio)`` decides the target."""
    for r in (ours, base):
        if isinstance(r, Exception):
            return error_row(figure, target, r)
    ratio = ours[key] / base[key] if base[key] else float("nan")
    return Row(figure, ours=show.format(ours[key]), baseline=show.format(base[key]), ratio=f"{ratio:.2f}x",
               target=target or "-", met=verdict(meets(ratio)) if meets else "-",
               detail=dict(ratio=ratio, ours=ours, baseline=base))


def side_by_side(figure: str, ours: list, base: list, show: str = "{:.2f}", target: str = "-",
                 meets: Optional[Callable[[float], bool]] = None, **detail) -> Row:
    """Medians of ``ours`` and ``base`` (one number a round) and the ratio of the medians."""
    row = compare(figure, target, dict(m=statistics.median(ours)), dict(m=statistics.median(base)), "m", meets, show)
    row.detail = dict(ratio=row.detail["ratio"], ours=list(ours), baseline=list(base), **detail)
    return row


def interleaved(fns: dict, rounds: int, warmup: int = 0) -> dict:
    """Each of ``fns`` (name -> ``fn(round)``) once a round, the order reversed every other round, so that the
    machine's drift hits all alike; the results of the rounds after ``warmup``, by name."""
    out: dict = {name: [] for name in fns}
    names = list(fns)
    for i in range(warmup + rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            r = fns[name](i)
            if i >= warmup:
                out[name].append(r)
    return out


def medians(runs: list, *keys: str) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def median_s(fn: Callable[[], object], reps: int, sync: Callable[[], None] = lambda: None) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after a warm-up one, ``sync()`` (queued work) included."""
    fn()
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def format_table(rows: list[Row]) -> str:
    cells = [COLUMNS] + [tuple(getattr(r, c) for c in COLUMNS) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["| " + " | ".join(v.ljust(w) for v, w in zip(c, widths)) + " |" for c in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _plain(o):
    """JSON of what ``json`` does not know: numpy's and torch's scalars as numbers, anything else as text."""
    try:
        return o.item()
    except (AttributeError, ValueError, RuntimeError):
        return str(o)


def write_json(path, result: dict) -> None:
    """``result`` as JSON at ``path``; nothing without a path."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1, default=_plain))


def report(rows: list[Row], path, note: str = "", **result) -> int:
    """Print ``note`` and the table; write the rows and ``result`` to ``path``; 1 if a row is an error."""
    print((note + "\n" if note else "") + format_table(rows), flush=True)
    write_json(path, dict(result, rows=[dataclasses.asdict(r) for r in rows], load_avg=os.getloadavg()))
    return 1 if any(r.met == "error" for r in rows) else 0


def emit(result: dict) -> None:
    """A child process's figures, for :func:`run_child`."""
    print(RESULT + json.dumps(result, default=_plain), flush=True)


def run_child(cmd: list, env: Optional[dict] = None, timeout: float = 3600, what: str = "") -> dict:
    """Run ``cmd`` from the repository root; its last :func:`emit` ted figures, with ``process_s``."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    found = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode or not found:
        tail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-10:]
        raise RuntimeError(f"{what or cmd[-1]} exited with {proc.returncode}: " + "\n".join(tail))
    return dict(json.loads(found[-1][len(RESULT):]), process_s=time.perf_counter() - start)


def child_env(**extra) -> dict:
    """A child's environment: this checkout first on the path (the DGL interpreter imports bench and gnnray from
    here), without ``RAY_ADDRESS`` (a user's run starts its own cluster)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "PYTHONPATH": path, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dgl_or_none():
    """DGL where this environment has the dgl extra, else ``None`` (it cannot load beside a current torch)."""
    if importlib.util.find_spec("dgl") is None:
        return None
    from gnnray.sampler.graphbolt import import_dgl

    try:
        return import_dgl()
    except Exception:  # noqa: BLE001 - ConfigError: DGL cannot load beside this torch
        return None


@contextlib.contextmanager
def threads(n: int):
    """Limit torch's and, where loaded, DGL's OpenMP pools to ``n`` threads (they are separate libgomp copies)."""
    import torch

    pools = [(torch.get_num_threads, torch.set_num_threads)]
    if (dgl := dgl_or_none()) is not None:
        pools.append((dgl.utils.get_num_threads, dgl.utils.set_num_threads))
    before = [get() for get, _ in pools]
    for _, set_ in pools:
        set_(n)
    try:
        yield
    finally:
        for (_, set_), b in zip(pools, before):
            set_(b)


def machine() -> dict:
    import psutil
    import torch

    from gnnray import stack

    versions = stack.installed(["numba", "dgl", "ray"])
    return dict(cpus=os.cpu_count(), memory_gib=round(psutil.virtual_memory().total / 2**30, 1),
                gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                load_avg=os.getloadavg(), python=platform.python_version(), torch=torch.__version__,
                dgl_python=DGL_PYTHON, **versions)
