"""Joining clusters a user started: by ``RAY_ADDRESS=HOST:PORT`` under ``ray start``'s token authentication, and one
without a dashboard (as ``ray start --include-dashboard=false``), whose console stays quiet."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from drills import JOB_TIMEOUT_S, REPO, SMALL

TOKEN = "0123456789abcdef0123456789abcdef"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def token_cluster(tmp_path_factory):
    """A head started as a user would (``ray start --head``, Ray's token authentication, no dashboard); its
    address."""
    import ray

    temp = tmp_path_factory.mktemp("ray-head")
    port = _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block",
                             f"--port={port}", "--num-cpus=4", f"--temp-dir={temp}", "--include-dashboard=false",
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
            head.wait(timeout=5)  # its graceful stop waits out processes for about 30 s: nothing here needs it
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()


def _check(address: str, **env) -> subprocess.CompletedProcess:
    code = ("from gnnray.driver.connect import check_token\nfrom gnnray.errors import ClusterError\n"
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


def test_a_cluster_without_a_dashboard_prints_no_train_state_noise(token_cluster, tmp_path):
    """No state API there: no state tracking (whose actor would fail with a traceback) and none of Ray Train's
    per-second "Failed to query" warnings; the cluster line says the dashboard is off."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_TRAIN_ENABLE_STATE_TRACKING"}
    env.update(RAY_ADDRESS=token_cluster, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN)
    job = subprocess.run([sys.executable, "jobs/train_arxiv.py", *SMALL, "--num-workers", "1", "--epochs", "1",
                          "--storage-path", str(tmp_path), "--name", "nodash"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    console = job.stdout + job.stderr
    assert job.returncode == 0, console
    assert re.search(r"^ray: cluster \S+, .* dashboard off$", console, re.M), console
    for noise in ("Traceback", "Failed to query", "State API", "ConnectionRefusedError"):
        assert noise not in console, console


# Whether the kernel may back the VMA holding a 64 MB torch tensor with huge pages (/proc/self/smaps' THPeligible).
_ELIGIBLE = """
import torch
x = torch.ones(64 << 20, dtype=torch.uint8)
at, vma = x.data_ptr(), None
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
        lo, hi = (int(v, 16) for v in head.split("-"))
        vma = lo <= at < hi
    elif vma and head == "THPeligible:":
        print(line.split()[1])
"""


def test_the_runs_processes_ask_torch_for_huge_pages():
    """A step's large temporaries are fresh memory each step: in 4 KB pages they fault in one page at a time
    (a products-shaped SAGE step on CPU 594 against 378 ms). The run's environment has torch advise huge pages."""
    from gnnray.config import parse_args
    from gnnray.driver.connect import run_env

    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        mode = "[never]"
    if "[never]" in mode:
        pytest.skip("this kernel has transparent huge pages off: there is nothing to ask for")
    base = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}

    def eligible(env: dict) -> str:
        out = subprocess.run([sys.executable, "-c", _ELIGIBLE], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip()

    assert eligible({**base, **run_env(parse_args([]), {})}) == "1"
    if "[madvise]" in mode:  # here only the advice makes them eligible
        assert eligible(base) == "0"
