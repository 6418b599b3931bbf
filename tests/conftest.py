"""Shared fixtures: one Ray cluster per test session, tiny graphs, the shared datasets."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from gnnray.data.csc import csc_from_edges
from gnnray.data.graph import Graph
from s3_server import start_for_session
from shared_runs import script_run  # noqa: F401  (a session fixture: one script run read by several modules)

os.environ.setdefault("DGLBACKEND", "pytorch")  # read by DGL where the dgl extra is installed
os.environ.setdefault("OUTDATED_IGNORE", "1")  # ogb's dependency asks PyPI for updates (no internet here)
# The session's runs register and lease cores among themselves (gnnray.leases): the tests
# that check which cores a worker pins must not depend on what other sessions on the host hold meanwhile.
os.environ.setdefault("GNNRAY_CPU_DIR", tempfile.mkdtemp(prefix="gnnray-cpus-"))

# ../shared beside the repository (present here and in CI; absent on a user's machine).
SHARED_DATASETS = Path(__file__).resolve().parents[2] / "shared" / "datasets"


HAS_DGL = importlib.util.find_spec("dgl") is not None
NO_DGL = ("DGL is not installed: its last wheel needs torch 2.2.1 and cannot be imported beside this torch; .ci/run "
          "runs these tests in its second environment (pip install -e '.[test,dgl]')")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``dgl`` skip, saying why, where DGL cannot exist: beside the default install's torch."""
    if HAS_DGL:
        return
    for item in items:
        if "dgl" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=NO_DGL))


_ORACLE = {"ran": 0, "skipped": 0}


def pytest_runtest_logreport(report):
    """Count the oracle tests (marked ``dgl``) that ran and that skipped (see pytest_terminal_summary)."""
    if "dgl" not in report.keywords:
        return
    if report.skipped and report.when in ("setup", "call"):
        _ORACLE["skipped"] += 1
    elif report.when == "call":
        _ORACLE["ran"] += 1


def pytest_terminal_summary(terminalreporter):
    """One line that .ci/run reads: how many oracle tests ran in this environment."""
    terminalreporter.write_line(f"oracle tests (marked dgl): {_ORACLE['ran']} ran, {_ORACLE['skipped']} skipped")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """An S3-compatible server on the loopback (tests/s3_server.py), its endpoint and dummy credentials in the
    environment of this process and of all it starts after: the session's cluster depends on it."""
    server = start_for_session()
    yield server
    server.stop()


@pytest.fixture
def storage_path(request, tmp_path) -> str:
    """Where a test's run keeps its files: ``tmp_path``, or with ``s3_server.STORAGE_KINDS``'s ``"s3"`` a fresh
    prefix of the test bucket (``s3://gnnray-tests/...``)."""
    if getattr(request, "param", "file") == "file":
        return str(tmp_path)
    return request.getfixturevalue("s3_server").fresh_prefix()


@pytest.fixture(scope="session")
def cluster(s3_server):
    """The session's Ray cluster (``ray.cluster_utils.Cluster``), started once (10-40 s here).

    Its head has six logical CPUs on two cores, so two train workers, two
    sampler actors and Ray Data's tasks fit at once, as in the job's own local
    cluster. Multi-node tests add simulated nodes with ``cluster.add_node`` and
    must remove them (``cluster.remove_node``) before they return.
    """
    import ray
    import ray.data
    from ray.cluster_utils import Cluster

    # A free dashboard port: the state API and the Train view need the dashboard, and another Ray
    # instance on this machine may hold the default one.
    # RAY_ADDRESS set before the head starts, so every process of this cluster (Ray Train's placement-group
    # cleaner included) joins it rather than the newest Ray instance on the machine.
    gcs = _free_port()
    os.environ["RAY_ADDRESS"] = f"{ray.util.get_node_ip_address()}:{gcs}"
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 6, "dashboard_port": _free_port(),
                                                      "gcs_server_port": gcs})
    # No job runtime env: DGLBACKEND and OUTDATED_IGNORE reach the workers through the cluster's environment
    # (set above, before it started); a runtime env would start each worker through Ray's setup_worker.py.
    ray.init(address=c.address)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="session")
def ray_cluster(cluster):
    """The ``ray`` module, connected to the session's cluster."""
    import ray

    return ray


def tiny_graph(num_nodes: int = 40, num_edges: int = 200, feat_dim: int = 4, num_classes: int = 3,
               seed: int = 0) -> Graph:
    """A random graph small enough to check by hand; every node is in one split."""
    rng = np.random.default_rng(seed)
    src, dst = rng.integers(0, num_nodes, num_edges), rng.integers(0, num_nodes, num_edges)
    indptr, indices = csc_from_edges(src, dst, num_nodes)
    perm = rng.permutation(num_nodes)
    a, b = num_nodes // 2, 3 * num_nodes // 4
    return Graph(indptr, indices, rng.standard_normal((num_nodes, feat_dim)).astype(np.float32),
                 rng.integers(0, num_classes, num_nodes).astype(np.int64),
                 np.sort(perm[:a]), np.sort(perm[a:b]), np.sort(perm[b:]), num_classes, "tiny")


# Object store of each simulated node that holds a feature shard: small, so that a feature table larger
# than it is still quick to generate (Ray's smallest store is 75 MiB).
SHARD_NODE_STORE = 80 * 2**20


def mapping_perms(address: int) -> str:
    """This process's permissions on the memory mapping that holds ``address`` (``r--s``: a read-only shared map)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return line.split()[1]
    return ""


@contextlib.contextmanager
def _simulated_nodes(cluster, count: int, env_vars: dict | None = None):
    """``count`` simulated nodes with one CPU and a SHARD_NODE_STORE object store each, removed afterwards;
    ``env_vars`` is their processes' environment (their raylet's, which Ray's workers inherit)."""
    added = [cluster.add_node(num_cpus=1, object_store_memory=SHARD_NODE_STORE, env_vars=env_vars)
             for _ in range(count)]
    cluster.wait_for_nodes()
    try:
        yield added
    finally:
        for n in added:
            if n in cluster.worker_nodes:
                cluster.remove_node(n)
        cluster.wait_for_nodes()


def other_versions(root: Path, versions: dict) -> dict:
    """The environment of a node whose packages report other ``versions`` (name -> version): a directory of
    package metadata first on its ``PYTHONPATH``, which ``importlib.metadata`` reads before site-packages (the
    packages themselves still import from there)."""
    for name, version in versions.items():
        info = root / f"{name}-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def shard_nodes(cluster, ray_cluster):
    """Three simulated nodes with one CPU and an 80 MiB object store each, removed after the module.

    Yields the list of Ray's node objects; a test may remove one (``cluster.remove_node``).
    """
    with _simulated_nodes(cluster, 3) as added:
        yield added


@pytest.fixture(scope="module")
def five_shard_nodes(cluster, ray_cluster):
    """As ``shard_nodes``, five of them: room to rebuild two lost shards on two spare nodes."""
    with _simulated_nodes(cluster, 5) as added:
        yield added


@pytest.fixture
def graph() -> Graph:
    return tiny_graph()


def shared_dataset(name: str) -> Path:
    """Path of a dataset in ../shared/datasets, or skip saying it is missing."""
    path = SHARED_DATASETS / name
    if not path.is_dir():
        pytest.skip(f"needs {path} (the shared datasets beside the repository)")
    return path


@pytest.fixture(scope="session")
def cora_run(ray_cluster, tmp_path_factory):
    """One SAGE run on cora (2 workers, 20 epochs, layer-wise final accuracies, the sampled ones beside them),
    shared by tests/test_job.py and tests/inference: (its summary, the storage path of its run "cora")."""
    from gnnray.config import parse_args
    from gnnray.driver.fit import run

    cora = shared_dataset("cora")
    storage = tmp_path_factory.mktemp("runs")
    cfg = parse_args(["--dataset", str(cora), "--normalize-features", "--epochs", "20", "--batch-size", "32",
                      "--fanouts", "10,10", "--hidden", "64", "--lr", "0.01", "--weight-decay", "5e-4",
                      "--num-workers", "2", "--storage-path", str(storage), "--name", "cora"])
    return run(cfg), storage


def run_gloo_ranks(target, tmp_path, world: int = 2, timeout: float = 300) -> None:
    """Run ``target(rank, port, str(tmp_path))`` in ``world`` spawned processes that can form a gloo group on
    ``127.0.0.1:port``; fail unless every one exits 0 (results come back through files in ``tmp_path``)."""
    import multiprocessing
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, port, str(tmp_path))) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * world
