"""A run's largest files in a directory and in an object store: time and peak memory of writing and reading them.

``python -m bench.storage``: an embedding owner's checkpoint of its shard and a resume's read of a third of it,
each in a fresh process, in a directory and in moto's S3 server (``tests/s3_server.py``), writes also with
pyarrow's background writes (the baseline); medians of rounds. ``--requests``: the requests a 3-epoch run makes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from bench.harness import REPO, child_env, medians, run_child


def _measure(kind: str, location: str, rows: int, dim: int, background: bool = False) -> dict:
    """In this (fresh) process: write a shard of ``rows`` x ``dim`` at ``location``, or read a third of it;
    ``background``: with pyarrow's default S3 filesystem (background writes), the baseline gnnray turns off."""
    import resource
    import time

    import numpy as np
    import pyarrow.fs  # loaded in any process that runs a job: Ray's own imports load it

    from gnnray import run_storage
    from gnnray.train import checkpoint

    if background:
        run_storage._filesystem = lambda root: pyarrow.fs.FileSystem.from_uri(root)
    run_storage.size(run_storage.join(location, "warm-up"))  # the filesystem made and connected before the clock starts

    def peak_mib() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    if kind == "write":
        rng = np.random.default_rng(0)
        arrays = {name: rng.standard_normal((rows, dim), dtype=np.float32)
                  for name in ("weight", "exp_avg", "exp_avg_sq")}
        arrays["step"] = np.ones(rows, dtype=np.int32)
        held = sum(a.nbytes for a in arrays.values()) / 2**20
        before, start = peak_mib(), time.perf_counter()
        entry = checkpoint.write_rows(location, 0, rows, arrays)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "extra_mib": peak_mib() - before, "table_mib": held,
                "file_mib": sum(entry["bytes"].values()) / 2**20}
    model_meta = {"embedding": {"num_nodes": rows, "dim": dim, "shards": [
        {"lo": 0, "hi": rows, "dir": f"embedding/rows-{0:012d}-{rows:012d}"}]}}
    run_storage.write_bytes(run_storage.join(location, checkpoint.META_FILE), json.dumps(model_meta).encode())
    before, start = peak_mib(), time.perf_counter()
    got = checkpoint.read_rows(location, rows // 3, 2 * rows // 3)
    seconds = time.perf_counter() - start
    read = sum(a.nbytes for a in got.values()) / 2**20
    return {"seconds": seconds, "extra_mib": peak_mib() - before - read, "table_mib": read}


def _in_fresh_process(kind: str, location: str, rows: int, dim: int, env: dict, background: bool = False) -> dict:
    code = (f"import bench.storage as b, bench.harness as h; "
            f"h.emit(b._measure({kind!r}, {location!r}, {rows}, {dim}, {background}))")
    return run_child([sys.executable, "-c", code], env, what=f"{kind} at {location}")


RUN = ["--dataset", "synthetic", "--synthetic-nodes", "3000", "--synthetic-feat-dim", "16", "--fanouts", "5,5",
       "--batch-size", "32", "--hidden", "16", "--num-workers", "1", "--sampler-actors", "1", "--eval", "sampled",
       "--checkpoint-interval", "0", "--epochs", "3", "--name", "requests"]


def _requests_of_a_run(server, env: dict) -> None:
    """Run the job into the server's bucket; print its requests by method and file."""
    import collections
    import re
    from urllib.parse import urlsplit

    where = server.fresh_prefix("bench-requests")
    with server.recording() as requests:
        subprocess.run([sys.executable, str(REPO / "jobs" / "train_arxiv.py"), *RUN, "--storage-path", where],
                       cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    counts: collections.Counter = collections.Counter()
    for r in requests:
        key = urlsplit(r["url"]).path.split("/", 3)[-1] if r["url"].count("/") > 3 else ""
        what = re.sub(r"checkpoint_[^/]+", "checkpoint_*", key)
        what = re.sub(r"rows-\d+-\d+", "rows-*", re.sub(r"\.write-test-\d+", ".write-test", what))
        counts[(r["method"], what or "(bucket)")] += 1
    print(f"requests of one run ({' '.join(RUN)}), by method and object")
    for (method, what), n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"{n:6d}  {method:6} {what}")
    print(f"{sum(counts.values()):6d}  in all")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", action="store_true", help="count the requests of a whole run instead")
    a = p.parse_args(argv)
    sys.path.insert(0, str(REPO / "tests"))
    from gnnray import run_storage
    from s3_server import start_for_session

    server = start_for_session()  # its endpoint and credentials in this process's environment, and the runs'
    env = child_env()  # the run starts its own local cluster
    if a.requests:
        try:
            _requests_of_a_run(server.wait(), env)
        finally:
            server.stop()
        return
    results: dict = {}
    try:
        with tempfile.TemporaryDirectory(prefix="gnnray-bench-storage-") as tmp:
            for r in range(a.rounds):
                places = {"file": os.path.join(tmp, f"r{r}"), "s3": server.fresh_prefix(f"bench-r{r}"),
                          "s3-bg": server.fresh_prefix(f"bench-bg-r{r}")}
                for where, location in places.items():
                    for kind in ("write",) if where == "s3-bg" else ("write", "read"):
                        results.setdefault((where, kind), []).append(
                            _in_fresh_process(kind, location, a.rows, a.dim, env, where == "s3-bg"))
                    fs, path = run_storage.resolve(location)
                    fs.delete_dir(path)  # moto's server holds its objects in memory
    finally:
        server.stop()
    print(f"embedding shard of {a.rows:,} x {a.dim} (rows, moments, steps); medians of {a.rounds} rounds; "
          "s3-bg: pyarrow's default background writes (the baseline)")
    print(f"{'where':6} {'what':16} {'seconds':>8} {'table MiB':>10} {'extra peak MiB':>15} {'extra/table':>12}")
    for (where, kind), runs in results.items():
        what = "write the shard" if kind == "write" else "read a third"
        med = medians(runs, "seconds", "table_mib", "extra_mib")
        print(f"{where:6} {what:16} {med['seconds']:8.2f} {med['table_mib']:10.1f} {med['extra_mib']:15.1f} "
              f"{med['extra_mib'] / med['table_mib']:12.2f}")


if __name__ == "__main__":
    main()
