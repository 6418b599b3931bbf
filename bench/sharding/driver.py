"""The sharding section's driver memory against the feature table (fresh driver processes, their own peak RSS)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from bench.harness import Row
from bench.sharding.cluster import FIGURE, MIB, ShardSettings, SimulatedCluster


# Run in a child process (its own peak RSS): publish with --feature-shards and report the driver's memory.
_DRIVER_PROBE = """
import ctypes, json, resource, sys
import psutil
from bench.harness import emit
limit = int(sys.argv[2])
if limit:
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
from gnnray.config import JobConfig, DataConfig, RunConfig
from gnnray.driver import launch
spec = json.loads(sys.argv[1])
pub = launch.load_and_publish(JobConfig(data=DataConfig(**spec["data"]), run=RunConfig(**spec["run"])))
ctypes.CDLL("libc.so.6").malloc_trim(0)
info = psutil.Process().memory_full_info()
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
# VmHWM (this process's peak RSS), not ru_maxrss, which keeps the forking parent's across exec.
emit(dict(peak_rss=int(status["VmHWM"].split()[0]) * 1024, rss=info.rss, uss=info.uss,
          vm_data=int(status["VmData"].split()[0]) * 1024, source=type(pub.source).__name__))
"""


def driver_memory(address: str, data, name: str, workdir: Path, limit_bytes: int = 0) -> dict:
    """The driver's peak RSS, and RSS and USS after publishing ``data``, in a fresh process joining ``address``
    (under ``RLIMIT_DATA`` = ``limit_bytes`` if given)."""
    import sys

    from bench.harness import run_child

    spec = dict(data=dataclasses.asdict(data), run=dict(name=name, storage_path=str(workdir / "runs")))
    try:
        return run_child([sys.executable, "-c", _DRIVER_PROBE, json.dumps(spec), str(limit_bytes)],
                         dict(os.environ, RAY_ADDRESS=address), timeout=1800, what="the driver")
    except RuntimeError as exc:  # a driver over its limit fails: that is a result
        return dict(failed=str(exc).splitlines()[-1])


def bench_driver_memory(cl: SimulatedCluster, ss: ShardSettings, data, workdir: Path, out: dict) -> list[Row]:
    """The driver's memory with feature tables of two widths: generated on the shard nodes (K = 3), loaded by the
    driver (K = 1: it must grow), read into its memory then spilled (typed, K = 3: what stays must not grow)."""
    from gnnray.config import DataConfig

    k = max(ss.shards)
    res = {}
    for dim in ss.memory_dims:
        cases = {f"K={shards} generated": dataclasses.replace(data, random_features=dim, feature_shards=shards,
                                                              feature_cache=ss.cache) for shards in (1, k)}
        cases[f"K={k} spilled"] = DataConfig(dataset="synthetic-hetero", synthetic_nodes=ss.nodes * 2 // 3,
                                             synthetic_feat_dim=dim, feature_shards=k, feature_cache=ss.cache)
        for case, d in cases.items():
            key = f"{case} D={dim}"
            res[key] = dict(table_bytes=ss.nodes * dim * 4,
                            **driver_memory(cl.cluster.address, d, f"mem-{len(res)}", workdir))
            print(f"  driver memory, {key}: {res[key]}", flush=True)
    out["driver_memory"] = res
    a, b = ss.memory_dims
    table = ss.nodes * (b - a) * 4 / MIB

    def grow(case: str, what: str) -> float:
        return (res[f"{case} D={b}"][what] - res[f"{case} D={a}"][what]) / MIB

    return [Row(f"{FIGURE}: driver's peak RSS growth, feature table {a} -> {b} dims (+{table:.0f} MiB), "
                f"K={k} generated vs K=1", ours=f"+{grow(f'K={k} generated', 'peak_rss'):.1f} MiB",
                baseline=f"+{grow('K=1 generated', 'peak_rss'):.1f} MiB", target="does not grow with the table",
                met="yes" if grow(f"K={k} generated", "peak_rss") < 0.1 * table else "no", detail=res),
            Row(f"{FIGURE}: driver's USS after publishing, growth {a} -> {b} dims, K={k} spilled (typed graph, "
                f"table read into memory)", ours=f"+{grow(f'K={k} spilled', 'uss'):.1f} MiB",
                baseline=f"peak +{grow(f'K={k} spilled', 'peak_rss'):.1f} MiB", target="does not grow with the table",
                met="yes" if grow(f"K={k} spilled", "uss") < 0.1 * table else "no")]


def bench_driver_limit(ss: ShardSettings, workdir: Path, verbose: bool, out: dict) -> list[Row]:
    """A feature table twice the driver's ``RLIMIT_DATA`` of ``limit_gb`` (private memory; the store's shared pages
    do not count): K = 3 must publish, K = 1 must fail. Its own cluster, stores that fit a third of the table."""
    from gnnray.config import DataConfig

    limit = int(ss.limit_gb * 1e9)
    dim = int(2 * limit / (ss.nodes * 4)) + 1
    table = ss.nodes * dim * 4
    need = (table / 3 + 0.1 * table + 64 * MIB) / 0.9  # shard + cache + structure, at most 90% of a store
    cl = SimulatedCluster(dataclasses.replace(ss, store_mib=int(need / MIB) + 64), verbose)
    res = {}
    try:
        for shards in (3, 1):
            d = DataConfig(dataset="synthetic", synthetic_nodes=ss.nodes, synthetic_feat_dim=dim,
                           feature_shards=shards, feature_cache=ss.cache)
            res[f"K={shards}"] = driver_memory(cl.cluster.address, d, f"limit-{shards}", workdir, limit)
            print(f"  driver under RLIMIT_DATA {limit / 1e9:.2f} GB, table {table / 1e9:.2f} GB, K={shards}: "
                  f"{res[f'K={shards}']}", flush=True)
    finally:
        cl.close()
    out["driver_limit"] = dict(limit_bytes=limit, table_bytes=table, dim=dim, runs=res)
    ok = "failed" not in res["K=3"] and "failed" in res["K=1"]
    return [Row(f"{FIGURE}: driver under RLIMIT_DATA {limit / 1e9:.2f} GB, feature table {table / 1e9:.2f} GB",
                ours="K=3: " + ("failed" if "failed" in res["K=3"] else
                                f"published, peak RSS {res['K=3']['peak_rss'] / MIB:.0f} MiB"),
                baseline="K=1: " + ("failed" if "failed" in res["K=1"] else "published"),
                target="K=3 publishes", met="yes" if ok else "no", detail=out["driver_limit"])]
