"""``fit.run`` with K = 3 against K = 1: training seeds/s and the job's CPU-seconds per steady epoch."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from pathlib import Path

from bench.harness import Row, interleaved, side_by_side
from bench.settings import Settings, epochs_of, job_config, metrics_log
from bench.sharding.cluster import FIGURE, MIB, ShardSettings


def pairs(ss: ShardSettings, data, workdir: Path, epochs: int, rounds: int, prefix: str, one) -> dict:
    """``one(cfg)`` of ``fit.run``'s job with K = 1 and K = max(shards), interleaved in ``rounds`` (the harness's
    rounds: the order reversed every other one); results by K."""
    k = max(ss.shards)
    s = Settings(quick=ss.quick, cores=2, fanouts=ss.fanouts, batch_size=ss.batch_size, hidden=ss.hidden,
                 epochs=epochs, seed=ss.seed)

    def run(shards: int):
        return lambda i: one(job_config(dataclasses.replace(data, feature_shards=shards, feature_cache=ss.cache), s,
                                        workdir, f"{prefix}-{shards}-{i}"))
    return interleaved({1: run(1), k: run(k)}, rounds)


def bench_cluster_training(ss: ShardSettings, data, workdir: Path, out: dict) -> list[Row]:
    """Training seeds/s in the last epoch, K = max(shards) against K = 1."""
    from gnnray.driver.fit import run

    def one(cfg) -> dict:
        start = time.perf_counter()
        summary = run(cfg)
        r = dict(name=cfg.run.name, wall_s=time.perf_counter() - start, last=summary.metrics, epochs=epochs_of(cfg))
        print(f"  fit.run {cfg.run.name}: {summary.metrics['seeds_per_s']:.0f} seeds/s in the last epoch, "
              f"{r['wall_s']:.0f} s", flush=True)
        return r

    k, runs = max(ss.shards), pairs(ss, data, workdir, ss.epochs, ss.train_pairs, "shards", one)
    out["training"] = dict(runs=runs, config=dict(epochs=ss.epochs, hidden=ss.hidden, train=ss.train_batches
                                                  * ss.batch_size, workers=1, cpus_per_worker=2, sampler_actors=1))
    last = runs[k][-1]["last"]
    return [side_by_side(f"{FIGURE}: training seeds/s, last epoch, K={k} vs K=1, median of {ss.train_pairs} "
                         f"(remote {last.get('remote_bytes_per_batch', 0) / MIB:.1f} MiB/batch, cache hit "
                         f"{last.get('cache_hit_rate', 0):.0%})", [r["last"]["seeds_per_s"] for r in runs[k]],
                         [r["last"]["seeds_per_s"] for r in runs[1]], "{:,.0f}",
                         first_epoch_loss={j: [r["epochs"][0]["loss"] for r in rs] for j, rs in runs.items()})]


def bench_cluster_cpu(ss: ShardSettings, data, workdir: Path, out: dict) -> list[Row]:
    """CPU-seconds of the job's processes per steady epoch (epochs 2.., each window one epoch line to the
    next), K = max(shards) against K = 1; the whole machine's busy CPU beside it (polluted)."""
    from bench.cpu import machine_busy_s, on_new_lines, tree_cpu_s
    from gnnray.driver.fit import run

    def one(cfg) -> list:
        snap = lambda: (time.perf_counter(), tree_cpu_s(os.getpid()), machine_busy_s())  # noqa: E731
        with on_new_lines(metrics_log(cfg), snap, every_s=0.05) as snaps:
            run(cfg)
        windows = [dict(wall_s=b[0] - a[0], job_cpu_s=b[1] - a[1], machine_cpu_s=b[2] - a[2])
                   for a, b in zip(snaps, snaps[1:])]
        print(f"  {cfg.run.name}: job CPU-s per steady epoch " + ", ".join(f"{w['job_cpu_s']:.1f}" for w in windows)
              + " (machine: " + ", ".join(f"{w['machine_cpu_s']:.1f}" for w in windows) + ")", flush=True)
        return windows

    k, runs = max(ss.shards), pairs(ss, data, workdir, ss.cpu_epochs, ss.cpu_pairs, "cpu", one)
    out["cpu"] = dict(runs=runs, epochs=ss.cpu_epochs, load_avg_1min=os.getloadavg()[0])
    med = {shards: statistics.median(w["job_cpu_s"] for ws in rs for w in ws) for shards, rs in runs.items()}
    machine = {shards: statistics.median(w["machine_cpu_s"] for ws in rs for w in ws) for shards, rs in runs.items()}
    ratio = med[k] / med[1]
    return [Row(f"{FIGURE}: CPU-s of the job's processes per steady epoch, K={k} vs K=1 (median of "
                f"{sum(map(len, runs[k]))} / {sum(map(len, runs[1]))} windows; machine-wide "
                f"{machine[k]:.1f} / {machine[1]:.1f}, shared)", ours=f"{med[k]:.1f}", baseline=f"{med[1]:.1f}",
                ratio=f"{ratio:.2f}x", target="<= 1.25x", met="yes" if ratio <= 1.25 else "no",
                detail=out["cpu"])]
