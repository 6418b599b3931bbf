"""What every figure shares: the settings, a job and its epochs, a table row, thread limits, the machine, Ray."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import platform
import re
import sys
import traceback
from pathlib import Path
from typing import Callable, Optional, Union

from gnnray.config import DataConfig, JobConfig, ModelConfig, RunConfig, SamplerConfig, TrainConfig
from gnnray.cpus import node_cores

REPO = Path(__file__).resolve().parents[1]
# The interpreter of an environment with the dgl extra (torch 2.2.1), where the DGL baselines run: DGL cannot be
# imported beside the default install's torch. Ours runs in this process's environment.
DGL_PYTHON = os.environ.get("GNNRAY_DGL_PYTHON", sys.executable)
DEFAULT_DATASET = REPO.parent / "shared" / "datasets" / "arxiv-structure"
DEFAULT_JSON = REPO / "bench-results" / "benchmark.json"


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every measurement uses; ``--quick`` shrinks only the amounts of work."""

    quick: bool
    cores: int  # physical cores both sides of every comparison get
    fanouts: tuple = (15, 10, 5)
    batch_size: int = 1024
    hidden: int = 256
    dropout: float = 0.5
    lr: float = 0.003
    seed: int = 0
    # Figure 2: batches consumed per configuration, and how many to skip first.
    sampler_batches: int = 400
    sampler_warmup: int = 32  # several calls of the actor (a call samples one seed block: 16 rows or fewer,
    # as --max-ahead makes them; see gnnray.driver.stream)
    sampler_rounds: int = 3  # pipeline runs of 1 actor, each between two plain loops of each baseline
    epochs: int = 4  # a job's epochs (steady: all but the first and the last, see training.steady)
    workers: int = 1  # Ray Train workers; they share the cores (see trainer_cpus)
    samplers: int = 1  # sampler actors in the pool
    max_ahead: int = SamplerConfig().max_ahead  # --max-ahead of every stream and job, the job's default
    ddp_workers: int = 2  # the whole runs' DDP configuration: the job with this many DDP workers
    # The fast trainer (a GPU worker's regime, training.py): a step about as long as sampling a batch.
    fast_fanouts: tuple = (15, 10)
    fast_hidden: int = 32
    fast_epochs: int = 4  # at least 3, as epochs
    # Whole runs (wall.py): a short and a longer run of every configuration; their difference is steady state.
    wall_epochs: tuple = (1, 4)
    wall_repeats: int = 3  # interleaved rounds of every pair; each figure is their median
    wall_only: tuple = ()  # wall.SHORT_NAMES of the configurations to run (empty: all)
    # Figure 4: batches each probe process samples before it is measured.
    memory_batches: int = 4
    memory_processes: tuple = (1, 2, 4)
    # --quick: training/validation/test nodes kept, in batches.
    quick_train_batches: int = 20
    quick_eval_batches: int = 2

    @property
    def trainer_cpus(self) -> int:
        """CPUs of each train worker: all the cores, split between workers.

        The sampler actor is not given cores of its own: sampling a batch costs
        a small fraction of a training step (figure 2 against a whole run's
        step), so the trainer's thread pool gets every core, as the DGL loop
        does. Ray's logical CPUs are oversubscribed to allow it.
        """
        return max(1, self.cores // self.workers)


def job_config(data: DataConfig, s: Settings, workdir: Path, name: str = "bench") -> JobConfig:
    """The job that ``s`` describes; the DGL loops build their model, loader and evaluation from it too.

    Runs under one ``workdir`` need distinct ``name``s (the same name resumes a run).
    """
    import torch

    return JobConfig(
        data=data,
        sampler=SamplerConfig(fanouts=tuple(s.fanouts), batch_size=s.batch_size, actors=(s.samplers,),
                              cpus_per_actor=1.0, max_ahead=s.max_ahead),
        model=ModelConfig(hidden=s.hidden, dropout=s.dropout),
        # Sampled final accuracies, as the DGL loop computes them: no layer-wise inference pass after training.
        # Threads come from the job's CPU plan (gnnray/cpus.py), as in a user's run with default options,
        # unless --cores gives the comparison fewer cores than the node has: then the trainers get them too.
        train=TrainConfig(epochs=s.epochs, lr=s.lr, num_workers=s.workers, use_gpu=torch.cuda.is_available(),
                          eval="sampled", trainer_threads=s.trainer_cpus if s.cores < node_cores() else 0),
        run=RunConfig(name=name, storage_path=str(workdir / "runs"), max_failures=0, seed=s.seed),
    )


def metrics_log(cfg: JobConfig) -> Path:
    """The run's ``metrics.jsonl``: rank 0 appends one JSON line per epoch (runs under a local storage path)."""
    from gnnray.run_storage import METRICS_LOG

    return Path(cfg.run.storage_path) / cfg.run.name / METRICS_LOG


def epochs_of(cfg: JobConfig) -> list[dict]:
    """Every epoch's metrics as the job reported them, from :func:`metrics_log`."""
    return [json.loads(line) for line in metrics_log(cfg).read_text().splitlines() if line.strip()]


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


COLUMNS = ("figure", "ours", "baseline", "ratio", "target", "met")


def error_row(figure: str, target: str, exc: BaseException) -> Row:
    """A row showing the error's most telling line (a remote error's cause is at the end of its text)."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines() if line.strip()]
    causes = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line)]
    message = causes[-1] if causes else f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return Row(figure, ours=f"error: {message[:70]}", target=target, met="error",
               detail={"error": traceback.format_exception(type(exc), exc, exc.__traceback__)})


def verdict(ok: bool) -> str:
    return "yes" if ok else "NO"


Result = Union[dict, Exception]  # a measurement, or why it failed


def attempt(fn: Callable[[], dict]) -> Result:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - shown in the rows that need it
        return exc


def compare(figure: str, target: str, ours: Result, base: Result, key: str,
            meets: Optional[Callable[[float], bool]] = None, show: str = "{:.0f}") -> Row:
    """``ours[key]`` against ``base[key]`` (both measured in this run), ratio ours / baseline.

    ``meets(ratio)`` decides the target, if there is one; a failed side makes an error row.
    """
    for r in (ours, base):
        if isinstance(r, Exception):
            return error_row(figure, target, r)
    ratio = ours[key] / base[key] if base[key] else float("nan")
    return Row(figure, ours=show.format(ours[key]), baseline=show.format(base[key]), ratio=f"{ratio:.2f}x",
               target=target or "-", met=verdict(meets(ratio)) if meets else "-",
               detail=dict(ratio=ratio, ours=ours, baseline=base))


def format_table(rows: list[Row]) -> str:
    cells = [COLUMNS] + [tuple(getattr(r, c) for c in COLUMNS) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["| " + " | ".join(v.ljust(w) for v, w in zip(c, widths)) + " |" for c in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _dgl():
    """DGL where this environment has the dgl extra, else ``None`` (it cannot load beside a current torch)."""
    if importlib.util.find_spec("dgl") is None:
        return None
    from gnnray.sampler.graphbolt import import_dgl

    return import_dgl()


@contextlib.contextmanager
def threads(n: int):
    """Limit torch's and, where loaded, DGL's OpenMP pools to ``n`` threads (they are separate libgomp copies)."""
    import torch

    dgl = _dgl()
    torch_before = torch.get_num_threads()
    dgl_before = dgl.utils.get_num_threads() if dgl else None
    torch.set_num_threads(n)
    if dgl:
        dgl.utils.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(torch_before)
        if dgl:
            dgl.utils.set_num_threads(dgl_before)


def machine() -> dict:
    import psutil
    import ray
    import torch

    from gnnray import stack

    return dict(cpus=os.cpu_count(), memory_gib=round(psutil.virtual_memory().total / 2**30, 1),
                gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                load_avg=os.getloadavg(), python=platform.python_version(), torch=torch.__version__,
                numba=stack.installed(["numba"])["numba"], dgl=stack.installed(["dgl"])["dgl"], ray=ray.__version__,
                dgl_python=DGL_PYTHON)


def start_ray(s: Settings, verbose: bool) -> None:
    """One local cluster for the whole run, with enough logical CPUs for the largest stage.

    Logical CPUs exceed physical ones on purpose: every stage is given all the
    physical cores (see ``Settings.trainer_cpus``); Ray's counts only decide
    what may run at once.
    """
    import ray
    import ray.data

    import bench
    from gnnray import cpus
    from gnnray.driver.console import quiet_ray

    # Ship the bench's actors and tasks by value: workers need not find this folder on their path.
    ray.cloudpickle.register_pickle_by_value(bench)
    need = max(s.workers * s.trainer_cpus + s.samplers + 3, max(s.memory_processes) + 1, 3, s.cores)
    # Keep the dashboard: Ray Train's placement-group cleaner asks the state API
    # (served by it) whether the controller lives, and without it tears the
    # workers down mid-run ("A worker health check failed").
    ray.init(address="local", num_cpus=need, log_to_driver=verbose,
             runtime_env={"env_vars": {"DGLBACKEND": "pytorch", **cpus.JOB_ENV}})  # as the job's own cluster
    quiet_ray(verbose)
    ray.data.DataContext.get_current().enable_progress_bars = False
