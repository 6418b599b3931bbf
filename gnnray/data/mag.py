"""The typed OGB datasets: ``--dataset ogbn-mag`` and ``--dataset mag240m``, read from ``--data-dir``.

Both become one typed graph (:mod:`gnnray.data.typed`): papers first, then
the other node types, each a range of ids; papers are the labelled target
type and the only one with features, the others get their neighbors' mean.

* ``ogbn-mag``: read by ``ogb`` (``DATA_DIR/ogbn_mag``); papers, authors,
  institutions and fields of study; float32 features, in memory.
* ``mag240m``: OGB-LSC's layout in ``DATA_DIR/mag240m_kddcup2021``, read
  with numpy (the ``ogb.lsc`` loader is not needed)::

      meta.pt                 {"paper": N, "author": A, "institution": I}
      split_dict.pt           {"train", "valid", "test-dev"(, "test-challenge")}: paper ids
      processed/paper/node_feat.npy    (N, 768) float16, memory-mapped
      processed/paper/node_label.npy   (N,) float, NaN where unlabelled
      processed/paper/node_year.npy    (N,) (not used)
      processed/author___writes___paper/edge_index.npy              (2, E) author, paper
      processed/author___affiliated_with___institution/edge_index.npy
      processed/paper___cites___paper/edge_index.npy

  The feature table of all nodes (float16, as the papers') is written once,
  a chunk at a time, to ``processed/gnnray/full_feat.npy`` beside the data
  and memory-mapped; the paper features are never read whole. The edges are
  never stacked either: the typed CSC is written relation by relation, a
  chunk at a time, straight from the memory-mapped edge files
  (:func:`~gnnray.data.typed.relation_csc`), so the driver's peak memory is
  about the final structure.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from gnnray.data.graph import SPLITS, Graph, GraphParts, check_ids
from gnnray.data.ogb import ogb_dataset, ogb_label
from gnnray.data.typed import EdgeColumn, fill_rounds, relation_csc, stack_types
from gnnray.errors import DatasetError

MAG240M_DIR = "mag240m_kddcup2021"
MAG240M_CLASSES = 153
MAG240M_RELATIONS = (("author", "writes", "paper"), ("author", "affiliated_with", "institution"),
                     ("paper", "cites", "paper"))
# Rows of the feature table copied per step: bounds the copy's temporaries.
COPY_ROWS = 1 << 16


def read_ogbn_mag(data_dir: str) -> GraphParts:
    """ogbn-mag, read by ``ogb`` (its ``NodePropPredDataset`` returns dicts keyed by node and edge type)."""
    name = "ogbn-mag"
    dataset, split, graph, labels, local = ogb_dataset(name, data_dir, marker="triplet-type-list.csv.gz")
    counts = graph["num_nodes_dict"]
    order = ["paper"] + sorted(t for t in counts if t != "paper")
    relations = [(tuple(t), e[0], e[1]) for t, e in sorted(graph["edge_index_dict"].items())]
    for (s, r, d), src, dst in relations:
        check_ids(np.asarray(src), int(counts[s]), f"{local / 'raw' / 'relations'}: {s}___{r}___{d} source ids")
        check_ids(np.asarray(dst), int(counts[d]), f"{local / 'raw' / 'relations'}: {s}___{r}___{d} destination ids")
    offset, src, dst, etype, ntype = stack_types({t: counts[t] for t in order}, relations)
    n = int(sum(counts.values()))
    paper_feat = (graph.get("node_feat_dict") or {}).get("paper")
    if paper_feat is None:
        raise DatasetError(f"{name}: {local / 'raw' / 'node-feat' / 'paper'} has no node-feat.csv.gz; place the "
                           f"OGB files of ogbn-mag there")
    feat = np.zeros((n, paper_feat.shape[1]), dtype=np.float32)
    feat[:counts["paper"]] = paper_feat
    label = np.full(n, -1, dtype=np.int64)
    label[:counts["paper"]] = ogb_label(labels["paper"], int(counts["paper"]), name)
    return GraphParts(
        name=name, num_nodes=n, num_classes=int(dataset.num_classes), src=src, dst=dst, feat=feat, label=label,
        splits={k: np.asarray(split[k]["paper"], dtype=np.int64).reshape(-1) for k in SPLITS},
        reverse_default=True, etype=etype, ntype=ntype, node_types=tuple(order),
        edge_types=tuple(t for t, _, _ in relations), target_type="paper", has_feat=ntype == 0)


@dataclass
class Mag240mParts(GraphParts):
    """MAG240M's parts: the edges stay in their memory-mapped ``(2, E)`` files until :meth:`build` reads them."""

    edge_index: tuple = ()  # per MAG240M_RELATIONS
    offset: Optional[dict] = None  # node type -> its first global id

    @property
    def typed(self) -> bool:
        return True

    def build(self, reverse: Optional[bool] = None, self_loops: bool = False) -> Graph:
        """The typed CSC, written relation by relation from the edge files (each relation's reverse: ``rev_r``)."""
        if self_loops:
            raise DatasetError("mag240m: --self-loops is not supported on a typed graph (a self loop has no "
                               "relation); drop it: rgat and rsage add each node's own features themselves")
        reverse = self.reverse_default if reverse is None else reverse
        r = len(MAG240M_RELATIONS)
        streams = [(EdgeColumn(e, 0, self.offset[s]), EdgeColumn(e, 1, self.offset[d]), j)
                   for j, ((s, _, d), e) in enumerate(zip(MAG240M_RELATIONS, self.edge_index))]
        edge_types = MAG240M_RELATIONS
        if reverse:
            streams += [(dst, src, r + j) for src, dst, j in streams]
            edge_types += tuple((d, f"rev_{rel}", s) for s, rel, d in MAG240M_RELATIONS)
        indptr, indices, etype = relation_csc(self.num_nodes, streams, len(edge_types))
        self.edge_index = ()
        return Graph(indptr=indptr, indices=indices, feat=self.feat, label=self.label,
                     train_idx=self.splits["train"], valid_idx=self.splits["valid"], test_idx=self.splits["test"],
                     num_classes=self.num_classes, name=self.name, etype=etype, ntype=self.ntype,
                     node_types=tuple(self.node_types), edge_types=edge_types, target_type=self.target_type)


def read_mag240m(data_dir: str) -> GraphParts:
    """MAG240M in OGB-LSC's layout (module docstring): papers, authors, institutions; float16 features."""
    import torch

    root = Path(data_dir).expanduser() / MAG240M_DIR
    processed = root / "processed"
    files = [root / "meta.pt", root / "split_dict.pt", processed / "paper" / "node_feat.npy",
             processed / "paper" / "node_label.npy"] + [processed / "___".join(t) / "edge_index.npy"
                                                        for t in MAG240M_RELATIONS]
    missing = [str(f.relative_to(root)) for f in files if not f.is_file()]
    if missing:
        raise DatasetError(f"mag240m: {', '.join(missing)} not found in {root}. gnnray does not download it "
                           f"(over 200 GB): download it with ogb-lsc's MAG240MDataset(root=DATA_DIR) on a machine "
                           f"with the disk, or pass --data-dir for the directory that holds {MAG240M_DIR}/")
    try:
        meta = torch.load(root / "meta.pt", weights_only=False)
        split = torch.load(root / "split_dict.pt", weights_only=False)
        paper_feat = np.load(processed / "paper" / "node_feat.npy", mmap_mode="r")
        paper_label = np.load(processed / "paper" / "node_label.npy", mmap_mode="r")
        edges = [np.load(processed / "___".join(t) / "edge_index.npy", mmap_mode="r") for t in MAG240M_RELATIONS]
        counts = {t: int(meta[t]) for t in ("paper", "author", "institution")}
    except (OSError, ValueError, KeyError, TypeError, EOFError, RuntimeError) as exc:
        raise DatasetError(f"mag240m: cannot read the files in {root}: {type(exc).__name__}: {exc}. Repair them, or "
                           f"download them again") from exc
    if paper_feat.ndim != 2 or paper_feat.shape[0] != counts["paper"]:
        raise DatasetError(f"{processed / 'paper' / 'node_feat.npy'}: shape {paper_feat.shape}; expected "
                           f"({counts['paper']}, dim) as meta.pt says")
    for (s, r, d), e in zip(MAG240M_RELATIONS, edges):
        where = processed / f"{s}___{r}___{d}" / "edge_index.npy"
        if e.ndim != 2 or e.shape[0] != 2:
            raise DatasetError(f"{where}: shape {e.shape}; expected (2, num_edges)")
        check_ids(e[0], counts[s], f"{where}: row 0 ({s} ids)")
        check_ids(e[1], counts[d], f"{where}: row 1 ({d} ids)")
    offset, start = {}, 0
    for t, count in counts.items():
        offset[t], start = start, start + count
    n = start
    ntype = np.repeat(np.arange(len(counts), dtype=np.int8), list(counts.values()))
    label = np.full(n, -1, dtype=np.int64)
    label[:counts["paper"]] = ogb_label(np.asarray(paper_label), counts["paper"], "mag240m")
    feat = _mag240m_features(paper_feat, edges, offset, n, processed / "gnnray")
    return Mag240mParts(
        name="mag240m", num_nodes=n, num_classes=MAG240M_CLASSES, src=None, dst=None, feat=feat, label=label,
        splits=_mag240m_splits(split, label, root / "split_dict.pt"), reverse_default=True, ntype=ntype,
        node_types=tuple(counts), edge_types=MAG240M_RELATIONS, target_type="paper", edge_index=tuple(edges),
        offset=offset)


def _mag240m_splits(split: dict, label: np.ndarray, file: Path) -> dict:
    """train and valid as given; test is test-dev where it is labelled, else the second half of valid.

    MAG240M's test labels are hidden (NaN in node_label.npy), and every
    split must be labelled here: the held-out half of valid stands in.
    """
    if "test" in split and "test-dev" not in split:  # the older layout: ogb-lsc derives test-dev from it
        from ogb.lsc.utils import split_test

        split_test(split)
    try:
        train, valid = (np.asarray(split[k], dtype=np.int64).reshape(-1) for k in ("train", "valid"))
    except KeyError as exc:
        raise DatasetError(f"{file}: no {exc} split; it must hold train, valid and test-dev paper ids") from exc
    test = np.asarray(split.get("test-dev", []), dtype=np.int64).reshape(-1)
    if test.size and np.all(label[test] >= 0):
        return {"train": np.sort(train), "valid": np.sort(valid), "test": np.sort(test)}
    valid = np.sort(valid)
    return {"train": np.sort(train), "valid": valid[0::2], "test": valid[1::2]}


def _mag240m_features(paper_feat: np.ndarray, edges: list, offset: dict, n: int, cache: Path) -> np.ndarray:
    """All nodes' features, memory-mapped from ``cache/full_feat.npy``, written once if missing or stale.

    Papers' rows are copied a chunk at a time; authors' and institutions'
    are their neighbors' mean (:func:`~gnnray.data.typed.fill_rounds`),
    from a CSC of the edges into featureless nodes only, built from the edge files.
    """
    target = cache / "full_feat.npy"
    source = Path(paper_feat.filename)
    if target.is_file() and target.stat().st_mtime >= source.stat().st_mtime:
        full = np.load(target, mmap_mode="r")
        if full.shape == (n, paper_feat.shape[1]):
            return full
    tmp = target.with_name(target.name + ".tmp")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        # A new .npy file is zeros (sparse on disk): the rows fill_rounds expects of featureless nodes.
        full = np.lib.format.open_memmap(tmp, mode="w+", dtype=paper_feat.dtype, shape=(n, paper_feat.shape[1]))
        papers = paper_feat.shape[0]
        for a in range(0, papers, COPY_ROWS):
            full[a:min(a + COPY_ROWS, papers)] = paper_feat[a:a + COPY_ROWS]
        # Each author's and institution's neighbors, both directions; papers need none (cites is skipped).
        streams = [(EdgeColumn(e, a, offset[ta]), EdgeColumn(e, b, offset[tb]), 0)
                   for (s, _, d), e in zip(MAG240M_RELATIONS, edges)
                   for (a, ta), (b, tb) in (((0, s), (1, d)), ((1, d), (0, s))) if tb != "paper"]
        indptr, nbr, _ = relation_csc(n, streams, 1)
        fill_rounds(full, np.arange(n) >= papers, indptr, nbr)
        del indptr, nbr
        full.flush()
        del full
        os.replace(tmp, target)
    except OSError as exc:
        raise DatasetError(f"mag240m: cannot write the feature table {target} ({exc}); it needs num_nodes x 768 x 2 "
                           f"bytes of disk beside the data: make {cache} writable or free the space") from exc
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return np.load(target, mmap_mode="r")


READERS = {"ogbn-mag": read_ogbn_mag, "mag240m": read_mag240m}
