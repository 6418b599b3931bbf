"""The sharding section's gathers: the object store per node, remote rows per batch and the cache hit rate.

Probe actors pinned to nodes read features as a train worker does; the K = 1 reader on the head runs before and
after each configuration, and the baseline is the mean of the two.
"""

from __future__ import annotations

import gc
import statistics
import time

import numpy as np

from bench.harness import Row
from bench.sharding.cluster import FIGURE, MIB, ShardSettings, SimulatedCluster, bytes_on, publish


class GatherProbe:
    """A Ray actor pinned to a node that reads features as a train worker does: per batch, the gather's wall time
    into a reused buffer and what the reader counted."""

    def __init__(self, handle):
        from gnnray.train.feature_reader import reader_for

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
    share = lambda k: sum(b[k] for b in per) / max(rows, 1)  # noqa: E731
    return dict(batches=len(per), gather_ms=1e3 * med("s"), wait_ms=1e3 * med("wait_s"),
                rows_per_batch=med("rows"), remote_mib=med("remote_bytes") / MIB,
                batch_mib=med("rows") * feat_bytes_per_row / MIB, remote_calls=med("remote_calls"),
                rows_per_s=rows / sum(b["s"] for b in per), cache_hit_rate=share("cached_rows"),
                local_share=share("local_rows"), remote_share=share("remote_rows"), per_batch=per)


def _layout(cl: SimulatedCluster, handle, baseline=None) -> tuple[dict, dict]:
    """Each node's bytes of ``handle``'s objects; and its raylet's ``object_store_bytes_used`` beside this layout's
    bytes, the K = 1 baseline's (still alive) and the rest (rows in flight, objects freed but not yet deleted)."""
    mine = bytes_on(cl, handle)
    base = bytes_on(cl, baseline) if baseline is not None else {}
    used = cl.raylet_used()
    check = {}
    for n in cl.nodes:
        a, b = sum(mine.get(n, {}).values()), sum(base.get(n, {}).values())
        check[cl.name(n, handle)] = dict(raylet_used_mib=used.get(n, float("nan")) / MIB, layout_mib=a / MIB,
                                         k1_baseline_mib=b / MIB, other_mib=(used.get(n, float("nan")) - a - b) / MIB)
    return {cl.name(n, handle): v for n, v in mine.items()}, check


def bench_cluster_gathers(cl: SimulatedCluster, ss: ShardSettings, data, out: dict) -> list[Row]:
    """Per-node layout, remote fetch per batch, cache hit rates, and the gather's rows/s."""
    import ray

    from gnnray.sampler.sampler import Sampler
    from gnnray.store.shards import cache_nbytes

    row_bytes = ss.feat_dim * 4
    base_pub, publish_s = publish(data, 1, ss.cache, ss.seed)
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
        pub, publishes[key] = publish(data, k, cache, ss.seed)
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
    def row(figure, ours, base, ratio, detail=None) -> Row:
        return Row(f"{FIGURE}: {figure}", ours=ours, baseline=base, ratio=f"{ratio:.2f}x", target="-", met="-",
                   detail=detail or {})

    rows, k = [], max(ss.shards)
    node_mib = {k: {n: sum(v.values()) / MIB for n, v in layouts[k].items()} for k in ss.shards if k in layouts}
    base_max = max(node_mib[1].values())
    for j in (j for j in ss.shards if j > 1 and j in node_mib):
        top, low, e = max(node_mib[j].values()), min(node_mib[j].values()), layouts[f"{j} expected per shard node"]
        rows.append(row(f"object store per node, K={j} (max / min over nodes; structure+shard+cache = "
                        f"{sum(e.values()) / MIB:.1f})", f"{top:.1f} / {low:.1f} MiB", f"{base_max:.1f} MiB (K=1)",
                        top / base_max, dict(per_node_mib=node_mib[j], replicated_per_node_mib=node_mib[1])))
    readers = (("head (no shard)", "head"), ("shard node", "shard node"))
    for j in (j for j in ss.shards if j > 1 and f"K={j}, cache {ss.cache:g}, head" in gathers):
        key = f"K={j}, cache {ss.cache:g}"
        b = gathers[f"{key}, K=1 head beside"]
        for where, suffix in readers:
            g = gathers[f"{key}, {suffix}"]
            rows.append(row(f"remote MiB per batch, {key}, reader on {where}", f"{g['remote_mib']:.1f} "
                            f"({g['remote_share']:.0%} of rows)", f"{g['batch_mib']:.1f} (batch)",
                            g["remote_mib"] / g["batch_mib"], g))
            rows.append(row(f"gather ms per batch (remote wait), {key}, reader on {where}", f"{g['gather_ms']:.0f} "
                            f"({g['wait_ms']:.0f})", f"{b['gather_ms']:.0f} (K=1)", g["gather_ms"] / b["gather_ms"],
                            dict(ours=g, baseline=b)))
    none = gathers.get(f"K={k}, cache 0, head")
    for cache in (c for c in ss.caches if f"K={k}, cache {c:g}, head" in gathers):
        g, n = gathers[f"K={k}, cache {cache:g}, head"], gathers[f"K={k}, cache {cache:g}, shard node"]
        rows.append(Row(f"{FIGURE}: cache hit rate, --feature-cache {cache:g} (K={k}); remote MiB/batch head / "
                        f"shard node", ours=f"{g['cache_hit_rate']:.1%}; {g['remote_mib']:.1f} / {n['remote_mib']:.1f}",
                        baseline=f"{cache:.0%}; {none['remote_mib']:.1f} (cache 0)" if none else f"{cache:.0%}",
                        ratio=f"{g['remote_mib'] / none['remote_mib']:.2f}x bytes" if none else "-",
                        target="-", met="-", detail=dict(head=g, shard_node=n)))
    key = f"K={k}, cache {ss.cache:g}"
    if f"{key}, head" in gathers:
        b = gathers[f"{key}, K=1 head beside"]
        for where, suffix in readers:
            g = gathers[f"{key}, {suffix}"]
            rows.append(row(f"gather rows/s, K={k} vs K=1, reader on {where}", f"{g['rows_per_s']:,.0f}",
                            f"{b['rows_per_s']:,.0f}", g["rows_per_s"] / b["rows_per_s"], dict(ours=g, baseline=b)))
    return rows
