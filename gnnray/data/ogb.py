"""OGB node-property datasets, read from ``--data-dir``.

* ``ogbn-arxiv`` and ``ogbn-products``: read by the ``ogb`` package from
  ``DATA_DIR/ogbn_arxiv``; downloaded only when that holds no OGB files.
* ``ogbn-papers100M``: OGB's binary layout (``raw/data.npz``,
  ``raw/node-label.npz``, ``split/time/``) in ``DATA_DIR/ogbn_papers100M``,
  read with ogb's metadata but not its loader: the large arrays are
  decompressed once into ``processed/gnnray/*.npy`` and memory-mapped
  (:func:`_npz_array`), never held twice.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import logging
import os
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np

from gnnray.data.graph import SPLITS, GraphParts, check_ids
from gnnray.errors import DatasetError

log = logging.getLogger(__name__)

# Homogeneous single-label OGB datasets, and whether reverse edges are added by
# default: arxiv and papers100M are directed citation graphs, ogb stores
# products both ways.
REVERSE_DEFAULT = {"ogbn-arxiv": True, "ogbn-products": False, "ogbn-papers100M": True}


# Distributed as numpy archives (master.csv "binary"), read by _read_ogb_npz.
_OGB_NPZ = ("ogbn-papers100M",)



def read_ogb(name: str, data_dir: str) -> GraphParts:
    """Read OGB dataset ``name`` (a key of :data:`REVERSE_DEFAULT`) from ``data_dir``."""
    parts = (_read_ogb_npz if name in _OGB_NPZ else _read_ogb)(name, data_dir)
    parts.reverse_default = REVERSE_DEFAULT[name]
    return parts


def _read_ogb(name: str, data_dir: str) -> GraphParts:
    """Read an OGB node-property dataset with the ``ogb`` package."""
    dataset, split, graph, labels, local = ogb_dataset(name, data_dir)
    n = int(graph["num_nodes"])
    edge_index = np.asarray(graph["edge_index"], dtype=np.int64)
    label = ogb_label(labels, n, name)
    for column, ids in (("source", edge_index[0]), ("destination", edge_index[1])):
        check_ids(ids, n, f"{local / 'raw' / 'edge.csv.gz'}: {column} ids")
    feat = graph.get("node_feat")
    return GraphParts(
        name=name, num_nodes=n, num_classes=int(dataset.num_classes),
        src=edge_index[0], dst=edge_index[1],
        feat=None if feat is None else np.ascontiguousarray(feat, dtype=np.float32),
        label=label,
        splits={k: np.asarray(split[k], dtype=np.int64).reshape(-1) for k in SPLITS},
        no_feat=f"{local / 'raw' / 'node-feat.csv.gz'} is missing",
    )


def ogb_dataset(name: str, data_dir: str, marker: str = "edge.csv.gz") -> tuple:
    """``(dataset, split, graph, labels, local dir)`` of OGB dataset ``name`` read by ``ogb`` from ``data_dir``.

    ``marker``: the raw file whose presence means the dataset is there
    (``triplet-type-list.csv.gz`` for a heterogeneous one).
    """
    local = Path(data_dir).expanduser() / name.replace("-", "_")
    # Without these ogb downloads the dataset (and replaces the directory).
    has_files = (local / "raw" / marker).is_file() or (local / "processed" / "data_processed").is_file()
    fix = (f"Place the OGB files of {name} in {local} (raw/ and split/), pass --data-dir for the "
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
    return dataset, split, graph, labels, local


def _read_ogb_npz(name: str, data_dir: str) -> GraphParts:
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
    files = [raw / "data.npz", raw / "node-label.npz"] + [split_dir / f"{k}.csv.gz" for k in SPLITS]
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
                  for k in SPLITS}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise DatasetError(f"{name}: cannot read the OGB files in {local}: {type(exc).__name__}: {exc}. Repair "
                           f"them, or download {meta['url']} again") from exc
    if edge_index.ndim != 2 or edge_index.shape[0] != 2:
        raise DatasetError(f"{raw / 'data.npz'}: edge_index has shape {edge_index.shape}; expected (2, num_edges)")
    if feat is not None and (feat.ndim != 2 or feat.shape[0] != n):
        raise DatasetError(f"{raw / 'data.npz'}: node_feat has shape {feat.shape}; expected ({n}, feat_dim)")
    for column, ids in (("source", edge_index[0]), ("destination", edge_index[1])):
        check_ids(ids, n, f"{raw / 'data.npz'}: edge_index {column} ids")
    return GraphParts(
        name=name, num_nodes=n, num_classes=int(meta["num classes"]), src=edge_index[0], dst=edge_index[1],
        feat=feat, label=ogb_label(labels, n, name),
        splits={k: np.asarray(v, dtype=np.int64) for k, v in splits.items()},
        no_feat=f"{raw / 'data.npz'} has no node_feat",
    )


def ogb_label(labels, n: int, name: str) -> np.ndarray:
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

