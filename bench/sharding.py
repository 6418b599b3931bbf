"""``--sharding``: the feature table split over nodes (``--feature-shards K``), on a simulated cluster.

Run with ``python -m bench --sharding [--quick]``. It measures, in one
invocation, on ``ray.cluster_utils.Cluster`` (a head and 3 nodes, each with its
own object store of ``store_mib``; all share this machine's cores and "network"
is loopback between the stores):

1. **Object store per node** for K = 1 (replicated), 2, 3, cache 0.1: every
   node runs a probe that reads the graph as a train worker does
   (``GraphHandle.get`` and :func:`gnnray.pipeline.features.reader_for`, one
   gather), then ``ray.experimental.get_object_locations`` over the job's
   objects (structure, shards, cache) gives the bytes on each node. The
   raylet's own ``object_store_bytes_used`` is in the JSON beside it
   (``store_check``), with what of it the layout explains.
2. **Remote fetch per batch**: real sampled mini-batches (batch 1024, fanouts
   10,10,10, seeds drawn from all nodes; the same ids everywhere) gathered
   through ``reader_for`` by a probe actor pinned to the head (which holds no
   shard: every uncached row is remote) and by one pinned to shard 0's node
   (its own rows local); medians over batches of the gather's wall time, the
   wait for remote rows, and the remote bytes. The K = 1 gather on the same
   node runs before and after each configuration (the baseline: the mean of
   the two medians).
3. **Cache hit rate** for ``--feature-cache`` 0, 0.1 and 0.3 (K = 3), with the
   remote bytes per batch at each.
4. **Throughput**: ``gnnray.driver.fit.run`` with K = 3 against K = 1,
   interleaved in pairs; the last epoch's ``seeds_per_s`` (median over
   pairs); and the gather alone, rows/s, K = 3 against K = 1.
5. **Sampling only** (no Ray; the basis of docs/scaling.md's extrapolation):
   on the arxiv structure and on larger synthetic graphs, input nodes per
   batch of 1024, and with a batch small enough that its reach is 2% of the
   graph (papers100M's regime, see :func:`bench_extrapolation`) input nodes
   per seed, the cache hit rate at 0.1 and 0.3, and the share of rows a
   reader on a shard node fetches remotely with K = 2, 4, 8 contiguous shards.
6. **The driver's memory** (:func:`bench_driver_memory`): a fresh driver
   process publishes feature tables of two widths with K = 3 (rows generated
   on the shard nodes; a typed graph's table read into memory and spilled)
   and with K = 1 (the driver loads the table: the growth the measurement must
   see); its peak RSS, and RSS, USS and ``VmData`` after publishing.
7. **CPU per steady epoch** (:func:`bench_cluster_cpu`): ``fit.run`` with
   K = 3 and K = 1, the CPU-seconds of this process and all its descendants
   (the simulated cluster's daemons and workers: the job's processes alone)
   between consecutive ``metrics.jsonl`` lines after the first; the machine's
   ``/proc/stat`` busy time beside it, which other processes on a shared
   machine pollute.

The graph: a synthetic structure (``nodes``, average in-degree
``avg_degree``, reverse edges) written as a graph directory whose training
split is cut to ``train_batches`` batches (as ``--quick`` does for the other
figures) so that epochs are short, with ``feat_dim`` random float32 features
(``--random-features``: each shard's rows generated on its node).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from bench.common import Row, Settings, error_row, job_config

FIGURE = "sharding"
DEFAULT_JSON_NAME = "sharding.json"
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class ShardSettings:
    """What the sharding section uses; ``--quick`` shrinks the amounts of work only."""

    quick: bool
    nodes: int = 100_000
    avg_degree: int = 10
    feat_dim: int = 128
    store_mib: int = 300  # object store of every simulated node
    worker_nodes: int = 3  # nodes besides the head
    head_cpus: int = 6  # logical: 1 train worker x 2 CPUs + 1 sampler actor + Ray Data's tasks
    shards: tuple = (1, 2, 3)
    cache: float = 0.1  # the default --feature-cache, used for the K rows
    caches: tuple = (0.0, 0.1, 0.3)
    fanouts: tuple = (10, 10, 10)
    batch_size: int = 1024
    batches: int = 12  # gathered per configuration and reader, after one warm-up
    # Training (fit.run): splits cut to these many batches, epochs, (K=1, K=3) pairs.
    train_batches: int = 16
    eval_batches: int = 2
    epochs: int = 2
    hidden: int = 256
    train_pairs: int = 2
    # Sampling only: (name, nodes, average in-degree) of the synthetic graphs; the arxiv structure when present.
    extrapolation: tuple = (("synthetic-250k", 250_000, 29), ("synthetic-1M", 1_000_000, 29))
    extrapolation_batches: int = 8
    small_reach: float = 0.02  # the small batch reaches at most this share of the graph's nodes
    small_reach_seeds: int = 4096  # seeds sampled in small batches per graph
    extrapolation_shards: tuple = (2, 4, 8)
    # CPU of the job's processes per steady epoch: epochs per run, (K=1, K=3) pairs.
    cpu_epochs: int = 4
    cpu_pairs: int = 1
    memory_dims: tuple = (128, 512)  # the driver's memory with feature tables of these widths
    limit_gb: float = 2.25  # RLIMIT_DATA of the driver publishing a table twice that (its VmData is ~1.9 GB)
    seed: int = 0


def settings(quick: bool) -> ShardSettings:
    s = ShardSettings(quick=quick)
    if quick:
        s = dataclasses.replace(s, batches=5, train_batches=8, train_pairs=1,
                                extrapolation=(("synthetic-250k", 250_000, 29),), extrapolation_batches=4,
                                small_reach_seeds=2048)
    return s


def upper_bound(batch_size: int, fanouts: tuple) -> int:
    """Input nodes of a batch if no node repeated: seeds x (1 + f1 + f1 f2 + ...)."""
    total, layer = batch_size, batch_size
    for f in fanouts:
        layer *= f
        total += layer
    return total


# ---------------------------------------------------------------------------------------------------------------
# 5. Sampling only: no Ray, one process.


def sampling_stats(graph, ss: ShardSettings, batch_size: int, batches: int,
                   seeds_from: Optional[np.ndarray] = None) -> dict:
    """Per-batch input nodes, cache hit rates and remote shares with contiguous shards; medians over batches.

    Hit rates and shares are per batch over its unique input nodes, what a
    gather fetches.
    """
    from gnnray.data.shards import cache_ids, shard_bounds
    from gnnray.pipeline.sampler import Sampler

    n = graph.num_nodes
    sampler = Sampler(graph, ss.fanouts)
    rng = np.random.default_rng(ss.seed)
    pool = np.arange(n) if seeds_from is None else seeds_from
    cached = {}
    for f in ss.caches:
        mask = np.zeros(n, dtype=bool)
        mask[cache_ids(graph.indptr, f)] = True
        cached[f] = mask
    bounds = {k: shard_bounds(n, k)[1:] for k in ss.extrapolation_shards}
    per = []
    start = time.perf_counter()
    for _ in range(batches):
        ids = sampler.sample(rng.choice(pool, min(batch_size, len(pool)), replace=False)).input_nodes.numpy()
        b = dict(input_nodes=int(len(ids)))
        for f, mask in cached.items():
            b[f"cache_hit_{f:g}"] = float(mask[ids].mean())
        miss = ids[~cached[ss.cache][ids]]
        for k in ss.extrapolation_shards:
            counts = np.bincount(np.searchsorted(bounds[k], miss, side="right"), minlength=k)
            # A reader on shard j's node fetches the uncached rows of the other shards: over j the mean is
            # (1 - hit) (k - 1) / k; the max shows how uneven contiguous ranges are; the busiest server's share.
            remote = (len(miss) - counts) / len(ids)
            b[f"remote_share_k{k}_mean"] = float(remote.mean())
            b[f"remote_share_k{k}_max"] = float(remote.max())
            b[f"busiest_shard_share_k{k}"] = float(counts.max() / max(len(miss), 1))
        per.append(b)
    sample_s = (time.perf_counter() - start) / batches
    med = {k: statistics.median(b[k] for b in per) for k in per[0]}
    # Hit rates and shares also over all batches' rows together (small batches are noisy one by one).
    total = sum(b["input_nodes"] for b in per)
    pooled = {k: sum(b[k] * b["input_nodes"] for b in per) / total for k in per[0] if k != "input_nodes"}
    return dict(batch_size=batch_size, batches=batches, median=med, pooled=pooled,
                input_nodes_per_seed=statistics.mean(b["input_nodes"] for b in per) / batch_size,
                upper_bound=upper_bound(batch_size, ss.fanouts), sample_s_per_batch=sample_s)


def small_reach_batch(n: int, ss: ShardSettings) -> int:
    """Seeds per batch whose reach (no repeats) is ``small_reach`` of the graph's nodes, at least 1."""
    return max(1, int(ss.small_reach * n / upper_bound(1, ss.fanouts)))


def bench_extrapolation(ss: ShardSettings) -> list[Row]:
    """Sampling only, per graph: at batch 1024, and at a small batch whose reach is a small share of the graph.

    On graphs of 10^5-10^6 nodes a batch of 1024 seeds with fanouts 10,10,10
    reaches most nodes (its input nodes saturate and every cache hit rate tends
    to the cached share of nodes). ogbn-papers100M's 111 M nodes are ~100x a
    batch's reach: the small batch keeps that ratio, so its input nodes per
    seed and hit rates are the ones to scale (docs/scaling.md).
    """
    from bench.common import DEFAULT_DATASET
    from gnnray.config import DataConfig
    from gnnray.data.load import load_structure

    graphs = []
    if DEFAULT_DATASET.is_dir():  # random_features: a lazy source, never made; load_structure wants features
        graphs.append(("arxiv-structure", DataConfig(dataset=str(DEFAULT_DATASET), reverse_edges=True,
                                                     random_features=1), True))
    for name, n, deg in ss.extrapolation:
        graphs.append((name, DataConfig(dataset="synthetic", synthetic_nodes=n, synthetic_feat_dim=1,
                                        synthetic_avg_degree=deg), False))
    rows = []
    for name, cfg, real in graphs:
        figure = f"{FIGURE}, sampling only: input nodes/batch, {name}"
        try:
            start = time.perf_counter()
            graph, _ = load_structure(cfg, ss.seed)
            load_s = time.perf_counter() - start
            # arxiv: seeds from its training split (as a job); synthetic: from all nodes (a random 60% split).
            pool = graph.train_idx if real else None
            full = sampling_stats(graph, ss, ss.batch_size, ss.extrapolation_batches, pool)
            b = small_reach_batch(graph.num_nodes, ss)
            small = sampling_stats(graph, ss, b, -(-ss.small_reach_seeds // b), pool)
            degree = np.diff(graph.indptr)
            st = dict(graph=name, nodes=graph.num_nodes, edges=int(graph.num_edges), load_s=load_s,
                      avg_in_degree=float(degree.mean()), median_in_degree=float(np.median(degree)),
                      index_dtype=str(graph.indices.dtype), batch=full, small_reach=small)
            del graph, degree
            gc.collect()
        except Exception as exc:  # noqa: BLE001 - one graph failing must not hide the others
            rows.append(error_row(figure, "", exc))
            continue
        m, p = full["median"], small["pooled"]
        print(f"  {name}: {m['input_nodes']:,.0f} input nodes/batch of {ss.batch_size}; batch {b}: "
              f"{small['input_nodes_per_seed']:.0f} per seed, cache hit {p['cache_hit_0.1']:.1%} (0.1) "
              f"{p['cache_hit_0.3']:.1%} (0.3)", flush=True)
        rows.append(Row(figure + f" of {ss.batch_size}", ours=f"{m['input_nodes']:,.0f}",
                        baseline=f"{full['upper_bound']:,} (no repeats)",
                        ratio=f"{m['input_nodes'] / full['upper_bound']:.2f}x", target="-", met="-", detail=st))
        rows.append(Row(f"{FIGURE}, sampling only: input nodes per seed, batch {b} (reach {ss.small_reach:.0%} of "
                        f"nodes), {name}", ours=f"{small['input_nodes_per_seed']:.0f}",
                        baseline=f"{upper_bound(1, ss.fanouts):,} (no repeats)",
                        ratio=f"{small['input_nodes_per_seed'] / upper_bound(1, ss.fanouts):.2f}x", target="-",
                        met="-", detail=dict(graph=name, small_reach=small)))
        shares = " / ".join(f"{p[f'remote_share_k{k}_mean']:.0%}" for k in ss.extrapolation_shards)
        rows.append(Row(f"{FIGURE}, sampling only: batch {b}: cache hit 0.1 / 0.3; remote share (cache 0.1) K="
                        f"{'/'.join(map(str, ss.extrapolation_shards))}, {name}",
                        ours=f"{p['cache_hit_0.1']:.1%} / {p['cache_hit_0.3']:.1%}; {shares}",
                        baseline="10% / 30% (uniform)",
                        ratio=f"{p['cache_hit_0.1'] / 0.1:.2f}x / {p['cache_hit_0.3'] / 0.3:.2f}x", target="-",
                        met="-", detail=dict(graph=name, pooled=p,
                                             batch_1024=dict(median=m, pooled=full["pooled"]))))
    return rows


# ---------------------------------------------------------------------------------------------------------------
# The simulated cluster.


def _free_port() -> int:
    with socket.socket() as so:
        so.bind(("", 0))
        return so.getsockname()[1]


class SimulatedCluster:
    """A head and ``worker_nodes`` nodes, each with its own object store, and this process connected to it.

    ``RAY_ADDRESS`` names the new cluster before it starts: Ray Train's
    placement-group cleaner looks its cluster up through it, and could find
    another Ray cluster on this machine otherwise (docs/performance.md).
    """

    def __init__(self, ss: ShardSettings, verbose: bool):
        import ray
        import ray.data
        from ray.cluster_utils import Cluster

        import bench
        from gnnray.driver.console import quiet_ray

        self._env = os.environ.get("RAY_ADDRESS")
        port = _free_port()
        os.environ["RAY_ADDRESS"] = f"{ray.util.get_node_ip_address()}:{port}"
        store = ss.store_mib * MIB
        self.cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=ss.head_cpus, gcs_server_port=port, object_store_memory=store))
        for _ in range(ss.worker_nodes):
            self.cluster.add_node(num_cpus=1, object_store_memory=store)
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, log_to_driver=verbose,
                 logging_config=ray.LoggingConfig(log_level="INFO" if verbose else "WARNING"))
        os.environ["RAY_ADDRESS"] = self.cluster.address
        ray.cloudpickle.register_pickle_by_value(bench)  # the probes' class travels by value
        quiet_ray(verbose)
        ray.data.DataContext.get_current().enable_progress_bars = False
        self.head = ray.get_runtime_context().get_node_id()
        self.nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        self.nodes.sort(key=lambda n: (n != self.head, n))  # head first

    def name(self, node_id: str, handle=None) -> str:
        """``head`` or ``node i``, with the shard it holds."""
        label = "head" if node_id == self.head else f"node {self.nodes.index(node_id)}"
        held = [i for i, s in enumerate(handle.features.shards) if s.node_id == node_id] \
            if handle is not None and handle.features is not None else []
        return label + "".join(f" (shard {i})" for i in held)

    def raylet_used(self) -> dict:
        """Each node's ``object_store_bytes_used`` as its raylet reports it (all live objects), or {}."""
        import ray

        try:
            from ray._private.internal_api import node_stats

            return {n["NodeID"]: int(node_stats(n["NodeManagerAddress"], n["NodeManagerPort"],
                                                include_memory_info=False).store_stats.object_store_bytes_used)
                    for n in ray.nodes() if n.get("Alive")}
        except Exception:  # noqa: BLE001 - a private API; the locations are the figure
            return {}

    def close(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
        if self._env is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = self._env


class GatherProbe:
    """A process on one node that reads features as a train worker does (a Ray actor, pinned).

    ``__init__`` attaches the graph and makes the reader (pulling the structure
    and the cache to this node, mapping a shard held here); :meth:`gather`
    gathers the given input-node arrays one by one into a reused float32
    buffer and returns per batch its wall time and what the reader counted.
    """

    def __init__(self, handle):
        from gnnray.pipeline.features import reader_for

        self._graph = handle.get()
        self._reader = reader_for(self._graph, handle.features)

    def gather(self, batches: list) -> list:
        out = np.empty((max(len(b) for b in batches), self._reader.dim), dtype=np.float32)
        per = []
        for ids in batches:
            before = self._reader.stats()
            start = time.perf_counter()
            self._reader.gather(ids, out[:len(ids)])
            took = time.perf_counter() - start
            d = self._reader.stats().since(before)
            per.append(dict(s=took, rows=d.rows, cached_rows=d.cached_rows, local_rows=d.local_rows,
                            remote_rows=d.remote_rows, remote_bytes=d.remote_bytes, remote_calls=d.remote_calls,
                            wait_s=d.wait_s))
        return per


def _probe(node_id: str, handle):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    pin = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return ray.remote(GatherProbe).options(scheduling_strategy=pin, num_cpus=0, max_restarts=0).remote(handle)


def _summary(per: list, feat_bytes_per_row: int) -> dict:
    """Medians over batches (and sums), of one probe's gathers."""
    med = lambda k: statistics.median(b[k] for b in per)  # noqa: E731
    rows = sum(b["rows"] for b in per)
    return dict(batches=len(per), gather_ms=1e3 * med("s"), wait_ms=1e3 * med("wait_s"),
                rows_per_batch=med("rows"), remote_mib=med("remote_bytes") / MIB,
                batch_mib=med("rows") * feat_bytes_per_row / MIB, remote_calls=med("remote_calls"),
                rows_per_s=rows / sum(b["s"] for b in per),
                cache_hit_rate=sum(b["cached_rows"] for b in per) / max(rows, 1),
                local_share=sum(b["local_rows"] for b in per) / max(rows, 1),
                remote_share=sum(b["remote_rows"] for b in per) / max(rows, 1), per_batch=per)


# ---------------------------------------------------------------------------------------------------------------
# 1-4. On the cluster.


def graph_dir(ss: ShardSettings, workdir: Path):
    """The synthetic structure as a graph directory with short splits; its DataConfig and the graph's figures."""
    from bench.graphs import quick_data_config
    from gnnray.config import DataConfig
    from gnnray.data.load import load_structure

    graph, _ = load_structure(DataConfig(dataset="synthetic", synthetic_nodes=ss.nodes, synthetic_feat_dim=1,
                                         synthetic_avg_degree=ss.avg_degree), ss.seed)
    s = Settings(quick=True, cores=1, batch_size=ss.batch_size, seed=ss.seed, quick_train_batches=ss.train_batches,
                 quick_eval_batches=ss.eval_batches)
    data = dataclasses.replace(quick_data_config(graph, s, workdir), random_features=ss.feat_dim)
    info = dict(nodes=graph.num_nodes, edges=graph.num_edges, index_dtype=str(graph.indices.dtype),
                structure_mib=graph.nbytes / MIB, feature_mib=graph.num_nodes * ss.feat_dim * 4 / MIB,
                train=ss.train_batches * ss.batch_size, data=dataclasses.asdict(data))
    return data, info


def _publish(data, k: int, cache: float, seed: int):
    from gnnray.config import JobConfig, RunConfig
    from gnnray.driver import launch

    cfg = JobConfig(data=dataclasses.replace(data, feature_shards=k, feature_cache=cache), run=RunConfig(seed=seed))
    start = time.perf_counter()
    pub = launch.load_and_publish(cfg)
    return pub, time.perf_counter() - start


def _bytes_on(cl: SimulatedCluster, handle) -> dict:
    """``{node_id: {object: bytes}}`` of the job's objects (``get_object_locations``): structure, shards, cache."""
    from ray.experimental import get_object_locations

    refs = {"structure" if handle.features is not None else "graph": handle._ref[0]}
    if handle.features is not None:
        refs.update({f"shard {i}": s.ref[0] for i, s in enumerate(handle.features.shards)})
        if handle.features.cache is not None:
            refs["cache"] = handle.features.cache[0]
    locs = get_object_locations(list(refs.values()))
    per = {n: {} for n in cl.nodes}
    for what, ref in refs.items():
        for n in locs[ref]["node_ids"]:
            per.setdefault(n, {})[what] = int(locs[ref]["object_size"])
    return per


def _layout(cl: SimulatedCluster, handle, baseline=None) -> tuple[dict, dict]:
    """Each node's bytes of ``handle``'s objects, and the raylet's view of the same moment.

    The second: per node the raylet's ``object_store_bytes_used``, the bytes
    of this layout, of the K = 1 baseline's graph (still alive) and the rest
    (rows in flight, objects freed but not yet deleted).
    """
    mine = _bytes_on(cl, handle)
    base = _bytes_on(cl, baseline) if baseline is not None else {}
    used = cl.raylet_used()
    check = {}
    for n in cl.nodes:
        a, b = sum(mine.get(n, {}).values()), sum(base.get(n, {}).values())
        check[cl.name(n, handle)] = dict(raylet_used_mib=used.get(n, float("nan")) / MIB, layout_mib=a / MIB,
                                         k1_baseline_mib=b / MIB, other_mib=(used.get(n, float("nan")) - a - b) / MIB)
    return {cl.name(n, handle): v for n, v in mine.items()}, check


def bench_cluster_gathers(cl: SimulatedCluster, ss: ShardSettings, data, out: dict) -> list[Row]:
    """Figures 1-3 and the gather half of 4: per-node layout, remote fetch per batch, cache hit rates."""
    import ray

    from gnnray.data.shards import cache_nbytes
    from gnnray.pipeline.sampler import Sampler

    row_bytes = ss.feat_dim * 4
    base_pub, publish_s = _publish(data, 1, ss.cache, ss.seed)
    graph = base_pub.graph
    rng = np.random.default_rng(ss.seed)
    sampler = Sampler(graph, ss.fanouts)
    batches = [sampler.sample(rng.choice(graph.num_nodes, ss.batch_size, replace=False)).input_nodes.numpy()
               for _ in range(ss.batches + 1)]
    warm, batches = batches[:1], batches[1:]
    del sampler
    structure_bytes = graph.nbytes - graph.feat.nbytes
    out["input_nodes_per_batch"] = [len(b) for b in batches]
    out["structure_bytes"] = structure_bytes
    layouts, used, gathers, publishes = {}, {}, {}, {1: publish_s}

    def run(probe) -> dict:
        return _summary(ray.get(probe.gather.remote(batches)), row_bytes)

    # K = 1: a reader on every node (each pulls the whole graph), kept on the head and node 1 for the baselines.
    probes = {n: _probe(n, base_pub.handle) for n in cl.nodes}
    ray.get([p.gather.remote(warm) for p in probes.values()])
    layouts[1], used[1] = _layout(cl, base_pub.handle)
    base = {"head": probes[cl.head], "node": probes[cl.nodes[1]]}
    for n, p in probes.items():
        if p not in base.values():
            ray.kill(p)
    gathers["K=1, head"] = run(base["head"])
    gathers["K=1, node 1"] = run(base["node"])
    print(f"  K=1: {gathers['K=1, head']['gather_ms']:.0f} ms/batch on the head", flush=True)

    configs = [(k, ss.cache) for k in ss.shards if k > 1] + [(max(ss.shards), c) for c in ss.caches if c != ss.cache]
    for k, cache in configs:
        key = f"K={k}, cache {cache:g}"
        pub, publishes[key] = _publish(data, k, cache, ss.seed)
        h = pub.handle
        shard0 = h.features.shards[0].node_id
        # The K rows (default cache): every node reads as a trainer would, for the layout; else two readers.
        everywhere = cache == ss.cache
        probes = {n: _probe(n, h) for n in (cl.nodes if everywhere else [cl.head, shard0])}
        ray.get([p.gather.remote(warm) for p in probes.values()])
        if everywhere:
            layouts[k], used[k] = _layout(cl, h, base_pub.handle)
            expected = dict(structure=structure_bytes, shard=h.features.shard_bytes,
                            cache=cache_nbytes(graph.num_nodes, ss.feat_dim, "float32", cache))
            layouts[f"{k} expected per shard node"] = expected
        before = run(base["head"])
        gathers[f"{key}, head"] = run(probes[cl.head])
        gathers[f"{key}, shard node"] = run(probes[shard0])
        after = run(base["head"])
        gathers[f"{key}, K=1 head beside"] = dict(before=before, after=after,
                                                   gather_ms=(before["gather_ms"] + after["gather_ms"]) / 2,
                                                   rows_per_s=(before["rows_per_s"] + after["rows_per_s"]) / 2)
        g = gathers[f"{key}, head"]
        print(f"  {key}: {g['gather_ms']:.0f} ms/batch on the head, {g['remote_mib']:.1f} MiB remote, cache hit "
              f"{g['cache_hit_rate']:.1%}", flush=True)
        for p in probes.values():
            ray.kill(p)
        del probes, pub, h
        gc.collect()
    for p in base.values():
        ray.kill(p)
    del base, base_pub, graph
    gc.collect()
    out.update(layouts=layouts, store_check=used,
               gathers={k: {kk: vv for kk, vv in v.items() if kk != "per_batch"} for k, v in gathers.items()},
               gathers_per_batch={k: v.get("per_batch") for k, v in gathers.items()}, publish_s=publishes)
    return gather_rows(ss, layouts, gathers)


def gather_rows(ss: ShardSettings, layouts: dict, gathers: dict) -> list[Row]:
    rows = []
    node_mib = {k: {n: sum(v.values()) / MIB for n, v in layouts[k].items()} for k in ss.shards if k in layouts}
    base_max = max(node_mib[1].values())
    for k in ss.shards:
        if k == 1 or k not in node_mib:
            continue
        top, low = max(node_mib[k].values()), min(node_mib[k].values())
        e = layouts[f"{k} expected per shard node"]
        rows.append(Row(f"{FIGURE}: object store per node, K={k} (max / min over nodes; structure+shard+cache = "
                        f"{sum(e.values()) / MIB:.1f})", ours=f"{top:.1f} / {low:.1f} MiB",
                        baseline=f"{base_max:.1f} MiB (K=1)", ratio=f"{top / base_max:.2f}x", target="-", met="-",
                        detail=dict(per_node_mib=node_mib[k], replicated_per_node_mib=node_mib[1])))
    for k in ss.shards:
        key = f"K={k}, cache {ss.cache:g}"
        if k == 1 or f"{key}, head" not in gathers:
            continue
        b = gathers[f"{key}, K=1 head beside"]
        for where, suffix in (("head (no shard)", "head"), ("shard node", "shard node")):
            g = gathers[f"{key}, {suffix}"]
            rows.append(Row(f"{FIGURE}: remote MiB per batch, {key}, reader on {where}",
                            ours=f"{g['remote_mib']:.1f} ({g['remote_share']:.0%} of rows)",
                            baseline=f"{g['batch_mib']:.1f} (batch)",
                            ratio=f"{g['remote_mib'] / g['batch_mib']:.2f}x", target="-", met="-", detail=g))
            rows.append(Row(f"{FIGURE}: gather ms per batch (remote wait), {key}, reader on {where}",
                            ours=f"{g['gather_ms']:.0f} ({g['wait_ms']:.0f})", baseline=f"{b['gather_ms']:.0f} (K=1)",
                            ratio=f"{g['gather_ms'] / b['gather_ms']:.2f}x", target="-", met="-",
                            detail=dict(ours=g, baseline=b)))
    k = max(ss.shards)
    none = gathers.get(f"K={k}, cache 0, head")
    for cache in ss.caches:
        key = f"K={k}, cache {cache:g}"
        if f"{key}, head" not in gathers:
            continue
        g, n = gathers[f"{key}, head"], gathers[f"{key}, shard node"]
        rows.append(Row(f"{FIGURE}: cache hit rate, --feature-cache {cache:g} (K={k}); remote MiB/batch head / "
                        f"shard node", ours=f"{g['cache_hit_rate']:.1%}; {g['remote_mib']:.1f} / {n['remote_mib']:.1f}",
                        baseline=f"{cache:.0%}; {none['remote_mib']:.1f} (cache 0)" if none else f"{cache:.0%}",
                        ratio=f"{g['remote_mib'] / none['remote_mib']:.2f}x bytes" if none else "-",
                        target="-", met="-", detail=dict(head=g, shard_node=n)))
    key = f"K={k}, cache {ss.cache:g}"
    if f"{key}, head" in gathers:
        b = gathers[f"{key}, K=1 head beside"]
        for where, suffix in (("head (no shard)", "head"), ("shard node", "shard node")):
            g = gathers[f"{key}, {suffix}"]
            rows.append(Row(f"{FIGURE}: gather rows/s, K={k} vs K=1, reader on {where}",
                            ours=f"{g['rows_per_s']:,.0f}", baseline=f"{b['rows_per_s']:,.0f}",
                            ratio=f"{g['rows_per_s'] / b['rows_per_s']:.2f}x", target="-", met="-",
                            detail=dict(ours=g, baseline=b)))
    return rows


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
            path = Path(cfg.run.storage_path) / name / "metrics.jsonl"
            epochs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            runs[shards].append(dict(name=name, wall_s=wall_s, last=summary.metrics, epochs=epochs))
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


# ---------------------------------------------------------------------------------------------------------------
# 6-7. CPU of the job's own processes per steady epoch; the driver's memory against the feature table.

_TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(root: int) -> float:
    """CPU-seconds (user + system, all threads) of ``root`` and every live process descended from it.

    The simulated cluster's daemons and workers descend from the process that
    started it, so this is the job's CPU alone; ``/proc/stat`` would add every
    other process on a shared machine (other engineers' test clusters here).
    """
    kids: dict = {}
    cpu: dict = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        kids.setdefault(int(stat[1]), []).append(int(pid))
        cpu[int(pid)] = (int(stat[11]) + int(stat[12])) / _TICK
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += cpu.get(pid, 0.0)
        stack.extend(kids.get(pid, ()))
    return total


def bench_cluster_cpu(ss: ShardSettings, data, workdir: Path, out: dict) -> list[Row]:
    """CPU-seconds of the job's processes per steady epoch (epochs 2.., each window one epoch line to the
    next), K = max(shards) against K = 1, alternating; the whole machine's busy CPU beside it (polluted)."""
    import threading

    from bench.cpu import machine_busy_s
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
            log = Path(cfg.run.storage_path) / name / "metrics.jsonl"
            snaps, stop = [], threading.Event()

            def watch() -> None:
                seen = 0
                while not stop.wait(0.05):
                    try:
                        n = log.read_text().count("\n")
                    except OSError:
                        continue
                    if n > seen:
                        seen = n
                        snaps.append((time.perf_counter(), tree_cpu_s(os.getpid()), machine_busy_s()))

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            run(cfg)
            stop.set()
            watcher.join()
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


# Run in a child process (its own peak RSS): publish with --feature-shards and report the driver's memory.
_DRIVER_PROBE = """
import ctypes, json, resource, sys
import psutil
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
print("RESULT" + json.dumps(dict(peak_rss=int(status["VmHWM"].split()[0]) * 1024, rss=info.rss,
                                 uss=info.uss, vm_data=int(status["VmData"].split()[0]) * 1024,
                                 source=type(pub.source).__name__)))
"""


def driver_memory(address: str, data, name: str, workdir: Path, limit_bytes: int = 0) -> dict:
    """The driver's peak RSS, and RSS and USS after publishing ``data``, in a fresh process joining ``address``
    (under ``RLIMIT_DATA`` = ``limit_bytes`` if given: private memory past it fails the process)."""
    import subprocess
    import sys

    spec = dict(data=dataclasses.asdict(data), run=dict(name=name, storage_path=str(workdir / "runs")))
    env = dict(os.environ, RAY_ADDRESS=address)
    proc = subprocess.run([sys.executable, "-c", _DRIVER_PROBE, json.dumps(spec), str(limit_bytes)], env=env,
                          capture_output=True, text=True, timeout=1800, cwd=Path(__file__).resolve().parents[1])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    if proc.returncode or not lines:
        tail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        return dict(failed=f"exit {proc.returncode}: {tail}")
    return json.loads(lines[-1][len("RESULT"):])


def bench_driver_memory(cl: SimulatedCluster, ss: ShardSettings, data, workdir: Path, out: dict) -> list[Row]:
    """The driver's memory with feature tables of two widths: generated on the shard nodes (K = 3), loaded by
    the driver (K = 1: the baseline the measurement must see grow), and read into driver memory then
    spilled (synthetic-hetero, K = 3: the load peaks, what stays after publishing must not grow)."""
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
    """A feature table twice the driver's limit: the driver runs under ``RLIMIT_DATA`` (its private writable
    memory: heap, thread stacks; the object store's shared pages are not counted) of ``limit_gb``, and
    publishes a generated table of twice that with K = 3 (must succeed) and K = 1 (must fail: the baseline
    that shows the limit bites). Its own cluster: 3 nodes with stores that fit a third of the table each."""
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
    return rows
