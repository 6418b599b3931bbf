"""Stage 1 (driver): ``--dataset`` becomes a validated :class:`~gnnray.data.graph.Graph`.

``DataConfig.dataset`` picks the reader: ``synthetic`` (:mod:`.synthetic`), an
OGB name (:mod:`.ogb`) or the path of a graph directory (:mod:`.graph_dir`).
Each returns :class:`~gnnray.data.graph.GraphParts`; features are then chosen
(:func:`_features`), the CSC is built once (:mod:`.csc`) and the result is
validated (:mod:`.validate`). Every problem with the data raises
:class:`~gnnray.errors.DatasetError` naming the file (and column) and what to do.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np

from gnnray.config import DataConfig
from gnnray.data.feature_source import (ArrayRows, FeatureSource, Normalized, RandomRows, check_finite, materialize,
                                  source_of)
from gnnray.data.graph import Graph, GraphParts
from gnnray.data.typed import symmetric_relations
from gnnray.data.validate import validate
from gnnray.errors import DatasetError

log = logging.getLogger(__name__)


def load_graph(cfg: DataConfig, seed: int = 0) -> Graph:
    """Read, prepare and validate the graph that ``cfg.dataset`` names, its features in memory.

    Args:
        cfg: ``dataset`` picks the source; ``reverse_edges`` (``None``: the
            dataset's default), ``self_loops``, ``random_features`` (if > 0,
            replaces the features by seeded standard normal ones) and
            ``normalize_features`` (rows scaled to sum 1) are applied.
        seed: Seed of the synthetic generator and of random features.

    Raises:
        DatasetError: The dataset is unknown, missing, unreadable or inconsistent.
    """
    graph, source = load_structure(cfg, seed)
    feat = materialize(source, graph.label)
    check_finite(feat, source.where)
    return dataclasses.replace(graph, feat=feat)


def load_structure(cfg: DataConfig, seed: int = 0) -> tuple[Graph, FeatureSource]:
    """As :func:`load_graph`, but the features stay a :class:`~gnnray.data.feature_source.FeatureSource`.

    The graph's ``feat`` is a ``(num_nodes, 0)`` placeholder: with
    ``--feature-shards`` each shard's rows are produced on its own node
    (:mod:`gnnray.store.shards`), so the driver never holds the whole table.
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
        path = check_dataset(cfg)
        source = str(path)
        parts = graph_dir.read_graph_dir(path, feat_on_nodes=cfg.feature_shards > 1)

    feat = _features(parts, cfg, source, seed)
    if cfg.random_features > 0:
        parts.origins.pop("feat", None)
    elif parts.typed and parts.has_feat is not None and not parts.has_feat.all():
        parts.feat = feat if isinstance(feat, np.ndarray) else materialize(feat, parts.label)
        typed.fill_missing(parts, cfg.embedding_dim, source)  # neighbor means need the whole table
        feat = source_of(parts.feat)
    if cfg.normalize_features:
        # Row L1 normalisation, as PyG's NormalizeFeatures and the GCN paper's
        # preprocessing of bag-of-words graphs (cora, citeseer, pubmed).
        feat = Normalized(feat)
    if feat.num_rows != parts.num_nodes:
        raise DatasetError(f"{parts.origins.get('feat', source)}: feat has {feat.num_rows} rows but the graph has "
                           f"{parts.num_nodes} nodes; it needs one row per node")
    parts.feat = np.zeros((parts.num_nodes, 0), dtype=np.dtype(feat.dtype))
    graph = parts.build(cfg.reverse_edges, cfg.self_loops)
    if cfg.symmetric_relations:  # DGL's MAG240M example's relation set
        if graph.etype is None:
            raise DatasetError(f"{source}: --symmetric-relations applies to typed graphs, and this graph has no "
                               f"edge types; leave the option out")
        graph = symmetric_relations(graph)
    validate(graph, source, parts.origins)
    feat.where = parts.origins.get("feat", source)
    return graph, feat


def check_dataset(cfg: DataConfig) -> Path:
    """Raise :class:`DatasetError` at once if ``cfg.dataset`` is no dataset name and no graph directory.

    Returns the directory's path (meaningless for a dataset name). Cheap: the
    driver calls it before Ray starts beside the loading (:func:`gnnray.driver.fit.run`).
    """
    from gnnray.data import graph_dir, mag, ogb

    path = Path(cfg.dataset).expanduser()
    names = ("synthetic", "synthetic-hetero", *ogb.REVERSE_DEFAULT, *mag.READERS)
    if cfg.dataset not in names and not path.is_dir():
        raise DatasetError(
            f"unknown dataset {cfg.dataset!r}: no graph directory {path} exists. Use --dataset "
            f"{', '.join(names)}, or the path of a graph directory ({graph_dir.HELP})")
    return path


def _features(parts: GraphParts, cfg: DataConfig, source: str, seed: int) -> FeatureSource:
    if cfg.random_features > 0:
        if parts.feat is not None:
            log.warning("%s: replacing its %d-dim features by random ones (--random-features %d)",
                        source, source_of(parts.feat).dim, cfg.random_features)  # an array or a source
        return RandomRows(seed, cfg.random_features, parts.num_nodes)
    if parts.feat is None:
        if cfg.embedding_dim > 0:
            # Zero-width features: the learnable embeddings are the whole input
            # and the object store holds no feature bytes.
            return ArrayRows(np.zeros((parts.num_nodes, 0), dtype=np.float32))
        raise DatasetError(f"{source}: the graph has no node features ({parts.no_feat}). Add them, pass "
                           f"--embedding-dim DIM to learn node embeddings instead, or pass --random-features DIM "
                           f"to use random features (for load tests: they carry no signal)")
    return source_of(parts.feat)

