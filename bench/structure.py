"""Sampling time and structure bytes: gnnray's ``Sampler`` (GraphBolt) against the DGL sampler it replaced.

Run with ``.venv/bin/python -m bench.structure [--batches 60] [--threads 1]
[--synthetic-nodes 1000000] [--json out.json]``. No Ray: both samplers run
in this process, on the same seeds, taking turns batch by batch (the order
alternates), so machine load hits both alike. Per batch it records wall time
and this process's CPU time; the figures are medians, and the ratio is DGL's
over GraphBolt's (above 1: GraphBolt is faster).

Graphs (reverse edges, fanouts 10,10,10, 1024 seeds per batch):

1. **arxiv-structure** (``../shared/datasets``): int32 ``indptr`` and
   ``indices``, as both samplers take it; seeds from its training split.
2. **synthetic**, papers100M's average degree (29), laid out as a graph past
   2**31 edges: node 0 has 2**31 + 5 self loops, a hole in a sparse file,
   so ``indptr`` is int64 and every other node's edges lie past offset
   2**31. GraphBolt samples that with int32 ``indices``. The DGL sampler
   needs both arrays int64 there (``dgl.graph`` takes one dtype), which was
   gnnray's layout past 2**31 edges: it samples the same graph without the
   hole (node 0 without edges; no node has node 0 as a neighbor, and no seed
   is node 0, so both samplers see the same neighbor lists).

``--threads`` is the torch and DGL threads of each sampler: 1 is a sampler
actor of one CPU (the CPU plan gives an actor its CPUs' worth).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np

from bench.common import DEFAULT_DATASET, threads
from gnnray.data.graph import Graph

FANOUTS = (10, 10, 10)
BATCH = 1024
LOOPS = 2**31 + 5  # node 0's in-edges in the synthetic layout: offsets past what int32 holds


class DglSampler:
    """The sampler gnnray used before GraphBolt: DGL 2.1's ``NeighborSampler`` over ``store.to_dgl``.

    Kept here only as the baseline. It includes the work-around its fused
    CPU path needed on int32 graphs (a scratch array of the graph's idtype).
    """

    def __init__(self, graph: Graph, fanouts: tuple):
        import dgl

        from gnnray.data.store import to_dgl

        self._graph, self._g = graph, to_dgl(graph)
        self._sampler = dgl.dataloading.NeighborSampler(list(fanouts))

    def sample(self, seeds: np.ndarray) -> int:
        """Sample the blocks of ``seeds`` into the batch's layers as the old sampler did; the edges sampled."""
        import dgl
        import torch

        s, g = self._sampler, self._g
        fused = g.idtype != torch.int64 and s.fused and dgl.utils.get_num_threads() > 1
        if fused:
            if s.g is not g:
                s.g, s.mapping = g, {}
            s.mapping.setdefault(f"__mapping{os.getpid()}", [torch.full((g.num_nodes(),), -1, dtype=g.idtype)])
        _, output_nodes, blocks = s.sample_blocks(g, torch.from_numpy(seeds.astype(self._graph.indices.dtype)))
        edges = sum(int(block.adj_tensors("csc")[1].shape[0]) for block in blocks)
        _ = self._graph.label[output_nodes.numpy()]  # as the old sampler's batch had its labels
        return edges


def _gb(graph: Graph):
    from gnnray.pipeline.sampler import Sampler

    sampler = Sampler(graph, FANOUTS)
    return lambda seeds: sum(int(layer.indices.shape[0]) for layer in sampler.sample(seeds).layers)


def side_by_side(samplers: dict, batches: list, warmup: int) -> dict:
    """Time each sampler on every batch, taking turns; medians of wall and CPU ms per batch, edges per batch."""
    times = {name: [] for name in samplers}
    cpu = {name: [] for name in samplers}
    edges = {name: [] for name in samplers}
    names = list(samplers)
    for i, seeds in enumerate(batches):
        for name in (names if i % 2 == 0 else names[::-1]):
            start, c = time.perf_counter(), time.process_time()
            e = samplers[name](seeds)
            wall, c = time.perf_counter() - start, time.process_time() - c
            if i >= warmup:
                times[name].append(1000 * wall)
                cpu[name].append(1000 * c)
                edges[name].append(e)
    return {name: dict(wall_ms=statistics.median(times[name]), cpu_ms=statistics.median(cpu[name]),
                       edges=statistics.median(edges[name]), batches=len(times[name])) for name in names}


def seed_batches(pool: np.ndarray, count: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [rng.choice(pool, BATCH, replace=False) for _ in range(count)]


def arxiv(batches: int, warmup: int) -> dict:
    from gnnray.config import DataConfig
    from gnnray.data.load import load_structure

    graph, _ = load_structure(DataConfig(dataset=str(DEFAULT_DATASET), reverse_edges=True, random_features=1), 0)
    seeds = seed_batches(graph.train_idx, batches + warmup)
    timing = side_by_side({"dgl": DglSampler(graph, FANOUTS).sample, "graphbolt": _gb(graph)}, seeds, warmup)
    return dict(graph="arxiv-structure", nodes=graph.num_nodes, edges=graph.num_edges,
                dtypes=f"{graph.indptr.dtype}/{graph.indices.dtype}", timing=timing,
                structure_bytes=dict(both=graph.indptr.nbytes + graph.indices.nbytes))


def synthetic(nodes: int, batches: int, warmup: int, workdir: str) -> dict:
    from gnnray.data.synthetic import synthetic_parts

    base = synthetic_parts(nodes - 1, 1, 2, 29, 0).build(reverse=True)  # avg in-degree ~29 with reverse edges
    shifted = (base.indices + 1).astype(np.int32)  # node v becomes v + 1: node 0 is nobody's neighbor
    e = shifted.size
    label = np.zeros(nodes, dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)

    def graph(indptr, indices) -> Graph:
        return Graph(indptr, indices, np.zeros((nodes, 0), np.float32), label, np.arange(1, nodes), empty, empty, 2)

    # Today's layout past 2**31 edges: both int64. Node 0 without edges here.
    wide = graph(np.concatenate([[0], base.indptr]).astype(np.int64), shifted.astype(np.int64))
    # The new one: node 0's 2**31 + 5 loops first (a sparse file's hole), then everyone's edges, int32 ids.
    path = os.path.join(workdir, "indices.int32")
    with open(path, "wb") as f:
        f.truncate((LOOPS + e) * 4)
    tail = np.memmap(path, dtype=np.int32, mode="r+", offset=LOOPS * 4)
    tail[:] = shifted
    tail.flush()
    del tail
    mixed = graph(np.concatenate([[0], LOOPS + base.indptr.astype(np.int64)]), np.memmap(path, np.int32, "r"))
    assert mixed.indptr.dtype == np.int64 and mixed.indices.dtype == np.int32 and mixed.indptr[-1] > 2**31
    seeds = seed_batches(np.arange(1, nodes), batches + warmup)
    timing = side_by_side({"dgl": DglSampler(wide, FANOUTS).sample, "graphbolt": _gb(mixed)}, seeds, warmup)
    return dict(graph=f"synthetic {nodes:,} nodes, past 2**31 edges", nodes=nodes, edges=e,
                edges_with_loops=int(mixed.indptr[-1]), dtypes=dict(dgl="int64/int64", graphbolt="int64/int32"),
                timing=timing,
                # Per node of the real edges (the hole is virtual): what each layout keeps in every store.
                structure_bytes=dict(dgl=wide.indptr.nbytes + wide.indices.nbytes,
                                     graphbolt=mixed.indptr.nbytes + 4 * e))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=60, help="timed batches per graph (after 5 warm-up ones)")
    p.add_argument("--threads", type=int, default=1, help="torch and DGL threads")
    p.add_argument("--synthetic-nodes", type=int, default=1_000_000)
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)
    results = []
    with threads(args.threads), tempfile.TemporaryDirectory() as workdir:
        if DEFAULT_DATASET.is_dir():
            results.append(arxiv(args.batches, 5))
        else:
            print(f"{DEFAULT_DATASET} not found: arxiv skipped", flush=True)
        results.append(synthetic(args.synthetic_nodes, args.batches, 5, workdir))
    for r in results:
        t = r["timing"]
        print(f"{r['graph']} ({r['nodes']:,} nodes, {r['edges']:,} edges), {args.threads} thread(s), "
              f"median of {t['dgl']['batches']} batches:")
        for name in ("dgl", "graphbolt"):
            print(f"  {name:9s} {t[name]['wall_ms']:8.1f} ms wall {t[name]['cpu_ms']:8.1f} ms CPU "
                  f"{t[name]['edges']:,.0f} edges/batch")
        print(f"  ratio dgl/graphbolt: wall {t['dgl']['wall_ms'] / t['graphbolt']['wall_ms']:.2f}x, "
              f"CPU {t['dgl']['cpu_ms'] / t['graphbolt']['cpu_ms']:.2f}x; structure bytes {r['structure_bytes']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(threads=args.threads, load_avg=os.getloadavg(), results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
