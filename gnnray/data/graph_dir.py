"""Graph directories: ``--dataset PATH``::

    DIR/edges.parquet  src, dst: int64; one row per edge src -> dst
    DIR/nodes.parquet  id: int64 (any order), label: int64 (-1: none),
                       split: string (train, valid, test or none),
                       feat: fixed-size list of float32 (optional)
    DIR/meta.json      {"num_nodes": N, "num_classes": C, "name": ..., "feat_dim": D}

A typed graph (node and edge types, :mod:`gnnray.data.typed`) adds a string
column ``type`` to both files: the node's type and the edge's relation. Its
``feat`` is a list of float32 (or float16), null for nodes without features,
and ``meta.json`` may list ``node_types``, ``edge_types`` (``[src_type,
relation, dst_type]`` triples) and ``target_type`` (the labelled type); what
it leaves out is inferred from the data.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from gnnray.data.feature_source import ParquetRows
from gnnray.data.graph import SPLITS, GraphParts, check_ids
from gnnray.errors import DatasetError

HELP = ("a graph directory needs edges.parquet (int64 columns src, dst), nodes.parquet "
                   "(int64 id, int64 label, string split, optional feat: fixed-size list of float32) "
                   "and meta.json (num_nodes, num_classes)")



def read_graph_dir(path: Path, feat_on_nodes: bool = False) -> GraphParts:
    """Read a graph directory (see the module docstring).

    With ``feat_on_nodes`` (``--feature-shards K > 1``) an untyped graph's
    ``feat`` column is not read here: the features are a :class:`ParquetRows`
    source, which each shard's node reads for its own rows.
    """
    missing = [f for f in ("edges.parquet", "nodes.parquet", "meta.json") if not (path / f).is_file()]
    if missing:
        raise DatasetError(f"{path}: missing {', '.join(missing)}; {HELP}")
    meta = _read_meta(path / "meta.json")
    n = meta["num_nodes"]

    edges_file, nodes_file = path / "edges.parquet", path / "nodes.parquet"
    typed = _has_column(nodes_file, "type") or _has_column(edges_file, "type")
    edges = _read_parquet(edges_file, {"src": _INT, "dst": _INT, **({"type": _TYPE} if typed else {})})
    src, dst = (_int_column(edges, c) for c in ("src", "dst"))
    for column, ids in (("src", src), ("dst", dst)):
        check_ids(ids, n, f"{edges_file}: column {column!r}")
    if "num_edges" in meta and meta["num_edges"] != src.size:
        raise DatasetError(f"{edges_file}: {src.size} rows but {path / 'meta.json'} says num_edges is "
                           f"{meta['num_edges']}; fix one of them")

    lazy = feat_on_nodes and not typed and _has_column(nodes_file, "feat")
    nodes = _read_parquet(nodes_file, {"id": _INT, "label": _INT, "split": _STR, "feat": _FEAT,
                                       **({"type": _TYPE} if typed else {})},
                          optional=("feat",), nullable=("feat",) if typed else (), skip=("feat",) if lazy else ())
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
    feat, has_feat = _feat_column(nodes, nodes_file) if "feat" in nodes.column_names else (None, None)
    if row_of is not None:
        label = label[row_of]
        feat = None if feat is None else feat[row_of]
        has_feat = None if has_feat is None else has_feat[row_of]
    if lazy:
        feat = ParquetRows(str(nodes_file), n)
    feat_dim = 0 if feat is None else feat.shape[1] if isinstance(feat, np.ndarray) else feat.dim
    if meta.get("feat_dim", feat_dim) != feat_dim:
        raise DatasetError(f"{nodes_file}: column 'feat' has dimension {feat_dim} but meta.json says feat_dim "
                           f"is {meta['feat_dim']}; fix one of them")
    parts = GraphParts(
        name=str(meta.get("name", path.name)), num_nodes=n, num_classes=meta["num_classes"],
        src=src, dst=dst, feat=feat, label=label, splits=splits,
        no_feat=f"{nodes_file} has no column 'feat'",
        origins={"feat": f"{nodes_file}: column 'feat'", "label": f"{nodes_file}: column 'label'",
                 "split": f"{nodes_file}: column 'split'", "ntype": f"{nodes_file}: column 'type'",
                 "etype": f"{edges_file}: column 'type'"},
    )
    if typed:
        _read_types(parts, meta, path, nodes.column("type"), edges.column("type"), row_of)
        parts.has_feat = has_feat
    elif has_feat is not None and not has_feat.all():
        raise DatasetError(f"{nodes_file}: column 'feat' has {int((~has_feat).sum())} null values; fill them, or "
                           f"make it a typed graph (a column 'type') whose featureless nodes get their neighbors' mean")
    return parts


def _read_types(parts: GraphParts, meta: dict, path: Path, node_type, edge_type, row_of) -> None:
    """Set ``parts``' type fields from the ``type`` columns and ``meta.json`` (node_types, edge_types, target_type)."""
    from gnnray.data.typed import relation_codes

    meta_file, nodes_file, edges_file = path / "meta.json", path / "nodes.parquet", path / "edges.parquet"
    node_names = _strings(node_type)
    node_types = _names(meta, "node_types", meta_file) or sorted(set(node_names.tolist()))
    ntype = relation_codes(node_names, node_types, f"{nodes_file}: column 'type'")
    if row_of is not None:
        ntype = ntype[row_of]
    rel_names = _strings(edge_type)
    declared = meta.get("edge_types")
    if declared is None:  # each relation's endpoint types, as the data has them
        relations = sorted(set(rel_names.tolist()))
        codes = relation_codes(rel_names, relations, f"{edges_file}: column 'type'")
        edge_types = []
        for j, r in enumerate(relations):
            pairs = set(zip(ntype[parts.src[codes == j]].tolist(), ntype[parts.dst[codes == j]].tolist()))
            if len(pairs) != 1:
                shown = sorted((node_types[a], node_types[b]) for a, b in pairs)[:4]
                raise DatasetError(f"{edges_file}: column 'type': relation {r!r} joins several pairs of node types "
                                   f"{shown}; give each pair its own relation, or declare edge_types in {meta_file}")
            (a, b), = pairs
            edge_types.append((node_types[a], r, node_types[b]))
    else:
        if not (isinstance(declared, list) and all(isinstance(t, list) and len(t) == 3
                                                   and all(isinstance(x, str) for x in t) for t in declared)):
            raise DatasetError(f"{meta_file}: edge_types must be a list of [src_type, relation, dst_type] string "
                               f"triples, got {declared!r}")
        edge_types = [tuple(t) for t in declared]
        unknown = sorted({x for s, _, d in edge_types for x in (s, d)} - set(node_types))
        if unknown:
            raise DatasetError(f"{meta_file}: edge_types name unknown node types {unknown}; add them to node_types "
                               f"({node_types})")
        codes = relation_codes(rel_names, [r for _, r, _ in edge_types], f"{edges_file}: column 'type'")
    target = meta.get("target_type")
    if target is None:
        labelled = set(ntype[parts.label != -1].tolist())
        if len(labelled) != 1:
            raise DatasetError(f"{meta_file}: no target_type, and the labelled nodes have {len(labelled)} types; "
                               f"add \"target_type\": the one node type that is labelled")
        target = node_types[labelled.pop()]
    elif target not in node_types:
        raise DatasetError(f"{meta_file}: target_type {target!r} is not a node type; choose one of {node_types}")
    parts.etype, parts.ntype = codes.astype(np.int8 if 2 * len(edge_types) <= 127 else np.int16), ntype.astype(np.int8)
    parts.node_types, parts.edge_types, parts.target_type = tuple(node_types), tuple(edge_types), target
    parts.reverse_default = True


def _names(meta: dict, key: str, file: Path) -> list:
    names = meta.get(key)
    if names is not None and not (isinstance(names, list) and all(isinstance(x, str) for x in names)):
        raise DatasetError(f"{file}: {key} must be a list of strings, got {names!r}")
    return names


def _strings(column) -> np.ndarray:
    if pa.types.is_dictionary(column.type):
        column = column.cast(pa.string())
    return column.to_numpy(zero_copy_only=False)


def _has_column(file: Path, column: str) -> bool:
    try:
        return column in pq.read_schema(file).names
    except (pa.ArrowException, OSError):
        return False  # _read_parquet reports it


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


_TYPE = (_is_str, "a string column (the node type, or the edge's relation, of a typed graph)")


def _read_parquet(file: Path, columns: dict, optional: tuple = (), nullable: tuple = (),
                  skip: tuple = ()) -> pa.Table:
    """Read ``columns`` of a Parquet file after checking their types in its schema (``skip``: checked, not read)."""
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
    present = [c for c in columns if c in schema.names and c not in skip]
    try:
        table = pq.read_table(file, columns=present)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{file}: cannot read it as Parquet, it may be truncated or corrupt ({exc}); "
                           f"rewrite it with pyarrow.parquet.write_table") from exc
    for column in present:
        nulls = 0 if column in nullable else table.column(column).null_count
        if nulls:
            raise DatasetError(f"{file}: column {column!r} has {nulls} null values; fill them "
                               f"(label -1 and split 'none' mark unlabelled nodes)")
    return table


def _int_column(table, column: str) -> np.ndarray:
    return table.column(column).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _feat_column(table, file: Path) -> tuple[np.ndarray, np.ndarray]:
    """The features (float32, zeros in null rows) and whether each row has them."""
    col = table.column("feat").combine_chunks()
    has = col.is_valid().to_numpy(zero_copy_only=False)
    if pa.types.is_fixed_size_list(col.type):
        dim = col.type.list_size
    else:
        lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)[has].astype(np.int64)
        dim = int(lengths[0]) if lengths.size else 0
        if np.any(lengths != dim):
            raise DatasetError(f"{file}: column 'feat' has rows of different lengths "
                               f"({lengths.min()}..{lengths.max()}); every feature vector needs the same size")
    if dim < 1:
        raise DatasetError(f"{file}: column 'feat' has empty feature vectors; drop the column instead")
    values = col.flatten().to_numpy(zero_copy_only=False)  # the values of the rows that are not null
    if has.all():
        return values.astype(np.float32, copy=False).reshape(-1, dim), has
    feat = np.zeros((has.size, dim), dtype=np.float32)
    feat[has] = values.reshape(-1, dim)
    return feat, has
