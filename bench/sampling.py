"""Sampling seeds/s: gnnray's sampler against GraphBolt's, the sampler it replaced, on the same cores.

``python -m bench.sampling [--threads 1 2] [--batches 60]``: both sample the same seeds, turns alternating, on the
arxiv structure and a products-sized synthetic graph (GraphBolt's side needs the dgl extra's environment); also
the numba kernels' compile into an empty cache and load from it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.harness import DEFAULT_DATASET, REPO, dgl_or_none, interleaved, write_json
from gnnray.data.graph import Graph

PRODUCTS_NODES = 2_449_029
BATCH = 1024


def side_by_side(samplers: dict, batches: list, warmup: int) -> dict:
    """Every batch by each sampler, taking turns: median ms a batch, seeds/s and edges a batch."""
    def one(name: str):
        def run(i: int) -> tuple:
            start = time.perf_counter()
            mb = samplers[name](batches[i], i)
            return time.perf_counter() - start, sum(int(layer.indices.shape[0]) for layer in mb.layers)
        return run

    runs = interleaved({name: one(name) for name in samplers}, len(batches) - warmup, warmup)
    out = {}
    for name, rs in runs.items():
        ms = 1000 * statistics.median(t for t, _ in rs)
        out[name] = dict(ms=ms, seeds_per_s=1000 * BATCH / ms, edges=statistics.median(e for _, e in rs),
                         batches=len(rs))
    return out


def samplers_for(graph: Graph, fanouts: tuple, threads: int, graphbolt: bool) -> dict:
    import torch

    from gnnray.sampler.sampler import Sampler

    torch.set_num_threads(threads)
    ours = Sampler(graph, fanouts, seed=0, threads=threads)
    out = {"gnnray": lambda seeds, i: ours.sample(seeds, epoch=0, batch=i)}
    if graphbolt:
        from gnnray.sampler.graphbolt import GraphBoltSampler

        gb = GraphBoltSampler(graph, fanouts, threads)  # sets torch's and DGL's threads
        out["graphbolt"] = lambda seeds, i: gb.sample(seeds, epoch=0)
    return out


def graphs(arxiv: str, products: bool) -> list[tuple[str, Graph, tuple, np.ndarray]]:
    """(name, graph, fanouts, seed pool) of each graph measured."""
    from gnnray.config import DataConfig
    from gnnray.data.load import load_structure
    from gnnray.data.synthetic import synthetic_parts

    out = []
    if os.path.isdir(arxiv):
        graph, _ = load_structure(DataConfig(dataset=arxiv, reverse_edges=True, random_features=1), 0)
        out.append(("arxiv-structure", graph, (10, 10, 10), graph.train_idx))
    else:
        print(f"{arxiv} not found: arxiv skipped", flush=True)
    if products:
        parts = synthetic_parts(PRODUCTS_NODES, 47, 1, 50, 0)
        graph = parts.build(reverse=True)
        out.append(("products-sized synthetic", graph, (15, 10, 5), np.arange(graph.num_nodes)))
    return out


def compile_times() -> dict:
    """Seconds for a new process to compile the kernels into an empty cache, then to load them from it."""
    code = ("import time, numpy as np; t = time.perf_counter(); from gnnray.sampler.pick import warm_up; "
            "i = time.perf_counter(); warm_up(np.int32, np.int32); print(i - t, time.perf_counter() - i)")
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache, "PYTHONPATH": str(REPO)}
        for step in ("compile", "cached"):
            run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=cache)
            imported, warm = map(float, run.stdout.split())
            out[step] = dict(import_s=imported, kernels_s=warm)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=60, help="timed batches per graph and thread count (after 5 "
                   "warm-up ones)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="threads of each sampler")
    p.add_argument("--no-products", action="store_true", help="leave out the products-sized graph")
    p.add_argument("--dataset", default=str(DEFAULT_DATASET), help="the arxiv structure's graph directory")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)
    graphbolt = dgl_or_none() is not None
    if not graphbolt:
        print("DGL cannot be loaded here (current torch): gnnray's sampler only", flush=True)
    results = []
    compiled = compile_times()
    print(f"numba kernels in a new process: compile {compiled['compile']['kernels_s']:.2f} s into an empty cache, "
          f"load {compiled['cached']['kernels_s']:.2f} s from it (import {compiled['cached']['import_s']:.2f} s)")
    for name, graph, fanouts, pool in graphs(args.dataset, not args.no_products):
        rng = np.random.default_rng(0)
        batches = [rng.choice(pool, BATCH, replace=False) for _ in range(args.batches + 5)]
        for threads in args.threads:
            timing = side_by_side(samplers_for(graph, fanouts, threads, graphbolt), batches, 5)
            row = dict(graph=name, nodes=graph.num_nodes, edges=graph.num_edges, fanouts=fanouts, threads=threads,
                       timing=timing)
            line = f"{name}, fanouts {','.join(map(str, fanouts))}, {threads} thread(s): " + ", ".join(
                f"{k} {v['ms']:.1f} ms/batch ({v['seeds_per_s']:,.0f} seeds/s, {v['edges']:,.0f} edges)"
                for k, v in timing.items())
            if graphbolt:
                row["ratio"] = timing["gnnray"]["seeds_per_s"] / timing["graphbolt"]["seeds_per_s"]
                line += f"; ours/GraphBolt {row['ratio']:.2f}x"
            print(line, flush=True)
            results.append(row)
        del graph
    write_json(args.json, dict(load_avg=os.getloadavg(), compile=compiled, results=results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
