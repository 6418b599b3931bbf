"""``ray job submit`` to a real local head: the job succeeds and logs its epochs; a bad option ends FAILED.

The head is this test's own (``ray start --head --block`` in a new session, its
own ports and temp dir, loopback only) and is stopped by its pids at the end;
the session's shared cluster is untouched.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TINY = ["--dataset", "synthetic", "--synthetic-nodes", "2000", "--synthetic-feat-dim", "16", "--fanouts", "5,5",
        "--batch-size", "128", "--hidden", "32", "--num-workers", "2", "--sampler-actors", "1", "--epochs", "2",
        "--eval", "sampled"]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                if state != "Z" and os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids


def _stop_session(proc: subprocess.Popen) -> None:
    """Stop every process of ``proc``'s session (this head's and nothing else): SIGTERM, then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        for pid in _session_pids(proc.pid):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()  # reap `ray start` itself
            if not _session_pids(proc.pid):
                return
            time.sleep(0.5)


class _Head:
    """A running head: its Jobs API address, temp dir, and the environment its clients need."""

    def __init__(self, address: str, temp: str, env: dict):
        self.address, self.temp, self.env = address, temp, env

    def api(self, path: str) -> dict:
        """GET the Jobs REST API (``/api/jobs/...``), authenticated with the head's token."""
        request = urllib.request.Request(f"{self.address}{path}",
                                         headers={"Authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())


@pytest.fixture(scope="module")
def head():
    """A fresh single-node head with 4 CPUs and token authentication, as Ray 2.60 recommends."""
    # Short path: Ray's unix socket paths under the temp dir must stay under 108 bytes.
    temp = tempfile.mkdtemp(prefix="gnnray-head-", dir="/tmp")
    gcs, dash, client, agent, agent_grpc, metrics, env_agent, node_mgr, obj_mgr = _free_ports(9)
    # The job's `python` is the first on the head's PATH: this environment's, as for a user whose venv is active.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    # Explicit token auth: the same on every machine, whatever ~/.ray/auth_token holds.
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    # The head's processes find it by RAY_ADDRESS: Ray Train's placement-group cleaner looks its cluster up
    # by address, and with the tests' own cluster also on this machine it would otherwise pick that one.
    env["RAY_ADDRESS"] = f"127.0.0.1:{gcs}"
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
           f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
           f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={env_agent}",
           f"--node-manager-port={node_mgr}", f"--object-manager-port={obj_mgr}",
           "--min-worker-port=0", "--max-worker-port=0",  # random worker ports: no clash with other clusters
           "--num-cpus=4", f"--temp-dir={temp}", "--disable-usage-stats"]
    log = open(os.path.join(temp, "ray-start.log"), "wb")
    # A new session: every process of this head (and its workers) carries its id, so it can be stopped by pid.
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    h = _Head(f"http://127.0.0.1:{dash}", temp, env)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, f"ray start exited {proc.returncode}: {Path(log.name).read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"head not up after 240 s: {Path(log.name).read_text()[-3000:]}"
            try:
                h.api("/api/version")
                break
            except OSError:
                time.sleep(2)
        yield h
    finally:
        _stop_session(proc)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _submit(head: _Head, submission_id: str, args: list[str]) -> subprocess.CompletedProcess:
    # Only .rayignore decides what is uploaded (as for a checkout without .gitignore).
    env = dict(head.env, RAY_RUNTIME_ENV_IGNORE_GITIGNORE="1")
    return subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", head.address, "--submission-id", submission_id,
         "--working-dir", str(REPO), "--", "python", "jobs/train_arxiv.py", *args],
        env=env, capture_output=True, text=True, timeout=480,
    )


def test_submitted_job_succeeds_and_logs_epochs(head, tmp_path):
    job_id = f"gnnray-{uuid.uuid4().hex[:8]}"
    out = _submit(head, job_id, TINY + ["--storage-path", str(tmp_path), "--name", "submitted"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert head.api(f"/api/jobs/{job_id}")["status"] == "SUCCEEDED"
    logs = head.api(f"/api/jobs/{job_id}/logs")["logs"]
    assert logs in out.stdout  # `ray job submit` showed the job's output as it ran
    epochs = [l for l in logs.splitlines() if l.startswith("epoch=")]
    assert [l.split()[0] for l in epochs] == ["epoch=0", "epoch=1"], logs[-3000:]
    assert all(k in epochs[0] for k in ("loss=", "val_acc=", "seeds_per_s=", "data_wait=", "eta="))
    assert sum(l.startswith("best_val_acc=") for l in logs.splitlines()) == 1
    assert [json.loads(l)["epoch"] for l in (tmp_path / "submitted" / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    # The console is the run's own lines, not Ray's INFO chatter (that goes to the session's log files).
    assert len(logs.splitlines()) <= 15, logs

    # The dashboard's Train view (its HTTP API for Train V2 runs) lists the run, finished.
    runs = head.api("/api/train/v2/runs/v1")["train_runs"]
    assert [r["status"] for r in runs if r["name"] == "submitted"] == ["FINISHED"], runs
    # With torch's version as text, which Ray Train's state actor (behind the view) reads without importing
    # torch: torch.__version__ is a str subclass of torch's own, and unpickling one loads all of torch.
    import torch

    [run] = [r for r in runs if r["name"] == "submitted"]
    assert run["framework_versions"]["torch"] == str(torch.__version__), run["framework_versions"]
    query = "/api/v0/actors?detail=1&filter_keys=class_name&filter_predicates=%3D&filter_values=TrainStateActor"
    [state] = [a for a in head.api(query)["data"]["result"]["result"] if a["state"] == "ALIVE"]
    assert "libtorch" not in Path(f"/proc/{state['pid']}/maps").read_text()

    # What was uploaded: the sources, without venv, VCS data or outputs (.rayignore).
    pkg_dirs = [p for p in Path(head.temp).glob("session_2*/runtime_resources/working_dir_files/*") if p.is_dir()]
    assert len(pkg_dirs) == 1, pkg_dirs
    files = [p.relative_to(pkg_dirs[0]) for p in pkg_dirs[0].rglob("*") if p.is_file()]
    assert Path("jobs/train_arxiv.py") in files and Path("gnnray/driver/fit.py") in files
    assert not [f for f in files if f.parts[0] in (".venv", ".git", "bench-results", "outputs")]
    assert sum((pkg_dirs[0] / f).stat().st_size for f in files) < 5 * 2**20


def test_bad_option_ends_failed_with_one_line_reason(head, tmp_path):
    job_id = f"gnnray-bad-{uuid.uuid4().hex[:8]}"
    out = _submit(head, job_id, TINY + ["--storage-path", str(tmp_path), "--batch-size", "0"])
    assert out.returncode == 1, out.stdout[-3000:]  # `ray job submit` exits 1 for a FAILED job
    info = head.api(f"/api/jobs/{job_id}")
    assert info["status"] == "FAILED" and "exit code 2" in info["message"], info
    logs = head.api(f"/api/jobs/{job_id}/logs")["logs"]
    errors = [l for l in logs.splitlines() if l.startswith("gnnray: error:")]
    assert errors == ["gnnray: error: --batch-size 0: must be at least 1"], logs[-3000:]
    assert "Traceback" not in logs
