"""Stage 1a (driver): datasets become validated numpy graphs.

Input: a :class:`~gnnray.config.DataConfig`. Output: a
:class:`~gnnray.graph_store.Graph` (in-edge CSC, float32 features, int64 labels
and splits) that has passed :func:`validate`, ready for
:func:`gnnray.graph_store.publish`.

``DataConfig.dataset`` picks the source:

* ``synthetic``: :func:`make_synthetic`, a learnable graph built in memory.
* ``ogbn-arxiv`` (or ``ogbn-products``): read by the ``ogb`` package from
  ``DATA_DIR/ogbn_arxiv``; downloaded only when that holds no OGB files.
* ``ogbn-papers100M``: OGB's binary layout (``raw/data.npz``,
  ``raw/node-label.npz``, ``split/time/``) in ``DATA_DIR/ogbn_papers100M``,
  read with ogb's metadata but not its loader: the large arrays are
  decompressed once into ``processed/gnnray/*.npy`` and memory-mapped
  (:func:`_npz_array`), never held twice.

Reverse edges (``add_reverse_edges``) are added by :func:`_bidirected_csc`
straight into the CSC, in chunks, so a 1.6-billion-edge graph is not copied
several times on the way.
* anything else: the path of a graph directory::

      DIR/edges.parquet  src, dst: int64; one row per edge src -> dst
      DIR/nodes.parquet  id: int64 (any order), label: int64 (-1: none),
                         split: string (train, valid, test or none),
                         feat: fixed-size list of float32 (optional)
      DIR/meta.json      {"num_nodes": N, "num_classes": C, "name": ..., "feat_dim": D}

Every problem with the data raises :class:`~gnnray.errors.DatasetError` that
names the file (and column) and what to do.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import json
import logging
import os
import sys
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gnnray.config import DataConfig
from gnnray.errors import DatasetError
from gnnray.graph_store import Graph, csc_from_edges

log = logging.getLogger(__name__)

_SPLITS = ("train", "valid", "test")
# Homogeneous single-label OGB datasets, and whether reverse edges are added by
# default: arxiv and papers100M are directed citation graphs, ogb stores
# products both ways.
_OGB_REVERSE_DEFAULT = {"ogbn-arxiv": True, "ogbn-products": False, "ogbn-papers100M": True}
# Distributed as numpy archives (master.csv "binary"), read by _read_ogb_npz.
_OGB_NPZ = ("ogbn-papers100M",)
_CHUNK_EDGES = 1 << 23  # edges per step of the chunked CSC build (~64 MiB of int64)
_GRAPH_DIR_HELP = ("a graph directory needs edges.parquet (int64 columns src, dst), nodes.parquet "
                   "(int64 id, int64 label, string split, optional feat: fixed-size list of float32) "
                   "and meta.json (num_nodes, num_classes)")


@dataclass
class _Parts:
    """A graph as read: an edge list, before edges are added and the CSC is built."""

    name: str
    num_nodes: int
    num_classes: int
    src: np.ndarray
    dst: np.ndarray
    feat: Optional[np.ndarray]  # None: the source has no features
    label: np.ndarray
    splits: dict
    no_feat: str = ""  # where features were looked for, for the error message
    origins: dict = field(default_factory=dict)  # "feat"/"label": the file and column read, named by validate


def load_graph(cfg: DataConfig) -> Graph:
    """Read, prepare and validate the graph that ``cfg.dataset`` names.

    Args:
        cfg: ``dataset`` picks the source (see the module docstring);
            ``add_reverse_edges`` (``None``: on for ogbn-arxiv, off otherwise),
            ``add_self_loops``, ``random_features`` (if > 0, replaces the
            features by seeded standard normal ones) and ``normalize_features``
            (rows scaled to sum 1) are applied.

    Returns:
        The validated graph.

    Raises:
        DatasetError: The dataset is unknown, missing, unreadable or inconsistent.
    """
    if cfg.dataset == "synthetic":
        source, reverse_default = "synthetic", False
        parts = _synthetic_parts(cfg.synthetic_nodes, cfg.synthetic_classes, cfg.synthetic_feat_dim,
                                 cfg.synthetic_avg_degree, cfg.seed)
    elif cfg.dataset in _OGB_REVERSE_DEFAULT:
        source, reverse_default = cfg.dataset, _OGB_REVERSE_DEFAULT[cfg.dataset]
        parts = (_read_ogb_npz if cfg.dataset in _OGB_NPZ else _read_ogb)(cfg.dataset, cfg.data_dir)
    else:
        path = Path(cfg.dataset).expanduser()
        if not path.is_dir():
            raise DatasetError(
                f"unknown dataset {cfg.dataset!r}: no graph directory {path} exists. Use --dataset "
                f"synthetic, {', '.join(_OGB_REVERSE_DEFAULT)}, or the path of a graph directory "
                f"({_GRAPH_DIR_HELP})")
        source, reverse_default = str(path), False
        parts = _read_graph_dir(path)

    parts.feat = _features(parts, cfg, source)
    if cfg.random_features > 0:
        parts.origins.pop("feat", None)
    if cfg.normalize_features:
        # Row L1 normalisation, as PyG's NormalizeFeatures and the GCN paper's
        # preprocessing of bag-of-words graphs (cora, citeseer, pubmed).
        sums = np.abs(parts.feat).sum(axis=1, keepdims=True)
        parts.feat = (parts.feat / np.maximum(sums, 1e-12)).astype(np.float32)
    reverse = reverse_default if cfg.add_reverse_edges is None else cfg.add_reverse_edges
    if reverse:
        csc = _bidirected_csc(parts.src, parts.dst, parts.num_nodes, cfg.add_self_loops)
        parts.src = parts.dst = None  # the (possibly memory-mapped) edge list is no longer needed
        graph = _build(parts, csc)
    else:
        parts.src, parts.dst = _transform_edges(parts.src, parts.dst, parts.num_nodes, False, cfg.add_self_loops)
        graph = _build(parts)
    validate(graph, source, parts.origins)
    return graph


def validate(graph: Graph, source: str, origins: Optional[dict] = None) -> None:
    """Check that ``graph`` is consistent; every later stage relies on it.

    Args:
        graph: The graph to check.
        source: File path or dataset name, named in the error.
        origins: Where ``feat`` and ``label`` were read (``"FILE: column 'x'"``),
            named instead of ``source`` in errors about them.

    Raises:
        DatasetError: The first problem found (dtypes, CSC structure, features,
            labels or splits).
    """
    def fail(problem: str, array: str = "") -> None:
        raise DatasetError(f"{(origins or {}).get(array, source)}: {problem}")

    for name in ("indptr", "indices", "label", "train_idx", "valid_idx", "test_idx"):
        a = getattr(graph, name)
        if not isinstance(a, np.ndarray) or a.dtype != np.int64 or a.ndim != 1:
            fail(f"{name} must be a 1-D int64 array, got {_describe(a)}")
    if not isinstance(graph.feat, np.ndarray) or graph.feat.dtype != np.float32 or graph.feat.ndim != 2:
        fail(f"feat must be a 2-D float32 array (num_nodes, feat_dim), got {_describe(graph.feat)}")

    indptr, indices, feat, n = graph.indptr, graph.indices, graph.feat, graph.num_nodes
    if indptr.size == 0:
        fail("indptr is empty; it needs num_nodes + 1 entries")
    for name, rows in (("feat", feat.shape[0]), ("label", graph.label.shape[0])):
        if rows != n:
            fail(f"{name} has {rows} rows but indptr has {indptr.size} entries ({n} nodes); "
                 f"indptr needs num_nodes + 1 entries, {name} one row per node")
    if indptr[0] != 0:
        fail(f"indptr must start at 0, starts at {indptr[0]}")
    if np.any(indptr[1:] < indptr[:-1]):
        fail("indptr must be non-decreasing (it holds the cumulative in-degrees)")
    if indptr[-1] != indices.size:
        fail(f"indptr ends at {indptr[-1]} but there are {indices.size} indices (edges)")
    if indices.size and (indices.min() < 0 or indices.max() >= n):
        bad = np.count_nonzero((indices < 0) | (indices >= n))
        fail(f"{bad} edge source ids (indices) are outside [0, num_nodes={n})")

    # A row sum in float64 is non-finite exactly when the row holds a NaN or inf,
    # without a (num_nodes, feat_dim) temporary.
    bad_rows = np.count_nonzero(~np.isfinite(feat.sum(axis=1, dtype=np.float64)))
    if bad_rows:
        fail(f"{bad_rows} feature rows contain NaN or infinite values; clean or impute them", "feat")

    if graph.num_classes < 2:
        fail(f"num_classes is {graph.num_classes}; node classification needs at least 2")

    in_split = np.zeros(n, dtype=bool)
    for name in _SPLITS:
        idx = graph.split(name)
        if idx.size == 0:
            fail(f"the {name} split is empty; every split (train, valid, test) needs at least one node")
        if idx.min() < 0 or idx.max() >= n:
            fail(f"the {name} split has node ids outside [0, num_nodes={n})")
        ordered = np.sort(idx)
        dup = ordered[1:][ordered[1:] == ordered[:-1]]
        if dup.size:
            fail(f"the {name} split lists {dup.size} node ids more than once, e.g. {dup[:3].tolist()}")
        if np.any(in_split[idx]):
            fail(f"the {name} split shares nodes with another split; each node belongs to one split at most")
        in_split[idx] = True
        lab = graph.label[idx]
        missing = np.count_nonzero(lab == -1)
        if missing:
            fail(f"{missing} nodes of the {name} split have no label (-1); label them or move them to split "
                 "'none'", "label")
        if np.any(lab < 0) or np.any(lab >= graph.num_classes):
            fail(f"labels of the {name} split must be in [0, num_classes={graph.num_classes}), "
                 f"found {lab.min()}..{lab.max()}", "label")


def make_synthetic(num_nodes: int, num_classes: int, feat_dim: int, avg_degree: int, seed: int) -> Graph:
    """Build a learnable undirected graph, the same for the same arguments.

    Features are a class centroid plus noise, so features alone classify
    poorly; about 80% of a node's neighbors share its class, so averaging over
    neighbors helps a lot. Degrees are skewed: one end of every edge is drawn
    with Zipf-like popularity.

    Args:
        num_nodes: Number of nodes.
        num_classes: Number of classes.
        feat_dim: Feature dimension.
        avg_degree: Average in-degree (slightly less after duplicates are removed).
        seed: Random seed.

    Returns:
        The graph, with a random 60/20/20 train/valid/test split.
    """
    return _build(_synthetic_parts(num_nodes, num_classes, feat_dim, avg_degree, seed))


def _synthetic_parts(n: int, c: int, d: int, avg_degree: int, seed: int,
                     homophily: float = 0.8, zipf: float = 0.8) -> _Parts:
    rng = np.random.default_rng(seed)
    label = rng.integers(0, c, size=n, dtype=np.int64)
    # Centroids of norm 1.5 in unit noise: roughly half the nodes are classified
    # right from their own features, most from the mean over their neighbors.
    centroids = rng.standard_normal((c, d), dtype=np.float32) * np.float32(1.5 / np.sqrt(d))
    feat = centroids[label] + rng.standard_normal((n, d), dtype=np.float32)

    # Each undirected edge joins a node (in turn) to a popular one, drawn from the
    # first node's class with probability `homophily`: inverse-CDF sampling
    # over the nodes sorted by class, popularity as cumulative weight.
    m = n * avg_degree // 2
    a = np.arange(m) % n  # every node gets its share of edges: none is isolated
    weight = (rng.permutation(n) + 1.0) ** -zipf
    order = np.argsort(label, kind="stable")
    cum = np.cumsum(weight[order])
    start = np.searchsorted(label[order], np.arange(c + 1))
    cum_before = np.concatenate([[0.0], cum])[start]
    cls = np.where(rng.random(m) < homophily, label[a], rng.integers(0, c, size=m))
    u = cum_before[cls] + rng.random(m) * (cum_before[cls + 1] - cum_before[cls])
    b = order[np.minimum(np.searchsorted(cum, u, side="right"), start[cls + 1] - 1)]
    keep = a != b
    src, dst = _transform_edges(a[keep], b[keep], n, reverse=True, self_loops=False)

    perm = rng.permutation(n)
    n_train, n_valid = int(0.6 * n), int(0.2 * n)
    splits = {"train": np.sort(perm[:n_train]), "valid": np.sort(perm[n_train:n_train + n_valid]),
              "test": np.sort(perm[n_train + n_valid:])}
    return _Parts(f"synthetic-{n}", n, c, src, dst, feat, label, splits)


def _read_ogb(name: str, data_dir: str) -> _Parts:
    """Read an OGB node-property dataset with the ``ogb`` package."""
    local = Path(data_dir).expanduser() / name.replace("-", "_")
    # Without these ogb downloads the dataset (and replaces the directory).
    has_files = (local / "raw" / "edge.csv.gz").is_file() or (local / "processed" / "data_processed").is_file()
    fix = (f"Place the OGB files of {name} in {local} (raw/*.csv.gz and split/), pass --data-dir for the "
           f"directory that holds {local.name}/, or use --dataset synthetic or a graph directory")
    try:
        NodePropPredDataset = _import_ogb()
    except ImportError as exc:
        raise DatasetError(f"{name}: the ogb package is needed to read it ({exc}); pip install ogb") from exc
    if has_files:
        # ogb saves a processed copy there and fails if the folder is missing.
        with contextlib.suppress(OSError):
            (local / "processed").mkdir(exist_ok=True)
    asked: list[str] = []
    try:
        with _ogb_noninteractive(asked):
            dataset = NodePropPredDataset(name=name, root=str(local.parent))
            split = dataset.get_idx_split()
            graph, labels = dataset[0]
    except (Exception, SystemExit) as exc:
        reason = f"{type(exc).__name__}: {exc}"
        if asked:
            reason += f" (ogb asked {asked[-1]!r} and was answered no)"
        if has_files:
            raise DatasetError(f"{name}: cannot read the OGB files in {local}: {reason}. Repair them, or delete "
                               f"{local} to download again. {fix}") from exc
        raise DatasetError(f"{name}: not found in {local} and the download failed: {reason}. {fix}") from exc

    n = int(graph["num_nodes"])
    edge_index = np.asarray(graph["edge_index"], dtype=np.int64)
    label = _ogb_label(labels, n, name)
    for column, ids in (("source", edge_index[0]), ("destination", edge_index[1])):
        _check_ids(ids, n, f"{local / 'raw' / 'edge.csv.gz'}: {column} ids")
    feat = graph.get("node_feat")
    return _Parts(
        name=name, num_nodes=n, num_classes=int(dataset.num_classes),
        src=edge_index[0], dst=edge_index[1],
        feat=None if feat is None else np.ascontiguousarray(feat, dtype=np.float32),
        label=label,
        splits={k: np.asarray(split[k], dtype=np.int64).reshape(-1) for k in _SPLITS},
        no_feat=f"{local / 'raw' / 'node-feat.csv.gz'} is missing",
    )


def _read_ogb_npz(name: str, data_dir: str) -> _Parts:
    """Read an OGB dataset of ogb's binary layout (papers100M) with ogb's metadata, not its loader.

    ogb's loader decompresses every array of ``raw/data.npz`` into memory and
    then saves a pickled copy of them all (``processed/data_processed``):
    twice papers100M's 57 GB of features, plus the edges. Here each large array
    is decompressed once, a chunk at a time, into ``processed/gnnray/KEY.npy``
    (:func:`_npz_array`), which this and later loads memory-map.
    """
    try:
        meta = _ogb_meta(name)
    except ImportError as exc:
        raise DatasetError(f"{name}: the ogb package is needed to read it ({exc}); pip install ogb") from exc
    local = Path(data_dir).expanduser() / name.replace("-", "_")
    raw, split_dir = local / "raw", local / "split" / meta["split"]
    files = [raw / "data.npz", raw / "node-label.npz"] + [split_dir / f"{k}.csv.gz" for k in _SPLITS]
    missing = [str(f.relative_to(local)) for f in files if not f.is_file()]
    if missing:
        raise DatasetError(
            f"{name}: {', '.join(missing)} not found in {local}. gnnray does not download it unattended (tens of "
            f"GB): download {meta['url']}, unzip it in {local.parent} and rename {meta['download_name']}/ to "
            f"{local.name}/, or pass --data-dir for the directory that holds {local.name}/")
    import pandas as pd

    try:
        with np.load(raw / "data.npz") as npz:
            keys, counts = set(npz.files), npz["num_nodes_list"]
        if len(counts) != 1:
            raise ValueError(f"num_nodes_list has {len(counts)} graphs; expected one")
        n = int(counts[0])
        edge_index = _npz_array(raw / "data.npz", "edge_index", local / "processed" / "gnnray")
        feat = (_npz_array(raw / "data.npz", "node_feat", local / "processed" / "gnnray", np.float32)
                if "node_feat" in keys else None)
        with np.load(raw / "node-label.npz") as npz:
            labels = npz["node_label"]
        splits = {k: pd.read_csv(split_dir / f"{k}.csv.gz", compression="gzip", header=None).to_numpy()[:, 0]
                  for k in _SPLITS}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise DatasetError(f"{name}: cannot read the OGB files in {local}: {type(exc).__name__}: {exc}. Repair "
                           f"them, or download {meta['url']} again") from exc
    if edge_index.ndim != 2 or edge_index.shape[0] != 2:
        raise DatasetError(f"{raw / 'data.npz'}: edge_index has shape {edge_index.shape}; expected (2, num_edges)")
    if feat is not None and (feat.ndim != 2 or feat.shape[0] != n):
        raise DatasetError(f"{raw / 'data.npz'}: node_feat has shape {feat.shape}; expected ({n}, feat_dim)")
    for column, ids in (("source", edge_index[0]), ("destination", edge_index[1])):
        _check_ids(ids, n, f"{raw / 'data.npz'}: edge_index {column} ids")
    return _Parts(
        name=name, num_nodes=n, num_classes=int(meta["num classes"]), src=edge_index[0], dst=edge_index[1],
        feat=feat, label=_ogb_label(labels, n, name),
        splits={k: np.asarray(v, dtype=np.int64) for k, v in splits.items()},
        no_feat=f"{raw / 'data.npz'} has no node_feat",
    )


def _ogb_label(labels, n: int, name: str) -> np.ndarray:
    """One int64 label per node from ogb's label array (``-1`` where it is NaN: unlabelled)."""
    label = np.asarray(labels).reshape(n, -1)
    if label.shape[1] != 1:
        raise DatasetError(f"{name}: has {label.shape[1]} labels per node; only single-label datasets are supported")
    label = label[:, 0]
    if np.issubdtype(label.dtype, np.floating):  # unlabelled nodes are NaN in some OGB datasets
        label = np.where(np.isnan(label), -1, label)
    return label.astype(np.int64)


def _npz_array(npz: Path, key: str, cache: Path, dtype=None) -> np.ndarray:
    """Array ``key`` of the archive ``npz``, memory-mapped from an uncompressed copy ``cache/KEY.npy``.

    The copy is written once, a chunk at a time from the compressed member
    (cast to ``dtype`` if given), through a temporary name, and reused while
    it is newer than the archive. Without a writable ``cache`` the array is
    read into memory instead (a warning says so).
    """
    target = cache / f"{key}.npy"
    if target.is_file() and target.stat().st_mtime >= npz.stat().st_mtime:
        return np.load(target, mmap_mode="r")
    tmp = target.with_name(target.name + ".tmp")
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(npz) as zf, zf.open(key + ".npy") as member:
            version = np.lib.format.read_magic(member)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"{npz}: {key} has .npy format version {version}; expected 1.0 or 2.0")
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, src_dtype = read_header(member)
            if fortran or src_dtype.hasobject:
                raise ValueError(f"{npz}: {key} is Fortran-ordered or holds objects; expected a C-ordered numeric array")
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype or src_dtype, shape=shape)
            flat, step = out.reshape(-1), max(1, (64 << 20) // src_dtype.itemsize)
            for pos in range(0, flat.size, step):
                count = min(step, flat.size - pos)
                data = member.read(count * src_dtype.itemsize)
                if len(data) != count * src_dtype.itemsize:
                    raise ValueError(f"{npz}: {key} is truncated")
                flat[pos:pos + count] = np.frombuffer(data, dtype=src_dtype)
            out.flush()
            del out, flat
        os.replace(tmp, target)
    except PermissionError:
        log.warning("%s is not writable: reading %s of %s into memory instead of memory-mapping it", cache, key, npz)
        with np.load(npz) as z:
            return z[key].astype(dtype or z[key].dtype, copy=False)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return np.load(target, mmap_mode="r")


def _ogb_meta(name: str) -> dict:
    """ogb's metadata of dataset ``name`` (its ``master.csv``): url, split, num classes, ..."""
    import pandas as pd

    package_dir = Path(sys.modules[_import_ogb().__module__].__file__).parent
    master = pd.read_csv(package_dir / "master.csv", index_col=0, keep_default_na=False)
    return dict(master[name])


def _import_ogb():
    """Import ogb's dataset class without its check for a newer ogb release.

    Importing ogb (and its ``outdated`` dependency) starts threads that ask PyPI
    for the latest version, retried and without a timeout; on a cluster without
    internet they only delay the driver's exit. Hiding ``outdated`` during the
    import makes ogb skip the check.
    """
    hide = "outdated" not in sys.modules
    if hide:
        sys.modules["outdated"] = None  # makes `import outdated` raise ImportError
    try:
        from ogb.nodeproppred import NodePropPredDataset
    finally:
        if hide and sys.modules.get("outdated", 0) is None:
            del sys.modules["outdated"]
    return NodePropPredDataset


@contextlib.contextmanager
def _ogb_noninteractive(asked: list):
    """Let ogb run unattended.

    ogb calls ``input()`` when a local copy lacks its ``RELEASE_v*.txt``
    ("update now?": yes would delete it) and before downloads over 1 GB; both are
    answered no, so local files are kept and a large download stops with
    ``SystemExit``. ``torch.load`` of ogb's own processed files gets
    ``weights_only=False`` (the default changed in torch 2.6).
    """
    import torch

    saved_input, saved_load = builtins.input, torch.load

    def answer_no(prompt: str = "") -> str:
        asked.append(str(prompt).strip())
        log.warning("ogb asked %r; answering no", asked[-1])
        return "n"

    builtins.input = answer_no
    torch.load = functools.partial(saved_load, weights_only=False)
    try:
        yield
    finally:
        builtins.input, torch.load = saved_input, saved_load


def _read_graph_dir(path: Path) -> _Parts:
    """Read a graph directory (see the module docstring)."""
    missing = [f for f in ("edges.parquet", "nodes.parquet", "meta.json") if not (path / f).is_file()]
    if missing:
        raise DatasetError(f"{path}: missing {', '.join(missing)}; {_GRAPH_DIR_HELP}")
    meta = _read_meta(path / "meta.json")
    n = meta["num_nodes"]

    edges_file, nodes_file = path / "edges.parquet", path / "nodes.parquet"
    edges = _read_parquet(edges_file, {"src": _INT, "dst": _INT})
    src, dst = (_int_column(edges, c) for c in ("src", "dst"))
    for column, ids in (("src", src), ("dst", dst)):
        _check_ids(ids, n, f"{edges_file}: column {column!r}")
    if "num_edges" in meta and meta["num_edges"] != src.size:
        raise DatasetError(f"{edges_file}: {src.size} rows but {path / 'meta.json'} says num_edges is "
                           f"{meta['num_edges']}; fix one of them")

    nodes = _read_parquet(nodes_file, {"id": _INT, "label": _INT, "split": _STR, "feat": _FEAT}, optional=("feat",))
    ids = _int_column(nodes, "id")
    if ids.size != n:
        raise DatasetError(f"{nodes_file}: column 'id' has {ids.size} rows but meta.json num_nodes is {n}; "
                           f"nodes.parquet needs exactly one row per node")
    _check_ids(ids, n, f"{nodes_file}: column 'id'")
    seen = np.zeros(n, dtype=bool)
    seen[ids] = True
    if not seen.all():  # n rows, all in range: some id repeats
        values, counts = np.unique(ids, return_counts=True)
        raise DatasetError(f"{nodes_file}: column 'id' repeats ids, e.g. {values[counts > 1][:3].tolist()}; "
                           f"each node needs exactly one row")
    # Rows may come in any order: row_of[v] is the row of node v.
    row_of = None
    if not np.array_equal(ids, np.arange(n)):
        row_of = np.empty(n, dtype=np.int64)
        row_of[ids] = np.arange(n)

    split = nodes.column("split")
    if pa.types.is_dictionary(split.type):
        split = split.cast(pa.string())
    unknown = pc.invert(pc.is_in(split, value_set=pa.array(_SPLITS + ("none",))))
    if pc.any(unknown).as_py():
        bad = pc.unique(pc.filter(split, unknown)).to_pylist()[:5]
        raise DatasetError(f"{nodes_file}: column 'split' has unknown values {bad}; "
                           f"use train, valid, test or none")
    splits = {k: np.sort(ids[pc.equal(split, k).to_numpy(zero_copy_only=False)]) for k in _SPLITS}

    label = _int_column(nodes, "label")
    feat = _feat_column(nodes, nodes_file) if "feat" in nodes.column_names else None
    if row_of is not None:
        label = label[row_of]
        feat = None if feat is None else feat[row_of]
    feat_dim = 0 if feat is None else feat.shape[1]
    if meta.get("feat_dim", feat_dim) != feat_dim:
        raise DatasetError(f"{nodes_file}: column 'feat' has dimension {feat_dim} but meta.json says feat_dim "
                           f"is {meta['feat_dim']}; fix one of them")
    return _Parts(
        name=str(meta.get("name", path.name)), num_nodes=n, num_classes=meta["num_classes"],
        src=src, dst=dst, feat=feat, label=label, splits=splits,
        no_feat=f"{nodes_file} has no column 'feat'",
        origins={"feat": f"{nodes_file}: column 'feat'", "label": f"{nodes_file}: column 'label'"},
    )


def _read_meta(file: Path) -> dict:
    try:
        meta = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DatasetError(f"{file}: not valid JSON ({exc}); it must be an object such as "
                           f'{{"num_nodes": 2708, "num_classes": 7, "name": "cora"}}') from exc
    if not isinstance(meta, dict):
        raise DatasetError(f"{file}: must hold a JSON object with num_nodes and num_classes")
    missing = [k for k in ("num_nodes", "num_classes") if k not in meta]
    if missing:
        raise DatasetError(f"{file}: missing key(s) {', '.join(missing)}; meta.json needs num_nodes and "
                           f"num_classes (name and feat_dim are optional)")
    for key in ("num_nodes", "num_classes"):
        if not isinstance(meta[key], int) or isinstance(meta[key], bool) or meta[key] < 1:
            raise DatasetError(f"{file}: {key} must be a positive integer, got {meta[key]!r}")
    return meta


def _is_str(t: pa.DataType) -> bool:
    t = t.value_type if pa.types.is_dictionary(t) else t
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_feat(t: pa.DataType) -> bool:
    lists = pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t)
    return lists and pa.types.is_floating(t.value_type)


# Column checks: (accepts the Arrow type, what is expected). Narrower integer
# and float types are accepted and widened.
_INT = (pa.types.is_integer, "an integer column (int64)")
_STR = (_is_str, "a string column (train, valid, test or none)")
_FEAT = (_is_feat, "a fixed-size list of float32 (one feature vector per node)")


def _read_parquet(file: Path, columns: dict, optional: tuple = ()) -> pa.Table:
    """Read ``columns`` of a Parquet file after checking their types in its schema."""
    try:
        schema = pq.read_schema(file)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{file}: cannot read it as Parquet ({exc}); rewrite it with "
                           f"pyarrow.parquet.write_table") from exc
    for column, (accepts, expected) in columns.items():
        if column not in schema.names:
            if column in optional:
                continue
            raise DatasetError(f"{file}: no column {column!r} (it has {schema.names}); expected {expected}")
        if not accepts(schema.field(column).type):
            raise DatasetError(f"{file}: column {column!r} has type {schema.field(column).type}, expected {expected}")
    present = [c for c in columns if c in schema.names]
    try:
        table = pq.read_table(file, columns=present)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{file}: cannot read it as Parquet, it may be truncated or corrupt ({exc}); "
                           f"rewrite it with pyarrow.parquet.write_table") from exc
    for column in present:
        nulls = table.column(column).null_count
        if nulls:
            raise DatasetError(f"{file}: column {column!r} has {nulls} null values; fill them "
                               f"(label -1 and split 'none' mark unlabelled nodes)")
    return table


def _int_column(table, column: str) -> np.ndarray:
    return table.column(column).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _feat_column(table, file: Path) -> np.ndarray:
    col = table.column("feat").combine_chunks()
    if pa.types.is_fixed_size_list(col.type):
        dim = col.type.list_size
    else:
        lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
        dim = int(lengths[0]) if lengths.size else 0
        if np.any(lengths != dim):
            raise DatasetError(f"{file}: column 'feat' has rows of different lengths "
                               f"({lengths.min()}..{lengths.max()}); every feature vector needs the same size")
    if dim < 1:
        raise DatasetError(f"{file}: column 'feat' has empty feature vectors; drop the column instead")
    values = col.flatten().to_numpy(zero_copy_only=False)
    return values.astype(np.float32, copy=False).reshape(-1, dim)


def _check_ids(ids: np.ndarray, n: int, what: str) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        bad = ids[(ids < 0) | (ids >= n)]
        raise DatasetError(f"{what}: {bad.size} node ids are outside [0, num_nodes={n}), e.g. {bad[:3].tolist()}; "
                           f"node ids must be 0..num_nodes-1")


def _features(parts: _Parts, cfg: DataConfig, source: str) -> np.ndarray:
    if cfg.random_features > 0:
        if parts.feat is not None:
            log.warning("%s: replacing its %d-dim features by random ones (--random-features %d)",
                        source, parts.feat.shape[1], cfg.random_features)
        rng = np.random.default_rng(cfg.seed)
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


def _transform_edges(src: np.ndarray, dst: np.ndarray, n: int, reverse: bool,
                     self_loops: bool) -> tuple[np.ndarray, np.ndarray]:
    """Add reverse edges (dropping duplicate edges) and/or missing self loops."""
    src, dst = src.astype(np.int64, copy=False), dst.astype(np.int64, copy=False)
    if reverse:
        # Unique (dst, src) keys drop duplicates and leave the edges sorted by dst.
        key = np.unique(np.concatenate([dst * n + src, src * n + dst]))
        dst, src = np.divmod(key, n)
    if self_loops:
        has_loop = np.zeros(n, dtype=bool)
        has_loop[src[src == dst]] = True
        loops = np.flatnonzero(~has_loop)
        src, dst = np.concatenate([src, loops]), np.concatenate([dst, loops])
    return src, dst


def _bidirected_csc(src: np.ndarray, dst: np.ndarray, n: int, self_loops: bool,
                    chunk: int = _CHUNK_EDGES) -> tuple[np.ndarray, np.ndarray]:
    """In-edge CSC of the edges ``src -> dst`` and ``dst -> src``, duplicates dropped, built in chunks.

    The same graph as :func:`_transform_edges` with ``reverse=True`` followed
    by :func:`csc_from_edges` (each node's in-neighbors sorted by id, plus a
    self loop for every node if ``self_loops``), without their copies of the
    doubled edge list: peak memory is the output (``indices`` for both
    directions, before duplicates are dropped), two ``n + 1`` counters and
    ``chunk``-sized temporaries. ``src`` and ``dst`` may be memory-mapped.
    """
    m = int(src.shape[0])
    deg = np.full(n, 1 if self_loops else 0, dtype=np.int64)
    for a in range(0, m, chunk):
        deg += np.bincount(dst[a:a + chunk], minlength=n)
        deg += np.bincount(src[a:a + chunk], minlength=n)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(deg, out=indptr[1:])
    del deg
    indices = np.empty(int(indptr[-1]), dtype=np.int64)
    free = indptr[:-1].copy()  # next unwritten slot of each node's segment

    def scatter(s: np.ndarray, d: np.ndarray) -> None:
        order = np.argsort(d, kind="stable")
        d, s = d[order], s[order]
        starts = np.flatnonzero(np.r_[True, d[1:] != d[:-1]])
        counts = np.diff(np.r_[starts, d.size])
        rank = np.arange(d.size) - np.repeat(starts, counts)  # position among the chunk's edges into d
        indices[free[d] + rank] = s
        free[d[starts]] += counts

    for a in range(0, m, chunk):
        s, d = np.asarray(src[a:a + chunk], dtype=np.int64), np.asarray(dst[a:a + chunk], dtype=np.int64)
        scatter(s, d)
        scatter(d, s)
    if self_loops:
        for a in range(0, n, chunk):
            loops = np.arange(a, min(a + chunk, n), dtype=np.int64)
            scatter(loops, loops)
    del free

    # Sort each node's in-neighbors and drop duplicates, a block of nodes at a
    # time, compacting in place (the write position never passes the read one).
    out_ptr = np.zeros(n + 1, dtype=np.int64)
    v = written = 0
    while v < n:
        w = min(n, max(v + 1, int(np.searchsorted(indptr, indptr[v] + chunk, side="right")) - 1))
        local_dst = np.repeat(np.arange(w - v, dtype=np.int64), np.diff(indptr[v:w + 1]))
        key = np.unique(local_dst * n + indices[indptr[v]:indptr[w]])
        kept_dst, kept_src = np.divmod(key, n)
        indices[written:written + key.size] = kept_src
        out_ptr[v + 1:w + 1] = written + np.cumsum(np.bincount(kept_dst, minlength=w - v))
        written += key.size
        v = w
    # A view keeps the dropped duplicates' memory; worth a copy only when
    # many were dropped (a graph stored both ways already).
    return out_ptr, indices[:written].copy() if 2 * written < indices.size else indices[:written]


def _build(parts: _Parts, csc: Optional[tuple[np.ndarray, np.ndarray]] = None) -> Graph:
    indptr, indices = csc if csc is not None else csc_from_edges(parts.src, parts.dst, parts.num_nodes)
    return Graph(indptr=indptr, indices=indices, feat=parts.feat, label=parts.label,
                 train_idx=parts.splits["train"], valid_idx=parts.splits["valid"], test_idx=parts.splits["test"],
                 num_classes=parts.num_classes, name=parts.name)


def _describe(a) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype} array of shape {a.shape}"
    return type(a).__name__
