"""Before training: does layer-wise inference's hidden tables fit the object stores that would hold them?

The driver's check (``preflight.check_layerwise``) on made-up clusters, with
papers100M's own sizes: docs/scaling.md's recipe (K = 4 on 60 GB stores) cannot hold
them, K = 8 on 70 GB stores can; the refusal is one line with the figure, and
``--eval-fallback`` turns it into a note.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gnnray.config import parse_args
from gnnray.store.shards import Shard, ShardedFeatures, cache_nbytes, hidden_nbytes, shard_bounds
from gnnray.driver.preflight import Node, check_layerwise
from gnnray.errors import ClusterError, size_text

# ogbn-papers100M as gnnray stores it (docs/scaling.md): 111,059,956 nodes, 128 float32 features, structure
# with int64 indptr and int32 indices.
PAPERS = 111_059_956
STRUCTURE = 14_710_000_000


def _nodes(count: int, store: float, gpus: int = 1) -> list:
    return [Node(f"{i:02d}" + "cd" * 27, f"10.0.0.{i}", 32, gpus, int(store)) for i in range(count)]


def _features(nodes: list, num_rows: int = PAPERS, dim: int = 128) -> ShardedFeatures:
    bounds = shard_bounds(num_rows, len(nodes))
    shards = tuple(Shard(int(lo), int(hi), n.node_id, n.address, [None], None, [None])
                   for lo, hi, n in zip(bounds[:-1], bounds[1:], nodes))
    return ShardedFeatures(shards, num_rows, dim, "float32", None, 60.0, cache_nbytes(num_rows, dim, "float32", 0.1))


def _cfg(*extra: str):
    return parse_args(["--hidden", "256", "--fanouts", "10,10,10", "--num-workers", "4", *extra])


def test_papers100m_recipe_of_four_60gb_nodes_is_refused_with_the_figure():
    nodes = _nodes(4, 60e9)
    features = _features(nodes)
    with pytest.raises(ClusterError) as e:
        check_layerwise(_cfg("--feature-shards", "4"), PAPERS, STRUCTURE, features, nodes, True)
    text = str(e.value)
    need = STRUCTURE + features.shard_bytes + features.cache_bytes + hidden_nbytes(PAPERS, [256, 256], 4)
    assert need == pytest.approx(91.98e9, rel=1e-3)  # 14.71 + 14.22 + 6.13 + 2 x 113.7 / 4 GB
    assert "\n" not in text and f"needs {size_text(need)}" in text and "node 10.0.0.0" in text
    assert size_text(60e9) in text and "--feature-shards" in text and "--eval-fallback" in text


def test_papers100m_on_eight_70gb_nodes_fits():
    nodes = _nodes(8, 70e9)
    features = _features(nodes)
    assert check_layerwise(_cfg("--feature-shards", "8"), PAPERS, STRUCTURE, features, nodes, True) is None
    # 14.71 + 7.11 + 6.13 + 2 x 113.7 / 8 = 56.4 GB, within 90% of 70 GB.
    need = STRUCTURE + features.shard_bytes + features.cache_bytes + hidden_nbytes(PAPERS, [256, 256], 8)
    assert need == pytest.approx(56.38e9, rel=1e-3) and need <= 0.9 * 70e9


def test_fallback_is_a_note_and_sampled_evaluation_is_not_checked():
    nodes = _nodes(4, 60e9)
    note = check_layerwise(_cfg("--feature-shards", "4", "--eval-fallback"), PAPERS, STRUCTURE, _features(nodes),
                           nodes, True)
    assert note.startswith("note: --eval layerwise needs") and "sampled" in note and "\n" not in note
    assert check_layerwise(_cfg("--feature-shards", "4", "--eval", "sampled"), PAPERS, STRUCTURE, _features(nodes),
                           nodes, True) is None


def test_only_the_shard_nodes_hold_hidden_rows():
    """A small store on a node without a shard (the head) does not matter; one on a shard node does."""
    shard_nodes, head = _nodes(8, 70e9), _nodes(9, 30e9)[8]
    features = _features(shard_nodes)
    assert check_layerwise(_cfg("--feature-shards", "8"), PAPERS, STRUCTURE, features, shard_nodes + [head],
                           True) is None
    small = shard_nodes[:7] + [Node(shard_nodes[7].node_id, "10.0.0.7", 32, 1, int(50e9))]
    with pytest.raises(ClusterError, match="node 10.0.0.7"):
        check_layerwise(_cfg("--feature-shards", "8"), PAPERS, STRUCTURE, features, small, True)


def test_unsharded_tables_whole_on_each_worker_node():
    """Without shards every node with a train worker holds the graph and every hidden table; with one worker
    the tables stay in its own memory (not a store's)."""
    n, graph = 2_000_000, 2_000_000 * (128 * 4 + 40)
    tables = 2 * n * 256 * 4  # 4.1 GB
    fits, short = _nodes(2, (graph + tables) / 0.9 + 1), _nodes(2, (graph + tables) / 0.9 - 1)
    assert check_layerwise(_cfg(), n, graph, None, fits, True) is None
    with pytest.raises(ClusterError, match=f"2 x {n:,} nodes x 256 x 4 B = {size_text(tables)}") as e:
        check_layerwise(_cfg(), n, graph, None, short, True)
    assert "--feature-shards K" in str(e.value)
    assert check_layerwise(_cfg("--num-workers", "1"), n, graph, None, short, True) is None
    # A node that cannot run a train worker (no GPU, on a GPU run) holds none of them.
    assert check_layerwise(_cfg(), n, graph, None, fits + _nodes(1, 1e9, gpus=0), True) is None


def test_gat_tables_are_heads_times_wider():
    nodes = _nodes(4, 60e9)
    n = 10_000_000
    features = _features(nodes, n)
    base = STRUCTURE // 10 + features.shard_bytes + features.cache_bytes
    sage, gat = hidden_nbytes(n, [256, 256], 4), hidden_nbytes(n, [1024, 1024], 4)
    assert gat == 4 * sage
    store = int((base + sage) / 0.9) + 1  # room for sage's tables, not for gat's four heads
    nodes = _nodes(4, store)
    assert check_layerwise(_cfg("--feature-shards", "4"), n, STRUCTURE // 10, features, nodes, True) is None
    with pytest.raises(ClusterError, match=size_text(base + gat)):
        check_layerwise(_cfg("--feature-shards", "4", "--model", "gat", "--heads", "4"), n, STRUCTURE // 10,
                        features, nodes, True)
    assert np.isclose(gat / (n / 4 * 2 * 1024 * 4), 1.0)


def test_two_shards_on_one_node_after_a_repair_need_both_ranges():
    """A repair can put a lost shard beside another: that node then holds both shards and both ranges' hidden rows,
    which one shard per node's figure would pass."""
    nodes = _nodes(4, 60e9)
    features = _features(nodes)
    cfg = _cfg("--feature-shards", "4", "--fanouts", "10,10")  # one hidden table
    one = STRUCTURE / 4  # a made-up structure, a quarter of papers100M's
    # 3.7 + 14.2 + 6.1 + 28.4 = 52.4 GB within 90% of 60 GB; with two shards 94.9 GB.
    assert check_layerwise(cfg, PAPERS, one, features, nodes, True) is None
    lost = features.shards[3]
    repaired = dataclasses.replace(features, shards=features.shards[:3] + (dataclasses.replace(
        lost, node_id=nodes[0].node_id, address=nodes[0].address),))
    with pytest.raises(ClusterError) as e:
        check_layerwise(cfg, PAPERS, one, repaired, nodes, True)
    assert "node 10.0.0.0" in str(e.value) and "2 shards" in str(e.value)
