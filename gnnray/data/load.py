"""Stage 1 (driver): ``--dataset`` becomes a validated :class:`~gnnray.data.graph.Graph`.

``DataConfig.dataset`` picks the reader: ``synthetic`` (:mod:`.synthetic`), an
OGB name (:mod:`.ogb`) or the path of a graph directory (:mod:`.graph_dir`).
Each returns :class:`~gnnray.data.graph.GraphParts`; features are then chosen
(:func:`_features`), the CSC is built once (:mod:`.csc`) and the result is
validated (:mod:`.validate`). Every problem with the data raises
:class:`~gnnray.errors.DatasetError` naming the file (and column) and what to do.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from gnnray.config import DataConfig
from gnnray.data.graph import Graph, GraphParts
from gnnray.data.validate import validate
from gnnray.errors import DatasetError

log = logging.getLogger(__name__)


def load_graph(cfg: DataConfig, seed: int = 0) -> Graph:
    """Read, prepare and validate the graph that ``cfg.dataset`` names.

    Args:
        cfg: ``dataset`` picks the source; ``reverse_edges`` (``None``: the
            dataset's default), ``self_loops``, ``random_features`` (if > 0,
            replaces the features by seeded standard normal ones) and
            ``normalize_features`` (rows scaled to sum 1) are applied.
        seed: Seed of the synthetic generator and of random features.

    Raises:
        DatasetError: The dataset is unknown, missing, unreadable or inconsistent.
    """
    from gnnray.data import graph_dir, mag, ogb, synthetic, typed

    if cfg.dataset in ("synthetic", "synthetic-hetero"):
        source = cfg.dataset
        make = synthetic.synthetic_parts if cfg.dataset == "synthetic" else synthetic.synthetic_hetero_parts
        parts = make(cfg.synthetic_nodes, cfg.synthetic_classes, cfg.synthetic_feat_dim, cfg.synthetic_avg_degree,
                     seed)
    elif cfg.dataset in mag.READERS:
        source = cfg.dataset
        parts = mag.READERS[cfg.dataset](cfg.data_dir)
    elif cfg.dataset in ogb.REVERSE_DEFAULT:
        source = cfg.dataset
        parts = ogb.read_ogb(cfg.dataset, cfg.data_dir)
    else:
        path = Path(cfg.dataset).expanduser()
        if not path.is_dir():
            raise DatasetError(
                f"unknown dataset {cfg.dataset!r}: no graph directory {path} exists. Use --dataset "
                f"synthetic, synthetic-hetero, {', '.join([*ogb.REVERSE_DEFAULT, *mag.READERS])}, or the path of a "
                f"graph directory "
                f"({graph_dir.HELP})")
        source = str(path)
        parts = graph_dir.read_graph_dir(path)

    parts.feat = _features(parts, cfg, source, seed)
    if cfg.random_features > 0:
        parts.origins.pop("feat", None)
    elif parts.typed:
        typed.fill_missing(parts, cfg.embedding_dim, source)
    if cfg.normalize_features:
        # Row L1 normalisation, as PyG's NormalizeFeatures and the GCN paper's
        # preprocessing of bag-of-words graphs (cora, citeseer, pubmed).
        sums = np.abs(parts.feat).sum(axis=1, keepdims=True)
        parts.feat = (parts.feat / np.maximum(sums, 1e-12)).astype(np.float32)
    graph = parts.build(cfg.reverse_edges, cfg.self_loops)
    validate(graph, source, parts.origins)
    return graph


def _features(parts: GraphParts, cfg: DataConfig, source: str, seed: int) -> np.ndarray:
    if cfg.random_features > 0:
        if parts.feat is not None:
            log.warning("%s: replacing its %d-dim features by random ones (--random-features %d)",
                        source, parts.feat.shape[1], cfg.random_features)
        rng = np.random.default_rng(seed)
        return rng.standard_normal((parts.num_nodes, cfg.random_features), dtype=np.float32)
    if parts.feat is None:
        if cfg.embedding_dim > 0:
            # Zero-width features: the learnable embeddings are the whole input
            # and the object store holds no feature bytes.
            return np.zeros((parts.num_nodes, 0), dtype=np.float32)
        raise DatasetError(f"{source}: the graph has no node features ({parts.no_feat}). Add them, pass "
                           f"--embedding-dim DIM to learn node embeddings instead, or pass --random-features DIM "
                           f"to use random features (for load tests: they carry no signal)")
    return parts.feat

