"""``--sharding``: the feature table split over nodes (``--feature-shards K``), on a simulated cluster.

Run with ``python -m bench --sharding [--quick]``. It measures, in one
invocation, on ``ray.cluster_utils.Cluster`` (a head and 3 nodes, each with its
own object store of ``store_mib``; all share this machine's cores and "network"
is loopback between the stores):

1. **Object store per node** (``gathers.py``) for K = 1 (replicated), 2, 3, cache 0.1: every
   node runs a probe that reads the graph as a train worker does
   (``GraphHandle.get`` and :func:`gnnray.train.feature_reader.reader_for`, one
   gather), then ``ray.experimental.get_object_locations`` over the job's
   objects (structure, shards, cache) gives the bytes on each node. The
   raylet's own ``object_store_bytes_used`` is in the JSON beside it
   (``store_check``), with what of it the layout explains.
2. **Remote fetch per batch** (``gathers.py``): real sampled mini-batches (batch 1024, fanouts
   10,10,10, seeds drawn from all nodes; the same ids everywhere) gathered
   through ``reader_for`` by a probe actor pinned to the head (which holds no
   shard: every uncached row is remote) and by one pinned to shard 0's node
   (its own rows local); medians over batches of the gather's wall time, the
   wait for remote rows, and the remote bytes. The K = 1 gather on the same
   node runs before and after each configuration (the baseline: the mean of
   the two medians).
3. **Cache hit rate** (``gathers.py``) for ``--feature-cache`` 0, 0.1 and 0.3 (K = 3), with the
   remote bytes per batch at each.
4. **Throughput** (``training.py``): ``gnnray.driver.fit.run`` with K = 3 against K = 1,
   interleaved in pairs; the last epoch's ``seeds_per_s`` (median over
   pairs); and the gather alone, rows/s, K = 3 against K = 1.
5. **Sampling only** (``sampling.py``; no Ray; the basis of docs/scaling.md#what-a-batch-reaches):
   on the arxiv structure and on larger synthetic graphs, input nodes per
   batch of 1024, and with a batch small enough that its reach is 2% of the
   graph (papers100M's regime, see :func:`bench_extrapolation`) input nodes
   per seed, the cache hit rate at 0.1 and 0.3, and the share of rows a
   reader on a shard node fetches remotely with K = 2, 4, 8 contiguous shards.
6. **The driver's memory** (``driver.py``): a fresh driver
   process publishes feature tables of two widths with K = 3 (rows generated
   on the shard nodes; a typed graph's table read into memory and spilled)
   and with K = 1 (the driver loads the table: the growth the measurement must
   see); its peak RSS, and RSS, USS and ``VmData`` after publishing.
7. **CPU per steady epoch** (``training.py``): ``fit.run`` with
   K = 3 and K = 1, the CPU-seconds of this process and all its descendants
   (the simulated cluster's daemons and workers: the job's processes alone)
   between consecutive ``metrics.jsonl`` lines after the first; the machine's
   ``/proc/stat`` busy time beside it, which other processes on a shared
   machine pollute.
8. **Layer-wise inference's hidden tables** (``layerwise.py``, also runnable
   alone; clusters of its own): three ranks, one per node, with K = 3 and
   K = 1; each node's store peak during the evaluation against 2 x table / K,
   what spilled on stores too small for whole tables, and the predictions of
   the two compared.

The graph: a synthetic structure (``nodes``, average in-degree
``avg_degree``, reverse edges) written as a graph directory whose training
split is cut to ``train_batches`` batches (as ``--quick`` does for the other
figures) so that epochs are short, with ``feat_dim`` random float32 features
(``--random-features``: each shard's rows generated on its node).
``cluster.py`` holds the simulated cluster and the graph, ``settings.py`` the settings.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from bench.common import Row, error_row
from bench.sharding.cluster import SimulatedCluster, graph_dir
from bench.sharding.driver import bench_driver_limit, bench_driver_memory
from bench.sharding.gathers import bench_cluster_gathers
from bench.sharding.sampling import bench_extrapolation
from bench.sharding.settings import DEFAULT_JSON_NAME, FIGURE, ShardSettings, settings
from bench.sharding.training import bench_cluster_cpu, bench_cluster_training

__all__ = ["DEFAULT_JSON_NAME", "FIGURE", "ShardSettings", "run_section", "settings"]


def run_section(ss: ShardSettings, workdir: Path, verbose: bool, result: dict,
                guarded: Callable[[str, str, Callable[[], list]], list]) -> list[Row]:
    """The whole section: sampling only first (no Ray), then the cluster's figures; each stage guarded."""
    out: dict = {}
    result["sharding"] = out
    rows = guarded(f"{FIGURE}, sampling only", "", lambda: bench_extrapolation(ss))
    print(f"{FIGURE}: a head and {ss.worker_nodes} nodes with {ss.store_mib} MiB object stores each", flush=True)
    start = time.perf_counter()
    try:
        data, info = graph_dir(ss, workdir)
        out["graph"] = info
        print(f"  graph: {info['nodes']:,} nodes, {info['edges']:,} edges ({info['index_dtype']}), "
              f"{ss.feat_dim} float32 features ({info['feature_mib']:.1f} MiB), structure "
              f"{info['structure_mib']:.1f} MiB", flush=True)
        cl = SimulatedCluster(ss, verbose)
    except Exception as exc:  # noqa: BLE001 - the other rows are still worth printing
        return rows + [error_row(f"{FIGURE}: setup", "", exc)]
    out["cluster_start_s"] = time.perf_counter() - start
    try:
        rows += guarded(f"{FIGURE}: gathers", "", lambda: bench_cluster_gathers(cl, ss, data, out))
        rows += guarded(f"{FIGURE}: training", "", lambda: bench_cluster_training(ss, data, workdir, out))
        rows += guarded(f"{FIGURE}: driver memory", "", lambda: bench_driver_memory(cl, ss, data, workdir, out))
        rows += guarded(f"{FIGURE}: CPU per epoch", "", lambda: bench_cluster_cpu(ss, data, workdir, out))
    finally:
        cl.close()
    rows += guarded(f"{FIGURE}: driver under a limit", "", lambda: bench_driver_limit(ss, workdir, verbose, out))
    # Here, not at the top: ``python -m bench.sharding.layerwise`` runs that module as __main__ after this one.
    from bench.sharding.layerwise import bench_layerwise

    rows += guarded(f"{FIGURE}: layer-wise", "", lambda: bench_layerwise(ss, data, verbose, out))
    return rows
