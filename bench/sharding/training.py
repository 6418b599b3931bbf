"""4 (throughput half) and 7: ``fit.run`` with K = 3 against K = 1, seeds/s and the job's CPU per steady epoch."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from pathlib import Path

from bench.harness import Row
from bench.settings import Settings, epochs_of, job_config, metrics_log
from bench.sharding.cluster import FIGURE, MIB, ShardSettings


def bench_cluster_training(ss: ShardSettings, data, workdir: Path, out: dict) -> list[Row]:
    """The throughput half of 4: fit.run with K = max(shards) against K = 1, in pairs of alternating order."""
    from gnnray.driver.fit import run

    k = max(ss.shards)
    s = Settings(quick=ss.quick, cores=2, fanouts=ss.fanouts, batch_size=ss.batch_size, hidden=ss.hidden,
                 epochs=ss.epochs, seed=ss.seed)
    runs = {1: [], k: []}
    for pair in range(ss.train_pairs):
        for shards in ((1, k) if pair % 2 == 0 else (k, 1)):
            name = f"shards-{shards}-{pair}"
            cfg = job_config(dataclasses.replace(data, feature_shards=shards, feature_cache=ss.cache), s, workdir,
                             name)
            start = time.perf_counter()
            summary = run(cfg)
            wall_s = time.perf_counter() - start
            runs[shards].append(dict(name=name, wall_s=wall_s, last=summary.metrics, epochs=epochs_of(cfg)))
            print(f"  fit.run K={shards}: {summary.metrics['seeds_per_s']:.0f} seeds/s in the last epoch, "
                  f"{wall_s:.0f} s", flush=True)
    out["training"] = dict(runs=runs, config=dict(epochs=ss.epochs, hidden=ss.hidden, train=ss.train_batches
                                                  * ss.batch_size, workers=1, cpus_per_worker=2, sampler_actors=1))
    ours = statistics.median(r["last"]["seeds_per_s"] for r in runs[k])
    base = statistics.median(r["last"]["seeds_per_s"] for r in runs[1])
    loss0 = {shards: [r["epochs"][0]["loss"] for r in rs] for shards, rs in runs.items()}
    last = runs[k][-1]["last"]
    return [Row(f"{FIGURE}: training seeds/s, last epoch, K={k} vs K=1, median of {ss.train_pairs} "
                f"(remote {last.get('remote_bytes_per_batch', 0) / MIB:.1f} MiB/batch, cache hit "
                f"{last.get('cache_hit_rate', 0):.0%})", ours=f"{ours:,.0f}", baseline=f"{base:,.0f}",
                ratio=f"{ours / base:.2f}x", target="-", met="-",
                detail=dict(ours=[r["last"] for r in runs[k]], baseline=[r["last"] for r in runs[1]],
                            first_epoch_loss=loss0))]


def bench_cluster_cpu(ss: ShardSettings, data, workdir: Path, out: dict) -> list[Row]:
    """CPU-seconds of the job's processes per steady epoch (epochs 2.., each window one epoch line to the
    next), K = max(shards) against K = 1, alternating; the whole machine's busy CPU beside it (polluted)."""
    from bench.cpu import machine_busy_s, on_new_lines, tree_cpu_s
    from gnnray.driver.fit import run

    k = max(ss.shards)
    s = Settings(quick=ss.quick, cores=2, fanouts=ss.fanouts, batch_size=ss.batch_size, hidden=ss.hidden,
                 epochs=ss.cpu_epochs, seed=ss.seed)
    runs: dict = {1: [], k: []}
    for pair in range(ss.cpu_pairs):
        for shards in ((1, k) if pair % 2 == 0 else (k, 1)):
            name = f"cpu-{shards}-{pair}"
            cfg = job_config(dataclasses.replace(data, feature_shards=shards, feature_cache=ss.cache), s, workdir,
                             name)
            snap = lambda: (time.perf_counter(), tree_cpu_s(os.getpid()), machine_busy_s())  # noqa: E731
            with on_new_lines(metrics_log(cfg), snap, every_s=0.05) as snaps:
                run(cfg)
            windows = [dict(wall_s=b[0] - a[0], job_cpu_s=b[1] - a[1], machine_cpu_s=b[2] - a[2])
                       for a, b in zip(snaps, snaps[1:])]
            runs[shards].append(windows)
            print(f"  K={shards}: job CPU-s per steady epoch "
                  + ", ".join(f"{w['job_cpu_s']:.1f}" for w in windows)
                  + " (machine: " + ", ".join(f"{w['machine_cpu_s']:.1f}" for w in windows) + ")", flush=True)
    out["cpu"] = dict(runs=runs, epochs=ss.cpu_epochs, load_avg_1min=os.getloadavg()[0])
    med = {shards: statistics.median(w["job_cpu_s"] for ws in rs for w in ws) for shards, rs in runs.items()}
    machine = {shards: statistics.median(w["machine_cpu_s"] for ws in rs for w in ws) for shards, rs in runs.items()}
    ratio = med[k] / med[1]
    return [Row(f"{FIGURE}: CPU-s of the job's processes per steady epoch, K={k} vs K=1 (median of "
                f"{sum(map(len, runs[k]))} / {sum(map(len, runs[1]))} windows; machine-wide "
                f"{machine[k]:.1f} / {machine[1]:.1f}, shared)", ours=f"{med[k]:.1f}", baseline=f"{med[1]:.1f}",
                ratio=f"{ratio:.2f}x", target="<= 1.25x", met="yes" if ratio <= 1.25 else "no",
                detail=out["cpu"])]
