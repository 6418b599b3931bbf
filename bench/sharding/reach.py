"""What a batch reaches, sampling only (no Ray, one process): the basis of docs/scaling.md#what-a-batch-reaches."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Optional

import numpy as np

from bench.harness import Row, error_row
from bench.sharding.cluster import FIGURE, ShardSettings


def upper_bound(batch_size: int, fanouts: tuple) -> int:
    """Input nodes of a batch if no node repeated: seeds x (1 + f1 + f1 f2 + ...)."""
    total, layer = batch_size, batch_size
    for f in fanouts:
        layer *= f
        total += layer
    return total


def sampling_stats(graph, ss: ShardSettings, batch_size: int, batches: int,
                   seeds_from: Optional[np.ndarray] = None) -> dict:
    """Per-batch input nodes, and cache hit rates and remote shares over its unique input nodes (what a gather
    fetches) with contiguous shards; medians over batches."""
    from gnnray.sampler.sampler import Sampler
    from gnnray.store.shards import cache_ids, shard_bounds

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
    """Sampling only, per graph: at batch 1024, and at a batch whose reach is a small share of the graph, as
    papers100M is ~100x a batch's reach (docs/scaling.md#what-a-batch-reaches)."""
    from bench.harness import DEFAULT_DATASET
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
