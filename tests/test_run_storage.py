"""gnnray.run_storage on a directory and on a real S3-compatible server (moto's, tests/s3_server.py): one code path."""

from __future__ import annotations

import socket

import numpy as np
import pyarrow.fs
import pytest

from gnnray import run_storage
from s3_server import STORAGE_KINDS


@STORAGE_KINDS
def test_files_are_written_whole_appended_and_listed(storage_path):
    run = run_storage.join(storage_path, "run")
    log = run_storage.join(run, "log.jsonl")
    assert run_storage.size(log) is None and run_storage.read_from(log, 0) == b"" and run_storage.list_dirs(run) == []
    run_storage.append(log, b"a\n")
    run_storage.append(log, b"bc\n")
    assert run_storage.read_bytes(log) == b"a\nbc\n" and run_storage.size(log) == 5
    assert run_storage.read_from(log, 2) == b"bc\n" and run_storage.read_from(log, 5) == b""
    assert run_storage.write_bytes(run_storage.join(run, "checkpoint_1", "state"), b"xyz") == 3
    run_storage.write_bytes(run_storage.join(run, "checkpoint_0", "embedding", "weight.npy"), b"")
    assert run_storage.list_dirs(run) == ["checkpoint_0", "checkpoint_1"]
    with pytest.raises(FileNotFoundError):
        run_storage.read_bytes(run_storage.join(run, "missing"))


@STORAGE_KINDS
def test_a_writer_that_fails_leaves_nothing(storage_path):
    target = run_storage.join(storage_path, "state.pt")
    run_storage.write_bytes(target, b"old")

    def fail(f):
        f.write(b"half of it")
        raise RuntimeError("crash")

    with pytest.raises(RuntimeError):
        run_storage.write(run_storage.join(storage_path, "new.pt"), fail)
    with pytest.raises(RuntimeError):
        run_storage.write(target, fail)
    assert run_storage.size(run_storage.join(storage_path, "new.pt")) is None
    # The old file or object is kept whole, and nothing the failed writes began is left beside it.
    assert run_storage.read_bytes(target) == b"old"
    fs, base = run_storage.resolve(storage_path)
    left = fs.get_file_info(pyarrow.fs.FileSelector(base, recursive=True))
    assert [i.base_name for i in left] == ["state.pt"]
    run_storage.write_bytes(target, b"new!")
    assert run_storage.read_bytes(target) == b"new!" and len(fs.get_file_info(pyarrow.fs.FileSelector(base))) == 1


def _copies_and_deletes(requests: list) -> list:
    """The requests that copy an object on the server (S3 copies at most 5 GiB at once) or delete one."""
    return [(r["method"], r["url"]) for r in requests
            if r["method"] == "DELETE" or any(k.lower() == "x-amz-copy-source" for k in r["headers"])]


def test_a_large_object_is_replaced_without_a_copy(s3_server, monkeypatch):
    """A replacing write past the spool's size (shrunk here, so the large-object path runs) and past pyarrow's
    10 MiB upload part: written once, as a multipart upload in place; no server-side copy that S3 would refuse
    past 5 GiB, and no delete. A writer that fails there leaves the old object, and nothing else."""
    monkeypatch.setattr(run_storage, "SPOOL_BYTES", 2**20)
    where = s3_server.fresh_prefix()
    path = run_storage.join(where, "preds.bin")
    old, new = b"o" * (12 * 2**20), bytes(range(256)) * (13 * 2**12)
    run_storage.write_bytes(path, old)
    with s3_server.recording() as requests:
        assert run_storage.write_bytes(path, new) == len(new)
    assert run_storage.read_bytes(path) == new
    assert _copies_and_deletes(requests) == [], _copies_and_deletes(requests)
    assert any("uploads" in r["url"] for r in requests)  # the multipart upload itself

    def fail(f):
        f.write(old)
        raise RuntimeError("crash")

    with s3_server.recording() as requests, pytest.raises(RuntimeError):
        run_storage.write(path, fail)
    assert run_storage.read_bytes(path) == new and [r for r in requests if r["method"] in ("PUT", "POST")] == []
    fs, base = run_storage.resolve(where)
    assert [i.base_name for i in fs.get_file_info(pyarrow.fs.FileSelector(base))] == ["preds.bin"]


def test_a_small_rewrite_is_one_put(s3_server):
    """The progress file, rewritten during an epoch: a HEAD and one PUT, no copy, no delete."""
    path = run_storage.join(s3_server.fresh_prefix(), ".progress")
    run_storage.write_bytes(path, b"1 10 100")
    with s3_server.recording() as requests:
        run_storage.write_bytes(path, b"1 20 100")
    assert run_storage.read_bytes(path) == b"1 20 100"
    assert sorted(r["method"] for r in requests) == ["HEAD", "PUT"], [(r["method"], r["url"]) for r in requests]


@STORAGE_KINDS
def test_leftovers_of_killed_writes_are_cleaned_and_nothing_else(storage_path):
    names = {"state.pt", "state.pt.4242.tmp", "ckpt/meta.json", "ckpt/weight.npy.tmp-4242-0123abcd",
             "notes.tmp", "a.tmp-x"}
    for name in names:
        run_storage.write_bytes(run_storage.join(storage_path, *name.split("/")), b"x")
    assert run_storage.clean_leftovers(storage_path) == 0  # too young: perhaps a write going on
    assert run_storage.clean_leftovers(storage_path, older_than_s=0) == 2
    fs, base = run_storage.resolve(storage_path)
    left = {i.path[len(base) + 1:] for i in fs.get_file_info(pyarrow.fs.FileSelector(base, recursive=True))
            if i.type == pyarrow.fs.FileType.File}
    assert left == names - {"state.pt.4242.tmp", "ckpt/weight.npy.tmp-4242-0123abcd"}
    assert run_storage.clean_leftovers(run_storage.join(storage_path, "missing")) == 0


@STORAGE_KINDS
def test_npy_complete_knows_a_whole_array_from_a_cut_one(storage_path):
    a = np.arange(300, dtype=np.float32).reshape(100, 3)
    path = run_storage.join(storage_path, "a.npy")
    assert not run_storage.npy_complete(path, a.shape, a.dtype)
    run_storage.save_npy(path, a)
    assert run_storage.npy_complete(path, a.shape, a.dtype)
    assert not run_storage.npy_complete(path, (101, 3), a.dtype)
    assert not run_storage.npy_complete(path, a.shape, np.float16)
    whole = run_storage.read_bytes(path)
    for cut in (len(whole) - 4, 40):
        run_storage.write_bytes(path, whole[:cut])
        assert not run_storage.npy_complete(path, a.shape, a.dtype), cut


@STORAGE_KINDS
def test_npy_rows_read_only_the_rows_asked_for(storage_path):
    a = np.arange(5000 * 3, dtype=np.float32).reshape(5000, 3)
    path = run_storage.join(storage_path, "rows.npy")
    assert run_storage.save_npy(path, a) == run_storage.size(path)
    assert run_storage.npy_header(path) == ((5000, 3), np.dtype(np.float32))
    np.testing.assert_array_equal(run_storage.npy_rows(path, 1234, 1240), a[1234:1240])
    np.testing.assert_array_equal(run_storage.npy_rows(path, 4990, 6000), a[4990:])
    assert run_storage.npy_rows(path, 10, 10).shape == (0, 3)
    mapped = run_storage.mapped_npy(path)
    np.testing.assert_array_equal(mapped, a)
    assert not mapped.flags.writeable


def test_rows_of_an_object_come_from_ranged_requests(s3_server):
    """A holder's rows cost a header request and one ranged request for them, as the server recorded them:
    10 rows of a 6.4 MB array move 4 KiB + 640 bytes."""
    where = s3_server.fresh_prefix()
    path = run_storage.join(where, "big.npy")
    run_storage.save_npy(path, np.arange(100_000 * 16, dtype=np.float32).reshape(-1, 16))
    with s3_server.recording() as requests:
        rows = run_storage.npy_rows(path, 500, 510)
    np.testing.assert_array_equal(rows, np.arange(500 * 16, 510 * 16, dtype=np.float32).reshape(-1, 16))
    gets = [r["headers"].get("Range") for r in requests if r["method"] == "GET"]
    assert gets == ["bytes=0-4095", f"bytes={128 + 500 * 64}-{128 + 510 * 64 - 1}"], gets


def test_uris_and_paths_join_and_resolve():
    assert run_storage.join("s3://b/runs?region=eu-west-1", "n", "m") == "s3://b/runs/n/m?region=eu-west-1"
    assert run_storage.join("/tmp/x", "n") == "/tmp/x/n"
    assert run_storage.normalize("file:///tmp/x") == "/tmp/x" and not run_storage.is_uri("file:///tmp/x")
    assert run_storage.normalize("~/r").startswith("/") and run_storage.is_uri("gs://bucket/p")


def test_check_writable_names_what_refused(s3_server, tmp_path):
    s3_server.wait()
    with pytest.raises(OSError, match="NO_SUCH_BUCKET|not found|does not exist"):
        run_storage.check_writable("s3://no-such-bucket-here/runs/x")
    with socket.socket() as s:  # a port where nothing listens: no network to the store
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with pytest.raises(OSError, match="connect"):
        run_storage.check_writable(f"s3://gnnray-tests/runs?endpoint_override=http://127.0.0.1:{closed}")
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        run_storage.check_writable(str(tmp_path / "file" / "run"))


def test_an_old_pyarrow_is_one_line_naming_the_version(s3_server, monkeypatch):
    """pyarrow < 21 has no allow_delayed_open: the storage check says so rather than raise a TypeError."""
    import pyarrow

    from gnnray.config import parse_args
    from gnnray.driver.preflight import check_storage
    from gnnray.errors import ConfigError

    monkeypatch.setattr(pyarrow, "__version__", "18.1.0")
    run_storage._filesystem.cache_clear()
    cfg = parse_args(["--storage-path", s3_server.fresh_prefix(), "--name", "old-arrow"])
    try:
        with pytest.raises(ConfigError, match=r"needs pyarrow >= 21, and this node has 18\.1\.0") as e:
            check_storage(cfg)
    finally:
        run_storage._filesystem.cache_clear()
    assert "\n" not in str(e.value)


def test_pyarrow_bound_in_pyproject_is_the_one_the_code_needs():
    """Both environments' pyarrow ranges start where S3's options exist (and the dgl extra's range is not empty)."""
    import re
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    bounds = [r for r in project["dependencies"] + project["optional-dependencies"]["dgl"] if r.startswith("pyarrow")]
    assert bounds == [f"pyarrow>={run_storage.PYARROW_S3}", f"pyarrow>={run_storage.PYARROW_S3},<22"]
    assert run_storage.PYARROW_S3 < int(re.search(r"<(\d+)", bounds[1]).group(1))
