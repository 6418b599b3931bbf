"""A scaled-down MAG240M in OGB-LSC's exact on-disk layout: what ``ogb.lsc.MAG240MDataset`` reads.

Same file names, dtypes and per-node-type shapes as the real data (768
float16 features per paper, float32 labels with NaN where unlabelled, int64
``(2, E)`` edge lists, ``meta.pt`` and ``split_dict.pt`` written by
``torch.save``), with every node, edge and split count divided by ``scale``.
Papers carry signal: a class centroid plus noise, and citations mostly within
a class, so a replica trains to better than chance.

``python tests/data/mag_replica.py DATA_DIR [SCALE]`` writes one (SCALE 1000: about 0.7 GB on disk
once gnnray adds its feature table).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

# The real MAG240M (ogb-lsc v1).
NODES = {"paper": 121_751_666, "author": 122_383_112, "institution": 25_721}
EDGES = {("author", "writes", "paper"): 386_022_720, ("author", "affiliated_with", "institution"): 44_592_586,
         ("paper", "cites", "paper"): 1_297_748_926}
SPLITS = {"train": 1_112_392, "valid": 138_949, "test-dev": 88_092, "test-challenge": 58_726}
CLASSES, DIM = 153, 768


def write_mag240m_replica(root: Path, scale: int = 1000, seed: int = 0) -> Path:
    """Write ``root/mag240m_kddcup2021`` with the real counts divided by ``scale``; return ``root``."""
    rng = np.random.default_rng(seed)
    d = Path(root) / "mag240m_kddcup2021"
    (d / "processed" / "paper").mkdir(parents=True)
    n = {t: max(1, c // scale) for t, c in NODES.items()}
    p = n["paper"]

    label = rng.integers(0, CLASSES, p)
    centroid = rng.standard_normal((CLASSES, DIM)).astype(np.float32)
    feat = np.lib.format.open_memmap(d / "processed" / "paper" / "node_feat.npy", mode="w+", dtype=np.float16,
                                     shape=(p, DIM))
    for a in range(0, p, 1 << 14):
        rows = label[a:a + (1 << 14)]
        feat[a:a + rows.size] = centroid[rows] + 2 * rng.standard_normal((rows.size, DIM), dtype=np.float32)
    feat.flush()
    del feat

    order = rng.permutation(p)
    cuts = np.cumsum([max(1, c // scale) for c in SPLITS.values()])
    split = dict(zip(SPLITS, np.split(order[:cuts[-1]], cuts[:-1])))
    split = {k: np.sort(v).astype(np.int64) for k, v in split.items()}
    split["test-whole"] = np.sort(np.concatenate([split["test-dev"], split["test-challenge"]]))
    # Labels of train and valid only, as released (test labels are hidden): NaN elsewhere.
    labelled = np.full(p, np.nan, dtype=np.float32)
    known = np.concatenate([split["train"], split["valid"]])
    labelled[known] = label[known]
    np.save(d / "processed" / "paper" / "node_label.npy", labelled)
    np.save(d / "processed" / "paper" / "node_year.npy", rng.integers(1900, 2021, p).astype(np.int64))

    by_class = np.argsort(label, kind="stable")
    first = np.searchsorted(label[by_class], np.arange(CLASSES))
    size = np.bincount(label, minlength=CLASSES)
    for (s, r, t), count in EDGES.items():
        m = max(1, count // scale)
        src = rng.integers(0, n[s], m)
        if (s, t) == ("paper", "paper"):  # 3 in 4 citations within the citing paper's class
            same = rng.random(m) < 0.75
            c = label[src[same]]
            dst = rng.integers(0, p, m)
            dst[same] = by_class[first[c] + (rng.random(same.sum()) * size[c]).astype(np.int64)]
        else:
            dst = rng.integers(0, n[t], m)
        (d / "processed" / f"{s}___{r}___{t}").mkdir()
        np.save(d / "processed" / f"{s}___{r}___{t}" / "edge_index.npy", np.stack([src, dst]).astype(np.int64))

    import torch

    torch.save({**n, "num_classes": CLASSES}, d / "meta.pt")
    torch.save(split, d / "split_dict.pt")
    (d / "RELEASE_v1.txt").write_text("scaled-down replica\n")
    return Path(root)


if __name__ == "__main__":
    write_mag240m_replica(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1000)
