"""Figures 1 and 3 and the fast trainer: data wait and throughput of the real job, against the DGL loops.

Every job run is ``gnnray.driver.fit.run`` with ``--max-ahead`` bounding the
sampler pool (:func:`bench.common.job_config`), so its steady epochs sample
beside the trainer. Its numbers are what the job itself reports per epoch
(``metrics.jsonl``): the medians over the steady epochs (:func:`steady`:
neither the first, with the start-up, nor the last, with little sampling
left beside it), every epoch in the JSON.

- Figure 1: ``data_wait``, the share of a train worker's step time spent
  waiting for its next mini-batch.
- Figure 3: ``seeds_per_s`` against the DGL loops of :mod:`bench.dgl_loop`
  with ``DataLoader(num_workers=0)`` (sampling in the training process) and
  ``num_workers=1`` (DGL's own sampling process), each run before and after
  the jobs and averaged, since the machine's load drifts. Also the job with
  ``ddp_workers`` DDP workers (the cores split between them) against the
  1-worker job and against both loops.
- The fast trainer (a GPU worker's regime): GraphSAGE 2 x 32 with fanouts
  15,10, meant to take about as long per step as sampling one batch, so that
  data wait and the sampler pool decide throughput: the job with 2 sampler
  actors against 1, and (whether the regime was reached) its step time
  against sampling one batch on one thread. It trains on the full training
  split in both modes (``--quick`` runs fewer epochs): its epochs are short
  anyway, and many times ``--max-ahead`` steps long, so that the batches
  sampled ahead during validation do not hide the sampler's rate.

Ratios are ours / baseline: for seeds/s above 1 is faster, for data wait
below 1 is less waiting.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics
from pathlib import Path

from bench.common import Result, Row, Settings, attempt, compare, error_row, job_config, verdict
from bench.dgl_loop import dgl_baseline
from gnnray.config import DataConfig, JobConfig
from gnnray.data.graph import Graph

WAIT_FIGURE, WAIT_TARGET = "data-wait fraction (steady epochs)", "< 5%"
THROUGHPUT_FIGURE, THROUGHPUT_TARGET = "training throughput seeds/s vs DGL num_workers=0", ">= 1.0x"
LOADER_WORKERS = (0, 1)  # the DGL loops' DataLoader(num_workers=...)


def recording_model(path: str, in_feats: int, num_classes: int, cfg: JobConfig):
    """The job's default model; first writes the train worker's thread settings to ``path``."""
    import dgl.utils
    import torch

    from gnnray.train.model import model_for

    with open(path, "w") as f:
        json.dump(dict(torch_threads=torch.get_num_threads(), dgl_threads=dgl.utils.get_num_threads(),
                       omp_num_threads=os.environ.get("OMP_NUM_THREADS")), f)
    return model_for(in_feats, num_classes, cfg)


def steady(epochs: list[dict], seeds_per_step: int) -> dict:
    """Medians of the steady epochs: all but the first and the last; ``step_ms`` is a step's time, waits included.

    The first includes the start of the workers and sampler actors. In the
    last, the sampler pool has only the rows it had not yet sampled left (the
    stream ends there), so up to ``--max-ahead`` steps per worker train with
    no sampling beside them: in short epochs most of the epoch.
    """
    runs = [m for m in epochs if 1 <= m["epoch"] < epochs[-1]["epoch"]]
    if not runs:
        raise ValueError(f"{len(epochs)} epochs: need 3 or more for a steady one")
    steps = [math.ceil(round(m["seeds_per_s"] * m["epoch_time"]) / seeds_per_step) for m in runs]
    return dict(data_wait=statistics.median(m["data_wait"] for m in runs),
                seeds_per_s=statistics.median(m["seeds_per_s"] for m in runs),
                step_ms=statistics.median(1000 * m["epoch_time"] / n for m, n in zip(runs, steps)),
                steady_epochs=[m["epoch"] for m in runs], epochs=epochs)


def measure_job(data: DataConfig, s: Settings, workdir: Path, name: str, label: str) -> dict:
    """Train with ``gnnray.driver.fit.run`` as ``s`` says; the steady medians, every epoch and the worker's threads."""
    from gnnray.driver import fit
    from gnnray.storage import METRICS_LOG

    cfg = job_config(data, s, workdir, name)
    run_dir = Path(cfg.run.storage_path) / cfg.run.name
    threads_file = run_dir.parent / f"{name}-threads.json"
    fit.run(cfg, model_factory=functools.partial(recording_model, str(threads_file)))
    with open(run_dir / METRICS_LOG) as f:
        result = steady([json.loads(line) for line in f if line.strip()], s.batch_size * s.workers)
    result.update(workers=s.workers, cpus_per_worker=s.trainer_cpus, sampler_actors=s.samplers,
                  max_ahead=s.max_ahead, fanouts=list(s.fanouts), hidden=s.hidden,
                  worker_threads=json.loads(threads_file.read_text()) if threads_file.exists() else {})
    print(f"[3] {label}: {result['seeds_per_s']:.0f} seeds/s, data wait {100 * result['data_wait']:.1f}% "
          f"(median of epochs {result['steady_epochs']})", flush=True)
    return result


def wait_row(job: Result) -> Row:
    if isinstance(job, Exception):
        return error_row(WAIT_FIGURE, WAIT_TARGET, job)
    return Row(WAIT_FIGURE, ours=f"{job['data_wait']:.1%}", baseline="-", ratio="-", target=WAIT_TARGET,
               met=verdict(job["data_wait"] < 0.05), detail=job)


def mean_baseline(runs: list[Result]) -> Result:
    good = [b for b in runs if not isinstance(b, Exception)]
    if not good:
        return runs[-1]
    return dict(seeds_per_s=statistics.mean(b["seeds_per_s"] for b in good), runs=good)


def bench_training(data: DataConfig, graph: Graph, s: Settings, workdir: Path) -> list[Row]:
    """Figures 1 and 3: the 1-worker and the DDP job, between two rounds of both DGL loops."""
    cfg = job_config(data, s, workdir)
    loops = {w: [] for w in LOADER_WORKERS}

    def dgl_round(when: str) -> None:
        for w in LOADER_WORKERS:
            def one(w=w) -> dict:
                b = dgl_baseline(graph, cfg, s.cores, w, s.baseline_warmup, s.baseline_steps)
                print(f"[3] DGL loop, DataLoader(num_workers={w}){when}: {b['seeds_per_s']:.0f} seeds/s (the "
                      f"training process got {100 * b['cpu_share']:.0f}% of {s.cores} cores)", flush=True)
                return b
            loops[w].append(attempt(one))

    dgl_round("")
    job = attempt(lambda: measure_job(data, s, workdir, "bench", f"job, {s.workers} worker(s)"))
    ddp_s = dataclasses.replace(s, workers=s.ddp_workers)
    ddp = attempt(lambda: measure_job(data, ddp_s, workdir, "bench-ddp",
                                      f"job, {s.ddp_workers} DDP workers x {ddp_s.trainer_cpus} CPU(s)"))
    dgl_round(" again")
    dgl = {w: mean_baseline(runs) for w, runs in loops.items()}
    at_least_1 = lambda ratio: ratio >= 1.0  # noqa: E731
    ddp_name = f"training seeds/s, {s.ddp_workers} DDP workers"
    rows = [wait_row(job),
            compare(THROUGHPUT_FIGURE, THROUGHPUT_TARGET, job, dgl[0], "seeds_per_s", at_least_1),
            compare("training throughput seeds/s vs DGL num_workers=1", THROUGHPUT_TARGET, job, dgl[1],
                    "seeds_per_s", at_least_1),
            compare(f"{ddp_name} vs {s.workers} worker(s)", "", ddp, job, "seeds_per_s"),
            compare(f"{ddp_name} vs DGL num_workers=0", "", ddp, dgl[0], "seeds_per_s"),
            compare(f"{ddp_name} vs DGL num_workers=1", "", ddp, dgl[1], "seeds_per_s")]
    rates = {w: b["seeds_per_s"] for w, b in dgl.items() if not isinstance(b, Exception)}
    rows[1].detail["dgl_seeds_per_s"] = rates  # which loop the wall-time rows take (the faster)
    return rows


def bench_fast_trainer(data: DataConfig, graph: Graph, s: Settings, workdir: Path) -> list[Row]:
    """The fast trainer's data wait and seeds/s with 2 sampler actors against 1, and its step against sampling.

    The last row checks the regime: the 1-actor run's step time (data wait
    included) against the plain loop's time to sample one batch on one thread
    (``graph`` has the job's structure; its first training seeds, as in
    figure 2).
    """
    fast = dataclasses.replace(s, fanouts=tuple(s.fast_fanouts), hidden=s.fast_hidden, epochs=s.fast_epochs)
    runs = {k: attempt(lambda k=k: measure_job(data, dataclasses.replace(fast, samplers=k), workdir,
                                               f"bench-fast-{k}", f"fast trainer, {k} sampler actor(s)"))
            for k in (1, 2)}
    sampling = attempt(lambda: sampling_ms(graph, fast))
    step = runs[1] if isinstance(runs[1], Exception) else dict(ms=runs[1]["step_ms"])
    name = f"fast trainer (2x{s.fast_hidden}; {','.join(map(str, s.fast_fanouts))})"
    return [compare(f"data-wait, {name}: 2 actors vs 1", "", runs[2], runs[1], "data_wait", show="{:.1%}"),
            compare(f"training seeds/s, {name}: 2 actors vs 1", "", runs[2], runs[1], "seeds_per_s"),
            compare(f"training step ms, {name}, 1 actor, vs sampling 1 batch", "", step, sampling, "ms",
                    show="{:.0f} ms")]


def sampling_ms(graph: Graph, s: Settings, batches: int = 40, warmup: int = 8) -> dict:
    """Milliseconds to sample one of the job's batches in a plain loop on one thread (figure 2's baseline)."""
    from bench.sampler_runs import plain_sampling, same_seed_batches

    r = plain_sampling(graph, s.fanouts, same_seed_batches(graph.train_idx, s, batches)[0], warmup)
    print(f"[3] fast trainer's sampling, plain loop, 1 thread: {1000 / r['batches_per_s']:.1f} ms/batch", flush=True)
    return dict(ms=1000 / r["batches_per_s"], **r)
