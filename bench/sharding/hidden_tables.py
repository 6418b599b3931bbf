"""Layer-wise inference's hidden tables: each node's store peak, sharded (K = 3) against unsharded (K = 1).

``python -m bench.sharding.hidden_tables [--quick] [--stores]`` (also a stage of ``python -m bench --sharding``):
a rank on each node of a simulated cluster runs ``train.layerwise.infer``, on stores with room for K = 1's whole
tables and on stores with room for K = 3's ranges only. ``--stores``: each node's whole store use, layer-wise
against sampled evaluation.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import time

import numpy as np

from bench.harness import Row, free_port, format_table, write_json
from bench.sharding.cluster import FIGURE, MIB, ShardSettings, SimulatedCluster, publish

# What each node's raylet says of its store: every object there (freed ones not yet deleted included), the
# primary copies it must keep, and what did not fit.
USED, PRIMARY = "object_store_bytes_used", "object_store_bytes_primary_copy"
SPILLED, FALLBACK = "spilled_bytes_total", "object_store_bytes_fallback"  # to disk; allocated outside the store
FIELDS = (USED, PRIMARY, SPILLED, FALLBACK)
# Each node's metrics endpoint: ray_object_store_memory in shared memory and in the store's disk fallback.
METRICS, STORE_LOCATIONS = "ray_object_store_memory", ("MMAP_SHM", "MMAP_DISK")


class Rank:
    """One rank of a gloo group, pinned to a node: attaches the graph, then runs layer-wise inference."""

    def __init__(self, handle, rank: int, world: int, port: int):
        import torch
        import torch.distributed as dist

        from gnnray.train.feature_reader import reader_for

        torch.set_num_threads(1)  # three ranks and their servers on this machine's cores
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        self._handle, self._rank, self._world, self._graph = handle, rank, world, handle.get()
        self._reader = reader_for(self._graph, handle.features)

    def ready(self) -> bool:
        return True

    def infer(self, model, chunk: int) -> tuple:
        from gnnray.train.layerwise import infer

        r = infer(model, self._graph, [self._reader], chunk, "cpu", self._rank, self._world,
                  shards=self._handle.features)
        return r.ranges, r.pred, r.seconds

    def sampled(self, model, cfg) -> tuple:
        """``--eval sampled``'s final accuracies as the train workers compute them (valid, test): the baseline."""
        from gnnray.train.evaluate import Evaluator

        start = time.perf_counter()
        ev = Evaluator(self._graph, cfg, self._rank, self._world, "cpu", features=self._reader, handle=self._handle)
        acc = [ev.accuracy(model, split) for split in ("valid", "test")]
        return [], np.asarray(acc), time.perf_counter() - start


def metrics_store_bytes(cl: SimulatedCluster, *fields: str) -> dict:
    """``{node_id: {METRICS: bytes}}``: each node's ``ray_object_store_memory`` over ``STORE_LOCATIONS`` from its
    metrics endpoint (every object in its store, copies fetched from other nodes included)."""
    import re
    import urllib.request

    import ray

    out = {}
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        try:
            with urllib.request.urlopen(f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics",
                                        timeout=2) as r:
                text = r.read().decode()
        except OSError:
            continue
        total = 0.0
        for m in re.finditer(r"^ray_object_store_memory\{([^}]*)\} (\S+)$", text, re.M):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            if labels.get("Location") in STORE_LOCATIONS and labels.get("NodeId", n["NodeID"]) == n["NodeID"]:
                total += float(m.group(2))
        out[n["NodeID"]] = {METRICS: int(total)}
    return out


def run_ranks(cl: SimulatedCluster, handle, model, nodes: list, num_nodes: int, chunk: int, poll_s: float,
              read=None, fields: tuple = FIELDS, sampled=None) -> dict:
    """Inference by one rank per node of ``nodes`` (with ``sampled``, a JobConfig: sampled evaluation): the
    predictions, and each node's largest ``read(cl, *fields)`` (the raylets' store stats) less the one before."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    read = read or SimulatedCluster.store_stats
    port = free_port()
    ranks = [ray.remote(Rank).options(num_cpus=0, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        n, soft=False)).remote(handle, r, len(nodes), port) for r, n in enumerate(nodes)]
    try:
        ray.get([r.ready.remote() for r in ranks])
        before = read(cl, *fields)
        peak, stop = {n: dict(v) for n, v in before.items()}, threading.Event()

        def poll() -> None:
            while not stop.wait(poll_s):
                for n, stats in read(cl, *fields).items():
                    for f, v in stats.items():
                        peak.setdefault(n, {})[f] = max(peak.get(n, {}).get(f, 0), v)

        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        start = time.perf_counter()
        results = ray.get([r.infer.remote(model, chunk) if sampled is None else r.sampled.remote(model, sampled)
                           for r in ranks])
        wall_s = time.perf_counter() - start
        stop.set()
        watcher.join()
    finally:
        for r in ranks:
            ray.kill(r)
    pred = np.full(num_nodes, -1)
    for ranges, p, _ in results:
        at = 0
        for lo, hi, _ in ranges:
            pred[lo:hi] = p[at:at + hi - lo]
            at += hi - lo
    grew = {f: {cl.name(n): (peak[n][f] - before.get(n, {}).get(f, 0)) / MIB for n in nodes} for f in fields}
    return dict(pred=pred, wall_s=wall_s, rank_s=[s for _, _, s in results], mib=grew,
                peak_mib={cl.name(n): peak[n][fields[0]] / MIB for n in nodes},
                before_mib={cl.name(n): before.get(n, {}).get(fields[0], 0) / MIB for n in nodes},
                accuracy=[p.tolist() for r, p, _ in results if not r] or None)


def remote_rows(graph, lo: int, hi: int, chunk: int) -> int:
    """Rows of a hidden table the chunks of nodes ``[lo, hi)`` read from outside it: what a shard node's ranks fetch
    per layer (again by each chunk that reads it)."""
    from gnnray.train.layerwise import full_block

    total = 0
    for a in range(lo, hi, chunk):
        _, src = full_block(graph, a, min(a + chunk, hi))
        total += int(np.count_nonzero((src < lo) | (src >= hi)))
    return total


def runs_on(ss: ShardSettings, data, store_mib: int, plan: tuple, layers: int, hidden: int, verbose: bool,
            **run_kw) -> dict:
    """On a new cluster of ``store_mib`` stores, :func:`run_ranks` for each ``(name, K, sampled)`` of ``plan``: on
    the shard nodes (K > 1; else the last run's), with the same weights."""
    import ray
    import torch

    from gnnray.config import parse_args
    from gnnray.models.model import build_model

    runs = {}
    cl = SimulatedCluster(dataclasses.replace(ss, store_mib=store_mib), verbose)
    try:
        for name, shards, sampled in plan:
            pub, _ = publish(data, shards, ss.cache, ss.seed)
            graph, handle = pub.graph, pub.handle
            torch.manual_seed(ss.seed)
            model = build_model(ss.feat_dim, graph.num_classes, layers, hidden, 0.0).eval()
            nodes = [s.node_id for s in handle.features.shards] if shards > 1 else list(runs.values())[-1]["nodes"]
            cfg = dataclasses.replace(parse_args(["--fanouts", ",".join(["10"] * layers)]), data=dataclasses.replace(
                data, feature_shards=shards)) if sampled else None
            runs[name] = run = dict(run_ranks(cl, handle, model, nodes, graph.num_nodes, sampled=cfg, **run_kw),
                                    nodes=nodes)
            if shards > 1 and "read" not in run_kw:  # the servers' own count, and the rows fetched
                run["server_peak_mib"] = {cl.name(s.node_id): ray.get(s.server.hidden_bytes.remote())["peak"] / MIB
                                          for s in handle.features.shards}
                run["fetched_mib_per_layer"] = {cl.name(s.node_id): remote_rows(graph, s.lo, s.hi, run_kw["chunk"])
                                                * hidden * 4 / MIB for s in handle.features.shards}
            fields = run_kw.get("fields", FIELDS)
            print(f"  {name}, {store_mib} MiB stores: per node, store peak ("
                  f"{' / '.join(f.split('_')[-1] for f in fields)}): " + ", ".join(
                      f"{n} " + " / ".join(f"+{run['mib'][f][n]:.1f}" for f in fields) for n in run["mib"][fields[0]])
                  + f" MiB; {run['wall_s']:.1f} s", flush=True)
            del pub, graph, handle
            gc.collect()
    finally:
        cl.close()
    return runs


def bench_layerwise(ss: ShardSettings, data, verbose: bool, out: dict) -> list[Row]:
    """K = 3 against K = 1 on stores of ``store_mib`` and of ``infer_store_mib``: store peaks, spills, the
    servers' counts, predictions."""
    from gnnray.store.shards import hidden_nbytes

    k = max(ss.shards)
    widths = [ss.infer_hidden] * (ss.infer_layers - 1)
    # K = 3 then K = 1, inference on the same nodes, on each size of store.
    clusters = {store: runs_on(ss, data, store, ((k, k, False), (1, 1, False)), ss.infer_layers, ss.infer_hidden,
                               verbose, chunk=ss.infer_chunk, poll_s=ss.poll_s)
                for store in (ss.store_mib, ss.infer_store_mib)}
    roomy, tight = clusters[ss.store_mib], clusters[ss.infer_store_mib]
    n = roomy[k]["pred"].shape[0]
    table = n * ss.infer_hidden * 4 / MIB
    formula = {k: hidden_nbytes(n, widths, k) / MIB, 1: len(widths) * table}
    agree = {store: float(np.mean(runs[k]["pred"] == runs[1]["pred"])) for store, runs in clusters.items()}
    out["layerwise"] = dict(nodes=n, layers=ss.infer_layers, hidden=ss.infer_hidden, chunk=ss.infer_chunk,
                            table_mib=table, formula_mib=formula, pred_agree=agree, runs={
                                store: {shards: {key: v for key, v in r.items() if key != "pred"}
                                        for shards, r in runs.items()} for store, runs in clusters.items()})

    def most(runs: dict, shards: int, field: str) -> float:
        return max(runs[shards]["mib"][field].values())

    def lost(runs: dict, shards: int) -> float:  # spilled to disk or allocated outside the store, worst node
        return max(a + b for a, b in zip(runs[shards]["mib"][SPILLED].values(),
                                         runs[shards]["mib"][FALLBACK].values()))

    server = max(roomy[k]["server_peak_mib"].values())
    fetched = max(roomy[k]["fetched_mib_per_layer"].values())
    tables = f"{ss.infer_layers} layers x {ss.infer_hidden}, table {table:.1f} MiB"
    p, u = most(roomy, k, PRIMARY), {shards: most(roomy, shards, USED) for shards in (k, 1)}
    return [
        Row(f"{FIGURE}: layer-wise, K={k}: store peak per node, primary copies (max of 3; {tables}; "
            f"{ss.store_mib} MiB stores)", ours=f"+{p:.1f} MiB", baseline=f"2 x table / K = {formula[k]:.1f} MiB",
            ratio=f"{p / formula[k]:.2f}x", target="formula + rows in flight", met="-", detail=out["layerwise"]),
        Row(f"{FIGURE}: layer-wise store peak per node, all objects (freed ones not yet deleted too), K={k} vs K=1",
            ours=f"+{u[k]:.1f} MiB", baseline=f"+{u[1]:.1f} MiB (tables whole: {formula[1]:.1f})",
            ratio=f"{u[k] / u[1]:.2f}x", target="-", met="-"),
        Row(f"{FIGURE}: layer-wise on {ss.infer_store_mib} MiB stores: MiB spilled or outside the store (worst "
            f"node), K={k} vs K=1", ours=f"{lost(tight, k):.1f} (all objects +{most(tight, k, USED):.1f})",
            baseline=f"{lost(tight, 1):.1f}", ratio="-", target=f"K={k}: 0",
            met="yes" if lost(tight, k) == 0 else "NO"),
        Row(f"{FIGURE}: layer-wise, K={k}: hidden rows fetched from other nodes per layer per node (max of {k}; "
            f"chunks of {ss.infer_chunk})", ours=f"{fetched:.1f} MiB", baseline=f"{(k - 1) / k * table:.1f} MiB "
            f"(K=1: the other nodes' slices, once)", ratio=f"{fetched / ((k - 1) / k * table):.2f}x", target="-",
            met="-", detail=roomy[k]["fetched_mib_per_layer"]),
        Row(f"{FIGURE}: hidden rows a shard server held at most (max of {k}), against 2 x table / K",
            ours=f"{server:.2f} MiB", baseline=f"{formula[k]:.2f} MiB", ratio=f"{server / formula[k]:.2f}x",
            target="<= 1.00x", met="yes" if server <= formula[k] + 1e-9 else "NO",
            detail=roomy[k]["server_peak_mib"]),
        Row(f"{FIGURE}: layer-wise predictions, K={k} equal to K=1 (both clusters)",
            ours=" / ".join(f"{a:.2%}" for a in agree.values()), baseline="100%", ratio="-", target="100%",
            met="yes" if all(a == 1.0 for a in agree.values()) else "NO"),
        Row(f"{FIGURE}: layer-wise wall s, K={k} vs K=1, {ss.store_mib} MiB stores (contended: all on this "
            f"machine's cores)", ours=f"{roomy[k]['wall_s']:.1f}", baseline=f"{roomy[1]['wall_s']:.1f}",
            ratio=f"{roomy[k]['wall_s'] / roomy[1]['wall_s']:.2f}x", target="-", met="-"),
    ]


def bench_stores(ss: ShardSettings, data, verbose: bool, out: dict) -> list[Row]:
    """The store run on ``stores_store_mib`` stores: K = 3 sampled, then layer-wise evaluation, then K = 1's
    layer-wise predictions; each node's whole store use at its peak (metrics every ``metrics_s``)."""
    import os
    from unittest import mock

    from gnnray.store.shards import hidden_nbytes

    k = max(ss.shards)
    # The cluster's processes read the metrics' interval from the environment it starts with.
    with mock.patch.dict(os.environ, RAY_metrics_report_interval_ms=str(int(ss.metrics_s * 1000))):
        runs = runs_on(ss, data, ss.stores_store_mib, (("sampled", k, True), ("layerwise", k, False),
                                                       ("layerwise K=1", 1, False)), ss.stores_layers,
                       ss.stores_hidden, verbose, chunk=ss.stores_chunk, poll_s=ss.metrics_s, read=metrics_store_bytes,
                       fields=(METRICS,))
    n = runs["layerwise"]["pred"].shape[0]
    table = n * ss.stores_hidden * 4 / MIB
    bound = 2 * table / k  # the tables of two layers' ranges; with 2 layers one table's range, at most
    ranges = hidden_nbytes(n, [ss.stores_hidden] * (ss.stores_layers - 1), k) / MIB
    lw, base = runs["layerwise"]["peak_mib"], runs["sampled"]["peak_mib"]
    above = {node: lw[node] - base[node] for node in lw}
    agree = float(np.mean(runs["layerwise"]["pred"] == runs["layerwise K=1"]["pred"]))
    out["stores"] = dict(nodes=n, layers=ss.stores_layers, hidden=ss.stores_hidden, chunk=ss.stores_chunk,
                         store_mib=ss.stores_store_mib, table_mib=table, bound_mib=bound, ranges_mib=ranges,
                         above_mib=above,
                         pred_agree=agree, runs={name: {key: v for key, v in r.items() if key != "pred"}
                                                 for name, r in runs.items()})
    worst = max(above.values())
    return [
        Row(f"{FIGURE}: layer-wise, K={k}: each node's whole store use at its peak over --eval sampled's (metrics "
            f"endpoint, MMAP_SHM + MMAP_DISK; {ss.stores_layers} layers x {ss.stores_hidden}, table {table:.1f} "
            f"MiB; {ss.stores_store_mib} MiB stores)", ours=", ".join(f"+{v:.1f}" for v in above.values())
            + " MiB", baseline=f"2 x table / K = {bound:.1f} MiB (the ranges held: {ranges:.1f})",
            ratio=f"{worst / bound:.2f}x", target="<= 1.00x",
            met="yes" if worst <= bound else "NO", detail=out["stores"]),
        Row(f"{FIGURE}: the same run's predictions, K={k} equal to K=1", ours=f"{agree:.2%}", baseline="100%",
            ratio="-", target="100%", met="yes" if agree == 1.0 else "NO"),
    ]


def main(argv=None) -> int:
    import argparse
    import tempfile
    from pathlib import Path

    from bench.sharding.cluster import graph_dir, settings

    p = argparse.ArgumentParser(prog="python -m bench.sharding.hidden_tables", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the section's --quick settings")
    p.add_argument("--json", default="", help="where to write the figures")
    p.add_argument("--verbose", action="store_true", help="show the logs of Ray's workers")
    p.add_argument("--stores", action="store_true", help="the store run instead: each node's whole store use, "
                   "layer-wise against sampled evaluation (stores_* settings)")
    args = p.parse_args(argv)
    ss, out = settings(args.quick), {}
    if args.stores:
        ss = dataclasses.replace(ss, nodes=ss.stores_nodes)
    with tempfile.TemporaryDirectory() as tmp:
        data, info = graph_dir(ss, Path(tmp))
        print(f"graph: {info['nodes']:,} nodes, {info['edges']:,} edges, {ss.feat_dim} float32 features; a head and "
              f"{ss.worker_nodes} nodes", flush=True)
        rows = (bench_stores if args.stores else bench_layerwise)(ss, data, args.verbose, out)
    print(format_table(rows), flush=True)
    write_json(args.json, dict(graph=info, settings=dataclasses.asdict(ss), **out))
    return 0 if all(r.met != "NO" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
