"""The benchmark's graph: the arxiv structure or an arxiv-sized synthetic graph, and its ``--quick`` cut."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

from bench.common import DEFAULT_DATASET, Settings
from gnnray.config import DataConfig
from gnnray.data.graph import Graph


def base_data_config(dataset: Optional[str]) -> DataConfig:
    """The issue's data: the arxiv structure with 128 random features, else an arxiv-sized synthetic graph."""
    path = Path(dataset).expanduser() if dataset and dataset != "synthetic" else DEFAULT_DATASET
    if dataset != "synthetic" and path.is_dir():
        return DataConfig(dataset=str(path), reverse_edges=True, random_features=128)
    if dataset not in (None, "synthetic"):
        raise SystemExit(f"--dataset {dataset}: no such directory")
    if dataset is None:
        print(f"{DEFAULT_DATASET} not found: using the arxiv-sized synthetic graph", flush=True)
    return DataConfig(dataset="synthetic", synthetic_nodes=169_343, synthetic_feat_dim=128, synthetic_classes=40)


def quick_data_config(graph: Graph, s: Settings, workdir: Path) -> DataConfig:
    """Write ``graph`` as a graph directory whose splits are cut to a few batches (``--quick``).

    Same nodes, edges (reverse edges already added) and features of the same
    size, so one batch costs what it does on the full graph; only epochs get
    shorter. Loaded with the run's seed, arxiv's random features are even the
    same ones.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = workdir / "quick-graph"
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(s.seed)
    n = graph.num_nodes
    split = np.full(n, "none", dtype=object)
    keep = {"train": s.quick_train_batches, "valid": s.quick_eval_batches, "test": s.quick_eval_batches}
    for name, batches in keep.items():
        ids = graph.split(name)
        split[rng.choice(ids, min(len(ids), batches * s.batch_size), replace=False)] = name
    dst = np.repeat(np.arange(n, dtype=np.int64), np.diff(graph.indptr))
    pq.write_table(pa.table({"src": graph.indices, "dst": dst}), out / "edges.parquet")
    pq.write_table(pa.table({"id": np.arange(n, dtype=np.int64), "label": graph.label,
                             "split": pa.array(split, type=pa.string())}), out / "nodes.parquet")
    (out / "meta.json").write_text(json.dumps({"num_nodes": n, "num_classes": graph.num_classes,
                                               "name": f"{graph.name}-quick"}))
    return DataConfig(dataset=str(out), reverse_edges=False, random_features=graph.feat_dim)
