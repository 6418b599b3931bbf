"""The console of a run on a cluster started without a dashboard (as ``ray start --include-dashboard=false``)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

from drills import JOB_TIMEOUT_S, REPO, SMALL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_cluster_without_a_dashboard_prints_no_train_state_noise(tmp_path, monkeypatch):
    """No state API there: no state tracking (whose actor would fail with a traceback) and none of Ray Train's
    per-second "Failed to query" warnings; the cluster line says the dashboard is off."""
    import ray
    from ray.cluster_utils import Cluster

    address = f"{ray.util.get_node_ip_address()}:{_free_port()}"
    # Its own cluster, named before it starts so that its processes join it (other Ray instances may run here);
    # no token to hand over.
    monkeypatch.setenv("RAY_ADDRESS", address)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_TRAIN_ENABLE_STATE_TRACKING", raising=False)
    head = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "include_dashboard": False, "gcs_server_port": int(address.rsplit(":", 1)[1]),
        "dashboard_port": _free_port()})
    try:
        job = subprocess.run([sys.executable, "jobs/train_arxiv.py", *SMALL, "--num-workers", "1", "--epochs", "1",
                              "--storage-path", str(tmp_path), "--name", "nodash"],
                             cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    finally:
        head.shutdown()
    console = job.stdout + job.stderr
    assert job.returncode == 0, console
    assert re.search(r"^ray: cluster \S+, .* dashboard off$", console, re.M), console
    for noise in ("Traceback", "Failed to query", "State API", "ConnectionRefusedError"):
        assert noise not in console, console
