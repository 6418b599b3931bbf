"""Where feature rows come from: sources that produce any row range, on whichever node asks.

With ``--feature-shards K`` the driver never holds the whole feature table:
each shard's rows are produced on the shard's own node (:mod:`gnnray.store.shards`)
by ``source.rows(lo, hi, label)``. A source is small and picklable: the
synthetic generator (deterministic per seed and row, whatever the range), a
memory-mapped ``.npy`` file at the same path on every node (OGB's extracted
arrays, MAG240M's float16 table), a graph directory's ``nodes.parquet``
(:class:`ParquetRows`, only the row groups of the range), or, for graphs read
into driver memory (:class:`ArrayRows`), a spill: the table written once at
load, one ``.npy`` file per shard under the run's directory (:func:`spill`),
after which the driver drops it. A lost shard is rebuilt from the same source.

With one shard the same source is read whole (:func:`materialize`), so K=1 and
K=3 train on identical features.
"""

from __future__ import annotations

import hashlib
import posixpath
from dataclasses import dataclass
from typing import Optional

import numpy as np

from gnnray import run_storage
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

    @property
    def in_memory(self) -> bool:
        """Whether it holds rows in this process (then :func:`spill` writes them out for the shards)."""
        return False


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

    @property
    def in_memory(self):
        return self.array.size > 0


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

    @property
    def in_memory(self):
        return self.source.in_memory


@dataclass
class SpilledRows(FeatureSource):
    """A table spilled by :func:`spill`: file ``i`` of ``files`` holds rows ``bounds[i]:bounds[i + 1]``."""

    files: tuple
    bounds: tuple

    def __post_init__(self):
        shape, dtype = _read_spill(run_storage.npy_header, self.files[0])
        self.num_rows, self.dim, self.dtype = self.bounds[-1], shape[1], dtype

    def rows(self, lo, hi, label=None):
        parts = [_read_spill(run_storage.npy_rows, f, max(lo, a) - a, min(hi, b) - a)
                 for f, a, b in self._files(lo, hi)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def part(self, lo, hi):
        files = self._files(lo, hi)
        return SpilledRows(tuple(f for f, _, _ in files), (files[0][1],) + tuple(b for _, _, b in files))

    def _files(self, lo: int, hi: int) -> list:
        b = self.bounds
        return [(f, b[i], b[i + 1]) for i, f in enumerate(self.files) if b[i] < hi and b[i + 1] > lo]


def _read_spill(read, location: str, *args):
    """``read(location, *args)`` (a :mod:`gnnray.run_storage` reader), or the error that says what this node lacks."""
    try:
        return read(location, *args)
    except OSError as exc:
        raise DatasetError(f"{location}: cannot read this spilled feature shard on this node ({exc}); with several "
                           f"nodes --storage-path must be an object store or shared storage that every node mounts "
                           f"at the same path") from None


def spill(source: FeatureSource, bounds: np.ndarray, directory: str, dtype: str,
          label: Optional[np.ndarray] = None) -> FeatureSource:
    """``source`` written as one ``.npy`` file per shard (rows ``bounds[i]:bounds[i + 1]``, as ``dtype``) under
    ``directory`` if it holds its rows in this process; any other source as it is.

    A shard's file is named by what it holds (:func:`spill_name`: its range, dtype and a digest of its rows), so
    one written before, whole, is used as it is: a run that resumes writes none again. Files of other contents
    are deleted. ``directory`` is a path or an object store's URI (:mod:`gnnray.run_storage`); a reader never sees
    half a file.
    """
    if not source.in_memory:
        return source
    files, k = [], len(bounds) - 1
    for i in range(k):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        rows = np.ascontiguousarray(source.rows(lo, hi, label), dtype=dtype)
        path = run_storage.join(directory, spill_name(i, k, lo, rows))
        if not run_storage.npy_complete(path, rows.shape, rows.dtype):
            run_storage.save_npy(path, rows)
        files.append(path)
        del rows
    kept = {posixpath.basename(f.partition("?")[0]) for f in files}
    for name in run_storage.list_files(directory):
        if name.startswith("shard-") and name not in kept:  # an earlier table's: never read again
            run_storage.delete(run_storage.join(directory, name))
    spilled = SpilledRows(tuple(files), tuple(int(b) for b in bounds))
    spilled.where = source.where
    return spilled


def spill_name(i: int, k: int, lo: int, rows: np.ndarray) -> str:
    """``shard-I-of-K-DIGEST.npy``: a digest of the shard's first id, shape, dtype and bytes (BLAKE2b, about
    1 GB/s: a second a GB, much less than the upload it saves)."""
    digest = hashlib.blake2b(f"{lo} {rows.shape} {rows.dtype.str}".encode(), digest_size=10)
    flat = rows.reshape(-1).view(np.uint8)
    for a in range(0, flat.size, 64 * 2**20):
        digest.update(flat[a:a + 64 * 2**20])
    return f"shard-{i}-of-{k}-{digest.hexdigest()}.npy"


class ParquetRows(FeatureSource):
    """An untyped graph directory's ``feat`` column, read on the node that asks.

    Only the row groups whose ``id`` statistics overlap the range asked for
    are read (all of a group without statistics), one at a time: a shard node
    reads about 1/K of the file. Rows may be in any id order: each group's
    rows whose ``id`` falls in the range are placed by id. Memory: the range's
    rows plus one row group.
    """

    def __init__(self, path: str, num_rows: int):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.path, self.num_rows = path, num_rows
        t = pq.read_schema(path).field("feat").type
        if not pa.types.is_fixed_size_list(t):
            raise DatasetError(f"{path}: column 'feat' has type {t}; an untyped graph needs a fixed-size list of "
                               f"float32 (one feature vector per node)")
        self.dim, self.dtype = t.list_size, np.dtype(t.value_type.to_pandas_dtype())
        self.where = f"{path}: column 'feat'"

    def row_groups(self, meta, lo: int, hi: int) -> list:
        """The row groups of ``meta`` (``ParquetFile.metadata``) that may hold ids in ``[lo, hi)``."""
        column = meta.schema.names.index("id")
        keep = []
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(column).statistics
            if stats is None or not stats.has_min_max or (stats.min < hi and stats.max >= lo):
                keep.append(g)
        return keep

    def rows(self, lo, hi, label=None):
        import pyarrow as pa
        import pyarrow.parquet as pq

        out = np.zeros((hi - lo, self.dim), dtype=self.dtype)
        found = 0
        try:
            f = pq.ParquetFile(self.path)
            for g in self.row_groups(f.metadata, lo, hi):
                batch = f.read_row_group(g, columns=["id", "feat"])
                ids = batch.column(0).to_numpy().astype(np.int64, copy=False)
                keep = (ids >= lo) & (ids < hi)
                if not keep.any():
                    continue
                col = batch.column(1).filter(pa.array(keep)).combine_chunks()
                if col.null_count:
                    raise DatasetError(f"{self.where} has null values; fill them, or make it a typed graph (a "
                                       f"column 'type') whose featureless nodes get their neighbors' mean")
                out[ids[keep] - lo] = col.flatten().to_numpy(zero_copy_only=False).reshape(-1, self.dim)
                found += int(keep.sum())
        except (pa.ArrowException, OSError) as exc:
            raise DatasetError(f"{self.path}: cannot read it on this node ({exc}); every node that holds a feature "
                               f"shard needs the graph directory at this path (shared storage, or a copy)") from None
        if found != hi - lo:  # ids were checked unique and complete on the driver: the file changed since
            raise DatasetError(f"{self.path}: found {found} rows for ids {lo}..{hi - 1}, expected {hi - lo}; was "
                               f"the file changed while the job ran?")
        return out


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
