"""Performance benchmark of gnnray's data path against plain single-process DGL.

Usage (from the repository root)::

    .venv/bin/python bench/benchmark.py            # full: about 4-5 minutes on 2 cores
    .venv/bin/python bench/benchmark.py --quick    # about 2 minutes, fewer batches and epochs
    .venv/bin/python bench/benchmark.py --dataset synthetic --json out.json

It starts one local Ray cluster, measures the five figures of the performance
issue, prints one table (figure, ours, baseline, ratio, target, met?) and
writes every number, with the settings and the machine, to ``--json``. Each
measurement is guarded: one that fails shows its error in its row and the
others still run.

The figures (GraphSAGE, 3 layers, hidden 256, fanouts 15,10,5, batch 1024):

1. Data-wait fraction: share of a train worker's step time spent waiting for
   its next mini-batch, as the job itself reports it per epoch (``data_wait``
   in ``metrics.jsonl``), median over the steady epochs (epoch 0 includes the
   start of the sampler actors and is left out). Target: below 5%.
2. Sampler overhead: mini-batches per second of one sampler actor in the real
   Ray Data pipeline (row numbers -> ``SamplerActor`` pool -> a consumer that
   reads blocks as a train worker does and unpacks each row) against the same
   ``Sampler.sample`` calls on the same seeds in a plain loop on one core,
   alternating plain loop and pipeline and taking the median ratio. Rates are
   taken after the first calls, so actor start-up is excluded. Target: at
   least 0.9x, i.e. packing, transport and unpacking cost at most ~10% of
   sampling. A second baseline runs the same loop in a Ray worker process
   (a task over the node-shared graph), where the actor samples too, so that
   the ratio holds only what the pipeline adds. Beside it, 2 actors' total
   rate against 1 actor's, and against what 2 plain loops in 2 processes get
   over 1 on the same cores.
3. Throughput: training seeds per second of ``gnnray.job.run`` (median
   ``seeds_per_s`` of the steady epochs) against the DGL tutorials' loop in one
   process (``dgl.dataloading.DataLoader`` + ``NeighborSampler``, the same
   GraphSAGE from ``gnnray.model.build_model``, Adam, ``feat[input_nodes]``)
   with the same model, fanouts, batch size and physical cores. Target: >= 1x.
4. Memory: growth of the private memory (USS, after ``malloc_trim``) of
   processes that do what a sampler actor or train worker does with the graph
   (``GraphHandle.get``, ``to_dgl``, sample, gather features), at 1, 2 and 4
   such processes, per process, against processes that each copy the graph
   (``np.array``, as ``torch.multiprocessing.spawn`` examples do). Target: <5%
   of the graph's size per process.
5. GPU path: with a GPU, how much of the host-to-device copy the
   ``Prefetcher`` hides behind compute on synthetic batches; "n/a" without one.

``--quick`` keeps the same graph structure and features but marks only 20
batches' worth of nodes as training nodes (and 2 batches' worth as validation
and test), so epochs are short while each batch costs what it costs on the
full graph; it also takes fewer batches for figure 2.

Wall-clock numbers are noisy on small machines (30-40% between runs on an
idle 2-core machine, 2-3x when it is shared with other work): compare ratios
within one run; the CPU-time and memory rows hardly move. The JSON records the
load average around each stage.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("DGLBACKEND", "pytorch")

import numpy as np  # noqa: E402

from gnnray.config import DataConfig  # noqa: E402
from gnnray.graph_store import Graph  # noqa: E402

DEFAULT_DATASET = REPO.parent / "shared" / "datasets" / "arxiv-structure"
DEFAULT_JSON = REPO / "bench-results" / "benchmark.json"


# --------------------------------------------------------------------------- settings and results


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
    sampler_warmup: int = 32  # two calls of the actor (16-row blocks)
    sampler_rounds: int = 3  # pipeline runs of 1 actor, each between two plain loops of each baseline
    # Figure 3: our epochs (the first is start-up), the DGL loop's steps.
    epochs: int = 4
    baseline_warmup: int = 3
    baseline_steps: int = 40
    workers: int = 1  # Ray Train workers; they share the cores (see trainer_cpus)
    samplers: int = 1  # sampler actors in the pool
    # Figure 4: batches each probe process samples before it is measured.
    memory_batches: int = 4
    memory_processes: tuple = (1, 2, 4)
    # --quick: training/validation/test nodes kept, in batches.
    quick_train_batches: int = 20
    quick_eval_batches: int = 2

    @property
    def trainer_cpus(self) -> int:
        """CPUs of each train worker: all the cores, split between workers.

        The sampler actor is not given cores of its own: here sampling a batch
        costs ~10% of a training step (figure 2 vs 3), so one actor needs a
        tenth of a core, and the trainer's thread pool gets every core, as the
        DGL loop does. Ray's logical CPUs are oversubscribed to allow it.
        """
        return max(1, self.cores // self.workers)


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


def error_row(figure: str, target: str, exc: BaseException) -> Row:
    """A row showing the error's most telling line (a remote error's cause is at the end of its text)."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).splitlines() if line.strip()]
    causes = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line)]
    message = causes[-1] if causes else f"{type(exc).__name__}: {lines[0] if lines else ''}"
    return Row(figure, ours=f"error: {message[:70]}", target=target, met="error",
               detail={"error": traceback.format_exception(type(exc), exc, exc.__traceback__)})


def verdict(ok: bool) -> str:
    return "yes" if ok else "NO"


# --------------------------------------------------------------------------- small helpers


def malloc_trim() -> None:
    """Return freed heap memory to the OS so USS shows what is held, not glibc's cache."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


@contextlib.contextmanager
def threads(n: int):
    """Limit torch's and DGL's OpenMP pools to ``n`` threads (they are separate libgomp copies)."""
    import dgl.utils
    import torch

    torch_before, dgl_before = torch.get_num_threads(), dgl.utils.get_num_threads()
    torch.set_num_threads(n)
    dgl.utils.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(torch_before)
        dgl.utils.set_num_threads(dgl_before)


def from_readonly(a: np.ndarray):
    """``torch.from_numpy`` of a read-only Ray Data view without torch's warning (we only read it)."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a)


def same_seed_batches(train_idx: np.ndarray, s: Settings, rows: int) -> tuple[list, int]:
    """The first ``rows`` seed batches of the job's ``SeedPlan`` with one worker, and the epochs they span."""
    from gnnray.seeds import SeedPlan

    plan = SeedPlan.for_run(train_idx, s.batch_size, 1, s.seed)
    epochs = math.ceil(rows / plan.rows_per_epoch)
    return [b for e in range(epochs) for b in plan.batches(e)][:rows], epochs


# --------------------------------------------------------------------------- data


def base_data_config(dataset: Optional[str]) -> DataConfig:
    """The issue's data: the arxiv structure with 128 random features, else an arxiv-sized synthetic graph."""
    path = Path(dataset).expanduser() if dataset and dataset != "synthetic" else DEFAULT_DATASET
    if dataset != "synthetic" and path.is_dir():
        return DataConfig(dataset=str(path), add_reverse_edges=True, random_features=128)
    if dataset not in (None, "synthetic"):
        raise SystemExit(f"--dataset {dataset}: no such directory")
    if dataset is None:
        print(f"{DEFAULT_DATASET} not found: using the arxiv-sized synthetic graph", flush=True)
    return DataConfig(dataset="synthetic", synthetic_nodes=169_343, synthetic_feat_dim=128, synthetic_classes=40)


def quick_data_config(graph: Graph, s: Settings, workdir: Path, base: DataConfig) -> DataConfig:
    """Write ``graph`` as a graph directory whose splits are cut to a few batches (``--quick``).

    Same nodes, edges (reverse edges already added) and, with the same seed,
    the same random features, so one batch costs what it does on the full
    graph; only epochs get shorter.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = workdir / "quick-graph"
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(s.seed)
    n = graph.num_nodes
    split = np.full(n, "none", dtype=object)
    keep = {"train": s.quick_train_batches, "valid": s.quick_eval_batches, "test": s.quick_eval_batches}
    for name, batches in keep.items():
        ids = graph.split(name)
        split[rng.choice(ids, min(len(ids), batches * s.batch_size), replace=False)] = name
    dst = np.repeat(np.arange(n, dtype=np.int64), np.diff(graph.indptr))
    pq.write_table(pa.table({"src": graph.indices, "dst": dst}), out / "edges.parquet")
    pq.write_table(pa.table({"id": np.arange(n, dtype=np.int64), "label": graph.label,
                             "split": pa.array(split, type=pa.string())}), out / "nodes.parquet")
    (out / "meta.json").write_text(json.dumps({"num_nodes": n, "num_classes": graph.num_classes,
                                               "name": f"{graph.name}-quick"}))
    return DataConfig(dataset=str(out), add_reverse_edges=False, random_features=graph.feat_dim,
                      seed=base.seed if base.random_features else s.seed)


# --------------------------------------------------------------------------- Ray


def start_ray(s: Settings, verbose: bool) -> None:
    """One local cluster for the whole run, with enough logical CPUs for the largest stage.

    Logical CPUs exceed physical ones on purpose: every stage is given all the
    physical cores (see ``Settings.trainer_cpus``); Ray's counts only decide
    what may run at once.
    """
    import ray
    import ray.data

    if __name__ != "__main__":  # imported (python -m / tests): ship this module's actors by value
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    need = max(s.workers * s.trainer_cpus + s.samplers + 3, max(s.memory_processes) + 1, 3, s.cores)
    # Keep the dashboard: Ray Train's placement-group cleaner asks the state API
    # (served by it) whether the controller lives, and without it tears the
    # workers down mid-run ("A worker health check failed").
    ray.init(address="local", num_cpus=need, log_to_driver=verbose,
             runtime_env={"env_vars": {"DGLBACKEND": "pytorch"}})
    ray.data.DataContext.get_current().enable_progress_bars = False


# --------------------------------------------------------------------------- figure 2: sampler overhead


class StampedSamplerActor:
    """``SamplerActor`` plus one column: when the actor started and finished each call, and its CPU time.

    A consumer's arrival times over a run of a few seconds mostly show how
    fast it drains rows buffered while it started (it lags the actors by
    seconds at first here); the actors' own timestamps give their steady
    rate, the time inside the call (sampling + packing) against the time
    between calls shows what Ray Data's per-call work and waiting cost, and
    the actor process's CPU time (all its threads, so Ray's too) is the cost
    that does not depend on how busy the machine is. Each row carries its
    call's stamps (start, finish, pid, CPU seconds at the finish, rows in the
    call): 40 bytes a row.
    """

    def __init__(self, graph, fanouts, plan):
        from gnnray.sampling import SamplerActor

        self._actor = SamplerActor(graph, fanouts, plan)

    def __call__(self, rows: dict):
        import pyarrow as pa

        start = time.time()
        out = self._actor(rows)
        stamp = [start, time.time(), os.getpid(), time.process_time(), out.num_rows] * out.num_rows
        return out.append_column("stamp", pa.FixedSizeListArray.from_arrays(pa.array(stamp, pa.float64()), 5))


def call_stats(stamps: np.ndarray, warmup: int, actors: int) -> dict:
    """Steady rates from per-row call stamps, leaving out the calls that hold the first ``warmup`` rows.

    Returns rows/s of all actors, ms per row inside calls, and CPU ms per row
    of the actor processes.
    """
    calls = np.unique(stamps, axis=0)  # one line per call: start, finish, pid, cpu, rows
    calls = calls[np.argsort(calls[:, 1])]
    first = int(np.searchsorted(np.cumsum(calls[:, 4]), warmup))  # the call that holds row ``warmup``
    if first >= len(calls) - 1:
        raise RuntimeError(f"only {len(calls)} calls; need more after the first {warmup} rows")
    steady = calls[first + 1:]
    rate = steady[:, 4].sum() / (calls[-1, 1] - calls[first, 1])
    in_call = 1000 * float(np.sum(steady[:, 1] - steady[:, 0]) / steady[:, 4].sum())
    cpu, rows = 0.0, 0
    for pid in np.unique(calls[:, 2]):
        mine = calls[calls[:, 2] == pid]
        mine = mine[np.argsort(mine[:, 3])]
        skip = max(1, min(int(np.searchsorted(np.cumsum(mine[:, 4]), warmup // actors)) + 1, len(mine) - 1))
        cpu += mine[-1, 3] - mine[skip - 1, 3]
        rows += int(mine[skip:, 4].sum())
    return dict(rate=rate, in_call_ms=in_call, cpu_ms=1000 * cpu / rows, calls=len(calls))


def plain_sampling(graph: Graph, fanouts: tuple, batches: list, warmup: int, barrier=None) -> dict:
    """Sample ``batches`` with ``Sampler`` in a plain loop on one thread; steady batches/s and CPU ms per batch.

    With ``barrier`` (a :class:`Barrier` actor), the timed part starts when
    every process has warmed up, so that they run at once.
    """
    from gnnray.sampling import Sampler

    with threads(1):
        sampler = Sampler(graph, fanouts)
        for seeds in batches[:warmup]:
            sampler.sample(seeds)
        if barrier is not None:
            import ray

            ray.get(barrier.arrive.remote())
            while not ray.get(barrier.ready.remote()):
                time.sleep(0.01)
        start, cpu = time.perf_counter(), time.process_time()
        for seeds in batches[warmup:]:
            sampler.sample(seeds)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    n = len(batches) - warmup
    return dict(batches_per_s=n / elapsed, cpu_ms=1000 * cpu / n)


class Barrier:
    """Lets processes that each ``arrive`` poll until all ``n`` have (a Ray actor)."""

    def __init__(self, n: int):
        self._n, self._arrived = n, 0

    def arrive(self) -> None:
        self._arrived += 1

    def ready(self) -> bool:
        return self._arrived >= self._n


def _plain_sampling_task(handle, fanouts: tuple, batches: list, warmup: int, barrier) -> dict:
    """:func:`plain_sampling` in a Ray worker over the node-shared graph."""
    return plain_sampling(handle.get(), fanouts, batches, warmup, barrier)


def bench_sampler_overhead(graph: Graph, handle, seed_ids: np.ndarray, s: Settings) -> list[Row]:
    """Figure 2: one sampler actor's batches/s in the pipeline vs the same sampling in a plain loop.

    Baseline: ``Sampler(graph, fanouts).sample(seeds)`` in this process with
    torch and DGL limited to one thread, over exactly the seed batches the
    pipeline gets (the first batches of the job's ``SeedPlan`` over
    ``seed_ids``, the full training split even with ``--quick``).

    Ours: ``seed_dataset(...).map_batches(SamplerActor, compute=ActorPoolStrategy(size=k), num_cpus=1)``,
    read as a train worker reads it (whole blocks, rows sliced out with
    ``from_arrow``, each unpacked with ``MiniBatch.unpack``). The rate is the
    actors' steady rate after the calls that hold the first
    ``sampler_warmup`` rows (so start-up is excluded), from the times the
    actors finished each call; it includes sampling, packing and Ray Data's
    work in the actor (batch conversion, the object store put). The consumer
    must keep up for that rate to be the pipeline's: its unpack time and how
    far it lags the actors at the end are recorded.

    The machine's speed drifts by 20-40% within minutes, so the rounds
    alternate: plain loop, pipeline, plain loop, pipeline, ..., and each
    pipeline is compared with the mean of the plain loops just before and
    after it; the table shows the median over the rounds. A second row
    compares CPU time per batch (the actor process's, all threads, against
    the plain loop's).

    In a Ray worker: the same comparison against the plain loop run as a Ray
    task over the node-shared graph, interleaved with the others: the actor
    samples in such a process too, so this baseline holds what the process
    itself costs (here 0-15% slower than the driver, varying), and the ratio
    what the pipeline adds.

    Scaling: 2 actors' total rate against 1 actor's, beside what the hardware
    allows: 2 plain loops in 2 processes at once against 1.
    """
    import ray
    import ray.data

    from gnnray.batch import MiniBatch, from_arrow
    from gnnray.seeds import SeedPlan, seed_dataset

    target = ">= 0.9x"
    batches, epochs = same_seed_batches(seed_ids, s, 2 * s.sampler_batches)

    def plain_loop() -> dict:
        r = plain_sampling(graph, s.fanouts, batches[:s.sampler_batches], s.sampler_warmup)
        print(f"[2] plain loop, 1 thread: {r['batches_per_s']:.1f} batches/s ({1000 / r['batches_per_s']:.0f} "
              f"ms/batch, {r['cpu_ms']:.0f} ms of CPU)", flush=True)
        return r

    def plain_processes(n: int) -> list[dict]:
        """``n`` plain loops at once, each in a Ray worker process over the node-shared graph."""
        task = ray.remote(num_cpus=1)(_plain_sampling_task)
        barrier = ray.remote(num_cpus=0)(Barrier).remote(n)
        loops = ray.get([task.remote(handle, s.fanouts, batches[:s.sampler_batches], s.sampler_warmup, barrier)
                         for _ in range(n)])
        total = sum(r["batches_per_s"] for r in loops)
        print(f"[2] {n} plain loop(s) in {n} Ray worker process(es) at once: {total:.1f} batches/s in total "
              f"({statistics.mean(r['cpu_ms'] for r in loops):.0f} ms of CPU/batch)", flush=True)
        return loops

    def pipeline(k: int) -> dict:
        rows = k * s.sampler_batches
        plan = SeedPlan.for_run(seed_ids, s.batch_size, 1, s.seed)
        seeds_ds = seed_dataset(plan, 0, epochs).limit(rows)
        ds = seeds_ds.map_batches(
            StampedSamplerActor, fn_constructor_kwargs=dict(graph=handle, fanouts=s.fanouts, plan=plan),
            batch_size=None, batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=k), num_cpus=1)
        start, stamps, arrived, unpack_s = time.time(), [], [], 0.0
        # Read as a train worker reads (gnnray.train_loop): whole blocks, rows sliced out.
        for block in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=1):
            stamps += block.column("stamp").to_pylist()
            for packed in from_arrow(block):
                t = time.perf_counter()
                mb = MiniBatch.unpack(from_readonly(packed))
                unpack_s += time.perf_counter() - t
                assert mb.num_seeds > 0
                arrived.append(time.time())
        stamps = np.array(stamps)
        calls = call_stats(stamps, k * s.sampler_warmup, k)
        rate, busy = calls["rate"], calls["in_call_ms"]
        rows_by_actor = np.unique(stamps[:, 2], return_counts=True)[1].tolist()
        m = dict(actors=k, batches=len(stamps), calls=calls["calls"], warmup=k * s.sampler_warmup,
                 total_batches_per_s=rate, per_actor_batches_per_s=rate / k, rows_by_actor=rows_by_actor,
                 in_call_ms=busy, between_calls_ms=1000 * k / rate - busy, cpu_ms=calls["cpu_ms"],
                 first_batch_done_s=float(stamps[:, 1].min() - start),
                 consumer_lag_end_s=arrived[-1] - float(stamps[:, 1].max()), unpack_ms=1000 * unpack_s / len(stamps))
        print(f"[2] pipeline k={k}: {rate:.1f} batches/s total, {rate / k:.1f} per actor (rows per actor: "
              f"{m['rows_by_actor']}); in the actor {busy:.1f} ms/batch sampling+packing, "
              f"{m['between_calls_ms']:.1f} ms between calls, {m['cpu_ms']:.0f} ms of CPU; first batch "
              f"{m['first_batch_done_s']:.1f} s after start; consumer {m['consumer_lag_end_s']:.2f} s behind at "
              f"the end; unpack {m['unpack_ms']:.2f} ms", flush=True)
        return m

    rows = []
    # The pipeline runs interleaved with two baselines: the plain loop here in
    # the driver, and the same loop in a Ray worker process (as the actor is).
    plain, in_worker, ones = [plain_loop()], [plain_processes(1)[0]], []
    try:
        for _ in range(s.sampler_rounds):
            ones.append(pipeline(1))
            plain.append(plain_loop())
            in_worker.append(plain_processes(1)[0])
    except Exception as exc:  # noqa: BLE001 - recorded in the table
        rows.append(error_row("sampler actor batches/s (k=1)", target, exc))

    rate, cpu = ("per_actor_batches_per_s", "batches_per_s", "b/s"), ("cpu_ms", "cpu_ms", "ms")
    for figure, plains, (ours_key, base_key, unit) in (("sampler actor batches/s (k=1)", plain, rate),
                                                       ("sampler CPU ms/batch (k=1)", plain, cpu),
                                                       ("sampler k=1 vs plain loop in a Ray worker", in_worker, rate)):
        if not ones:
            break
        got = []  # each pipeline against the mean of the plain loops just before and after it; > 1 is faster
        for i, m in enumerate(ones):
            base = statistics.mean(p[base_key] for p in plains[i:i + 2])
            got.append(m[ours_key] / base if unit == "b/s" else base / m[ours_key])
        ratio = statistics.median(got)
        rows.append(Row(figure, ours=f"{statistics.median(m[ours_key] for m in ones):.1f} {unit}",
                        baseline=f"{statistics.median(p[base_key] for p in plains):.1f} {unit}",
                        ratio=f"{ratio:.2f}x", target=target, met=verdict(ratio >= 0.9),
                        detail=dict(baselines=plains, pipelines=ones, ratios=got)))

    figure = "sampler batches/s, 2 actors vs 1"
    try:
        two = pipeline(2)
        hw = (sum(r["batches_per_s"] for r in plain_processes(2))
              / statistics.median(r["batches_per_s"] for r in in_worker))
        one = statistics.median(m["total_batches_per_s"] for m in ones)
        scaling = two["total_batches_per_s"] / one
        rows.append(Row(figure, ours=f"{scaling:.2f}x ({two['total_batches_per_s']:.1f} b/s)",
                        baseline=f"{hw:.2f}x (plain loops)", ratio=f"{scaling / hw:.2f}x",
                        target=">= 0.9x of plain scaling", met=verdict(scaling >= 0.9 * hw),
                        detail=dict(pipeline=two, plain_scaling=hw, one_actor_batches_per_s=one)))
    except Exception as exc:  # noqa: BLE001
        rows.append(error_row(figure, ">= 0.9x of plain scaling", exc))
    return rows


# --------------------------------------------------------------------------- figures 1 and 3: the job


def recording_model(path: str, in_feats: int, num_classes: int, cfg):
    """The job's default GraphSAGE; first writes the train worker's thread settings to ``path``."""
    import dgl.utils
    import torch

    from gnnray.train_loop import default_model

    with open(path, "w") as f:
        json.dump(dict(torch_threads=torch.get_num_threads(), dgl_threads=dgl.utils.get_num_threads(),
                       omp_num_threads=os.environ.get("OMP_NUM_THREADS")), f)
    return default_model(in_feats, num_classes, cfg)


def run_job(data: DataConfig, s: Settings, workdir: Path) -> tuple[list[dict], dict]:
    """Train with ``gnnray.job.run``; return every epoch's metrics (``metrics.jsonl``) and the worker's threads."""
    import functools

    import torch

    from gnnray import job
    from gnnray.config import JobConfig

    d = JobConfig()
    # Final accuracies are not measured here: skip the layer-wise inference pass after training.
    final_eval = {"eval": "sampled"} if "eval" in {f.name for f in dataclasses.fields(d.train)} else {}
    cfg = dataclasses.replace(
        d,
        data=data,
        sampler=dataclasses.replace(d.sampler, fanouts=tuple(s.fanouts), batch_size=s.batch_size,
                                    actors_min=s.samplers, actors_max=s.samplers, cpus_per_actor=1.0),
        model=dataclasses.replace(d.model, hidden=s.hidden, dropout=s.dropout),
        train=dataclasses.replace(d.train, epochs=s.epochs, lr=s.lr, num_workers=s.workers,
                                  cpus_per_worker=float(s.trainer_cpus), use_gpu=torch.cuda.is_available(),
                                  seed=s.seed, **final_eval),
        run=dataclasses.replace(d.run, name="bench", storage_path=str(workdir / "runs"), max_failures=0),
    )
    threads_file = workdir / "worker-threads.json"
    job.run(cfg, model_factory=functools.partial(recording_model, str(threads_file)))
    with open(workdir / "runs" / "bench" / job.METRICS_LOG) as f:
        epochs = [json.loads(line) for line in f if line.strip()]
    return epochs, json.loads(threads_file.read_text()) if threads_file.exists() else {}


def dgl_baseline(graph: Graph, s: Settings) -> dict:
    """The DGL tutorials' single-process loop at the same model, fanouts, batch size and cores.

    ``DataLoader(g, train_ids, NeighborSampler(fanouts), batch_size, shuffle=True)``
    samples in the training process (``num_workers=0``) with all cores'
    threads; features are gathered with ``feat[input_nodes]``. Seeds/s are
    counted after ``baseline_warmup`` steps, over ``baseline_steps`` steps
    (more than one epoch if the split is small). Run before and after the
    job and averaged, since the machine's load drifts.
    """
    import dgl
    import torch
    import torch.nn.functional as F

    from gnnray.model import build_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with threads(s.cores):
        g = dgl.graph(("csc", (torch.from_numpy(graph.indptr), torch.from_numpy(graph.indices),
                               torch.empty(0, dtype=torch.int64))), num_nodes=graph.num_nodes)
        feat, label = torch.from_numpy(graph.feat), torch.from_numpy(graph.label)
        torch.manual_seed(s.seed)
        model = build_model(graph.feat_dim, graph.num_classes, len(s.fanouts), s.hidden, s.dropout).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=s.lr)
        loader = dgl.dataloading.DataLoader(g, torch.from_numpy(graph.train_idx),
                                            dgl.dataloading.NeighborSampler(list(s.fanouts)),
                                            batch_size=s.batch_size, shuffle=True, drop_last=False)
        model.train()
        step, seeds, start, cpu = 0, 0, time.perf_counter(), time.process_time()
        while step < s.baseline_warmup + s.baseline_steps:
            for input_nodes, output_nodes, blocks in loader:
                x, y = feat[input_nodes].to(device), label[output_nodes].to(device)
                blocks = [b.to(device) for b in blocks]
                loss = F.cross_entropy(model(blocks, x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                if step == s.baseline_warmup:
                    start, seeds, cpu = time.perf_counter(), 0, time.process_time()
                elif step > s.baseline_warmup:
                    seeds += int(output_nodes.shape[0])
                if step == s.baseline_warmup + s.baseline_steps:
                    break
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    # cpu_share < 1: the machine's other load took cores from the loop (a multi-process job gets more of
    # a contended machine than one process does, which favours ours: compare on an idle machine).
    return dict(seeds_per_s=seeds / elapsed, steps=s.baseline_steps, warmup=s.baseline_warmup,
                step_s=elapsed / s.baseline_steps, threads=s.cores, device=str(device),
                cpu_share=cpu / elapsed / s.cores)


def bench_training(data: DataConfig, graph: Graph, s: Settings, workdir: Path) -> list[Row]:
    """Figures 1 and 3 from one training run of the job, between two runs of the DGL loop (averaged)."""
    wait_fig, tput_fig = "data-wait fraction (steady epochs)", "training throughput seeds/s"
    wait_target, tput_target = "< 5%", ">= 1.0x"
    rows, baselines = [], []
    try:
        baselines.append(dgl_baseline(graph, s))
        print(f"[3] DGL DataLoader loop: {baselines[0]['seeds_per_s']:.0f} seeds/s (it got "
              f"{100 * baselines[0]['cpu_share']:.0f}% of {s.cores} cores)", flush=True)
    except Exception as exc:  # noqa: BLE001 - tried again after the job
        baselines.append(exc)
    try:
        epochs, worker_threads = run_job(data, s, workdir)
        steady = [m for m in epochs if m["epoch"] >= 1] or epochs
        wait = statistics.median(m["data_wait"] for m in steady)
        ours = statistics.median(m["seeds_per_s"] for m in steady)
        info = dict(epochs=epochs, steady_epochs=[m["epoch"] for m in steady], workers=s.workers,
                    cpus_per_worker=s.trainer_cpus, sampler_actors=s.samplers, worker_threads=worker_threads)
        rows.append(Row(wait_fig, ours=f"{100 * wait:.1f}%", baseline="-", ratio="-", target=wait_target,
                        met=verdict(wait < 0.05), detail=dict(data_wait=wait, **info)))
    except Exception as exc:  # noqa: BLE001 - recorded in the table
        return [error_row(wait_fig, wait_target, exc), error_row(tput_fig, tput_target, exc)]
    try:
        baselines.append(dgl_baseline(graph, s))
        print(f"[3] DGL DataLoader loop again: {baselines[-1]['seeds_per_s']:.0f} seeds/s (it got "
              f"{100 * baselines[-1]['cpu_share']:.0f}% of {s.cores} cores)", flush=True)
        good = [b for b in baselines if not isinstance(b, Exception)]
        base = statistics.mean(b["seeds_per_s"] for b in good)
        ratio = ours / base
        rows.append(Row(tput_fig, ours=f"{ours:.0f}", baseline=f"{base:.0f}", ratio=f"{ratio:.2f}x",
                        target=tput_target, met=verdict(ratio >= 1.0),
                        detail=dict(ours_seeds_per_s=ours, baseline_seeds_per_s=base, baselines=good, **info)))
    except Exception as exc:  # noqa: BLE001
        rows.append(error_row(tput_fig, tput_target, exc))
    return rows


# --------------------------------------------------------------------------- figure 4: memory


class MemoryProbe:
    """A process that uses the graph as a sampler actor or train worker does (a Ray actor).

    Its imports and DGL's kernels are loaded in ``__init__`` (on a tiny graph),
    so the difference between :meth:`usage` before and after :meth:`hold` is
    what holding and using the big graph costs.
    """

    def __init__(self):
        from gnnray.graph_store import csc_from_edges
        from gnnray.sampling import Sampler

        rng = np.random.default_rng(0)
        indptr, indices = csc_from_edges(rng.integers(0, 50, 400), rng.integers(0, 50, 400), 50)
        ids = np.arange(50)
        tiny = Graph(indptr, indices, np.zeros((50, 4), np.float32), np.zeros(50, np.int64), ids, ids, ids, 2)
        Sampler(tiny, (3, 3)).sample(ids[:8])
        self._held = None

    def usage(self) -> tuple[int, int]:
        """(USS, PSS) in bytes, after handing freed heap back to the OS."""
        import psutil

        gc.collect()
        malloc_trim()
        info = psutil.Process().memory_full_info()
        return int(info.uss), int(info.pss)

    def hold(self, handle, copy: bool, fanouts: tuple, batch_size: int, batches: int, seed: int) -> float:
        """Attach the graph (shared views, or private copies), sample and gather features.

        Keeps the graph and the sampler (the DGL graph), as a sampler actor or
        train worker does for its whole life; frees the last batch and its
        feature buffer, whose size (MiB, returned) is the same however the
        graph is held.
        """
        from gnnray.sampling import Sampler

        graph = handle.get()
        if copy:
            graph = dataclasses.replace(graph, **{f.name: np.array(getattr(graph, f.name))
                                                  for f in dataclasses.fields(graph)
                                                  if isinstance(getattr(graph, f.name), np.ndarray)})
        sampler = Sampler(graph, fanouts)
        rng = np.random.default_rng(seed)
        buf = np.empty((0, graph.feat_dim), np.float32)
        for _ in range(batches):
            mb = sampler.sample(rng.choice(graph.train_idx, min(batch_size, len(graph.train_idx)), replace=False))
            rows = mb.input_nodes.shape[0]
            if buf.shape[0] < rows:
                buf = np.empty((int(rows * 1.25), graph.feat_dim), np.float32)
            np.take(graph.feat, mb.input_nodes.numpy(), axis=0, out=buf[:rows])
        self._held = (graph, sampler)
        return rows * graph.feat_dim * 4 / 2**20

    def drop(self) -> None:
        self._held = None


def bench_memory(graph: Graph, handle, s: Settings) -> list[Row]:
    """Figure 4: private memory per added process, shared graph vs a copy per process.

    Four probe actors start (imports done); for each variant their idle
    USS/PSS is read, then 1, 2 and 4 of them :meth:`MemoryProbe.hold` the graph
    and the growth of the summed USS (PSS) of the holding processes is read.
    Per-process growth = growth at the most processes / their number (every
    process counted as added), in MiB and as % of one copy of the graph. The
    object store's one copy is not in any process's USS (it is shared memory);
    PSS shows its share. Per-batch memory (the blocks and the gathered
    features, ~40 MiB for one batch here, the same in both variants and in
    the DGL loop) is freed before measuring: this figure is about copies of
    the graph.
    """
    import ray

    figure, target = "memory per added process (USS)", "< 5% of graph"
    try:
        probe_cls = ray.remote(num_cpus=1)(MemoryProbe)
        probes = [probe_cls.remote() for _ in range(max(s.memory_processes))]
        try:
            results = {}
            for variant, copy in (("shared", False), ("copy", True)):
                idle = ray.get([p.usage.remote() for p in probes])
                points, held, buffers = [], 0, []
                for n in s.memory_processes:
                    buffers += ray.get([
                        p.hold.remote(handle, copy, s.fanouts, s.batch_size, s.memory_batches, s.seed + i)
                        for i, p in enumerate(probes[held:n], start=held)])
                    held = n
                    now = ray.get([p.usage.remote() for p in probes[:n]])
                    uss = sum(a[0] - b[0] for a, b in zip(now, idle)) / 2**20
                    pss = sum(a[1] - b[1] for a, b in zip(now, idle)) / 2**20
                    points.append(dict(processes=n, uss_growth_mib=uss, pss_growth_mib=pss))
                    print(f"[4] {variant}: {n} processes: USS +{uss:.0f} MiB, PSS +{pss:.0f} MiB", flush=True)
                ray.get([p.drop.remote() for p in probes])
                last = points[-1]
                results[variant] = dict(points=points, per_process_mib=last["uss_growth_mib"] / last["processes"],
                                        batch_feature_buffer_mib=float(np.mean(buffers)))
        finally:
            for p in probes:
                ray.kill(p)
        graph_mib = graph.nbytes / 2**20
        ours, base = results["shared"]["per_process_mib"], results["copy"]["per_process_mib"]
        pct = 100 * ours / graph_mib
        return [Row(figure, ours=f"{ours:.1f} MiB ({pct:.1f}%)",
                    baseline=f"{base:.1f} MiB ({100 * base / graph_mib:.0f}%)",
                    ratio=f"{ours / base:.2f}x" if base > 0 else "-", target=target, met=verdict(pct < 5),
                    detail=dict(graph_mib=graph_mib, batches_sampled=s.memory_batches, **results))]
    except Exception as exc:  # noqa: BLE001 - recorded in the table
        return [error_row(figure, target, exc)]


# --------------------------------------------------------------------------- figure 5: GPU prefetch


def prefetch_overlap(device: str, batches: int = 20, input_nodes: int = 100_000, feat_dim: int = 128) -> dict:
    """Per-batch times of the host side (gather + copy), of compute, and of both with and without the Prefetcher.

    Synthetic packed mini-batches (100k input nodes, 128 features: ~50 MiB to
    copy) and a compute step (matmuls on the batch's features) sized to take
    about as long as the copy, so full overlap would halve the serial time.
    """
    import torch

    from gnnray.batch import Layer, MiniBatch
    from gnnray.prefetch import Prefetcher

    dev = torch.device(device)
    rng = np.random.default_rng(0)
    num_nodes = 2 * input_nodes
    feat = rng.standard_normal((num_nodes, feat_dim), dtype=np.float32)
    packed = []
    for _ in range(batches):
        nodes = torch.from_numpy(rng.integers(0, num_nodes, input_nodes))
        seeds = nodes[:1024]
        layer = Layer(torch.arange(0, 10 * 1025, 10), torch.from_numpy(rng.integers(0, input_nodes, 10 * 1024)),
                      input_nodes)
        packed.append(MiniBatch(seeds, torch.zeros(1024, dtype=torch.int64), nodes, [layer]).pack())
    w = torch.randn(feat_dim, feat_dim, device=dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def compute(mb, reps):
        h = mb.x
        for _ in range(reps):
            h = torch.tanh(h @ w)
        return h

    def per_batch(fn) -> float:
        sync()
        t = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - t) / batches

    def host_only():
        with Prefetcher(packed, feat, dev, depth=2) as it:
            for _ in it:
                sync()

    copy_s = per_batch(host_only)
    with Prefetcher(packed[:1], feat, dev, depth=1) as it:
        resident = next(it)
        resident = dataclasses.replace(resident, x=resident.x.clone())
    one = per_batch(lambda: [compute(resident, 1) for _ in range(batches)])
    reps = max(1, round(copy_s / max(one, 1e-6)))
    compute_s = per_batch(lambda: [compute(resident, reps) for _ in range(batches)])

    def serial():
        buf = np.empty((input_nodes, feat_dim), np.float32)
        for p in packed:
            mb = MiniBatch.unpack(torch.from_numpy(p.copy()))
            np.take(feat, mb.input_nodes.numpy(), axis=0, out=buf)
            mb.x = torch.from_numpy(buf)
            compute(mb.to(dev), reps)
            sync()

    def overlapped():
        with Prefetcher(packed, feat, dev, depth=2) as it:
            for mb in it:
                compute(mb, reps)

    return dict(device=str(dev), copy_s=copy_s, compute_s=compute_s, reps=reps, serial_s=per_batch(serial),
                prefetch_s=per_batch(overlapped))


def bench_gpu(s: Settings) -> list[Row]:
    """Figure 5: the Prefetcher's copy/compute overlap on a GPU; n/a without one."""
    import torch

    figure, target = "GPU prefetch s/batch (overlap)", "<= 1.1 x max(copy, compute)"
    if not torch.cuda.is_available():
        return [Row(figure, ours="n/a (no GPU)", baseline="n/a", ratio="-", target=target, met="n/a")]
    try:
        r = prefetch_overlap("cuda", batches=10 if s.quick else 30)
        bound = max(r["copy_s"], r["compute_s"])
        return [Row(figure, ours=f"{1000 * r['prefetch_s']:.1f} ms", baseline=f"{1000 * r['serial_s']:.1f} ms serial",
                    ratio=f"{r['serial_s'] / r['prefetch_s']:.2f}x faster", target=target,
                    met=verdict(r["prefetch_s"] <= 1.1 * bound), detail=r)]
    except Exception as exc:  # noqa: BLE001
        return [error_row(figure, target, exc)]


# --------------------------------------------------------------------------- table and main


COLUMNS = ("figure", "ours", "baseline", "ratio", "target", "met")


def format_table(rows: list[Row]) -> str:
    cells = [COLUMNS] + [tuple(getattr(r, c) for c in COLUMNS) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["| " + " | ".join(v.ljust(w) for v, w in zip(c, widths)) + " |" for c in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def machine() -> dict:
    import dgl
    import psutil
    import ray
    import torch

    return dict(cpus=os.cpu_count(), memory_gib=round(psutil.virtual_memory().total / 2**30, 1),
                gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                load_avg=os.getloadavg(), python=platform.python_version(), torch=torch.__version__,
                dgl=dgl.__version__, ray=ray.__version__)


def settings_for(args) -> Settings:
    cores = args.cores or os.cpu_count() or 1
    s = Settings(quick=args.quick, cores=cores, workers=args.workers)
    if args.quick:
        s = dataclasses.replace(s, sampler_batches=160, sampler_warmup=16, sampler_rounds=2, epochs=3, baseline_warmup=2,
                                baseline_steps=18, memory_batches=2)
    return s


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer batches and epochs, short epochs (~2 minutes)")
    p.add_argument("--json", default=str(DEFAULT_JSON), help="where to write all results")
    p.add_argument("--dataset", default=None,
                   help=f"graph directory, or 'synthetic' (when not given: {DEFAULT_DATASET} if present, else "
                   "synthetic)")
    p.add_argument("--cores", type=int, default=None,
                   help="cores both sides of figure 3 use: the DGL loop's threads, the train workers' CPUs (when "
                   "not given: all)")
    p.add_argument("--workers", type=int, default=1, help="Ray Train workers for figures 1 and 3")
    p.add_argument("--verbose", action="store_true", help="show the logs of Ray's workers")
    return p.parse_args(argv)


def guarded(figure: str, fn: Callable[[], list]) -> list[Row]:
    """Run one stage; its rows get the stage's wall time and the machine's load around it (noise)."""
    load, start = os.getloadavg()[0], time.perf_counter()
    try:
        rows = fn()
    except Exception as exc:  # noqa: BLE001 - a failing stage must not hide the others
        rows = [error_row(figure, "", exc)]
    for r in rows:
        r.detail.update(stage_s=time.perf_counter() - start, load_avg_1min=(load, os.getloadavg()[0]))
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    s = settings_for(args)
    started = time.perf_counter()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    workdir = Path(tempfile.mkdtemp(prefix="gnnray-bench-"))
    rows: list[Row] = []
    result = dict(date=date, mode="quick" if s.quick else "full", machine=machine(), settings=dataclasses.asdict(s))
    try:
        import ray

        from gnnray.datasets import load_graph
        from gnnray.graph_store import publish

        data = base_data_config(args.dataset)
        graph = load_graph(data)
        full_train_idx = graph.train_idx
        if s.quick:
            data = quick_data_config(graph, s, workdir, data)
            graph = load_graph(data)
        result["data"] = dict(config=dataclasses.asdict(data), nodes=graph.num_nodes, edges=graph.num_edges,
                              train=len(graph.train_idx), graph_mib=graph.nbytes / 2**20)
        print(f"graph {graph.name}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges, "
              f"{len(graph.train_idx):,} training nodes, {graph.nbytes / 2**20:.0f} MiB; "
              f"{s.cores} cores, {'quick' if s.quick else 'full'} mode", flush=True)
        start_ray(s, args.verbose)
        try:
            handle = publish(graph)
            rows += guarded("sampler actor batches/s",
                            lambda: bench_sampler_overhead(graph, handle, full_train_idx, s))
            rows += guarded("training", lambda: bench_training(data, graph, s, workdir))
            rows += guarded("memory per added process", lambda: bench_memory(graph, handle, s))
            rows += guarded("GPU prefetch", lambda: bench_gpu(s))
        finally:
            ray.shutdown()
    except Exception as exc:  # noqa: BLE001 - still print and save what we have
        rows.append(error_row("setup", "", exc))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    order = ["data-wait", "sampler", "training", "memory", "GPU", "setup", ""]  # the order; sort is stable
    rows.sort(key=lambda r: next(i for i, key in enumerate(order) if r.figure.startswith(key)))
    wall = time.perf_counter() - started
    result.update(rows=[dataclasses.asdict(r) for r in rows], wall_s=wall, load_avg_end=os.getloadavg())
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"\n{result['mode']} mode, {date}, {s.cores} cores, load average {os.getloadavg()[0]:.1f}, "
          f"{wall:.0f} s; all numbers in {out}\n")
    print(format_table(rows), flush=True)
    return 1 if any(r.met == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
