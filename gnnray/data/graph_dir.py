"""Graph directories: ``--dataset PATH``::

    DIR/edges.parquet  src, dst: int64; one row per edge src -> dst
    DIR/nodes.parquet  id: int64 (any order), label: int64 (-1: none),
                       split: string (train, valid, test or none),
                       feat: fixed-size list of float32 (optional)
    DIR/meta.json      {"num_nodes": N, "num_classes": C, "name": ..., "feat_dim": D}
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gnnray.data.graph import SPLITS, GraphParts, check_ids
from gnnray.errors import DatasetError

HELP = ("a graph directory needs edges.parquet (int64 columns src, dst), nodes.parquet "
                   "(int64 id, int64 label, string split, optional feat: fixed-size list of float32) "
                   "and meta.json (num_nodes, num_classes)")



def read_graph_dir(path: Path) -> GraphParts:
    """Read a graph directory (see the module docstring)."""
    missing = [f for f in ("edges.parquet", "nodes.parquet", "meta.json") if not (path / f).is_file()]
    if missing:
        raise DatasetError(f"{path}: missing {', '.join(missing)}; {HELP}")
    meta = _read_meta(path / "meta.json")
    n = meta["num_nodes"]

    edges_file, nodes_file = path / "edges.parquet", path / "nodes.parquet"
    edges = _read_parquet(edges_file, {"src": _INT, "dst": _INT})
    src, dst = (_int_column(edges, c) for c in ("src", "dst"))
    for column, ids in (("src", src), ("dst", dst)):
        check_ids(ids, n, f"{edges_file}: column {column!r}")
    if "num_edges" in meta and meta["num_edges"] != src.size:
        raise DatasetError(f"{edges_file}: {src.size} rows but {path / 'meta.json'} says num_edges is "
                           f"{meta['num_edges']}; fix one of them")

    nodes = _read_parquet(nodes_file, {"id": _INT, "label": _INT, "split": _STR, "feat": _FEAT}, optional=("feat",))
    ids = _int_column(nodes, "id")
    if ids.size != n:
        raise DatasetError(f"{nodes_file}: column 'id' has {ids.size} rows but meta.json num_nodes is {n}; "
                           f"nodes.parquet needs exactly one row per node")
    check_ids(ids, n, f"{nodes_file}: column 'id'")
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
    unknown = pc.invert(pc.is_in(split, value_set=pa.array(SPLITS + ("none",))))
    if pc.any(unknown).as_py():
        bad = pc.unique(pc.filter(split, unknown)).to_pylist()[:5]
        raise DatasetError(f"{nodes_file}: column 'split' has unknown values {bad}; "
                           f"use train, valid, test or none")
    splits = {k: np.sort(ids[pc.equal(split, k).to_numpy(zero_copy_only=False)]) for k in SPLITS}

    label = _int_column(nodes, "label")
    feat = _feat_column(nodes, nodes_file) if "feat" in nodes.column_names else None
    if row_of is not None:
        label = label[row_of]
        feat = None if feat is None else feat[row_of]
    feat_dim = 0 if feat is None else feat.shape[1]
    if meta.get("feat_dim", feat_dim) != feat_dim:
        raise DatasetError(f"{nodes_file}: column 'feat' has dimension {feat_dim} but meta.json says feat_dim "
                           f"is {meta['feat_dim']}; fix one of them")
    return GraphParts(
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

