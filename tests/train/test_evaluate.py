"""Sampled evaluation through the worker's own sampler actor: exact with all neighbors, and bounded (counted)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import tiny_graph
from gnnray.config import JobConfig, ModelConfig, SamplerConfig, TrainConfig
from gnnray.store.handle import publish
from gnnray.train.evaluate import Evaluator
from plain_sage import mean_sage, whole_graph


def reference_accuracy(model, graph, split: str) -> float:
    """Accuracy of a full-graph forward (every layer on the whole graph, no sampling, no chunks)."""
    with torch.no_grad():
        logits = model([whole_graph(graph)] * model.num_layers, torch.from_numpy(graph.feat))
    ids = graph.split(split)
    return float(np.mean(logits.argmax(1).numpy()[ids] == graph.label[ids]))


@pytest.fixture(scope="module")
def big_tiny():
    return tiny_graph(num_nodes=400, num_edges=3000, feat_dim=6, num_classes=4)


def test_all_neighbors_give_the_full_graph_accuracy(ray_cluster, big_tiny):
    """Fanouts -1: sampled evaluation is exact, one batch (this thread) or many (the prefetch thread)."""
    graph, handle = big_tiny, publish(big_tiny)
    torch.manual_seed(0)
    model = mean_sage(graph.feat_dim, 8, graph.num_classes).eval()
    cfg = JobConfig(sampler=SamplerConfig(fanouts=(-1, -1)), model=ModelConfig(hidden=8, dropout=0.0))
    for split in ("valid", "test"):
        want = reference_accuracy(model, graph, split)
        for size in (4096, 7):
            evaluator = Evaluator(graph, replace(cfg, train=TrainConfig(eval_batch_size=size)), 0, 1, "cpu",
                                  handle=handle)
            assert evaluator.accuracy(model, split) == pytest.approx(want, abs=1e-6), (split, size)  # float32


def test_evaluation_streams_under_its_bound(ray_cluster, big_tiny):
    """Batches requested from the sampler actor and not yet computed never exceed the bound (counted, not timed).

    34 chunks of 3 seeds: a stream that asked for them all at once would count 34 at the first batch.
    """
    graph, handle = big_tiny, publish(big_tiny)
    cfg = JobConfig(sampler=SamplerConfig(fanouts=(5, 5)), model=ModelConfig(hidden=8, dropout=0.0),
                    train=TrainConfig(eval_batch_size=3, prefetch=1))
    model = mean_sage(graph.feat_dim, 8, graph.num_classes)
    evaluator = Evaluator(graph, cfg, 0, 1, "cpu", handle=handle)
    chunks = -(-len(graph.split("valid")) // 3)
    assert chunks > 2 * evaluator.max_in_flight
    for _ in range(2):
        evaluator.accuracy(model, "valid")
    assert evaluator.requested == evaluator.consumed == 2 * chunks
    assert 1 <= evaluator.peak_in_flight <= evaluator.max_in_flight == 5, evaluator.peak_in_flight


def test_evaluation_batches_are_bounded_by_rows_not_seeds(big_tiny):
    """``--eval-rows 200``: every batch gathers at most 200 feature rows, whatever ``--eval-batch-size`` (4096
    seeds would take the whole graph in one); batches over the bound are sampled again in smaller chunks, and
    every seed is still evaluated once (all neighbors: exactly the full graph's accuracy); a later evaluation starts
    from the chunks the last one reached. Sampled here, no Ray."""
    graph = big_tiny
    torch.manual_seed(0)
    model = mean_sage(graph.feat_dim, 8, graph.num_classes).eval()
    cfg = JobConfig(sampler=SamplerConfig(fanouts=(-1, -1)), model=ModelConfig(hidden=8, dropout=0.0),
                    train=TrainConfig(eval_rows=200, prefetch=1))
    want = reference_accuracy(model, graph, "valid")
    unbounded = Evaluator(graph, replace(cfg, train=TrainConfig(prefetch=1)), 0, 1, "cpu")
    assert unbounded.accuracy(model, "valid") == pytest.approx(want, abs=1e-6)
    assert unbounded.peak_rows > 200 and unbounded.requested == 1  # the default bound: one batch of it all
    evaluator = Evaluator(graph, cfg, 0, 1, "cpu")
    worst = evaluator._first_seeds  # every sampled neighbor new
    assert evaluator.accuracy(model, "valid") == pytest.approx(want, abs=1e-6)
    assert 0 < evaluator.peak_rows <= evaluator.max_rows == 200 and evaluator.requested > 5
    # The next evaluation starts from the size the rows per seed allowed: fewer, larger batches, the same bound.
    first = evaluator.requested
    assert evaluator._first_seeds > worst
    assert evaluator.accuracy(model, "valid") == pytest.approx(want, abs=1e-6)
    assert evaluator.requested - first < first and evaluator.peak_rows <= 200
    # First chunks sized above the bound (as a wrong estimate would be): dropped, sampled again, still exact.
    dropping = Evaluator(graph, cfg, 0, 1, "cpu")
    dropping._first_seeds = 50
    assert dropping.accuracy(model, "valid") == pytest.approx(want, abs=1e-6)
    assert dropping.resampled >= 1 and dropping.peak_rows <= 200


def hub_graph(num_nodes: int = 6000, hubs: int = 300, degree: int = 8):
    """Every node's in-neighbors among a few hubs: the more seeds a chunk holds, the fewer rows each samples."""
    from gnnray.data.csc import csc_from_edges
    from gnnray.data.graph import Graph

    rng = np.random.default_rng(0)
    dst, src = np.repeat(np.arange(num_nodes), degree), rng.integers(0, hubs, num_nodes * degree)
    indptr, indices = csc_from_edges(src, dst, num_nodes)
    perm, a = rng.permutation(num_nodes), num_nodes // 6
    return Graph(indptr, indices, rng.standard_normal((num_nodes, 4)).astype(np.float32),
                 rng.integers(0, 3, num_nodes).astype(np.int64), np.sort(perm[:a]), np.sort(perm[a:]),
                 np.sort(perm[:0]), 3, "hubs")


def test_evaluation_chunks_double_until_the_bound_then_keep_their_size():
    """Where rows per seed fall as chunks grow, the first evaluation doubles its chunks, one request at a time,
    until one comes back over ``--eval-rows`` (dropped, sampled again smaller); the next evaluation starts from the
    size found and keeps about it. Every batch stays under the bound."""
    graph = hub_graph()
    cfg = JobConfig(sampler=SamplerConfig(fanouts=(5, 5)), model=ModelConfig(hidden=8, dropout=0.0),
                    train=TrainConfig(eval_rows=1000, prefetch=1))
    model = mean_sage(graph.feat_dim, 8, graph.num_classes).eval()
    evaluator = Evaluator(graph, cfg, 0, 1, "cpu")
    asked, sample = [], evaluator._sampler.remote
    evaluator._sampler.remote = lambda seeds: asked.append(len(seeds)) or sample(seeds)
    evaluator.accuracy(model, "valid")
    first = asked[:]
    over = next(i for i in range(1, len(first)) if first[i] < first[i - 1])  # the chunk after the dropped one
    assert over >= 4 and all(b >= 2 * a for a, b in zip(first[:over - 1], first[1:over])), first
    assert evaluator.resampled == 1 and evaluator.peak_rows <= 1000
    asked.clear()
    evaluator.accuracy(model, "valid")
    found = first[over - 2]  # the largest chunk under the bound
    assert asked[0] >= 0.9 * found and len(asked) <= -(-len(graph.split("valid")) // int(0.8 * found)) + 1, asked
    assert evaluator.peak_rows <= 1000


def test_default_row_bound_follows_the_feature_table():
    """Half the table's rows over the prefetcher's buffers (a quarter of growth each), at least 2^17 per batch: a
    products-sized graph's 4,096-seed batch (about 2 M rows) is cut to a fraction of it."""
    from gnnray.train.evaluate import ROWS_AT_LEAST, row_bound

    assert row_bound(2_449_029, 4) == 244_902 and 4 * 1.25 * row_bound(2_449_029, 4) <= 2_449_029 / 2 + 4
    assert row_bound(2708, 4) == ROWS_AT_LEAST  # cora: one batch holds it all
