"""Runs sharing a host: run registrations and core leases, as ``flock`` locks on files of :func:`lease_dir`.

Each local run starts its own Ray cluster, and every cluster's CPU plan would
see the whole host: two runs would pin their first workers to the same cores,
with threads for every core each. So local runs register on the host
(:func:`register_run`: a file the driver holds locked until the run ends,
:func:`release_run`), and a worker plans for its run's share of the node's
cores, one part per run registered and alive (:func:`host_share`). A worker
pins only cores it holds a lease on (a lock on one file per CPU id,
:func:`lease_cores`); a core leased by another process (a run that planned
alone before this one registered) is skipped for a free one, and with too few
free cores the worker is not pinned: it cannot tell that those cores are its
own. The kernel drops ``flock`` locks when their process ends, however it
ends: a crashed run leaves no stale claim behind.

The directory is the user's own by default (``gnnray-cpus-UID`` in the temp
dir, mode 700), so another user cannot plant files in it. A directory named
by ``$GNNRAY_CPU_DIR`` may be shared by several users' runs: it must be the
user's own or root's with the sticky bit (as ``/tmp``), and nothing in it is
followed (``O_NOFOLLOW``) or has its mode changed unless this process made it;
a directory or file that fails these checks is refused, and the run plans
alone. Every name carries the host's name, so runs on different hosts that
share the directory (a temp dir on NFS) never count or lease each other.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import socket
import stat
import tempfile
import time
from typing import Optional

LEASE_DIR_ENV = "GNNRAY_CPU_DIR"  # where runs register and cores are leased (default: lease_dir())
RUN_ENV = "GNNRAY_HOST_RUN"  # the local run a process belongs to (set by register_run, inherited by its cluster)
LEASE_WAIT_S = 2.0  # a core held by a process still exiting (an earlier attempt's worker) is waited for this long
_FILE_MODE = 0o644  # readable: another user's run in a shared directory opens it read-only to test its lock

# The open files hold the locks: closing one releases its lock.
_registered: list = []  # [name, fd] of this process's registration as a local run
_leased: list = []  # (cpu id, fd) of the cores this process holds
_last_name: list = [None]  # this process's run name, kept after release_run: its cluster's processes carry it


class LeaseDirError(OSError):
    """The lease directory or one of its files fails the safety checks (the message says which and why)."""


def lease_dir() -> str:
    """Where local runs register and cores are leased: ``$GNNRAY_CPU_DIR``, or ``gnnray-cpus-UID`` in the temp
    dir."""
    return os.environ.get(LEASE_DIR_ENV) or os.path.join(tempfile.gettempdir(), f"gnnray-cpus-{os.getuid()}")


def host() -> str:
    """This host's name as lease names carry it (``@`` cannot occur in a host name)."""
    return socket.gethostname().replace("/", "_")


def cpu_file(cpu: int) -> str:
    """The name of CPU ``cpu``'s lease file on this host."""
    return f"cpu-{cpu}@{host()}"


def _checked_dir() -> str:
    """:func:`lease_dir`, made (mode 700) if missing; :class:`LeaseDirError` unless it is a real directory of
    this user's, or root's with the sticky bit, and writable by others only with the sticky bit."""
    directory = lease_dir()
    try:
        os.makedirs(os.path.dirname(directory) or ".", exist_ok=True)
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(directory)
    sticky = bool(st.st_mode & stat.S_ISVTX)
    if not stat.S_ISDIR(st.st_mode):
        why = "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a directory"
    elif st.st_uid != os.getuid() and not (st.st_uid == 0 and sticky):
        why = f"belongs to another user (uid {st.st_uid})"
    elif st.st_mode & 0o022 and not sticky:
        why = "is writable by other users without the sticky bit"
    else:
        return directory
    raise LeaseDirError(f"lease directory {directory} {why}: gnnray will not use it; remove it, or set "
                        f"{LEASE_DIR_ENV} to a directory of your own")


def _open_lock(name: str) -> int:
    """A file of :func:`lease_dir` opened for locking: made by this process (its mode set), or an existing
    regular file opened read-only, never through a symbolic link."""
    path = os.path.join(_checked_dir(), name)
    # O_NONBLOCK: a FIFO planted under the name would otherwise block the open forever.
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK, _FILE_MODE)
        os.fchmod(fd, _FILE_MODE)  # this process's own file: past the umask, so other users' runs can test it
        return fd
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if os.path.islink(path):
            raise LeaseDirError(f"lease file {path} is a symbolic link: gnnray never follows one there (it could "
                                f"point at another user's file); remove it") from None
        raise e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise LeaseDirError(f"lease file {path} is not a regular file: remove it")
    return fd


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def register_run() -> Optional[str]:
    """Register this process as a local run on the host until :func:`release_run` or its exit; its name, also in
    ``$GNNRAY_HOST_RUN`` for the processes of its cluster. A process registers under one name however often it
    runs, as its cluster's processes keep the name they started with. Raises :class:`OSError` (a
    :class:`LeaseDirError` says why) if the lease directory cannot be used: the run then plans alone.
    Called by the driver before a run on its local cluster."""
    if not _registered:
        name = _last_name[0] or f"run-{time.time_ns()}-{os.getpid()}@{host()}"
        # Locked before it gets its name: runs_on_host would take an unlocked run file for an ended run's.
        fd = _open_lock("new-" + name)
        _try_lock(fd)
        try:
            os.rename(os.path.join(lease_dir(), "new-" + name), os.path.join(lease_dir(), name))
        except OSError:
            os.close(fd)
            raise
        _registered[:] = [name, fd]
        _last_name[0] = name
    os.environ[RUN_ENV] = _registered[0]
    return _registered[0]


def release_run() -> None:
    """End this process's registration (if any): later runs on the host no longer leave it a share."""
    if _registered:
        name, fd = _registered
        _registered.clear()
        try:
            os.unlink(os.path.join(lease_dir(), name))
        except OSError:  # removed already (runs_on_host of another run), or the directory went away
            pass
        os.close(fd)


def runs_on_host() -> list:
    """Names of the local runs of this host registered and alive, oldest first; the files of ended runs (their
    lock free) are removed."""
    try:
        directory = _checked_dir()
        names = sorted(n for n in os.listdir(directory) if n.startswith("run-") and n.endswith("@" + host()))
    except OSError:
        return []
    alive = []
    for name in names:
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # removed meanwhile, a link, or not ours to open: ended or unknowable
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            if _try_lock(fd):  # nobody holds it: that run has ended
                os.unlink(os.path.join(directory, name))
            else:
                alive.append(name)
        except OSError:
            pass
        finally:
            os.close(fd)
    return sorted(alive, key=lambda n: int(n.split("-")[1]))


def host_share(node, run: Optional[str] = None):
    """This run's part of ``node`` (a :class:`gnnray.cpus.NodeCpus`) when several local runs share the host: its
    ids cut into one contiguous part per run (oldest run first), the quota divided alike. ``run`` defaults to
    ``$GNNRAY_HOST_RUN``; a process of no registered run (a cluster joined by address) counts as one more run."""
    run = os.environ.get(RUN_ENV) if run is None else run
    runs = runs_on_host()
    if run not in runs:
        runs.append(run)
    n = min(len(runs), len(node.ids))
    if n <= 1:
        return node
    i = min(runs.index(run), n - 1)
    ids = node.ids[i * len(node.ids) // n:(i + 1) * len(node.ids) // n]
    return dataclasses.replace(node, ids=ids, quota=node.quota / n if node.quota else 0.0, runs=len(runs))


def lease_cores(cores: tuple, ids: tuple, wait_s: float = LEASE_WAIT_S) -> Optional[tuple]:
    """Lease ``cores`` for this process (until it exits or leases again): those cores if free (waiting up to
    ``wait_s`` for them), else as many others of ``ids`` that are free; ``None`` if fewer are free, or the lease
    files cannot be used (then nothing is pinned)."""
    _release([fd for _, fd in _leased])  # a second plan in this process replaces the first
    _leased.clear()
    deadline = time.monotonic() + wait_s
    try:
        held = _lock_first(cores, len(cores))
        while len(held) < len(cores) and time.monotonic() < deadline:
            _release([fd for _, fd in held])
            time.sleep(0.1)
            held = _lock_first(cores, len(cores))
        if len(held) < len(cores):
            _release([fd for _, fd in held])
            held = _lock_first(ids, len(cores))
    except OSError:
        return None
    if len(held) < len(cores):
        _release([fd for _, fd in held])
        return None
    _leased.extend(held)
    return tuple(cpu for cpu, _ in held)


def _lock_first(ids: tuple, count: int) -> list:
    """``(cpu, fd)`` of the first ``count`` of ``ids`` whose lease this process could take."""
    held: list = []
    try:
        for cpu in ids:
            if len(held) == count:
                break
            fd = _open_lock(cpu_file(cpu))
            if _try_lock(fd):
                held.append((cpu, fd))
            else:
                os.close(fd)
    except OSError:
        _release([fd for _, fd in held])
        raise
    return held


def _release(fds: list) -> None:
    list(map(os.close, fds))
