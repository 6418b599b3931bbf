"""OGB datasets by name (ogbn-products, ogbn-papers100M) from tiny OGB-layout directories, and the chunked CSC build (no Ray)."""

from __future__ import annotations

import builtins
import importlib.util
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from gnnray.config import DataConfig
from gnnray.data.csc import bidirected_csc
from gnnray.data.load import load_graph
from gnnray.errors import DatasetError
from gnnray.data.csc import csc_from_edges
from gnnray.data.graph import Graph

needs_ogb = pytest.mark.skipif(importlib.util.find_spec("ogb") is None, reason="the ogb package is not installed")


def edge_set(g: Graph) -> set:
    dst = np.repeat(np.arange(g.num_nodes), np.diff(g.indptr))
    return set(zip(g.indices.tolist(), dst.tolist()))


@pytest.fixture
def no_network(monkeypatch):
    """Make any download fail at once, as on a machine without internet."""
    def refuse(*args, **kwargs):
        raise urllib.error.URLError("network disabled in tests")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)


def _splits(d: Path, split: str, n: int) -> dict:
    (d / "split" / split).mkdir(parents=True)
    ids = {"train": np.arange(0, n // 2), "valid": np.arange(n // 2, 3 * n // 4), "test": np.arange(3 * n // 4, n)}
    for name, values in ids.items():
        np.savetxt(d / "split" / split / f"{name}.csv.gz", values, fmt="%d")
    return ids


def write_ogb_products(root: Path, n: int = 24) -> dict:
    """A tiny ``ROOT/ogbn_products`` in the CSV layout of OGB's download (one direction per edge stored)."""
    rng = np.random.default_rng(1)
    d = root / "ogbn_products"
    (d / "raw").mkdir(parents=True)
    (d / "RELEASE_v1.txt").write_text("ogbn-products v1\n")
    pairs = {(int(a), int(b)) for a, b in rng.integers(0, n, (60, 2)) if a < b}  # undirected, each once
    edges = np.array(sorted(pairs))
    feat = rng.standard_normal((n, 6)).astype(np.float32)
    label = np.arange(n) % 47
    for name, values, fmt in (("edge", edges, "%d"), ("num-node-list", [n], "%d"), ("num-edge-list", [len(edges)], "%d"),
                              ("node-feat", feat, "%.6f"), ("node-label", label, "%d")):
        np.savetxt(d / "raw" / f"{name}.csv.gz", np.asarray(values), fmt=fmt, delimiter=",")
    return {"edges": edges, "feat": feat, "label": label, "split": _splits(d, "sales_ranking", n)}


def write_ogb_papers(root: Path, n: int = 40, feat_dtype=np.float32) -> dict:
    """A tiny ``ROOT/ogbn_papers100M`` in OGB's binary layout (raw/data.npz, raw/node-label.npz, split/time)."""
    rng = np.random.default_rng(2)
    d = root / "ogbn_papers100M"
    (d / "raw").mkdir(parents=True)
    (d / "RELEASE_v1.txt").write_text("ogbn-papers100M v1\n")
    src, dst = rng.integers(0, n, 150), rng.integers(0, n, 150)
    src, dst = np.r_[src, 3, 5, 7], np.r_[dst, 5, 3, 7]  # a reciprocal pair and a self loop
    edge_index = np.stack([src, dst]).astype(np.int64)
    feat = rng.standard_normal((n, 8)).astype(feat_dtype)
    label = (np.arange(n) % 172).astype(np.float32).reshape(n, 1)
    label[-3:] = np.nan  # unlabelled, as most of papers100M
    np.savez_compressed(d / "raw" / "data.npz", edge_index=edge_index, node_feat=feat,
                        num_nodes_list=np.array([n]), num_edges_list=np.array([edge_index.shape[1]]),
                        node_year=np.full((n, 1), 2000))
    np.savez_compressed(d / "raw" / "node-label.npz", node_label=label)
    split = _splits(d, "time", n - 3)
    return {"edges": edge_index, "feat": feat, "label": label[:, 0], "split": split}


@needs_ogb
def test_products_reads_local_files(tmp_path, no_network):
    data = write_ogb_products(tmp_path)
    g = load_graph(DataConfig(dataset="ogbn-products", data_dir=str(tmp_path)))
    assert (g.num_nodes, g.feat_dim, g.num_classes, g.name) == (24, 6, 47, "ogbn-products")
    np.testing.assert_allclose(g.feat, data["feat"], atol=1e-6)
    np.testing.assert_array_equal(g.label, data["label"])
    for name, ids in data["split"].items():
        np.testing.assert_array_equal(g.split(name), ids)
    # ogb stores products one way and adds the inverse edges itself: no reverse by default.
    undirected = {(int(a), int(b)) for a, b in data["edges"]}
    assert edge_set(g) == undirected | {(b, a) for a, b in undirected}
    assert g.num_edges == 2 * len(undirected)
    assert builtins.input.__module__ == "builtins"


@needs_ogb
def test_papers100m_reads_binary_layout_bidirected_and_memory_mapped(tmp_path, no_network):
    data = write_ogb_papers(tmp_path)
    cfg = DataConfig(dataset="ogbn-papers100M", data_dir=str(tmp_path))
    for _ in range(2):  # the second load reuses the uncompressed copies
        g = load_graph(cfg)
        assert (g.num_nodes, g.feat_dim, g.num_classes, g.name) == (40, 8, 172, "ogbn-papers100M")
        assert isinstance(g.feat, np.memmap) and not g.feat.flags.writeable  # mapped, not read into memory
        np.testing.assert_array_equal(g.feat, data["feat"])
        expected_label = np.where(np.isnan(data["label"]), -1, data["label"]).astype(np.int64)
        np.testing.assert_array_equal(g.label, expected_label)
        for name, ids in data["split"].items():
            np.testing.assert_array_equal(g.split(name), ids)
        directed = {(int(s), int(d)) for s, d in data["edges"].T}
        assert edge_set(g) == directed | {(d, s) for s, d in directed}  # bidirected, duplicates dropped
        assert g.num_edges == len(directed | {(d, s) for s, d in directed})
    cache = tmp_path / "ogbn_papers100M" / "processed"
    assert sorted(p.name for p in (cache / "gnnray").iterdir()) == ["edge_index.npy", "node_feat.npy"]
    assert not (cache / "data_processed").exists()  # ogb's pickled second copy is never written
    plain = load_graph(DataConfig(dataset="ogbn-papers100M", data_dir=str(tmp_path), reverse_edges=False))
    assert plain.num_edges == data["edges"].shape[1]


@needs_ogb
def test_papers100m_features_are_cast_to_float32(tmp_path, no_network):
    data = write_ogb_papers(tmp_path, feat_dtype=np.float16)
    g = load_graph(DataConfig(dataset="ogbn-papers100M", data_dir=str(tmp_path)))
    assert g.feat.dtype == np.float32
    np.testing.assert_array_equal(g.feat, data["feat"].astype(np.float32))


@needs_ogb
def test_papers100m_missing_files_say_where_to_get_them(tmp_path, no_network):
    with pytest.raises(DatasetError) as err:
        load_graph(DataConfig(dataset="ogbn-papers100M", data_dir=str(tmp_path)))
    message = str(err.value)
    for text in ("raw/data.npz", str(tmp_path / "ogbn_papers100M"), "papers100M-bin.zip", "--data-dir"):
        assert text in message, message


@needs_ogb
def test_papers100m_corrupt_archive_is_named(tmp_path, no_network):
    write_ogb_papers(tmp_path)
    npz = tmp_path / "ogbn_papers100M" / "raw" / "data.npz"
    npz.write_bytes(npz.read_bytes()[: npz.stat().st_size // 2])
    with pytest.raises(DatasetError, match="cannot read the OGB files in .*ogbn_papers100M"):
        load_graph(DataConfig(dataset="ogbn-papers100M", data_dir=str(tmp_path)))


@pytest.mark.parametrize("self_loops", [False, True])
@pytest.mark.parametrize("chunk", [5, 1 << 20])
def test_chunked_bidirected_csc_equals_the_edge_list_path(self_loops, chunk):
    rng = np.random.default_rng(3)
    n = 50
    src, dst = rng.integers(0, n, 400), rng.integers(0, n, 400)  # duplicates, reciprocal pairs, self loops
    indptr, indices = bidirected_csc(src, dst, n, self_loops, chunk=chunk)
    # Reference: both directions as a set of (src, dst) pairs, plus a loop per node.
    pairs = set(zip(src.tolist(), dst.tolist())) | set(zip(dst.tolist(), src.tolist()))
    pairs |= {(v, v) for v in range(n)} if self_loops else set()
    ref_src, ref_dst = (np.array(x, dtype=np.int64) for x in zip(*sorted(pairs)))
    ref_indptr, ref_indices = csc_from_edges(ref_src, ref_dst, n)
    np.testing.assert_array_equal(indptr, ref_indptr)
    for v in range(n):  # the same in-neighbors, each sorted by id
        got, ref = indices[indptr[v]:indptr[v + 1]], ref_indices[ref_indptr[v]:ref_indptr[v + 1]]
        np.testing.assert_array_equal(got, np.sort(ref))
    assert indices.dtype == np.int32 and indptr.dtype == np.int32  # structure_dtypes, written so directly
