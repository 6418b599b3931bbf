"""A small typed graph directory (``--dataset PATH``) whose signal is spread over relations, as a user's might be.

Papers (labelled, weak features: a class centroid in noise), authors and
institutions (no features: gnnray fills them with neighbor means at load).
Each paper is cited by about three papers mostly of its class (``cites``),
written by two or three authors mostly of its topic (``writes``), and
``mentions`` about twelve papers of any class: a relation without signal
that holds most of a paper's in-edges, so one draw over all relations finds
mostly noise, while a relational model sampling each relation apart sees
its citations and authors. Authors are ``affiliated_with`` one institution,
mostly of their topic. ``easy`` makes every signal stronger (features and the
share of neighbors of a paper's class).

``python tests/data/typed_dir.py DIR [PAPERS] [easy]`` writes one (default 6,000 papers).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

CLASSES, DIM = 5, 32


def write_typed_dir(path: Path, papers: int = 6000, seed: int = 0, easy: bool = False) -> Path:
    """Write ``edges.parquet``, ``nodes.parquet`` and ``meta.json`` under ``path``; return ``path``."""
    rng = np.random.default_rng(seed)
    # Share of a paper's citing papers and authors of its class, of authors' institutions of their topic,
    # and the scale of the class centroids in the papers' features (noise: 1).
    cites, writes, affiliation, centroid_scale = (0.8, 0.85, 0.7, 0.6) if easy else (0.6, 0.7, 0.6, 0.15)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    p, a, i = papers, papers // 2, max(CLASSES, papers // 60)
    label = rng.integers(0, CLASSES, p)
    topic = rng.integers(0, CLASSES, a)  # each author's
    place = rng.integers(0, CLASSES, i)  # each institution's

    def drawn(of: np.ndarray, cls: np.ndarray, offset: int = 0) -> np.ndarray:
        """For each entry of ``cls``, a uniformly drawn node of ``of``'s nodes of that class (ids + ``offset``)."""
        order = np.argsort(of, kind="stable")
        start = np.searchsorted(of[order], np.arange(CLASSES + 1))
        size = start[cls + 1] - start[cls]
        return order[start[cls] + (rng.random(cls.size) * size).astype(np.int64)] + offset

    def mostly(cls: np.ndarray, share: float) -> np.ndarray:
        """``cls``, each entry replaced by a random class with probability ``1 - share``."""
        return np.where(rng.random(cls.size) < share, cls, rng.integers(0, CLASSES, cls.size))

    cited = np.repeat(np.arange(p), rng.integers(2, 5, p))
    citing = drawn(label, mostly(label[cited], cites))
    written = np.repeat(np.arange(p), rng.integers(2, 4, p))
    author = drawn(topic, mostly(label[written], writes), offset=p)
    mentioned = np.repeat(np.arange(p), rng.integers(8, 17, p))
    mentioning = rng.integers(0, p, mentioned.size)
    member = np.arange(a)
    institution = drawn(place, mostly(topic, affiliation), offset=p + a)
    keep_c, keep_m = citing != cited, mentioning != mentioned
    edges = [(citing[keep_c], cited[keep_c], "cites"), (author, written, "writes"),
             (mentioning[keep_m], mentioned[keep_m], "mentions"), (member + p, institution, "affiliated_with")]
    pq.write_table(pa.table({"src": pa.array(np.concatenate([s for s, _, _ in edges]), pa.int64()),
                             "dst": pa.array(np.concatenate([d for _, d, _ in edges]), pa.int64()),
                             "type": pa.array(np.concatenate([[r] * len(s) for s, _, r in edges]), pa.string())}),
                   path / "edges.parquet")

    centroid = rng.standard_normal((CLASSES, DIM)).astype(np.float32) * np.float32(centroid_scale)
    feat = centroid[label] + rng.standard_normal((p, DIM), dtype=np.float32)
    n = p + a + i
    split = np.full(n, "none", dtype=object)
    split[:p] = rng.choice(["train", "valid", "test"], p, p=[0.6, 0.2, 0.2])
    pq.write_table(pa.table({
        "id": pa.array(np.arange(n), pa.int64()),
        "label": pa.array(np.r_[label, np.full(a + i, -1)], pa.int64()),
        "split": pa.array(split.tolist(), pa.string()),
        "type": pa.array(["paper"] * p + ["author"] * a + ["institution"] * i, pa.string()),
        "feat": pa.array([row.tolist() for row in feat] + [None] * (a + i), pa.list_(pa.float32()))}),
        path / "nodes.parquet")
    (path / "meta.json").write_text(json.dumps({"num_nodes": n, "num_classes": CLASSES, "target_type": "paper"}))
    return path


if __name__ == "__main__":
    write_typed_dir(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 6000, easy="easy" in sys.argv[3:])
