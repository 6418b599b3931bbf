"""Bad-input drills: degenerate seeds, bad graph data, bad options, a small object store, writes to the graph.

Every rejected input ends ``main()`` with ``gnnray: error: ...`` (exit 2) that
names the problem, before any worker or actor starts.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from ray import cloudpickle

from conftest import mapping_perms
from drills import REPO, SMALL, JobThread, logged, own_stderr
from gnnray.driver import preflight as cluster
from gnnray.config import parse_args
from gnnray.errors import ClusterError
from gnnray.driver.cli import main

# The custom model below must reach the workers by value: tests/ is not on their path.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _actors_created() -> int:
    """Actors ever created on the session's cluster (the GCS table keeps dead ones)."""
    import ray._private.state

    return len(ray._private.state.actors())


def _rejected(argv: list[str], capsys) -> str:
    """Run ``main(argv)``; check it fails as bad input before any actor starts; return its message."""
    before = _actors_created()
    assert main(argv) == 2
    err = own_stderr(capsys.readouterr().err)
    assert err.startswith("gnnray: error: ") and "Traceback" not in err, err
    assert _actors_created() == before, "an actor started before the input was rejected"
    return err


def _graph_dir(path: Path, n: int = 30, split=None, edges: dict | None = None, nodes: dict | None = None,
               meta: dict | None = None) -> Path:
    """A graph directory: a bidirected ring, ``feat[v] = (v, 1, v % 2)``, ``label[v] = v % 2``.

    By default node 0 is the only training node, 1..5 validate, 6..8 test.
    """
    path.mkdir()
    ids = np.arange(n)
    if split is None:
        split = np.array(["train"] + ["valid"] * 5 + ["test"] * 3 + ["none"] * (n - 9))
    feat = np.stack([ids, np.ones(n), ids % 2], axis=1).astype(np.float32)
    edge_cols = {"src": pa.array(np.concatenate([ids, (ids + 1) % n])),
                 "dst": pa.array(np.concatenate([(ids + 1) % n, ids]))}
    node_cols = {"id": pa.array(ids), "feat": pa.FixedSizeListArray.from_arrays(pa.array(feat.ravel()), 3),
                 "label": pa.array(ids % 2), "split": pa.array(split)}
    for cols, overrides in ((edge_cols, edges), (node_cols, nodes)):
        for key, value in (overrides or {}).items():
            cols[key] = value
    pq.write_table(pa.table(edge_cols), path / "edges.parquet")
    pq.write_table(pa.table(node_cols), path / "nodes.parquet")
    (path / "meta.json").write_text(json.dumps({"num_nodes": n, "num_classes": 2, **(meta or {})}))
    return path


# ----------------------------------------------------------------------------- drill 5: degenerate seeds

class _Recorder(torch.nn.Module):
    """A linear model that appends the seed ids of every call to ``log_dir/rank<R>.jsonl`` (feature 0 is the id)."""

    def __init__(self, in_feats: int, num_classes: int, log_dir: str):
        super().__init__()
        self.fc = torch.nn.Linear(in_feats - 1, num_classes)
        self.log_dir = log_dir

    def forward(self, blocks, x):
        import ray.train

        n = blocks[-1].num_dst
        rank = ray.train.get_context().get_world_rank()
        with open(f"{self.log_dir}/rank{rank}.jsonl", "a") as f:
            f.write(json.dumps({"train": self.training, "ids": x[:n, 0].long().tolist()}) + "\n")
        return self.fc(x[:n, 1:])


def test_split_smaller_than_workers_and_exact_evaluation(ray_cluster, tmp_path):
    """Drill 5: 1 training node for 2 ranks, 5 and 3 nodes to evaluate over 2 ranks in chunks of 2.

    One rank gets an empty batch each epoch; both take the same steps (no DDP
    hang), and the ranks together evaluate every node exactly once per pass.
    """
    graph = _graph_dir(tmp_path / "graph")
    (tmp_path / "calls").mkdir()
    epochs = 2
    argv = ["--dataset", str(graph), "--num-workers", "2", "--batch-size", "4", "--fanouts", "2,2", "--hidden", "8",
            "--eval", "sampled", "--eval-batch-size", "2", "--sampler-actors", "1,1", "--epochs", str(epochs),
            "--storage-path", str(tmp_path), "--name", "d5"]
    log_dir = str(tmp_path / "calls")
    job = JobThread(argv, model_factory=lambda f, c, _cfg: _Recorder(f, c, log_dir)).join()
    assert job.error is None, repr(job.error)
    assert [m["epoch"] for m in logged(tmp_path, "d5")] == list(range(epochs))

    calls = {r: [json.loads(l) for l in (tmp_path / "calls" / f"rank{r}.jsonl").read_text().splitlines()]
             for r in (0, 1)}
    train = {r: [c["ids"] for c in calls[r] if c["train"]] for r in calls}
    assert len(train[0]) == len(train[1]) == epochs  # one step per epoch on each rank
    assert sorted(len(ids) for r in train for ids in train[r]) == [0] * epochs + [1] * epochs
    assert collections.Counter(i for r in train for ids in train[r] for i in ids) == {0: epochs}
    evaluated = collections.Counter(i for r in calls for c in calls[r] if not c["train"] for i in c["ids"])
    # valid (1..5) once after each epoch, test (6..8) once after the last.
    assert evaluated == {**{v: epochs for v in range(1, 6)}, **{t: 1 for t in range(6, 9)}}, evaluated


@pytest.mark.parametrize("split, message", [
    (["none"] + ["valid"] * 5 + ["test"] * 3 + ["none"] * 21, "the train split is empty"),
    (["train"] * 6 + ["test"] * 3 + ["none"] * 21, "the valid split is empty"),
])
def test_empty_split_is_a_clear_error(ray_cluster, tmp_path, capsys, split, message):
    """Drill 5: an empty split is rejected when the graph is loaded (there is nothing to train or select on)."""
    graph = _graph_dir(tmp_path / "graph", split=np.array(split))
    err = _rejected(["--dataset", str(graph), "--storage-path", str(tmp_path)], capsys)
    assert message in err and str(graph) in err, err


# ----------------------------------------------------------------------------- drill 6: bad graph data

BAD_DATA = {
    "edge id out of range": (dict(edges={"dst": pa.array(np.full(60, 30))}), "edges.parquet", "'dst'", "outside"),
    "negative edge id": (dict(edges={"src": pa.array(np.full(60, -1))}), "edges.parquet", "'src'", "outside"),
    "nan feature": (dict(nodes={"feat": pa.FixedSizeListArray.from_arrays(
        pa.array(np.where(np.arange(90) == 4, np.nan, 1.0).astype(np.float32)), 3)}),
        "nodes.parquet", "'feat'", "NaN"),
    "label out of range": (dict(nodes={"label": pa.array(np.full(30, 5))}), "nodes.parquet", "'label'",
                           "num_classes=2"),
    "label missing": (dict(nodes={"label": pa.array(np.full(30, -1))}), "nodes.parquet", "'label'", "no label"),
    "length mismatch": (dict(meta={"num_nodes": 31}), "nodes.parquet", "'id'", "has 30 rows but meta.json"),
    "wrong dtype": (dict(edges={"src": pa.array(np.arange(60) / 2)}), "edges.parquet", "'src'", "double"),
    "wrong schema": (dict(nodes={"split": pa.array(np.zeros(30, np.int64))}), "nodes.parquet", "'split'",
                     "string"),
}


@pytest.mark.parametrize("case", list(BAD_DATA))
def test_bad_graph_data_rejected_before_any_worker(ray_cluster, tmp_path, capsys, case):
    """Drill 6 end to end (tests/data/test_datasets.py checks every case of the loader): file, column and problem named."""
    overrides, file, column, problem = BAD_DATA[case]
    graph = _graph_dir(tmp_path / "graph", **overrides)
    err = _rejected(["--dataset", str(graph), "--storage-path", str(tmp_path)], capsys)
    for text in (str(graph / file), column, problem):
        assert text in err, f"{text!r} not in {err}"


@pytest.mark.parametrize("damage, text", [
    (lambda g: (g / "nodes.parquet").unlink(), "missing nodes.parquet"),
    (lambda g: (g / "edges.parquet").write_bytes(b"PAR1 truncated"), "cannot read it as Parquet"),
])
def test_missing_or_unreadable_file_rejected(ray_cluster, tmp_path, capsys, damage, text):
    graph = _graph_dir(tmp_path / "graph")
    damage(graph)
    err = _rejected(["--dataset", str(graph), "--storage-path", str(tmp_path)], capsys)
    assert text in err and str(graph) in err, err


# ----------------------------------------------------------------------------- drill 7: bad options

@pytest.mark.parametrize("args, texts", [
    (["--fanouts", "5,0"], ["--fanouts", "positive"]),
    (["--fanouts", "5,x"], ["--fanouts", "integers"]),
    (["--fanouts", "5,2.5"], ["--fanouts", "integers"]),
    # Relation lists are checked against the loaded graph, on the driver.
    (["--fanouts", "5,5;cites=3,3"], ["--fanouts", "no relations", "--fanouts 5,5"]),
    (["--dataset", "synthetic-hetero", "--fanouts", "5,5;nope=1,1"], ["--fanouts", "no relation 'nope'", "cites"]),
    (["--eval-fanouts", "5,5;cites=3,3"], ["--eval-fanouts", "no relations", "--eval-fanouts 5,5"]),
    (["--batch-size", "0"], ["--batch-size"]),
    (["--storage-path", "/dev/null/runs"], ["--storage-path", "cannot write checkpoints"]),
    # The session's cluster has no autoscaler, 6 CPUs a node and no GPU.
    (["--num-workers", "64"], ["--num-workers 64", "1 CPU on one node", "fits"]),
    (["--cpus-per-worker", "7"], ["each train worker needs 7 CPUs on one node", "fits 0"]),
    (["--num-workers", "{workers}", "--sampler-actors", "2,2"], ["needs {need} CPUs", "has {cpus}"]),
    (["--use-gpu", "yes"], ["1 GPU", "--use-gpu no", "no GPU"]),
])
def test_bad_options_rejected_before_any_worker(ray_cluster, tmp_path, capsys, args, texts):
    """Drill 7: options no run can satisfy, including more than a fixed-size cluster can ever provide.

    There is no option for the number of layers: it is the number of fanouts,
    so a model with more layers than fanouts cannot be asked for.
    """
    cpus = int(sum(n.cpus for n in cluster.nodes()))
    sizes = dict(cpus=cpus, workers=cpus - 2, need=cpus + 1)  # workers fit, but not with 2 actors and Ray Data
    args, texts = [a.format(**sizes) for a in args], [t.format(**sizes) for t in texts]
    argv = SMALL + ["--storage-path", str(tmp_path)] + args
    err = _rejected(argv, capsys)
    for text in texts:
        assert text in err, f"{text!r} not in {err}"


@pytest.fixture(scope="module")
def strict_s3():
    """An S3 server that refuses every key, as S3 refuses keys it does not know."""
    from s3_server import S3Server

    server = S3Server(check_credentials=True)
    yield server.wait(bucket=False)
    server.stop()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("location, texts", [
    ("s3://no-such-bucket-gnnray/runs", ["s3://no-such-bucket-gnnray/runs/gnnray", "bucket does not exist"]),
    # No network to the store: an endpoint where nothing listens (the URI's own setting, over AWS_ENDPOINT_URL).
    ("s3://gnnray-tests/runs?endpoint_override=http://127.0.0.1:{port}", ["Could not connect", "AWS_ENDPOINT_URL"]),
    # Credentials the store does not accept: a second server that checks them.
    # The writer first asks whether the key exists (a replaced object goes through a temporary key): S3 answers
    # that HeadObject with 403 and no body.
    ("s3://gnnray-tests/runs?endpoint_override={strict}", ["ACCESS_DENIED", "the credentials"]),
    ("nosuch://bucket/runs", ["nosuch://bucket/runs/gnnray", "Unrecognized filesystem type"]),
])
def test_a_store_that_refuses_stops_the_run_before_training(ray_cluster, s3_server, strict_s3, capsys, location,
                                                            texts):
    """An object store that refuses the run's first write stops it at once, in one line naming the store and
    what it said, before any worker or actor starts."""
    s3_server.wait()
    location = location.format(port=_closed_port(), strict=strict_s3.endpoint)
    err = _rejected(SMALL + ["--storage-path", location], capsys)
    assert len(err.strip().splitlines()) == 1 and f"--storage-path '{location}'" in err, err
    for text in texts:
        assert text in err, f"{text!r} not in {err}"


def _nodes(*cpus: float, gpus: float = 0, store: int = 2**30) -> list:
    return [cluster.Node(f"{i:056x}", "10.0.0.1", c, gpus, store) for i, c in enumerate(cpus)]


@pytest.mark.parametrize("args, nodes, text", [
    (["--num-workers", "3", "--cpus-per-worker", "2.5", "--sampler-actors", "1,1"], _nodes(4, 4), "fits 2"),
    (["--num-workers", "2", "--use-gpu", "yes"], _nodes(8, 8, gpus=0), "fits 0"),
    (["--num-workers", "2", "--use-gpu", "yes"], _nodes(8, gpus=1), "fits 1"),
    (["--num-workers", "2", "--sampler-actors", "3,4"], _nodes(3, 2), "needs 6 CPUs"),
    (["--num-workers", "1", "--cpus-per-sampler", "4"], _nodes(3, 3), "--cpus-per-sampler 4"),
])
def test_check_resources_rejects(args, nodes, text):
    cfg = parse_args(args)
    with pytest.raises(ClusterError, match=text.replace("-", r"\-")):
        cluster.check_resources(cfg, bool(cfg.train.use_gpu), nodes)


@pytest.mark.parametrize("args, nodes", [
    (["--num-workers", "2", "--cpus-per-worker", "3", "--sampler-actors", "1,4"], _nodes(4, 4)),
    (["--num-workers", "2", "--use-gpu", "yes"], _nodes(2, 2, gpus=1)),
    (["--num-workers", "1", "--sampler-actors", "1,1"], _nodes(3)),
])
def test_check_resources_accepts(args, nodes):
    cfg = parse_args(args)
    cluster.check_resources(cfg, bool(cfg.train.use_gpu), nodes)


def test_autoscaling_cluster_waits_instead(ray_cluster, monkeypatch, capsys):
    """A cluster whose autoscaler may add nodes is not rejected: the driver says what it waits for."""
    from gnnray.driver.connect import resolve_gpu as _resolve_gpu

    assert not cluster.autoscaling()  # the session's cluster has no autoscaler
    monkeypatch.setattr(cluster, "autoscaling", lambda: True)
    assert _resolve_gpu(parse_args(["--num-workers", "7", "--use-gpu", "no"]), local=False)[1] is False
    assert "waiting for the autoscaler" in capsys.readouterr().out


def test_more_feature_shards_than_nodes(ray_cluster, monkeypatch, capsys):
    """--feature-shards K past the nodes that fit: a fixed cluster stops at once; an autoscaling one waits, says
    so, and gives up with the same error after its wait."""
    from gnnray.driver import launch

    cfg = parse_args(["--feature-shards", "2"])
    with pytest.raises(ClusterError, match=r"--feature-shards 2: .* 1 of the cluster's 1 nodes can hold that"):
        launch._shard_nodes(cfg, False, 2**20, 2**20, 0)
    assert "waiting" not in capsys.readouterr().out
    monkeypatch.setattr(cluster, "autoscaling", lambda: True)
    monkeypatch.setattr(launch, "AUTOSCALE_WAIT_S", 1)
    monkeypatch.setattr(launch, "AUTOSCALE_POLL_S", 0.2)
    with pytest.raises(ClusterError, match=r"--feature-shards 2"):
        launch._shard_nodes(cfg, False, 2**20, 2**20, 0)
    assert "waiting up to 0 min for the autoscaler to add nodes: --feature-shards 2" in capsys.readouterr().out


def test_a_cluster_that_refuses_the_driver_is_a_clear_error(monkeypatch):
    """RAY_ADDRESS given, and Ray cannot connect (a token-authenticated head, a wrong address): one ClusterError
    that names the address and what to do, not Ray's traceback. Ray's refusal is stood in for: a second head
    with its own token would cost this suite another cluster."""
    import ray

    from gnnray.driver import connect

    def refused(**kwargs):
        raise ConnectionError("Failed to connect to Ray cluster at 10.1.2.3:6379")

    for name in ("RAY_TRAIN_ENABLE_STATE_TRACKING", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"):
        monkeypatch.delenv(name, raising=False)  # init_ray sets them: restored after the test
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refused)
    with socket.socket() as listening:  # something answers at the address (the driver's first probe passes)
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        address = f"127.0.0.1:{listening.getsockname()[1]}"
        monkeypatch.setenv("RAY_ADDRESS", address)
        with pytest.raises(ClusterError) as err:
            connect.init_ray(parse_args([]))
    for text in (f"RAY_ADDRESS={address}", "Failed to connect", "RAY_ADDRESS=auto", "RAY_AUTH_TOKEN",
                 "ray job submit"):
        assert text in str(err.value), str(err.value)


def test_nothing_listening_at_ray_address_fails_at_once(tmp_path):
    """The command users run, with RAY_ADDRESS where nothing listens: one line naming the address and what to
    do, where Ray alone retries for minutes. Nothing starts Ray (no lock needed)."""
    with socket.socket() as s:  # a port nobody listens on (bound, never listening, then closed)
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    out = subprocess.run([sys.executable, "jobs/train_arxiv.py", *SMALL, "--storage-path", str(tmp_path)],
                         cwd=REPO, env=dict(os.environ, RAY_ADDRESS=address), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip() == (f"gnnray: error: RAY_ADDRESS={address}: no Ray cluster answers there (connection "
                                  f"refused within 5 s); start one (`ray start --head --port {address[10:]}` on "
                                  f"127.0.0.1), set RAY_ADDRESS to the address `ray status` prints on a running "
                                  f"cluster's head, or unset RAY_ADDRESS to run on a new local cluster"), out.stderr


# ----------------------------------------------------------------------------- drill 9: object store too small

def test_object_store_check_names_sizes_and_setting():
    nodes = _nodes(4, 4, store=100 * 2**20)
    cluster.check_object_store(90 * 2**20, nodes)  # 90% fits
    with pytest.raises(ClusterError) as err:
        cluster.check_object_store(91 * 2**20, nodes)
    for text in ("91.0 MiB", "100.0 MiB", "--object-store-memory", "object_store_memory=", "101.1 MiB"):
        assert text in str(err.value), str(err.value)


def test_graph_bigger_than_the_object_store_rejected(ray_cluster, tmp_path, capsys):
    """Drill 9 end to end: the session's nodes have 150 MiB stores; a 153 MiB graph stops before it is put."""
    args = ["--dataset", "synthetic", "--synthetic-nodes", "50000", "--synthetic-feat-dim", "800",
            "--synthetic-avg-degree", "2", "--storage-path", str(tmp_path)]
    store = min(n.object_store_bytes for n in cluster.nodes())
    assert 0.9 * store < 50000 * 800 * 4, "the session's object store grew: make the graph bigger"
    err = _rejected(args, capsys)
    assert "object store of node" in err and "--object-store-memory" in err and "MiB" in err, err


# ----------------------------------------------------------------------------- drill 10: the shared graph is read-only

def test_writes_to_the_shared_graph_fail_loudly(ray_cluster):
    """Drill 10: writes through numpy raise, through torch or ctypes kill the writer; other readers see no change."""
    import ray

    from gnnray.data.synthetic import make_synthetic
    from gnnray.store.handle import publish

    graph = make_synthetic(4000, 4, 32, 5, seed=0)  # ~0.7 MiB: in the shared store, not inlined
    handle = publish(graph)
    sums = {k: float(np.asarray(v, dtype=np.float64).sum()) for k, v in vars(graph).items()
            if isinstance(v, np.ndarray)}

    def attempt(handle, how: str) -> str:
        import ctypes

        g = handle.get()
        if how == "numpy":
            try:
                g.feat[0, 0] = 1.0
            except ValueError as e:
                return f"ValueError: {e}"
        elif how == "numpy-flag":
            try:
                g.label.flags.writeable = True
            except ValueError as e:
                return f"ValueError: {e}"
        elif how == "torch-first":
            torch.from_numpy(g.feat)[0, 0] = 1.0  # the array's first page, shared with other objects
        elif how == "torch-inplace":
            torch.from_numpy(g.indices).zero_()
        elif how == "ctypes":
            ctypes.memset(g.label.ctypes.data + g.label.nbytes - 8, 0, 8)  # its last page
        return "written"

    def checksums(handle) -> dict:
        g = handle.get()
        return {k: float(np.asarray(v, dtype=np.float64).sum()) for k, v in vars(g).items()
                if isinstance(v, np.ndarray)}

    remote = ray.remote(max_retries=0, num_cpus=0.5)(attempt)
    for how in ("numpy", "numpy-flag"):
        assert ray.get(remote.remote(handle, how)).startswith("ValueError"), how
    for how in ("torch-first", "torch-inplace", "ctypes"):
        with pytest.raises(ray.exceptions.WorkerCrashedError):  # SIGSEGV in the writer
            ray.get(remote.remote(handle, how))
    assert ray.get(ray.remote(num_cpus=0.5)(checksums).remote(handle)) == sums
    assert checksums(handle) == sums


def test_read_only_alias_is_unmapped_with_its_last_view(ray_cluster):
    """The read-only mappings ``get`` makes live exactly as long as views on them."""
    import gc

    from gnnray.data.synthetic import make_synthetic
    from gnnray.store.handle import publish

    def read_only_store_bytes() -> int:
        total = 0
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                if fields[1] == "r--s" and "plasma" in line:
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    total += hi - lo
        return total

    graph = make_synthetic(4000, 4, 32, 5, seed=0)
    handle = publish(graph)
    gc.collect()  # earlier tests' views, unmapped now rather than during this test's count
    before = read_only_store_bytes()
    g = handle.get()
    assert mapping_perms(g.feat.ctypes.data) == mapping_perms(g.indices.ctypes.data) == "r--s"
    assert read_only_store_bytes() - before >= graph.nbytes
    feat = g.feat
    del g
    gc.collect()
    assert feat.nbytes <= read_only_store_bytes() - before < feat.nbytes + 2 * 4096  # its view keeps it
    np.testing.assert_array_equal(feat, graph.feat)
    del feat
    gc.collect()
    assert read_only_store_bytes() == before


# Exits at once after the driver starts importing torch on its thread, as load_and_publish does (a run refused
# before Ray connects); the first exit handler registered runs last and says whether torch's import had finished by then.
_EARLY_EXIT = """
import atexit, sys
atexit.register(lambda: print("TORCH", "torch" in sys.modules and hasattr(sys.modules["torch"], "nn"), flush=True))
from gnnray.driver import launch
launch._import_fork_hooks()
launch._import_torch_meanwhile()
sys.exit(2)
"""


def test_an_early_exit_waits_for_the_torch_import():
    """A driver that exits while torch imports on its thread finalizes no half-imported torch (seen in CI: a
    traceback from torch's finalizers after a refused run's one line)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _EARLY_EXIT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout.split() == ["TORCH", "True"], (out.stdout, out.stderr[-2000:])
    assert not out.stderr.strip(), out.stderr[-2000:]
