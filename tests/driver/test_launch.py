"""Joining a cluster by ``RAY_ADDRESS=HOST:PORT`` when it was started by ``ray start`` with token authentication."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from drills import REPO

TOKEN = "0123456789abcdef0123456789abcdef"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory):
    """A head started as a user would (``ray start --head``, Ray's token authentication); its address."""
    import ray

    temp = tmp_path_factory.mktemp("ray-head")
    port = _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block",
                             f"--port={port}", "--num-cpus=0", f"--temp-dir={temp}", "--include-dashboard=false",
                             "--disable-usage-stats"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)
    address = f"{ray.util.get_node_ip_address()}:{port}"
    try:
        for _ in range(240):  # the GCS answers first; nothing here needs the rest of the head
            try:
                socket.create_connection(tuple(address.rsplit(":", 1)), timeout=1).close()
                break
            except OSError:
                assert head.poll() is None, "ray start ended before its GCS answered"
                time.sleep(0.5)
        yield address
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # ray start --block stops what it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()


def _check(address: str, **env) -> subprocess.CompletedProcess:
    code = ("from gnnray.driver.launch import check_token\nfrom gnnray.errors import ClusterError\n"
            f"try:\n    check_token({address!r}, 30)\nexcept ClusterError as e:\n    print('refused:', e)\n"
            "else:\n    print('accepted')")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**clean, "HOME": "/nonexistent", **env},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("env,says", [
    ({}, "requires an auth token"),
    ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "f" * 32}, "refuses the auth token"),
    ({"RAY_AUTH_MODE": "token"}, "no auth token"),
    ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}, "accepted"),
])
def test_the_token_is_checked_before_ray_connects(token_cluster, env, says):
    out = _check(token_cluster, **env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert says in out.stdout and "InvalidAuthToken" not in out.stdout + out.stderr, out.stdout + out.stderr
    if says != "accepted":
        assert "RAY_AUTH_TOKEN" in out.stdout and "RAY_ADDRESS=auto" in out.stdout


def test_a_run_without_the_token_prints_one_line(token_cluster):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    out = subprocess.run([sys.executable, "jobs/train_arxiv.py", "--dataset", "synthetic", "--epochs", "1"],
                         cwd=REPO, env={**clean, "HOME": "/nonexistent", "RAY_ADDRESS": token_cluster},
                         capture_output=True, text=True, timeout=300)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert out.returncode != 0 and len(lines) == 1 and "requires an auth token" in lines[0], lines
