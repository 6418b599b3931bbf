"""Tests of gnnray.datasets: readers, validation and the synthetic generator (no Ray)."""

from __future__ import annotations

import builtins
import dataclasses
import importlib.util
import io
import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gnnray.config import DataConfig
from gnnray.data.load import load_graph
from gnnray.data.synthetic import make_synthetic
from gnnray.data.validate import validate
from gnnray.errors import DatasetError
from gnnray.data.graph import Graph

# find_spec, not importorskip: importing ogb here would start its PyPI version
# check, which gnnray.datasets suppresses when it imports ogb itself.
needs_ogb = pytest.mark.skipif(importlib.util.find_spec("ogb") is None, reason="the ogb package is not installed")
SHARED = Path(__file__).resolve().parents[3] / "shared" / "datasets"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"real datasets not found at {SHARED} "
                                  "(expected ../shared/datasets beside the repository)")


# ----------------------------------------------------------------------------- helpers

def feat_array(rows: np.ndarray) -> pa.Array:
    """A fixed-size list of float32 column from a 2-D array."""
    rows = np.asarray(rows, dtype=np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), rows.shape[1])


def write_graph_dir(tmp_path: Path, edges: dict | None = None, nodes: dict | None = None,
                    meta: dict | str | None = None, n: int = 6) -> Path:
    """Write a valid tiny graph directory, then apply overrides to break it.

    The graph is a directed ring ``v -> v+1``; node rows are written in reverse
    id order; ``feat[v] = [v, v, v]``, ``label[v] = v % 2``; ids 0, 1 are train,
    2 valid, 3 test, the rest none. An override value of ``None`` drops the
    column (or meta key); ``meta`` given as a string is written verbatim.
    """
    d = tmp_path / "graph"
    d.mkdir()
    ids = np.arange(n)[::-1].copy()
    edge_cols = {"src": pa.array(np.arange(n)), "dst": pa.array((np.arange(n) + 1) % n)}
    split = np.array(["train", "train", "valid", "test"] + ["none"] * (n - 4))
    node_cols = {"id": pa.array(ids), "feat": feat_array(np.repeat(ids[:, None], 3, axis=1)),
                 "label": pa.array(ids % 2), "split": pa.array(split[ids])}
    for cols, overrides, name in ((edge_cols, edges, "edges.parquet"), (node_cols, nodes, "nodes.parquet")):
        for key, value in (overrides or {}).items():
            if value is None:
                cols.pop(key)
            else:
                cols[key] = value
        pq.write_table(pa.table(cols), d / name)
    if isinstance(meta, str):
        (d / "meta.json").write_text(meta)
    else:
        m = {"name": "tiny", "num_nodes": n, "num_classes": 2, "feat_dim": 3, "num_edges": n}
        m.update(meta or {})
        (d / "meta.json").write_text(json.dumps({k: v for k, v in m.items() if v is not None}))
    return d


def load_dir(path: Path, **kw) -> Graph:
    seed = kw.pop("seed", 0)
    return load_graph(DataConfig(dataset=str(path), **kw), seed)


def edge_set(g: Graph) -> set:
    dst = np.repeat(np.arange(g.num_nodes), np.diff(g.indptr))
    return set(zip(g.indices.tolist(), dst.tolist()))


def homophily(g: Graph) -> float:
    dst = np.repeat(np.arange(g.num_nodes), np.diff(g.indptr))
    return float(np.mean(g.label[g.indices] == g.label[dst]))


# ----------------------------------------------------------------------------- graph directories

def test_graph_dir_places_rows_by_id(tmp_path):
    g = load_dir(write_graph_dir(tmp_path))
    assert (g.num_nodes, g.num_edges, g.feat_dim, g.num_classes, g.name) == (6, 6, 3, 2, "tiny")
    np.testing.assert_array_equal(g.feat[:, 0], np.arange(6, dtype=np.float32))
    np.testing.assert_array_equal(g.label, np.arange(6) % 2)
    assert (g.train_idx.tolist(), g.valid_idx.tolist(), g.test_idx.tolist()) == ([0, 1], [2], [3])
    assert edge_set(g) == {(v, (v + 1) % 6) for v in range(6)}


def test_graph_dir_reverse_edges_and_self_loops(tmp_path):
    path = write_graph_dir(tmp_path)
    g = load_dir(path, reverse_edges=True, self_loops=True)
    ring = {(v, (v + 1) % 6) for v in range(6)}
    assert edge_set(g) == ring | {(b, a) for a, b in ring} | {(v, v) for v in range(6)}
    assert g.num_edges == 18


def test_graph_dir_accepts_narrow_ints_lists_and_dictionary_strings(tmp_path):
    ids = np.arange(6)[::-1].copy()
    split = pa.array(np.array(["train", "train", "valid", "test", "none", "none"])[ids]).dictionary_encode()
    path = write_graph_dir(tmp_path, edges={"src": pa.array(np.arange(6), pa.int32())},
                           nodes={"feat": pa.array([[float(v)] * 3 for v in ids], pa.list_(pa.float64())),
                                  "split": split})
    g = load_dir(path)
    assert g.feat.dtype == np.float32 and g.indptr.dtype == g.indices.dtype == np.int32  # compact_csc
    np.testing.assert_array_equal(g.feat[:, 2], np.arange(6, dtype=np.float32))
    assert (g.train_idx.tolist(), g.valid_idx.tolist(), g.test_idx.tolist()) == ([0, 1], [2], [3])


def test_graph_dir_without_feat_needs_random_features(tmp_path):
    path = write_graph_dir(tmp_path, nodes={"feat": None}, meta={"feat_dim": 0})
    with pytest.raises(DatasetError, match="--random-features") as err:
        load_dir(path)
    assert "nodes.parquet" in str(err.value) and "'feat'" in str(err.value)
    g = load_dir(path, random_features=5, seed=3)
    assert g.feat.shape == (6, 5) and g.feat.dtype == np.float32
    np.testing.assert_array_equal(g.feat, load_dir(path, random_features=5, seed=3).feat)


def test_random_features_replace_a_synthetic_graphs_own(caplog):
    """The synthetic graph's features are a generator, not an array: the warning that they are replaced names
    their width (it raised AttributeError once)."""
    cfg = DataConfig(dataset="synthetic", synthetic_nodes=500, synthetic_feat_dim=7, random_features=3)
    g = load_graph(cfg, seed=1)
    assert g.feat.shape == (500, 3)
    assert "its 7-dim features by random ones" in caplog.text


def _garbage(path: Path) -> None:
    (path / "edges.parquet").write_bytes(b"this is not a parquet file")


def _truncate(path: Path) -> None:
    data = (path / "nodes.parquet").read_bytes()
    (path / "nodes.parquet").write_bytes(data[: len(data) // 2])


def _remove(name: str):
    return lambda path: (path / name).unlink()


BAD_DIRS = {
    "missing nodes file": (dict(), _remove("nodes.parquet"), ["nodes.parquet", "missing", "edges.parquet"]),
    "missing meta": (dict(), _remove("meta.json"), ["meta.json", "missing"]),
    "garbage parquet": (dict(), _garbage, ["edges.parquet", "Parquet"]),
    "truncated parquet": (dict(), _truncate, ["nodes.parquet", "Parquet"]),
    "missing column": (dict(edges={"dst": None}), None, ["edges.parquet", "'dst'"]),
    "missing label": (dict(nodes={"label": None}), None, ["nodes.parquet", "'label'"]),
    "float src": (dict(edges={"src": pa.array(np.arange(6.0))}), None, ["edges.parquet", "'src'", "double"]),
    "int split": (dict(nodes={"split": pa.array(np.zeros(6, np.int64))}), None, ["nodes.parquet", "'split'"]),
    "string feat": (dict(nodes={"feat": pa.array([["a"]] * 6)}), None, ["nodes.parquet", "'feat'"]),
    "ragged feat": (dict(nodes={"feat": pa.array([[1.0, 2.0]] * 5 + [[1.0]], pa.list_(pa.float32()))}), None,
                    ["nodes.parquet", "'feat'", "lengths"]),
    "dst out of range": (dict(edges={"dst": pa.array([1, 2, 3, 4, 5, 6])}), None,
                         ["edges.parquet", "'dst'", "outside"]),
    "negative src": (dict(edges={"src": pa.array([-1, 1, 2, 3, 4, 5])}), None, ["edges.parquet", "'src'", "outside"]),
    "id out of range": (dict(nodes={"id": pa.array([5, 4, 3, 2, 1, 9])}), None, ["nodes.parquet", "'id'", "outside"]),
    "negative id": (dict(nodes={"id": pa.array([5, 4, 3, 2, 1, -1])}), None, ["nodes.parquet", "'id'", "outside"]),
    "duplicate id": (dict(nodes={"id": pa.array([5, 4, 3, 2, 1, 1])}), None, ["nodes.parquet", "'id'", "repeats"]),
    "too few rows": (dict(meta={"num_nodes": 7}), None, ["nodes.parquet", "'id'", "num_nodes"]),
    "unknown split": (dict(nodes={"split": pa.array(["none", "none", "test", "valid", "training", "train"])}), None,
                      ["nodes.parquet", "'split'", "training"]),
    "null label": (dict(nodes={"label": pa.array([1, 0, None, 0, 1, 0], pa.int64())}), None,
                   ["nodes.parquet", "'label'", "null"]),
    "meta missing key": (dict(meta={"num_classes": None}), None, ["meta.json", "num_classes"]),
    "meta bad value": (dict(meta={"num_nodes": "six"}), None, ["meta.json", "num_nodes"]),
    "meta invalid json": (dict(meta="{num_nodes: 6"), None, ["meta.json", "JSON"]),
    "meta feat_dim": (dict(meta={"feat_dim": 4}), None, ["nodes.parquet", "feat_dim"]),
    "meta num_edges": (dict(meta={"num_edges": 7}), None, ["edges.parquet", "num_edges"]),
    "nan features": (dict(nodes={"feat": feat_array([[0, 0, 0]] * 4 + [[np.nan, 0, 0], [0, np.inf, 0]])}), None,
                     ["graph", "2 feature rows"]),
    "train label missing": (dict(nodes={"label": pa.array([1, 0, 1, 0, -1, 0])}), None, ["graph", "train", "no label"]),
    "label too large": (dict(nodes={"label": pa.array([1, 0, 1, 0, 1, 2])}), None, ["graph", "train", "num_classes"]),
    "empty valid split": (dict(nodes={"split": pa.array(["none", "none", "test", "none", "train", "train"])}), None,
                          ["graph", "valid split is empty"]),
    "one class": (dict(meta={"num_classes": 1}, nodes={"label": pa.array(np.zeros(6, np.int64))}), None,
                  ["graph", "at least 2"]),
}


@pytest.mark.parametrize("case", list(BAD_DIRS))
def test_bad_graph_dir(tmp_path, case):
    kwargs, damage, expected = BAD_DIRS[case]
    path = write_graph_dir(tmp_path, **kwargs)
    if damage:
        damage(path)
    with pytest.raises(DatasetError) as err:
        load_dir(path)
    for text in expected:
        assert text in str(err.value), f"{text!r} not in: {err.value}"


def test_unknown_dataset_lists_choices(tmp_path):
    with pytest.raises(DatasetError) as err:
        load_graph(DataConfig(dataset=str(tmp_path / "nope")))
    for text in ("unknown dataset", "nope", "synthetic", "ogbn-arxiv", "edges.parquet"):
        assert text in str(err.value)


# ----------------------------------------------------------------------------- validate

@pytest.fixture(scope="module")
def small() -> Graph:
    return make_synthetic(40, 3, 4, 4, seed=1)


def _set(a: np.ndarray, i, value) -> np.ndarray:
    a = a.copy()
    a[i] = value
    return a


BAD_GRAPHS = {
    "int16 indptr": (lambda g: dict(indptr=g.indptr.astype(np.int16)), "indptr must be a 1-D int32 or int64"),
    "float indices": (lambda g: dict(indices=g.indices.astype(np.float64)), "indices must be a 1-D int32 or int64"),
    "int32 label": (lambda g: dict(label=g.label.astype(np.int32)), "label must be a 1-D int64"),
    "int32 split": (lambda g: dict(test_idx=g.test_idx.astype(np.int32)), "test_idx must be a 1-D int64"),
    "float64 feat": (lambda g: dict(feat=g.feat.astype(np.float64)), "feat must be a 2-D float32"),
    "1-D feat": (lambda g: dict(feat=g.feat[:, 0].copy()), "feat must be a 2-D float32"),
    "indptr not at 0": (lambda g: dict(indptr=_set(g.indptr, 0, 1)), "start at 0"),
    "indptr decreasing": (lambda g: dict(indptr=_set(g.indptr, 5, g.indptr[7] + 1)), "non-decreasing"),
    "indptr end": (lambda g: dict(indices=g.indices[:-1]), "indptr ends at"),
    "indptr too short": (lambda g: dict(indptr=g.indptr[:-1]), "feat has 40 rows but indptr has 40 entries (39 nodes)"),
    "indices too large": (lambda g: dict(indices=_set(g.indices, 0, 40)), "outside [0, num_nodes=40)"),
    "negative indices": (lambda g: dict(indices=_set(g.indices, 3, -2)), "outside [0, num_nodes=40)"),
    "feat rows": (lambda g: dict(feat=g.feat[:-1]), "feat has 39 rows"),
    "non-finite feat": (lambda g: dict(feat=_set(_set(g.feat, (2, 0), np.nan), (5, 3), -np.inf)),
                        "2 feature rows contain NaN"),
    "label length": (lambda g: dict(label=g.label[:-1]), "label has 39 rows"),
    "num_classes 1": (lambda g: dict(num_classes=1), "at least 2"),
    "train unlabelled": (lambda g: dict(label=_set(g.label, g.train_idx[0], -1)), "train split have no label"),
    "valid label too big": (lambda g: dict(label=_set(g.label, g.valid_idx[0], 3)), "labels of the valid split"),
    "test label negative": (lambda g: dict(label=_set(g.label, g.test_idx[0], -5)), "labels of the test split"),
    "split id too large": (lambda g: dict(train_idx=_set(g.train_idx, 0, 40)), "train split has node ids outside"),
    "split id negative": (lambda g: dict(valid_idx=_set(g.valid_idx, 0, -1)), "valid split has node ids outside"),
    "duplicate split ids": (lambda g: dict(test_idx=_set(g.test_idx, 1, g.test_idx[0])), "more than once"),
    "empty train": (lambda g: dict(train_idx=g.train_idx[:0]), "train split is empty"),
    "empty test": (lambda g: dict(test_idx=g.test_idx[:0]), "test split is empty"),
    "overlapping splits": (lambda g: dict(valid_idx=_set(g.valid_idx, 0, g.train_idx[0])), "shares nodes"),
}


def test_valid_graph_passes(small):
    validate(small, "small")


@pytest.mark.parametrize("case", list(BAD_GRAPHS))
def test_validate_rejects(small, case):
    change, expected = BAD_GRAPHS[case]
    with pytest.raises(DatasetError) as err:
        validate(dataclasses.replace(small, **change(small)), "my-source")
    assert str(err.value).startswith("my-source: ")
    assert expected in str(err.value)


@pytest.fixture(scope="module")
def arxiv_scale() -> Graph:
    return make_synthetic(170_000, 40, 128, 14, seed=0)


def test_validate_passes_arxiv_scale(arxiv_scale):
    validate(arxiv_scale, "big")


@pytest.mark.parametrize("change, expected", [
    pytest.param(lambda g: dict(indices=_set(g.indices, -1, g.num_nodes)), "1 edge source ids (indices) are outside",
                 id="last index"),
    pytest.param(lambda g: dict(feat=_set(g.feat, (-1, -1), np.inf)), "1 feature rows contain NaN",
                 id="last feature row"),
    pytest.param(lambda g: dict(label=_set(g.label, g.test_idx[-1], -1)), "1 nodes of the test split have no label",
                 id="last test label"),
])
def test_validate_checks_every_entry_at_arxiv_scale(arxiv_scale, change, expected):
    """One bad entry at the very end of an arxiv-sized array is found: validation reads all of it, not a sample."""
    with pytest.raises(DatasetError) as err:
        validate(dataclasses.replace(arxiv_scale, **change(arxiv_scale)), "big")
    assert str(err.value).startswith("big: ") and expected in str(err.value)


# ----------------------------------------------------------------------------- synthetic

def test_synthetic_is_deterministic_per_seed():
    a, b, c = (make_synthetic(3000, 5, 16, 8, seed=s) for s in (7, 7, 8))
    for f in dataclasses.fields(Graph):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
    assert not np.array_equal(a.feat, c.feat)
    assert a.indices.shape != c.indices.shape or not np.array_equal(a.indices, c.indices)


def test_synthetic_graph_is_learnable_undirected_and_skewed():
    g = make_synthetic(5000, 8, 32, 10, seed=0)
    validate(g, "synthetic")
    assert homophily(g) > 0.6
    edges = edge_set(g)
    assert all((d, s) in edges for s, d in edges) and all(s != d for s, d in edges)
    deg = np.diff(g.indptr)
    assert deg.min() >= 1 and deg.max() > 10 * deg.mean()
    assert 8 <= g.num_edges / g.num_nodes <= 10
    assert (g.train_idx.size, g.valid_idx.size, g.test_idx.size) == (3000, 1000, 1000)

    # Nearest class centroid: features alone are clearly worse than the mean of
    # the neighbors' features.
    agg = np.add.reduceat(g.feat[g.indices], g.indptr[:-1], axis=0) / deg[:, None]

    def accuracy(x):
        tr, te = g.train_idx, g.test_idx
        centroids = np.stack([x[tr][g.label[tr] == k].mean(0) for k in range(g.num_classes)])
        pred = ((x[te, None, :] - centroids[None]) ** 2).sum(-1).argmin(1)
        return np.mean(pred == g.label[te])

    assert accuracy(g.feat) + 0.2 < accuracy(agg)


def test_load_synthetic_applies_options():
    cfg = DataConfig(dataset="synthetic", synthetic_nodes=500, synthetic_classes=4, synthetic_feat_dim=8,
                     synthetic_avg_degree=6)
    plain = load_graph(cfg, seed=2)
    assert (plain.num_nodes, plain.feat_dim, plain.num_classes) == (500, 8, 4)
    looped = load_graph(dataclasses.replace(cfg, self_loops=True, reverse_edges=True), seed=2)
    assert looped.num_edges == plain.num_edges + 500


def test_synthetic_default_size_builds_as_asked():
    """The default ``--dataset synthetic`` size (20,000 nodes, 64 features, 8 classes, degree 10)."""
    g = make_synthetic(20_000, 8, 64, 10, seed=0)
    validate(g, "synthetic")
    assert (g.num_nodes, g.feat_dim, g.num_classes) == (20_000, 64, 8)
    assert (g.train_idx.size, g.valid_idx.size, g.test_idx.size) == (12_000, 4_000, 4_000)
    assert 8 <= g.num_edges / g.num_nodes <= 10
    assert set(np.unique(g.label).tolist()) == set(range(8))


# ----------------------------------------------------------------------------- real datasets

@needs_shared
def test_cora():
    g = load_graph(DataConfig(dataset=str(SHARED / "cora")))
    assert (g.num_nodes, g.num_edges, g.feat_dim, g.num_classes) == (2708, 10556, 1433, 7)
    assert (g.train_idx.size, g.valid_idx.size, g.test_idx.size) == (140, 500, 1000)
    assert g.name == "cora" and g.feat.any()
    # Cora is stored with both directions: reverse edges add nothing.
    assert load_graph(DataConfig(dataset=str(SHARED / "cora"), reverse_edges=True)).num_edges == 10556


@needs_shared
def test_arxiv_structure_needs_random_features():
    path = str(SHARED / "arxiv-structure")
    with pytest.raises(DatasetError, match="--random-features"):
        load_graph(DataConfig(dataset=path))
    g = load_graph(DataConfig(dataset=path, random_features=8))
    assert (g.num_nodes, g.num_edges, g.feat_dim, g.num_classes) == (169_343, 1_166_243, 8, 40)
    assert (g.train_idx.size, g.valid_idx.size, g.test_idx.size) == (90_941, 29_799, 48_603)
    both = load_graph(DataConfig(dataset=path, random_features=8, reverse_edges=True))
    # Doubled, less the pairs already stored in both directions.
    assert 0.98 * 2 * g.num_edges < both.num_edges <= 2 * g.num_edges
    np.testing.assert_array_equal(both.feat, g.feat)


# ----------------------------------------------------------------------------- OGB

def write_ogb_arxiv(root: Path, n: int = 30, release: bool = True) -> dict:
    """Write a tiny ``ROOT/ogbn_arxiv`` in the layout of the OGB download."""
    rng = np.random.default_rng(0)
    d = root / "ogbn_arxiv"
    (d / "raw").mkdir(parents=True)
    (d / "split" / "time").mkdir(parents=True)
    if release:
        (d / "RELEASE_v1.txt").write_text("ogbn-arxiv v1\n")
    edges = np.stack([np.arange(n), (np.arange(n) * 7 + 3) % n], axis=1)  # src, dst per row
    feat = rng.standard_normal((n, 5)).astype(np.float32)
    label = np.arange(n) % 40
    files = {"raw/edge.csv.gz": (edges, "%d"), "raw/num-node-list.csv.gz": ([n], "%d"),
             "raw/num-edge-list.csv.gz": ([len(edges)], "%d"), "raw/node-feat.csv.gz": (feat, "%.6f"),
             "raw/node-label.csv.gz": (label, "%d"), "raw/node_year.csv.gz": (2000 + np.arange(n) % 20, "%d"),
             "split/time/train.csv.gz": (np.arange(0, 20), "%d"), "split/time/valid.csv.gz": (np.arange(20, 25), "%d"),
             "split/time/test.csv.gz": (np.arange(25, n), "%d")}
    for name, (values, fmt) in files.items():
        np.savetxt(d / name, np.asarray(values), fmt=fmt, delimiter=",")  # .gz: numpy compresses
    return {"edges": edges, "feat": feat, "label": label}


@pytest.fixture
def no_network(monkeypatch):
    """Make ogb's download fail at once, as on a machine without internet."""
    def refuse(*args, **kwargs):
        raise urllib.error.URLError("network disabled in tests")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)


@needs_ogb
@pytest.mark.parametrize("release", [True, False], ids=["release-file", "no-release-file"])
def test_ogb_arxiv_reads_local_files(tmp_path, no_network, release, caplog):
    data = write_ogb_arxiv(tmp_path, release=release)
    cfg = DataConfig(dataset="ogbn-arxiv", data_dir=str(tmp_path))
    for _ in range(2):  # the second load reads ogb's processed copy
        g = load_graph(cfg)
        assert (g.num_nodes, g.feat_dim, g.num_classes, g.name) == (30, 5, 40, "ogbn-arxiv")
        np.testing.assert_allclose(g.feat, data["feat"], atol=1e-6)
        np.testing.assert_array_equal(g.label, data["label"])
        assert (g.train_idx.size, g.valid_idx.size, g.test_idx.size) == (20, 5, 5)
        # Reverse edges are on by default for arxiv.
        directed = {(int(s), int(d)) for s, d in data["edges"]}
        assert edge_set(g) == directed | {(d, s) for s, d in directed}
    assert (tmp_path / "ogbn_arxiv" / "processed" / "data_processed").exists()
    assert builtins.input.__module__ == "builtins"  # the stdin guard was undone
    # Without RELEASE_v1.txt ogb asks whether to delete and re-download: answered no.
    assert ("Will you update the dataset now" in caplog.text) == (not release)
    assert load_graph(DataConfig(dataset="ogbn-arxiv", data_dir=str(tmp_path), reverse_edges=False)).num_edges == 30


@needs_ogb
def test_ogb_missing_directory_download_fails(tmp_path, no_network):
    with pytest.raises(DatasetError) as err:
        load_graph(DataConfig(dataset="ogbn-arxiv", data_dir=str(tmp_path / "data")))
    message = str(err.value)
    for text in (str(tmp_path / "data" / "ogbn_arxiv"), "download failed", "network disabled", "--data-dir",
                 "synthetic"):
        assert text in message


@needs_ogb
def test_ogb_empty_directory_download_fails(tmp_path, no_network):
    (tmp_path / "ogbn_arxiv").mkdir()
    (tmp_path / "ogbn_arxiv" / "RELEASE_v1.txt").write_text("")
    with pytest.raises(DatasetError, match="not found in .*ogbn_arxiv and the download failed"):
        load_graph(DataConfig(dataset="ogbn-arxiv", data_dir=str(tmp_path)))


@needs_ogb
def test_ogb_broken_files_are_named(tmp_path, no_network):
    write_ogb_arxiv(tmp_path)
    (tmp_path / "ogbn_arxiv" / "raw" / "node-label.csv.gz").write_bytes(b"not gzip")
    with pytest.raises(DatasetError, match="cannot read the OGB files in .*ogbn_arxiv"):
        load_graph(DataConfig(dataset="ogbn-arxiv", data_dir=str(tmp_path)))


@needs_ogb
def test_ogb_large_download_prompt_never_blocks(tmp_path, monkeypatch):

    class Huge(io.BytesIO):
        def info(self):
            return {"Content-Length": str(3 << 30)}

    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: Huge())
    with pytest.raises(DatasetError) as err:
        load_graph(DataConfig(dataset="ogbn-arxiv", data_dir=str(tmp_path)))
    assert "answered no" in str(err.value) and "download failed" in str(err.value)
