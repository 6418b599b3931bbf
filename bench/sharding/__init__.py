"""``python -m bench --sharding [--quick]``: the feature table split over nodes (``--feature-shards K``), on a
simulated cluster (``cluster.py``), each against K = 1: store per node, remote rows, gather time and cache hits
(``gathers.py``); the driver's memory (``driver.py``); layer-wise inference's hidden tables (``hidden_tables.py``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from bench.harness import Row, error_row
from bench.sharding.cluster import DEFAULT_JSON_NAME, FIGURE, ShardSettings, SimulatedCluster, graph_dir, settings
from bench.sharding.driver import bench_driver_limit, bench_driver_memory
from bench.sharding.gathers import bench_cluster_gathers

__all__ = ["DEFAULT_JSON_NAME", "FIGURE", "ShardSettings", "run_section", "settings"]


def run_section(ss: ShardSettings, workdir: Path, verbose: bool, result: dict,
                guarded: Callable[[str, str, Callable[[], list]], list]) -> list[Row]:
    """The whole section, each stage guarded."""
    out: dict = {}
    result["sharding"] = out
    print(f"{FIGURE}: a head and {ss.worker_nodes} nodes with {ss.store_mib} MiB object stores each", flush=True)
    start = time.perf_counter()
    try:
        data, info = graph_dir(ss, workdir)
        out["graph"] = info
        print(f"  graph: {info['nodes']:,} nodes, {info['edges']:,} edges ({info['index_dtype']}), "
              f"{ss.feat_dim} float32 features ({info['feature_mib']:.1f} MiB), structure "
              f"{info['structure_mib']:.1f} MiB", flush=True)
        cl = SimulatedCluster(ss, verbose)
    except Exception as exc:  # noqa: BLE001 - the failure is the section's row
        return [error_row(f"{FIGURE}: setup", "", exc)]
    out["cluster_start_s"] = time.perf_counter() - start
    try:
        rows = guarded(f"{FIGURE}: gathers", "", lambda: bench_cluster_gathers(cl, ss, data, out))
        rows += guarded(f"{FIGURE}: driver memory", "", lambda: bench_driver_memory(cl, ss, data, workdir, out))
    finally:
        cl.close()
    rows += guarded(f"{FIGURE}: driver under a limit", "", lambda: bench_driver_limit(ss, workdir, verbose, out))
    # Here, not at the top: ``python -m bench.sharding.hidden_tables`` runs that module as __main__ after this one.
    from bench.sharding.hidden_tables import bench_layerwise

    rows += guarded(f"{FIGURE}: layer-wise", "", lambda: bench_layerwise(ss, data, verbose, out))
    return rows
