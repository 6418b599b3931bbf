"""Where feature rows come from: sources that produce any row range, on whichever node asks.

With ``--feature-shards K`` the driver never holds the whole feature table:
each shard's rows are produced on the shard's own node (:mod:`gnnray.data.shards`)
by ``source.rows(lo, hi, label)``. A source is small and picklable: the
synthetic generator (deterministic per seed and row, whatever the range), a
memory-mapped ``.npy`` file at the same path on every node (OGB's extracted
arrays, MAG240M's float16 table), or, for graphs read into driver memory, the
rows themselves (:class:`ArrayRows` ships only the range it is asked for).

With one shard the same source is read whole (:func:`materialize`), so K=1 and
K=3 train on identical features.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from gnnray.errors import DatasetError

# Rows per generator chunk: a row's values depend only on the seed and its chunk, not on the range asked for.
SYNTHETIC_CHUNK = 1 << 16


class FeatureSource:
    """Rows ``[lo, hi)`` of a ``(num_rows, dim)`` feature table."""

    num_rows: int
    dim: int
    dtype: np.dtype
    where = "features"  # the file and column read, named in errors (set by the loader)

    def rows(self, lo: int, hi: int, label: Optional[np.ndarray] = None) -> np.ndarray:
        """The rows, float32 or float16; ``label`` is the graph's label array (the synthetic source reads it)."""
        raise NotImplementedError

    def part(self, lo: int, hi: int) -> "FeatureSource":
        """A source that can still produce ``[lo, hi)``, as small as possible to ship to another node."""
        return self


@dataclass
class ArrayRows(FeatureSource):
    """Rows held in this process (graphs read into memory); :meth:`part` ships a slice, not the table."""

    array: np.ndarray
    offset: int = 0

    def __post_init__(self):
        self.num_rows, self.dim, self.dtype = self.offset + self.array.shape[0], self.array.shape[1], self.array.dtype

    def rows(self, lo, hi, label=None):
        return self.array[lo - self.offset:hi - self.offset]

    def part(self, lo, hi):
        return ArrayRows(np.ascontiguousarray(self.array[lo - self.offset:hi - self.offset]), lo)


@dataclass
class NpyRows(FeatureSource):
    """A ``.npy`` file memory-mapped on the node that reads it (same path on every node, or shared storage)."""

    path: str

    def __post_init__(self):
        a = self._open()
        self.num_rows, self.dim, self.dtype = a.shape[0], a.shape[1], a.dtype

    def _open(self) -> np.ndarray:
        try:
            return np.load(self.path, mmap_mode="r")
        except OSError as exc:
            raise DatasetError(f"{self.path}: cannot read the feature file on this node ({exc}); every node that "
                               f"holds a feature shard needs it at this path (shared storage, or a copy)") from None

    def rows(self, lo, hi, label=None):
        return self._open()[lo:hi]  # still memory-mapped: read where it is used (copied into the store)


@dataclass
class SyntheticRows(FeatureSource):
    """The synthetic graph's features: its class centroid plus unit noise, generated per chunk of rows."""

    seed: int
    centroids: np.ndarray  # (classes, dim) float32
    num_rows: int = 0

    def __post_init__(self):
        self.dim, self.dtype = self.centroids.shape[1], np.dtype(np.float32)

    def rows(self, lo, hi, label=None):
        return self.centroids[label[lo:hi]] + chunked_random(self.seed, lo, hi, self.dim)


@dataclass
class RandomRows(FeatureSource):
    """``--random-features DIM``: standard normal rows, per chunk of rows as :class:`SyntheticRows`."""

    seed: int
    dim: int
    num_rows: int

    def __post_init__(self):
        self.dtype = np.dtype(np.float32)

    def rows(self, lo, hi, label=None):
        return chunked_random(self.seed, lo, hi, self.dim)


@dataclass
class Normalized(FeatureSource):
    """``--normalize-features``: each row of ``source`` scaled to sum to 1 (in absolute value)."""

    source: FeatureSource

    def __post_init__(self):
        self.num_rows, self.dim, self.dtype = self.source.num_rows, self.source.dim, np.dtype(np.float32)

    def rows(self, lo, hi, label=None):
        x = self.source.rows(lo, hi, label).astype(np.float32)
        return x / np.maximum(np.abs(x).sum(axis=1, keepdims=True), 1e-12)

    def part(self, lo, hi):
        return Normalized(self.source.part(lo, hi))


def chunked_random(seed: int, lo: int, hi: int, dim: int, uniform: bool = False) -> np.ndarray:
    """Rows ``[lo, hi)`` of a random float32 table, standard normal (or uniform in [-1, 1]).

    Each chunk of :data:`SYNTHETIC_CHUNK` rows has its own generator (seeded by
    ``seed``, the kind and the chunk), so a row's values do not depend on the
    range asked for: shards and the whole table agree.
    """
    out = np.empty((hi - lo, dim), dtype=np.float32)
    for c in range(lo // SYNTHETIC_CHUNK, -(-hi // SYNTHETIC_CHUNK)):
        a, b, start = max(lo, c * SYNTHETIC_CHUNK), min(hi, (c + 1) * SYNTHETIC_CHUNK), c * SYNTHETIC_CHUNK
        rng = np.random.default_rng([seed, 2 if uniform else 1, c])
        chunk = (rng.uniform(-1.0, 1.0, (b - start, dim)).astype(np.float32) if uniform
                 else rng.standard_normal((b - start, dim), dtype=np.float32))
        out[a - lo:b - lo] = chunk[a - start:]
    return out


def source_of(feat) -> FeatureSource:
    """``feat`` as a source: a memory-mapped array by its file (cheap to ship), anything else by value."""
    if isinstance(feat, FeatureSource):
        return feat
    if isinstance(feat, np.memmap) and feat.filename and feat.offset == _npy_offset(feat.filename):
        return NpyRows(str(feat.filename))
    return ArrayRows(feat)


def materialize(source: FeatureSource, label: Optional[np.ndarray], dtype: Optional[str] = None) -> np.ndarray:
    """The whole table in memory (one shard), stored as ``dtype`` (``None``: as the source gives it)."""
    x = source.rows(0, source.num_rows, label)
    return x if dtype is None else x.astype(dtype, copy=False)


def check_finite(x: np.ndarray, where: str, lo: int = 0) -> None:
    """Raise :class:`DatasetError` if rows of ``x`` hold NaN or inf (a float64 row sum, no full-size temporary)."""
    bad = np.flatnonzero(~np.isfinite(x.sum(axis=1, dtype=np.float64)))
    if bad.size:
        raise DatasetError(f"{where}: {bad.size} feature rows contain NaN or infinite values (e.g. node "
                           f"{lo + int(bad[0])}); clean or impute them")


def _npy_offset(path) -> int:
    try:
        return np.load(path, mmap_mode="r").offset
    except Exception:
        return -1
