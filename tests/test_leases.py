"""Runs sharing a host: their shares and core leases, a crashed holder's released, and a lease directory no other
user can turn against this one (gnnray.leases)."""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gnnray import leases
from gnnray.cpus import CpuPlan, NodeCpus
from gnnray.leases import host_share, lease_cores, runs_on_host


@pytest.fixture
def lease_dir(tmp_path, monkeypatch) -> Path:
    """A private directory for run registrations and core leases."""
    monkeypatch.setenv(leases.LEASE_DIR_ENV, str(tmp_path / "leases"))
    return tmp_path / "leases"


def _held(path: Path) -> int:
    """An fd holding ``path``'s lock, as another process's registration or lease would (flock locks belong to
    an open file, so this one conflicts with the module's own opens)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _run(name: str) -> str:
    return f"{name}@{leases.host()}"


def test_runs_sharing_a_host_plan_for_their_own_part(lease_dir):
    """Two live runs split the node's ids (oldest first) and its quota; an ended run's file is removed and not
    counted; a process of no registered run counts as one more."""
    older, newer, ended = _run("run-100-1"), _run("run-200-2"), _run("run-150-3")
    fds = [_held(lease_dir / older), _held(lease_dir / newer)]
    (lease_dir / ended).touch()  # its driver is gone: nobody holds the lock
    try:
        assert runs_on_host() == [older, newer] and not (lease_dir / ended).exists()
        node = NodeCpus(tuple(range(8)))
        assert host_share(node, older) == NodeCpus((0, 1, 2, 3), 0.0, 2)
        assert host_share(node, newer) == NodeCpus((4, 5, 6, 7), 0.0, 2)
        assert host_share(node, "joined-by-address").ids == (5, 6, 7)  # the third of three
        quota = host_share(NodeCpus(tuple(range(64)), 4.0), newer)
        assert quota.quota == 2.0 and quota.cores == 2 and not quota.pinnable
        # Each run's plan: its first worker on its own cores, threads for its share only.
        a, b = (CpuPlan(host_share(node, r), 1, 1) for r in (older, newer))
        assert a.trainer_cores(0) == (0, 1, 2) and b.trainer_cores(0) == (4, 5, 6)
        assert "shared by 2 runs" in a.line() and a.trainer_threads() + b.trainer_threads() <= 8
    finally:
        for fd in fds:
            os.close(fd)
    assert runs_on_host() == [] and host_share(NodeCpus(tuple(range(8))), older) == NodeCpus(tuple(range(8)))


def test_a_worker_pins_only_cores_no_other_process_holds(lease_dir):
    other = _held(lease_dir / leases.cpu_file(1))  # another run's worker pinned to core 1
    try:
        assert lease_cores((0, 1), (0, 1, 2, 3), wait_s=0) == (0, 2)  # core 1 skipped for a free one
        assert lease_cores((2, 3), (0, 1, 2, 3), wait_s=0) == (2, 3)  # a new lease replaces this process's last
        assert lease_cores((0, 1, 2, 3), (0, 1, 2, 3), wait_s=0) is None  # three free of four: not pinned
    finally:
        os.close(other)
    assert lease_cores((0, 1, 2, 3), (0, 1, 2, 3), wait_s=0) == (0, 1, 2, 3)
    lease_cores((), (), wait_s=0)


def test_an_unusable_lease_directory_leaves_the_run_unregistered_and_unpinned(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv(leases.LEASE_DIR_ENV, str(tmp_path / "file" / "leases"))  # under a file: cannot be made
    with pytest.raises(OSError):
        leases.register_run()
    assert leases.RUN_ENV not in os.environ
    assert lease_cores((0,), (0, 1), wait_s=0) is None and runs_on_host() == []


def test_a_crashed_runs_registration_and_leases_are_released(lease_dir):
    """A driver and a worker killed with SIGKILL (no clean-up runs) leave nothing held: the kernel drops their
    locks, so the next run plans for the whole host and pins the cores they had."""
    code = ("from gnnray import leases; print(leases.register_run(), leases.lease_cores((0, 1), (0, 1), 0), flush=True); "
            "import time; time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    try:
        name, leased = proc.stdout.readline().split(" ", 1)
        assert leased.strip() == "(0, 1)" and runs_on_host() == [name]
        assert lease_cores((0, 1), (0, 1), wait_s=0) is None  # held by the live process
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert runs_on_host() == [] and host_share(NodeCpus((0, 1)), None) == NodeCpus((0, 1))
    assert lease_cores((0, 1), (0, 1), wait_s=0) == (0, 1)
    lease_cores((), (), wait_s=0)




def test_a_symlink_planted_in_the_lease_directory_is_never_followed(tmp_path, lease_dir):
    """Another user's symlink ``cpu-0 -> victim's file`` (mode 600) leaves the file as it was; the lease is refused."""
    victim = tmp_path / "bashrc"
    victim.write_text("secret\n")
    victim.chmod(0o600)
    lease_dir.mkdir(mode=0o700)
    for name in ("cpu-0", leases.cpu_file(0), "new-" + _run("run-1-1")):  # the old name and today's
        (lease_dir / name).symlink_to(victim)
    assert lease_cores((0,), (0,), wait_s=0) is None
    with pytest.raises(leases.LeaseDirError, match="symbolic link: gnnray never follows one"):
        leases._open_lock(leases.cpu_file(0))
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600 and victim.read_text() == "secret\n"


@pytest.mark.parametrize("make, why", [
    (lambda d: d.mkdir(mode=0o777) or d.chmod(0o777), "writable by other users without the sticky bit"),
    (lambda d: d.symlink_to(d.parent), "is a symbolic link"),
])
def test_a_lease_directory_others_control_is_refused(lease_dir, make, why):
    make(lease_dir)
    with pytest.raises(leases.LeaseDirError, match=why):
        leases.register_run()
    assert lease_cores((0,), (0,), wait_s=0) is None and runs_on_host() == []


def test_a_lease_directory_of_another_user_is_refused(lease_dir, monkeypatch):
    lease_dir.mkdir(mode=0o700)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(lease_dir).st_uid + 1)
    with pytest.raises(leases.LeaseDirError, match=r"belongs to another user .*set GNNRAY_CPU_DIR"):
        leases.register_run()


def test_the_default_directory_is_the_users_own(monkeypatch, tmp_path):
    monkeypatch.delenv(leases.LEASE_DIR_ENV, raising=False)
    monkeypatch.setattr(leases.tempfile, "gettempdir", lambda: str(tmp_path))
    assert leases.lease_dir() == str(tmp_path / f"gnnray-cpus-{os.getuid()}")
    assert lease_cores((0,), (0,), wait_s=0) == (0,)
    lease_cores((), (), wait_s=0)
    assert stat.S_IMODE(os.stat(leases.lease_dir()).st_mode) == 0o700


def test_runs_and_leases_of_another_host_sharing_the_directory_are_not_this_hosts(lease_dir):
    """An NFS temp dir seen by two hosts: the other host's live run and leased core count for nothing here."""
    other = [_held(lease_dir / "run-100-1@other-host"), _held(lease_dir / "cpu-0@other-host")]
    try:
        assert runs_on_host() == [] and host_share(NodeCpus((0, 1)), None) == NodeCpus((0, 1))
        assert lease_cores((0,), (0,), wait_s=0) == (0,)
    finally:
        lease_cores((), (), wait_s=0)
        list(map(os.close, other))


def test_a_released_run_no_longer_takes_a_share(lease_dir, monkeypatch):
    monkeypatch.delenv(leases.RUN_ENV, raising=False)  # restored after the test, as is the module's memory
    monkeypatch.setattr(leases, "_last_name", [None])
    name = leases.register_run()
    try:
        assert runs_on_host() == [name] and name.endswith("@" + leases.host())
        assert host_share(NodeCpus((0, 1)), "another").ids == (1,)
    finally:
        leases.release_run()
    assert runs_on_host() == [] and host_share(NodeCpus((0, 1)), "another").ids == (0, 1)
    assert leases.register_run() == name  # the name its cluster's processes carry
    leases.release_run()
