"""The console of a run on a cluster started without a dashboard (``ray start --include-dashboard=false``)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

from drills import JOB_TIMEOUT_S, REPO, SMALL


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_cluster_without_a_dashboard_prints_no_train_state_noise(tmp_path):
    """No state API there: no state tracking (whose actor would fail with a traceback) and none of Ray Train's
    per-second "Failed to query" warnings; the cluster line says the dashboard is off."""
    import ray

    port, ip = _free_port(), ray.util.get_node_ip_address()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TRAIN_ENABLE_STATE_TRACKING")}
    # Its own cluster, addressed by its port (other Ray instances may run here); no token to hand over.
    env.update(RAY_AUTH_MODE="disabled", RAY_ADDRESS=f"{ip}:{port}")
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    temp = tempfile.mkdtemp(prefix="gnnray-", dir="/tmp")  # short: Ray's socket paths live under it
    subprocess.run([ray_cli, "start", "--head", "--include-dashboard=false", f"--port={port}", "--num-cpus=4",
                    f"--temp-dir={temp}", "--disable-usage-stats"], env={**env, "RAY_ADDRESS": ""}, check=True,
                   capture_output=True, timeout=300)
    try:
        job = subprocess.run([sys.executable, "jobs/train_arxiv.py", *SMALL, "--num-workers", "1", "--epochs", "1",
                              "--storage-path", str(tmp_path / "runs"), "--name", "nodash"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    finally:
        subprocess.run([sys.executable, "-c", _STOP, temp], env=env, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)
    console = job.stdout + job.stderr
    assert job.returncode == 0, console
    assert re.search(r"^ray: cluster \S+, .* dashboard off$", console, re.M), console
    for noise in ("Traceback", "Failed to query", "State API", "ConnectionRefusedError"):
        assert noise not in console, console


# Stops the cluster whose processes name its temp dir, and only those (`ray stop` would stop every Ray instance
# on this machine).
_STOP = """
import os, signal, sys, time
import psutil
mine = [p for p in psutil.process_iter(["cmdline"]) if any(sys.argv[1] in a for a in (p.info["cmdline"] or []))]
for p in mine:
    try:
        p.send_signal(signal.SIGTERM)
    except psutil.Error:
        pass
gone, alive = psutil.wait_procs(mine, timeout=15)
for p in alive:
    try:
        p.kill()
    except psutil.Error:
        pass
"""
