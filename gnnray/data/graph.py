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
    ``indices[indptr[v]:indptr[v + 1]]``, the layout DGL samples in-edges from
    without building another format.

    Attributes:
        indptr: int64, ``(num_nodes + 1,)``.
        indices: int64, ``(num_edges,)``, source node of each in-edge.
        feat: float32, ``(num_nodes, feat_dim)``.
        label: int64, ``(num_nodes,)``; ``-1`` marks unlabelled nodes.
        train_idx: int64 node ids of the training split.
        valid_idx: int64 node ids of the validation split.
        test_idx: int64 node ids of the test split.
        num_classes: Number of classes.
        name: Human-readable name for logs.
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
    feat: Optional[np.ndarray]  # None: the source has no features
    label: np.ndarray
    splits: dict
    no_feat: str = ""  # where features were looked for, for the error message
    origins: dict = field(default_factory=dict)  # "feat"/"label": the file and column read, named by validate
    reverse_default: bool = False  # add reverse edges unless --reverse-edges says otherwise

    def build(self, reverse: Optional[bool] = None, self_loops: bool = False) -> Graph:
        """The :class:`Graph` of these parts (``reverse=None``: :attr:`reverse_default`); frees the edge list."""
        from gnnray.data.csc import build_csc

        indptr, indices = build_csc(self.src, self.dst, self.num_nodes,
                                    self.reverse_default if reverse is None else reverse, self_loops)
        self.src = self.dst = None  # possibly memory-mapped and large: not needed once the CSC exists
        return Graph(indptr=indptr, indices=indices, feat=self.feat, label=self.label,
                     train_idx=self.splits["train"], valid_idx=self.splits["valid"], test_idx=self.splits["test"],
                     num_classes=self.num_classes, name=self.name)


def check_ids(ids: np.ndarray, n: int, what: str) -> None:
    """Raise :class:`DatasetError` naming ``what`` if some of ``ids`` are not node ids of an ``n``-node graph."""
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        bad = ids[(ids < 0) | (ids >= n)]
        raise DatasetError(f"{what}: {bad.size} node ids are outside [0, num_nodes={n}), e.g. {bad[:3].tolist()}; "
                           f"node ids must be 0..num_nodes-1")
