"""The graph type: what every reader produces and every stage reads."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import numpy as np

from gnnray.errors import DatasetError

SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class Graph:
    """A node-classification graph as plain numpy arrays.

    The structure is the in-edge CSC: the in-neighbors of node ``v`` are
    ``indices[indptr[v]:indptr[v + 1]]``, the layout in-edges are sampled
    from without building another format.

    Attributes:
        indptr: ``(num_nodes + 1,)``, int32 below 2**31 edges, int64 past
            that (:func:`~gnnray.data.csc.structure_dtypes`).
        indices: ``(num_edges,)``, source node of each in-edge: int32 below
            2**31 nodes, int64 past that, whatever ``indptr``'s dtype.
            The sampler reads any such pair without a copy
            (:mod:`gnnray.sampler.pick`); sampled ids come in this dtype.
        feat: float32, ``(num_nodes, feat_dim)``.
        label: int64, ``(num_nodes,)``; ``-1`` marks unlabelled nodes.
        train_idx: int64 node ids of the training split.
        valid_idx: int64 node ids of the validation split.
        test_idx: int64 node ids of the test split.
        num_classes: Number of classes.
        name: Human-readable name for logs.
        etype: Typed graphs only: relation of each in-edge, aligned with
            ``indices`` (int8, or int16 past 127 relations); ``None`` for an
            untyped graph, which then packs and stores nothing for types.
        ntype: Typed graphs only: int8 node type of each node.
        node_types: Names of the node types (``ntype`` codes index it).
        edge_types: ``(src_type, relation, dst_type)`` per relation (``etype`` codes index it).
        target_type: The node type that is labelled and split.
    """

    indptr: np.ndarray
    indices: np.ndarray
    feat: np.ndarray
    label: np.ndarray
    train_idx: np.ndarray
    valid_idx: np.ndarray
    test_idx: np.ndarray
    num_classes: int
    name: str = "graph"
    etype: Optional[np.ndarray] = None
    ntype: Optional[np.ndarray] = None
    node_types: tuple = ()
    edge_types: tuple = ()
    target_type: str = ""

    @property
    def typed(self) -> bool:
        return self.etype is not None

    @property
    def num_relations(self) -> int:
        return len(self.edge_types)

    @property
    def types(self) -> dict:
        """The type names (not arrays): what travels beside the arrays in a :class:`~gnnray.store.handle.GraphHandle`."""
        return dict(node_types=self.node_types, edge_types=self.edge_types, target_type=self.target_type)

    @property
    def num_nodes(self) -> int:
        return int(self.indptr.shape[0] - 1)

    @property
    def num_edges(self) -> int:
        return int(self.indices.shape[0])

    @property
    def feat_dim(self) -> int:
        return int(self.feat.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of all arrays: the size of one copy of the graph."""
        return sum(getattr(self, f.name).nbytes for f in fields(self) if isinstance(getattr(self, f.name), np.ndarray))

    def split(self, name: str) -> np.ndarray:
        """Node ids of split ``train``, ``valid`` or ``test``."""
        return {"train": self.train_idx, "valid": self.valid_idx, "test": self.test_idx}[name]



@dataclass
class GraphParts:
    """A graph as a reader returns it: an edge list, before edges are added and the CSC is built."""

    name: str
    num_nodes: int
    num_classes: int
    src: Optional[np.ndarray]
    dst: Optional[np.ndarray]
    feat: Optional[object]  # an array or a FeatureSource (gnnray.data.feature_source); None: the source has no features
    label: np.ndarray
    splits: dict
    no_feat: str = ""  # where features were looked for, for the error message
    origins: dict = field(default_factory=dict)  # "feat"/"label": the file and column read, named by validate
    reverse_default: bool = False  # add reverse edges unless --reverse-edges says otherwise
    # Typed graphs only (etype is None otherwise): relation code of each edge
    # (aligned with src, dst), node type code of each node, their names, the
    # labelled type, and which nodes have features (None: all do).
    etype: Optional[np.ndarray] = None
    ntype: Optional[np.ndarray] = None
    node_types: tuple = ()
    edge_types: tuple = ()
    target_type: str = ""
    has_feat: Optional[np.ndarray] = None

    @property
    def typed(self) -> bool:
        return self.etype is not None

    def build(self, reverse: Optional[bool] = None, self_loops: bool = False) -> Graph:
        """The :class:`Graph` of these parts (``reverse=None``: :attr:`reverse_default`); frees the edge list.

        A typed graph's reverse edges are relations of their own, ``rev_<relation>``.
        The CSC is stored as int32 where it fits (:func:`~gnnray.data.csc.compact_csc`).
        """
        from gnnray.data.csc import build_csc, compact_csc, typed_csc
        from gnnray.data.feature_source import FeatureSource, materialize

        reverse = self.reverse_default if reverse is None else reverse
        types = {}
        if self.typed:
            if self_loops:
                raise DatasetError(f"{self.name}: --self-loops is not supported on a typed graph (a self loop has no "
                                   f"relation); drop it: rgat and rsage add each node's own features themselves")
            indptr, indices, etype = typed_csc(self.src, self.dst, self.etype, self.num_nodes,
                                               len(self.edge_types), reverse)
            edge_types = tuple(tuple(t) for t in self.edge_types)
            if reverse:
                edge_types += tuple((d, f"rev_{r}", s) for s, r, d in edge_types)
            types = dict(etype=etype, ntype=self.ntype, node_types=tuple(self.node_types), edge_types=edge_types,
                         target_type=self.target_type)
        else:
            indptr, indices = build_csc(self.src, self.dst, self.num_nodes, reverse, self_loops)
        self.src = self.dst = self.etype = None  # possibly memory-mapped and large: not needed once the CSC exists
        indptr, indices = compact_csc(indptr, indices)  # rebinding frees the int64 arrays
        feat = materialize(self.feat, self.label) if isinstance(self.feat, FeatureSource) else self.feat
        return Graph(indptr=indptr, indices=indices, feat=feat, label=self.label,
                     train_idx=self.splits["train"], valid_idx=self.splits["valid"], test_idx=self.splits["test"],
                     num_classes=self.num_classes, name=self.name, **types)


def check_ids(ids: np.ndarray, n: int, what: str) -> None:
    """Raise :class:`DatasetError` naming ``what`` if some of ``ids`` are not node ids of an ``n``-node graph."""
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        bad = ids[(ids < 0) | (ids >= n)]
        raise DatasetError(f"{what}: {bad.size} node ids are outside [0, num_nodes={n}), e.g. {bad[:3].tolist()}; "
                           f"node ids must be 0..num_nodes-1")
