"""Where a run keeps its files: a directory, or a URI that ``pyarrow.fs`` resolves (``s3://``, ``gs://``, ``abfs://``).

A location is a plain string, a path or a URI, that any process on any node
turns into a filesystem and a path (:func:`resolve`); everything gnnray keeps
(checkpoints, ``metrics.jsonl``, ``workers.jsonl``, the progress file,
embedding shards, spilled feature shards, predictions) is read and written
here, one code path for both. Credentials and endpoints come from where
pyarrow's clients look for them: the environment (``AWS_ACCESS_KEY_ID``, ...,
``AWS_ENDPOINT_URL`` for an S3-compatible store), ``~/.aws``, the instance's role.

What differs between a file system and an object store stays in this module:

- A write is seen whole or not at all, and one that fails leaves the old
  file: on a file system through a temporary name and a rename. In an object
  store an object appears, or replaces the old one, at once when its upload
  completes (S3's PUT and multipart upload); nothing is ever copied (S3 copies
  at most 5 GiB at once) or moved. A new object is written in place; one that
  replaces another is first written whole to a local spool (memory up to
  :data:`SPOOL_BYTES`, then a temporary file), so a writer that raises never
  touches the old object. A writer that raises deletes what it wrote. A write
  killed midway leaves a temporary file (:func:`clean_leftovers` removes it at
  the next start) or, in an object store, an upload never completed: nothing
  a reader sees.
- An object store cannot append: :func:`append` rewrites the object, so it is
  for small logs only.
- An object store has no directories: a "directory" is a key prefix.
"""

from __future__ import annotations

import functools
import io
import os
import posixpath
import re
import shutil
import tempfile
import time
from typing import IO, Callable, Optional
from urllib.parse import urlsplit

import numpy as np

from gnnray.errors import ConfigError

# The oldest pyarrow whose S3FileSystem takes the options below (allow_delayed_open came in 21); pyproject.toml's
# bound (tests/test_run_storage.py keeps the two equal).
PYARROW_S3 = 21
# A write that replaces an object is spooled in memory up to this size (then in a local temporary file) before its
# upload: small rewrites (progress, metrics) cost one PUT, and no object is copied whatever its size.
SPOOL_BYTES = 8 * 2**20
# Leftovers of killed writes: file systems' temporary names (``NAME.PID.tmp``), and temporary keys that writes of
# older versions moved into place (``NAME.tmp-PID-HEX``).
_LEFTOVER = re.compile(r".+(\.\d+\.tmp|\.tmp-\d+-[0-9a-f]{8})$")


def is_uri(location: str) -> bool:
    """Whether ``location`` names an object store (or another remote filesystem) rather than a local path."""
    return "://" in location and not location.startswith("file://")


def normalize(location: str) -> str:
    """A path made absolute (``~`` expanded; ``file://`` dropped), a URI as it is."""
    if location.startswith("file://"):
        location = urlsplit(location).path
    return location if is_uri(location) else os.path.abspath(os.path.expanduser(location))


def join(location: str, *parts: str) -> str:
    """``location`` with ``parts`` appended (a URI keeps its query, e.g. ``?region=...``, at the end)."""
    if not is_uri(location):
        return os.path.join(location, *parts)
    base, sep, query = location.partition("?")
    return posixpath.join(base, *parts) + sep + query


# The files a run keeps beside its checkpoints, read by the driver's console as the train workers write them.
METRICS_LOG = "metrics.jsonl"  # rank 0 appends one JSON line per epoch
PROGRESS_FILE = ".progress"  # rank 0 rewrites "epoch step steps" during an epoch
WORKERS_LOG = "workers.jsonl"  # an elastic run's worker-group starts and preemption notices


def run_dir(storage_path: str, name: str) -> str:
    """The directory of run ``name`` under ``--storage-path`` (``STORAGE_PATH/NAME``, a path or a URI)."""
    return join(normalize(storage_path), name)


def parent(location: str) -> str:
    """The directory that holds ``location`` (a URI's query kept)."""
    if not is_uri(location):
        return os.path.dirname(normalize(location))
    base, sep, query = location.partition("?")
    return posixpath.dirname(base.rstrip("/")) + sep + query


@functools.lru_cache(maxsize=None)
def _filesystem(root: str):
    # One filesystem per bucket (and query) and process: without a region pyarrow asks S3 for the bucket's.
    import pyarrow
    import pyarrow.fs

    fs, base = pyarrow.fs.FileSystem.from_uri(root)
    if isinstance(fs, pyarrow.fs.S3FileSystem):
        if int(pyarrow.__version__.split(".")[0]) < PYARROW_S3:
            raise ConfigError(f"{root}: object storage needs pyarrow >= {PYARROW_S3}, and this node has "
                              f"{pyarrow.__version__}: pip install 'pyarrow>={PYARROW_S3}' (pip install -e . does)")
        # Background writes keep every part in flight in memory: on a store slower than the writer, much of the
        # file (writing a 370 MiB shard to moto's server: +164 MiB of peak memory, +28 MiB without them,
        # bench/storage.py). A delayed open makes a small file one request instead of a multipart upload's three.
        rebuild, (options,) = fs.__reduce__()  # from_uri's options, as pickling carries them
        fs = rebuild({**options, "background_writes": False, "allow_delayed_open": True})
    return fs, base


def resolve(location: str):
    """``(pyarrow filesystem, path on it)`` of ``location``."""
    import pyarrow.fs

    if not is_uri(location):
        return pyarrow.fs.LocalFileSystem(), normalize(location)
    parts = urlsplit(location)
    fs, base = _filesystem(f"{parts.scheme}://{parts.netloc}" + (f"?{parts.query}" if parts.query else ""))
    path = parts.path.strip("/")
    return fs, posixpath.join(base.rstrip("/"), path) if path else base


def write(location: str, fill: Callable[[IO], object], sync: bool = True) -> int:
    """Write the file ``location`` as ``fill(f)`` writes into ``f``; return its size. Readers see the old file
    or the whole new one; ``sync``: on a file system, on disk before it is renamed into place."""
    if not is_uri(location):
        path = normalize(location)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                fill(f)
                f.flush()
                if sync:
                    os.fsync(f.fileno())
                size = f.tell()
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        return size
    import pyarrow.fs

    fs, path = resolve(location)
    if fs.get_file_info(path).type == pyarrow.fs.FileType.NotFound:
        # A new object, written in place: it appears when its upload completes. The stream has no abort (closing
        # it completes the upload), so what a failed writer began is deleted.
        f = fs.open_output_stream(path)
        try:
            fill(f)
            size = f.tell()
            f.close()
        except BaseException:
            try:
                if not f.closed:
                    f.close()
                fs.delete_file(path)
            except OSError:  # the store failed too: the writer's error says more
                pass
            raise
        return size
    with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES, prefix="gnnray-write-") as spool:
        fill(spool)  # a writer that raises here has sent nothing: the old object stays
        size = spool.tell()
        spool.seek(0)
        with fs.open_output_stream(path) as f:  # the new object replaces the old one when it completes
            shutil.copyfileobj(spool, f, 16 * 2**20)
    return size


def write_bytes(location: str, data: bytes, sync: bool = True) -> int:
    return write(location, lambda f: f.write(data), sync)


def read_bytes(location: str) -> bytes:
    """The whole file ``location`` (:class:`FileNotFoundError` if there is none)."""
    fs, path = resolve(location)
    with fs.open_input_stream(path) as f:
        return f.read()


def append(location: str, data: bytes) -> None:
    """Add ``data`` at the end of the file ``location`` (one writer at a time). An object store cannot append:
    there the object is read and written again whole, which suits small logs only."""
    if not is_uri(location):
        path = normalize(location)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "ab") as f:
            f.write(data)
        return
    try:
        old = read_bytes(location)
    except FileNotFoundError:
        old = b""
    write_bytes(location, old + data)


def read_from(location: str, offset: int) -> bytes:
    """The bytes of the file ``location`` after its first ``offset`` (none if it is missing or no longer)."""
    fs, path = resolve(location)
    try:
        f = fs.open_input_file(path)  # an object store: one request for the size, one more only if it grew
    except FileNotFoundError:
        return b""
    with f:
        end = f.size()
        return f.read_at(end - offset, offset) if end > offset else b""


def size(location: str) -> Optional[int]:
    """Bytes of the file ``location``, or ``None`` if there is no file there."""
    import pyarrow.fs

    fs, path = resolve(location)
    info = fs.get_file_info(path)
    return info.size if info.type == pyarrow.fs.FileType.File else None


def list_dirs(location: str) -> list[str]:
    """Names of the directories (an object store: prefixes) directly under ``location``, sorted; none if missing."""
    return _names(location, directories=True)


def list_files(location: str) -> list[str]:
    """Names of the files (an object store: objects) directly under ``location``, sorted; none if missing."""
    return _names(location, directories=False)


def _names(location: str, directories: bool) -> list[str]:
    import pyarrow.fs

    fs, path = resolve(location)
    infos = fs.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True))
    kind = pyarrow.fs.FileType.Directory if directories else pyarrow.fs.FileType.File
    return sorted(i.base_name for i in infos if i.type == kind)


def make_dirs(location: str) -> None:
    """Create the directory ``location`` and its parents; nothing in an object store, where a prefix exists once
    an object is under it."""
    if not is_uri(location):
        os.makedirs(normalize(location), exist_ok=True)


def delete(location: str) -> None:
    """Delete the file ``location``, if there is one."""
    fs, path = resolve(location)
    try:
        fs.delete_file(path)
    except FileNotFoundError:
        pass


def clean_leftovers(directory: str, older_than_s: float = 600.0, recursive: bool = True) -> int:
    """Delete what killed writes left under ``directory`` (temporary files and keys, none of them a file a
    reader opens) unless younger than ``older_than_s``, which may be a write still going on; return how many.
    Where the listing is refused (a store this node cannot reach), nothing: the writes that follow say why."""
    import pyarrow.fs

    try:
        fs, path = resolve(directory)
        infos = fs.get_file_info(pyarrow.fs.FileSelector(path, recursive=recursive, allow_not_found=True))
    except (OSError, ValueError):
        return 0
    now, gone = time.time(), 0
    for info in infos:
        if info.type == pyarrow.fs.FileType.File and _LEFTOVER.fullmatch(info.base_name):
            if info.mtime is not None and now - info.mtime.timestamp() < older_than_s:
                continue
            try:
                fs.delete_file(info.path)
                gone += 1
            except FileNotFoundError:  # another process cleaned it first
                pass
    return gone


def check_writable(location: str) -> None:
    """Create ``location``, write a small file into it and delete it; raise what the filesystem raised."""
    make_dirs(location)
    probe = join(location, f".write-test-{os.getpid()}")
    write_bytes(probe, b"ok", sync=False)
    delete(probe)


# ---------------------------------------------------------------------------------------------------- .npy files

def save_npy(location: str, array: np.ndarray) -> int:
    """Write ``array`` (C order) as the ``.npy`` file ``location``; return its size. numpy writes a stream in
    chunks of 16 MiB, so nothing is copied whole."""
    return write(location, lambda f: np.save(f, np.ascontiguousarray(array)))


def _npy_header(f) -> tuple[tuple, np.dtype, int]:
    """``(shape, dtype, offset of the data)`` of the ``.npy`` file open as ``f`` (random access)."""
    from numpy.lib import format as npy

    def parse(stream):
        version = npy.read_magic(stream)  # np.save writes 1.0, or 2.0 for a header over 64 KiB
        read = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
        return (*read(stream), stream.tell())

    try:  # one request for the header (np.save pads it to 128 bytes for a few dimensions), not one per field
        shape, fortran, dtype, offset = parse(io.BytesIO(f.read_at(min(f.size(), 4096), 0)))
    except ValueError:  # a longer header
        f.seek(0)
        shape, fortran, dtype, offset = parse(f)
    if fortran:
        raise ValueError("a Fortran-ordered .npy file (gnnray writes C order only)")
    return shape, dtype, offset


def npy_header(location: str) -> tuple[tuple, np.dtype]:
    """``(shape, dtype)`` of the array in the ``.npy`` file ``location`` (only its header is read)."""
    fs, path = resolve(location)
    with fs.open_input_file(path) as f:
        return _npy_header(f)[:2]


def npy_rows(location: str, lo: int, hi: int) -> np.ndarray:
    """Rows ``[lo, hi)`` of the array in the ``.npy`` file ``location``, and no other: a file is memory-mapped
    (the rows are read when used), an object is read by one ranged request."""
    if not is_uri(location):
        return np.load(normalize(location), mmap_mode="r")[lo:hi]
    fs, path = resolve(location)
    with fs.open_input_file(path) as f:
        shape, dtype, offset = _npy_header(f)
        hi = min(hi, shape[0])
        row = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
        out = np.empty((max(0, hi - lo), *shape[1:]), dtype=dtype)
        if out.size:
            f.seek(offset + lo * row)
            got = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
            if got != out.nbytes:
                raise EOFError(f"{location}: {got} bytes where rows {lo}-{hi} need {out.nbytes}")
        return out


def npy_complete(location: str, shape: tuple, dtype) -> bool:
    """Whether the ``.npy`` file ``location`` exists and holds a whole array of ``shape`` and ``dtype``: its
    header says so and its size is the header's and the data's (a write cut short is not complete)."""
    fs, path = resolve(location)
    try:
        with fs.open_input_file(path) as f:
            found, found_dtype, offset = _npy_header(f)
            size = f.size()
    except (FileNotFoundError, ValueError, EOFError):  # missing, or not a whole header
        return False
    nbytes = np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64))
    return tuple(found) == tuple(shape) and found_dtype == np.dtype(dtype) and size == offset + nbytes


def mapped_npy(location: str) -> np.ndarray:
    """The array of the ``.npy`` file ``location``, memory-mapped read-only. An object is first copied to a
    file on this node's disk, which is unlinked at once: the mapping keeps it until the array is freed."""
    if not is_uri(location):
        return np.load(normalize(location), mmap_mode="r")
    fs, path = resolve(location)
    fd, local = tempfile.mkstemp(suffix=".npy", prefix="gnnray-")
    try:
        with os.fdopen(fd, "wb") as out, fs.open_input_stream(path) as f:
            while chunk := f.read(64 * 2**20):
                out.write(chunk)
        return np.load(local, mmap_mode="r")
    finally:
        os.remove(local)
