"""Tests of the typed OGB loaders on tiny layouts written here: ogbn-mag (read by ogb) and MAG240M (numpy)."""

from __future__ import annotations

import gzip
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from gnnray.config import DataConfig
from gnnray.data.load import load_graph
from gnnray.errors import DatasetError

# Per-type ids; papers are labelled. Authors 0-2, institutions 0-1, fields 0-1, papers 0-4.
MAG_COUNTS = {"author": 3, "field_of_study": 2, "institution": 2, "paper": 5}
MAG_EDGES = {("author", "affiliated_with", "institution"): [(0, 0), (1, 0), (2, 1)],
             ("author", "writes", "paper"): [(0, 0), (0, 1), (1, 2), (2, 3), (2, 4)],
             ("paper", "cites", "paper"): [(0, 1), (2, 1), (3, 4)],
             ("paper", "has_topic", "field_of_study"): [(0, 0), (1, 0), (2, 1), (3, 1), (4, 1)]}
PAPER_FEAT = np.arange(5 * 4, dtype=np.float32).reshape(5, 4) / 10


def _csv(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        f.write("".join(",".join(map(str, r)) + "\n" for r in rows))


def write_ogbn_mag(root: Path) -> Path:
    """ogbn-mag's raw layout as ogb reads it (read_csv_heterograph_raw, read_node_label_hetero, split/time/)."""
    local = root / "ogbn_mag"
    raw = local / "raw"
    _csv(raw / "num-node-dict.csv.gz", [list(MAG_COUNTS), list(MAG_COUNTS.values())])
    _csv(raw / "triplet-type-list.csv.gz", [list(t) for t in MAG_EDGES])
    for t, edges in MAG_EDGES.items():
        _csv(raw / "relations" / "___".join(t) / "edge.csv.gz", edges)
        _csv(raw / "relations" / "___".join(t) / "num-edge-list.csv.gz", [[len(edges)]])
    _csv(raw / "node-feat" / "paper" / "node-feat.csv.gz", PAPER_FEAT.tolist())
    _csv(raw / "nodetype-has-label.csv.gz", [list(MAG_COUNTS), [t == "paper" for t in MAG_COUNTS]])
    _csv(raw / "node-label" / "paper" / "node-label.csv.gz", [[c] for c in [0, 1, 2, 1, 0]])
    split = local / "split" / "time"
    _csv(split / "nodetype-has-split.csv.gz", [list(MAG_COUNTS), [t == "paper" for t in MAG_COUNTS]])
    for name, ids in (("train", [0, 1, 2]), ("valid", [3]), ("test", [4])):
        _csv(split / "paper" / f"{name}.csv.gz", [[i] for i in ids])
    (local / "RELEASE_v2.txt").write_text("tiny\n")
    return root


def typed_edges(graph) -> Counter:
    dst = np.repeat(np.arange(graph.num_nodes), np.diff(graph.indptr))
    return Counter((int(s), int(d), graph.edge_types[t][1]) for s, d, t in zip(graph.indices, dst, graph.etype))


def test_ogbn_mag_tiny_layout(tmp_path):
    g = load_graph(DataConfig(dataset="ogbn-mag", data_dir=str(write_ogbn_mag(tmp_path))))
    assert g.node_types == ("paper", "author", "field_of_study", "institution") and g.target_type == "paper"
    offset = {"paper": 0, "author": 5, "field_of_study": 8, "institution": 10}
    assert g.num_nodes == 12 and g.num_classes == 349
    assert g.ntype.tolist() == [0] * 5 + [1] * 3 + [2] * 2 + [3] * 2
    want = Counter()
    for (s, r, d), edges in MAG_EDGES.items():
        for a, b in edges:
            want[(a + offset[s], b + offset[d], r)] += 1
            want[(b + offset[d], a + offset[s], f"rev_{r}")] += 1
    assert typed_edges(g) == want
    assert g.label.tolist() == [0, 1, 2, 1, 0] + [-1] * 7
    assert g.train_idx.tolist() == [0, 1, 2] and g.test_idx.tolist() == [4]
    np.testing.assert_allclose(g.feat[:5], PAPER_FEAT)
    # Author 0 wrote papers 0 and 1; institution 0 has authors 0 and 1 (round 2).
    a0, a1 = PAPER_FEAT[[0, 1]].mean(0), PAPER_FEAT[[2]].mean(0)
    np.testing.assert_allclose(g.feat[offset["author"]], a0, rtol=1e-6)
    np.testing.assert_allclose(g.feat[offset["institution"]], (a0 + a1) / 2, rtol=1e-6)
    np.testing.assert_allclose(g.feat[offset["field_of_study"] + 1], PAPER_FEAT[[2, 3, 4]].mean(0), rtol=1e-6)


def test_ogbn_mag_missing_says_where(tmp_path):
    # An empty data directory: ogb would download; offline that fails, and the error names the place.
    with pytest.raises(DatasetError, match="ogbn_mag"):
        load_graph(DataConfig(dataset="ogbn-mag", data_dir=str(tmp_path / "none")))


# MAG240M: 4 papers, 3 authors, 2 institutions, 8-dim float16 features.
M_COUNTS = {"paper": 4, "author": 3, "institution": 2}
M_EDGES = {"author___writes___paper": [(0, 0), (0, 1), (1, 2), (2, 3)],
           "author___affiliated_with___institution": [(0, 0), (1, 0), (2, 1)],
           "paper___cites___paper": [(0, 1), (2, 3)]}


def write_mag240m(root: Path, labels=(0.0, 1.0, 2.0, np.nan)) -> tuple[Path, np.ndarray]:
    """OGB-LSC MAG240M's layout, as its MAG240MDataset reads it (meta.pt, split_dict.pt, processed/...)."""
    d = root / "mag240m_kddcup2021"
    (d / "processed" / "paper").mkdir(parents=True)
    feat = (np.arange(4 * 8).reshape(4, 8) / 8).astype(np.float16)
    np.save(d / "processed" / "paper" / "node_feat.npy", feat)
    np.save(d / "processed" / "paper" / "node_label.npy", np.array(labels, dtype=np.float32))
    np.save(d / "processed" / "paper" / "node_year.npy", np.array([2019, 2018, 2020, 2021]))
    for name, edges in M_EDGES.items():
        (d / "processed" / name).mkdir()
        np.save(d / "processed" / name / "edge_index.npy", np.array(edges, dtype=np.int64).T)
    torch.save(dict(M_COUNTS), d / "meta.pt")
    torch.save({"train": np.array([0]), "valid": np.array([1, 2]), "test-dev": np.array([3]),
                "test-challenge": np.array([], dtype=np.int64)}, d / "split_dict.pt")
    return root, feat


def test_mag240m_tiny_layout(tmp_path):
    root, paper = write_mag240m(tmp_path)
    g = load_graph(DataConfig(dataset="mag240m", data_dir=str(root)))
    assert g.node_types == ("paper", "author", "institution") and g.num_classes == 153
    assert g.feat.dtype == np.float16 and isinstance(g.feat, np.memmap)  # memory-mapped, not loaded
    table = root / "mag240m_kddcup2021" / "processed" / "gnnray" / "full_feat.npy"
    assert table.is_file()
    np.testing.assert_array_equal(g.feat[:4], paper)
    authors = [paper[[0, 1]].astype(np.float32).mean(0), paper[[2]].astype(np.float32).mean(0),
               paper[[3]].astype(np.float32).mean(0)]
    for a, want in enumerate(authors):
        np.testing.assert_allclose(g.feat[4 + a].astype(np.float32), want, rtol=1e-3)
    np.testing.assert_allclose(g.feat[7].astype(np.float32), (authors[0] + authors[1]) / 2, rtol=1e-3)
    offset = {"paper": 0, "author": 4, "institution": 7}
    want = Counter()
    for name, edges in M_EDGES.items():
        s, r, d = name.split("___")
        for a, b in edges:
            want[(a + offset[s], b + offset[d], r)] += 1
            want[(b + offset[d], a + offset[s], f"rev_{r}")] += 1
    assert typed_edges(g) == want
    # test-dev is unlabelled (NaN), as in the real data: the second half of valid stands in.
    assert g.train_idx.tolist() == [0] and g.valid_idx.tolist() == [1] and g.test_idx.tolist() == [2]
    assert g.label.tolist() == [0, 1, 2, -1] + [-1] * 5
    # The feature table is written once: a second load reads the same file.
    mtime = table.stat().st_mtime_ns
    load_graph(DataConfig(dataset="mag240m", data_dir=str(root)))
    assert table.stat().st_mtime_ns == mtime


def test_mag240m_missing_files_are_named(tmp_path):
    root, _ = write_mag240m(tmp_path)
    (root / "mag240m_kddcup2021" / "processed" / "paper___cites___paper" / "edge_index.npy").unlink()
    with pytest.raises(DatasetError, match="paper___cites___paper/edge_index.npy not found"):
        load_graph(DataConfig(dataset="mag240m", data_dir=str(root)))


def test_mag240m_edge_ids_out_of_range_are_named(tmp_path):
    root, _ = write_mag240m(tmp_path)
    np.save(root / "mag240m_kddcup2021" / "processed" / "author___writes___paper" / "edge_index.npy",
            np.array([[0, 5], [0, 1]]))
    with pytest.raises(DatasetError, match=r"author___writes___paper/edge_index.npy: row 0 \(author ids\)"):
        load_graph(DataConfig(dataset="mag240m", data_dir=str(root)))


def test_mag240m_replica_layout_builds_the_typed_csc_from_the_edge_files(tmp_path):
    """A scaled-down MAG240M in OGB-LSC's exact layout (tests/data/mag_replica.py): every edge file's edges, and
    their reverses, are in the CSC with their relation; features and splits as the files say."""
    from mag_replica import write_mag240m_replica

    root = write_mag240m_replica(tmp_path, scale=20_000)
    d = root / "mag240m_kddcup2021"
    g = load_graph(DataConfig(dataset="mag240m", data_dir=str(root)))
    meta = torch.load(d / "meta.pt")
    counts = {t: meta[t] for t in ("paper", "author", "institution")}
    offset = dict(zip(counts, np.cumsum([0] + list(counts.values()))[:-1].tolist()))
    assert g.num_nodes == sum(counts.values()) and g.indices.dtype == np.int32 and g.etype.dtype == np.int8
    want = Counter()
    for s, r, t in (("author", "writes", "paper"), ("author", "affiliated_with", "institution"),
                    ("paper", "cites", "paper")):
        e = np.load(d / "processed" / f"{s}___{r}___{t}" / "edge_index.npy")
        want.update(zip((e[0] + offset[s]).tolist(), (e[1] + offset[t]).tolist(), [r] * e.shape[1]))
        want.update(zip((e[1] + offset[t]).tolist(), (e[0] + offset[s]).tolist(), [f"rev_{r}"] * e.shape[1]))
    assert typed_edges(g) == want
    paper = np.load(d / "processed" / "paper" / "node_feat.npy")
    np.testing.assert_array_equal(g.feat[:counts["paper"]], paper)
    writes = np.load(d / "processed" / "author___writes___paper" / "edge_index.npy")
    a = int(writes[0, 0])
    np.testing.assert_allclose(g.feat[offset["author"] + a].astype(np.float32),
                               paper[writes[1, writes[0] == a]].astype(np.float32).mean(0), rtol=2e-3, atol=2e-3)
    split = torch.load(d / "split_dict.pt", weights_only=False)  # numpy arrays, as OGB-LSC writes them
    assert g.train_idx.tolist() == split["train"].tolist()
    assert sorted(g.valid_idx.tolist() + g.test_idx.tolist()) == split["valid"].tolist()  # test-dev is unlabelled
    assert (g.label[g.train_idx] >= 0).all() and (g.label[counts["paper"]:] == -1).all()
