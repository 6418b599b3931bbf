"""The ``fast`` stage: the fast trainer (GraphSAGE 2 x 32, fanouts 15,10, a GPU worker's regime on the CPU).

The job (``fit.run``, the job's read-ahead bound) with 2 sampler actors against 1: data wait and seeds/s, the
medians of the steady epochs of its ``metrics.jsonl``; and its step against sampling one batch on one thread
(whether the regime was reached). It trains on the full training split, ``--quick`` or not.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics
from pathlib import Path

from bench.harness import Row, attempt, compare, dgl_or_none
from bench.settings import Settings, epochs_of, job_config
from gnnray.config import DataConfig, JobConfig
from gnnray.data.graph import Graph


def recording_model(path: str, in_feats: int, num_classes: int, cfg: JobConfig):
    """The job's default model; first writes the train worker's thread settings to ``path``."""
    import torch

    from gnnray.models.model import model_for

    dgl = dgl_or_none()  # only in the dgl extra's environment
    with open(path, "w") as f:
        json.dump(dict(torch_threads=torch.get_num_threads(), dgl_threads=dgl.utils.get_num_threads() if dgl else None,
                       omp_num_threads=os.environ.get("OMP_NUM_THREADS")), f)
    return model_for(in_feats, num_classes, cfg)


def steady(epochs: list[dict], seeds_per_step: int) -> dict:
    """Medians of the steady epochs, all but the first (start-up) and the last (the stream ends in it: steps
    without sampling beside them); ``step_ms`` is a step's time, waits included."""
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

    cfg = job_config(data, s, workdir, name)
    threads_file = Path(cfg.run.storage_path) / f"{name}-threads.json"
    fit.run(cfg, model_factory=functools.partial(recording_model, str(threads_file)))
    result = steady(epochs_of(cfg), s.batch_size * s.workers)
    result.update(workers=s.workers, cpus_per_worker=s.trainer_cpus, sampler_actors=s.samplers,
                  max_ahead=s.max_ahead, fanouts=list(s.fanouts), hidden=s.hidden,
                  worker_threads=json.loads(threads_file.read_text()) if threads_file.exists() else {})
    print(f"[fast] {label}: {result['seeds_per_s']:.0f} seeds/s, data wait {100 * result['data_wait']:.1f}% "
          f"(median of epochs {result['steady_epochs']})", flush=True)
    return result


def bench_fast_trainer(data: DataConfig, graph: Graph, s: Settings, workdir: Path) -> list[Row]:
    """Data wait and seeds/s with 2 sampler actors against 1; the 1-actor step against sampling one batch."""
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
    from bench.actors import plain_sampling, same_seed_batches

    r = plain_sampling(graph, s.fanouts, same_seed_batches(graph.train_idx, s, batches)[0], warmup)
    print(f"[fast] sampling, plain loop, 1 thread: {1000 / r['batches_per_s']:.1f} ms/batch", flush=True)
    return dict(ms=1000 / r["batches_per_s"], **r)
