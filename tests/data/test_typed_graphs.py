"""Tests of typed graphs: the typed graph directory, its validation, features of featureless nodes, the CSC."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gnnray.config import DataConfig
from gnnray.data.csc import typed_csc
from gnnray.data.load import load_graph
from gnnray.data.typed import fill_features
from gnnray.errors import DatasetError

# Papers 0-5 (labelled, features), authors 6-8 (no features), institution 9 (no features).
TYPES = ["paper"] * 6 + ["author"] * 3 + ["institution"]
EDGES = [(0, 1, "cites"), (2, 1, "cites"), (3, 4, "cites"), (5, 0, "cites"),
         (6, 0, "writes"), (6, 1, "writes"), (7, 2, "writes"), (8, 3, "writes"), (8, 5, "writes"),
         (6, 9, "affiliated_with"), (8, 9, "affiliated_with")]
RELATIONS = [["paper", "cites", "paper"], ["author", "writes", "paper"], ["author", "affiliated_with", "institution"]]
SPLIT = ["train", "train", "valid", "test", "train", "none", "none", "none", "none", "none"]
LABEL = [0, 1, 0, 1, 0, -1, -1, -1, -1, -1]


def paper_feat(v: int) -> list:
    return [float(v), 1.0, -float(v)]


def write_typed(path: Path, *, types=TYPES, edges=EDGES, split=SPLIT, label=LABEL, feat=None, meta=None,
                meta_extra=None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    n = len(types)
    if feat is None:
        feat = [paper_feat(v) if types[v] == "paper" else None for v in range(n)]
    src, dst, rel = zip(*edges)
    pq.write_table(pa.table({"src": pa.array(src, pa.int64()), "dst": pa.array(dst, pa.int64()),
                             "type": pa.array(rel, pa.string())}), path / "edges.parquet")
    pq.write_table(pa.table({"id": pa.array(range(n), pa.int64()), "label": pa.array(label, pa.int64()),
                             "split": pa.array(split, pa.string()), "type": pa.array(types, pa.string()),
                             "feat": pa.array(feat, pa.list_(pa.float32()))}), path / "nodes.parquet")
    if meta is None:
        meta = {"num_nodes": n, "num_classes": 2, "node_types": ["paper", "author", "institution"],
                "edge_types": RELATIONS, "target_type": "paper"}
    meta.update(meta_extra or {})
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def load(path: Path, **options):
    return load_graph(DataConfig(dataset=str(path), **options))


def typed_edges(graph) -> Counter:
    """(src, dst, relation name) of every edge of ``graph``'s CSC."""
    dst = np.repeat(np.arange(graph.num_nodes), np.diff(graph.indptr))
    return Counter((int(s), int(d), graph.edge_types[t][1]) for s, d, t in zip(graph.indices, dst, graph.etype))


def test_typed_directory_round_trip(tmp_path):
    g = load(write_typed(tmp_path / "g"))
    assert g.typed and g.node_types == ("paper", "author", "institution") and g.target_type == "paper"
    assert g.ntype.tolist() == [0] * 6 + [1] * 3 + [2]
    assert g.etype.dtype == np.int8 and g.etype.shape == g.indices.shape
    # Reverse relations are on by default for typed graphs, as relations of their own.
    names = [r for _, r, _ in g.edge_types]
    assert names == ["cites", "writes", "affiliated_with", "rev_cites", "rev_writes", "rev_affiliated_with"]
    assert g.edge_types[4] == ("paper", "rev_writes", "author")
    want = Counter()
    for s, d, r in EDGES:
        want[(s, d, r)] += 1
        want[(d, s, f"rev_{r}")] += 1
    assert typed_edges(g) == want
    assert g.label.tolist() == LABEL and g.train_idx.tolist() == [0, 1, 4]
    assert g.feat.dtype == np.float32 and g.feat[:6].tolist() == [paper_feat(v) for v in range(6)]


def test_no_reverse_keeps_only_declared_relations(tmp_path):
    g = load(write_typed(tmp_path / "g"), reverse_edges=False)
    assert [r for _, r, _ in g.edge_types] == ["cites", "writes", "affiliated_with"]
    assert typed_edges(g) == Counter(EDGES)


def test_types_inferred_without_meta_lists(tmp_path):
    g = load(write_typed(tmp_path / "g", meta={"num_nodes": 10, "num_classes": 2}))
    assert g.node_types == ("author", "institution", "paper") and g.target_type == "paper"
    assert set(g.edge_types[:3]) == {tuple(r) for r in RELATIONS}


def test_featureless_nodes_get_neighbor_means_in_rounds(tmp_path):
    g = load(write_typed(tmp_path / "g"))
    f = lambda vs: np.mean([paper_feat(v) for v in vs], axis=0)  # noqa: E731
    authors = {6: f([0, 1]), 7: f([2]), 8: f([3, 5])}  # round 1: their papers
    for a, want in authors.items():
        np.testing.assert_allclose(g.feat[a], want, rtol=1e-6)
    # Round 2: the institution from its authors' round-1 features.
    np.testing.assert_allclose(g.feat[9], (authors[6] + authors[8]) / 2, rtol=1e-6)


def test_fill_features_in_small_chunks_matches_hand_computation():
    rng = np.random.default_rng(0)
    n, featured = 60, 30
    feat = np.zeros((n, 5), dtype=np.float32)
    feat[:featured] = rng.standard_normal((featured, 5))
    src, dst = rng.integers(0, n, 300), rng.integers(0, n, 300)
    has = np.arange(n) < featured
    expected, avail = feat.copy(), has.copy()
    while True:  # the rounds, by hand
        new = {}
        for v in np.flatnonzero(~avail):
            nb = [d for s, d in zip(src, dst) if s == v] + [s for s, d in zip(src, dst) if d == v]
            nb = [u for u in nb if avail[u]]
            if nb:
                new[v] = expected[nb].mean(axis=0)
        if not new:
            break
        for v, row in new.items():
            expected[v], avail[v] = row, True
    left = fill_features(feat, has, src, dst, chunk_bytes=64)  # a few edges per step
    np.testing.assert_allclose(feat, expected, rtol=1e-5, atol=1e-6)
    assert left == int((~avail).sum())


def test_embedding_dim_gives_featureless_nodes_zeros(tmp_path):
    g = load(write_typed(tmp_path / "g"), embedding_dim=4)
    assert not g.feat[6:].any() and g.feat[:6].any()


def test_typed_csc_matches_edge_list():
    rng = np.random.default_rng(1)
    src, dst = rng.integers(0, 50, 500), rng.integers(0, 50, 500)
    etype = rng.integers(0, 3, 500).astype(np.int8)
    indptr, indices, types = typed_csc(src, dst, etype, 50, 3, reverse=True, chunk=37)
    got = Counter(zip(indices.tolist(), np.repeat(np.arange(50), np.diff(indptr)).tolist(), types.tolist()))
    want = Counter(zip(src.tolist(), dst.tolist(), etype.tolist())) + Counter(
        zip(dst.tolist(), src.tolist(), (etype + 3).tolist()))
    assert got == want


def test_synthetic_hetero_is_deterministic_per_seed():
    cfg = DataConfig(dataset="synthetic-hetero", synthetic_nodes=300)
    a, b, c = load_graph(cfg, seed=1), load_graph(cfg, seed=1), load_graph(cfg, seed=2)
    assert a.typed and a.target_type == "paper"
    for name in ("indptr", "indices", "etype", "ntype", "feat", "label", "train_idx"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.feat, c.feat)


def test_typed_graph_survives_the_object_store(ray_cluster, tmp_path):
    from gnnray.store.handle import publish

    g = load(write_typed(tmp_path / "g"))
    back = publish(g).get()
    assert back.edge_types == g.edge_types and back.node_types == g.node_types and back.target_type == "paper"
    np.testing.assert_array_equal(back.etype, g.etype)
    np.testing.assert_array_equal(back.ntype, g.ntype)
    assert not back.etype.flags.writeable


# Each validation error: what to write, and what the message must name.
BAD = {
    "edge endpoint of the wrong type": (dict(edges=EDGES + [(0, 2, "writes")]),
                                        ["edges.parquet: column 'type'", "'writes'", "wrong type"]),
    "labelled node not of the target type": (dict(label=LABEL[:6] + [1, -1, -1, -1]),
                                             ["nodes.parquet: column 'label'", "target type 'paper'", "node 6"]),
    "split node not of the target type": (dict(split=SPLIT[:6] + ["test", "none", "none", "none"],
                                               label=LABEL[:6] + [1, -1, -1, -1]),
                                          ["not of the target type 'paper'"]),
    "features of different dimensions": (dict(feat=[paper_feat(v) if v < 5 else None for v in range(9)]
                                         + [[1.0, 2.0]]), ["column 'feat'", "different lengths"]),
    "unknown node type": (dict(types=TYPES[:9] + ["venue"]), ["nodes.parquet: column 'type'", "'venue'"]),
    "unknown relation": (dict(edges=EDGES + [(0, 1, "likes")]), ["edges.parquet: column 'type'", "'likes'"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_validation_errors(tmp_path, case):
    kwargs, words = BAD[case]
    with pytest.raises(DatasetError) as err:
        load(write_typed(tmp_path / "g", **kwargs))
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_inferred_relation_with_two_type_pairs_is_named(tmp_path):
    edges = EDGES + [(6, 7, "cites")]  # an author citing an author
    with pytest.raises(DatasetError, match="relation 'cites' joins several pairs of node types"):
        load(write_typed(tmp_path / "g", edges=edges, meta={"num_nodes": 10, "num_classes": 2}))


def test_unknown_target_type_and_types_in_edge_types(tmp_path):
    with pytest.raises(DatasetError, match="target_type 'venue' is not a node type"):
        load(write_typed(tmp_path / "a", meta_extra={"target_type": "venue"}))
    meta = {"num_nodes": 10, "num_classes": 2, "node_types": ["paper", "author", "institution"],
            "edge_types": RELATIONS + [["paper", "at", "venue"]]}
    with pytest.raises(DatasetError, match=r"edge_types name unknown node types \['venue'\]"):
        load(write_typed(tmp_path / "b", meta=meta))


def test_self_loops_on_a_typed_graph_say_what_to_do(tmp_path):
    with pytest.raises(DatasetError, match="--self-loops is not supported on a typed graph"):
        load(write_typed(tmp_path / "g"), self_loops=True)


def test_untyped_directory_rejects_null_features(tmp_path):
    path = tmp_path / "g"
    path.mkdir()
    pq.write_table(pa.table({"src": pa.array([0, 1], pa.int64()), "dst": pa.array([1, 2], pa.int64())}),
                   path / "edges.parquet")
    pq.write_table(pa.table({"id": pa.array([0, 1, 2], pa.int64()), "label": pa.array([0, 1, 0], pa.int64()),
                             "split": pa.array(["train", "valid", "test"]),
                             "feat": pa.array([[1.0], None, [2.0]], pa.list_(pa.float32()))}), path / "nodes.parquet")
    (path / "meta.json").write_text(json.dumps({"num_nodes": 3, "num_classes": 2}))
    with pytest.raises(DatasetError, match="column 'feat' has 1 null values"):
        load(path)


def test_symmetric_relations_merge_each_same_type_relation_with_its_reverse(tmp_path):
    """DGL's MAG240M relation set: cites holds both directions; writes and affiliated_with keep their reverses."""
    from gnnray.data.typed import symmetric_relations

    g = load_graph(DataConfig(dataset=str(write_typed(tmp_path / "g"))))
    before = typed_edges(g)
    merged = symmetric_relations(g)
    assert [r for _, r, _ in merged.edge_types] == ["cites", "writes", "affiliated_with", "rev_writes",
                                                   "rev_affiliated_with"]
    assert merged.etype.max() == len(merged.edge_types) - 1
    after = typed_edges(merged)
    want = Counter({(s, d, "cites" if r == "rev_cites" else r): c for (s, d, r), c in before.items()})
    assert after == want and sum(c for (_, _, r), c in after.items() if r == "cites") == 2 * 4
    # Without a same-type relation and its reverse there is nothing to merge.
    plain = load_graph(DataConfig(dataset=str(write_typed(tmp_path / "h")), reverse_edges=False))
    assert symmetric_relations(plain).edge_types == plain.edge_types
    # The option gives the same graph through the loader, and refuses an untyped graph.
    assert typed_edges(load(tmp_path / "g", symmetric_relations=True)) == after
    untyped = tmp_path / "u"
    untyped.mkdir()
    pq.write_table(pa.table({"src": pa.array([0, 1], pa.int64()), "dst": pa.array([1, 2], pa.int64())}),
                   untyped / "edges.parquet")
    pq.write_table(pa.table({"id": pa.array(range(3), pa.int64()), "label": pa.array([0, 1, 0], pa.int64()),
                             "split": pa.array(["train", "valid", "test"]),
                             "feat": pa.array([[1.0], [0.0], [2.0]], pa.list_(pa.float32()))}),
                   untyped / "nodes.parquet")
    (untyped / "meta.json").write_text(json.dumps({"num_nodes": 3, "num_classes": 2}))
    with pytest.raises(DatasetError, match="--symmetric-relations applies to typed graphs"):
        load(untyped, symmetric_relations=True)


def grouped_by_relation(indptr: np.ndarray, etype: np.ndarray) -> bool:
    """Whether each node's in-edges come as runs of one relation each, in code order (GraphBolt's requirement)."""
    dst = np.repeat(np.arange(indptr.size - 1), np.diff(indptr))
    key = dst * (int(etype.max()) + 1) + etype
    return bool(np.all(np.diff(key) >= 0))


def test_every_typed_builder_groups_in_edges_by_relation():
    """GraphBolt samples a node's relations apart only over in-edges grouped by relation: every builder does it."""
    from gnnray.data.typed import relation_csc, symmetric_relations

    rng = np.random.default_rng(4)
    src, dst = rng.integers(0, 50, 600), rng.integers(0, 50, 600)
    etype = rng.integers(0, 3, 600).astype(np.int8)
    indptr, indices, types = typed_csc(src, dst, etype, 50, 3, reverse=True, chunk=37)
    assert grouped_by_relation(indptr, types)
    # Streams given out of code order are written in code order.
    streams = [(src[etype == j], dst[etype == j], j) for j in (2, 0, 1)]
    indptr, indices, types = relation_csc(50, streams, 3)
    assert grouped_by_relation(indptr, types)
    got = Counter(zip(indices.tolist(), np.repeat(np.arange(50), np.diff(indptr)).tolist(), types.tolist()))
    assert got == Counter(zip(src.tolist(), dst.tolist(), etype.tolist()))
    # Merging rev_cites into cites (and rev_distracts into distracts) regroups them.
    g = load_graph(DataConfig(dataset="synthetic-hetero", synthetic_nodes=300))
    assert grouped_by_relation(g.indptr, g.etype)
    before = typed_edges(g)
    merged = symmetric_relations(g)
    assert grouped_by_relation(merged.indptr, merged.etype)
    assert sum(typed_edges(merged).values()) == sum(before.values())


def test_sort_by_relation_keeps_each_relations_order_and_the_edges():
    from gnnray.data.csc import csc_from_edges, sort_by_relation

    rng = np.random.default_rng(5)
    src, dst = rng.integers(0, 30, 400), rng.integers(0, 30, 400)
    etype = rng.integers(0, 4, 400).astype(np.int8)
    indptr, order = csc_from_edges(np.arange(400), dst, 30)  # edge ids in CSC order
    indices, types = src[order].copy(), etype[order].copy()
    assert not grouped_by_relation(indptr, types)
    edge_ids = order.copy()
    sort_by_relation(indptr, edge_ids, types.copy(), chunk=23)
    sort_by_relation(indptr, indices, types, chunk=23)
    assert grouped_by_relation(indptr, types)
    np.testing.assert_array_equal(indices, src[edge_ids])
    np.testing.assert_array_equal(types, etype[edge_ids])
    for v in range(30):  # stable: a node's edges of one relation keep their order (here: input order)
        seg = edge_ids[indptr[v]:indptr[v + 1]]
        for t in range(4):
            mine = seg[etype[seg] == t]
            assert np.all(np.diff(mine) > 0)


def test_typed_dir_helper_writes_a_graph_whose_signal_is_in_few_edges(tmp_path):
    """The accuracy runs' typed graph directory (docs/typed-graphs.md): papers' in-edges are mostly noise."""
    from typed_dir import write_typed_dir

    g = load(write_typed_dir(tmp_path / "g", papers=600))
    assert g.node_types == ("author", "institution", "paper") and g.target_type == "paper"
    names = [r for _, r, _ in g.edge_types]
    papers = np.flatnonzero(g.ntype == g.node_types.index("paper"))
    into_papers = np.concatenate([g.etype[g.indptr[v]:g.indptr[v + 1]] for v in papers])
    share = np.bincount(into_papers, minlength=len(names)) / into_papers.size
    noise = share[names.index("mentions")] + share[names.index("rev_mentions")]
    assert noise > 0.6 and share[names.index("cites")] < 0.15 and share[names.index("writes")] < 0.15
    assert grouped_by_relation(g.indptr, g.etype)
