"""The one line a failed attempt is reported by: the root failed rank's error, and its node when it was lost."""

from __future__ import annotations

import socket

from gnnray.errors import last_line


def one_line(e: BaseException) -> str:
    """The failure in one line: the root failed rank's error, and its node when its process died or went silent.

    A rank whose process died (or whose node was lost) is the root cause;
    the other ranks' errors (collective timeouts, connection resets) follow
    from it, so it is reported first. When the only errors that arrived are
    such consequences (a peer's connection closed before Ray Train's health
    check saw the dead rank), the lost node is named from the attempt's record.
    """
    failures = getattr(e, "worker_failures", None)
    if not failures:
        return last_line(e)
    nodes = {rank: node_of(err) for rank, err in failures.items()}
    rank = min(failures, key=lambda r: (not nodes[r], r))
    line = f"rank {rank}{nodes[rank]}: {last_line(failures[rank])}"
    if not nodes[rank]:
        line += "".join(f"; node {ip} ({node_id[:8]}) of rank{'s' if len(ranks) > 1 else ''} "
                        f"{', '.join(map(str, ranks))} is lost or unreachable"
                        for node_id, ip, ranks in lost_worker_nodes())
    return line


def stack_mismatch(e: BaseException) -> str:
    """The message of a rank's :class:`~gnnray.stack.StackError` among ``e``'s failures (a node whose stack
    differs from the driver's), or ``""``: restarting would only meet that node again."""
    from gnnray.stack import StackError

    return rank_error(e, StackError)


def rank_error(e: BaseException, kind: type) -> str:
    """The message of a rank's ``kind`` error among ``e``'s failures (raised there, or named in a wrapped
    error's text), or ``""``."""
    for err in (getattr(e, "worker_failures", None) or {}).values():
        found = err if isinstance(err, kind) else getattr(err, "cause", None)
        if isinstance(found, kind):
            return str(found)
        marker = f"{kind.__name__}: "
        line = next((l for l in str(err).splitlines() if marker in l), "")
        if line:
            return line.split(marker, 1)[1].strip()
    return ""


def node_of(err: BaseException) -> str:
    """`` on node IP (ID)`` of a worker whose actor died or became unreachable, so a lost node is named.

    Ray Train notices a lost node by a failed health check of its workers,
    seconds before Ray marks the node dead, so the node is looked up through
    the worker's actor (Ray's state API) rather than the list of dead nodes.
    """
    import ray
    import ray.exceptions
    from ray.util.state import get_actor

    cause = getattr(err, "health_check_failure", None) or err
    actor_id = getattr(cause, "actor_id", None) if isinstance(cause, ray.exceptions.RayActorError) else None
    if not actor_id:
        return ""
    try:
        # The address named: among several clusters on this machine the state API would find the newest.
        node_id = get_actor(actor_id, address=ray.get_runtime_context().gcs_address, timeout=10).node_id
        ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), "?")
    except Exception:  # best effort (the state API needs the dashboard): the message stays useful without it
        return ""
    return f" on node {ip} ({node_id[:8]})"


def lost_worker_nodes() -> list[tuple[str, str, list[int]]]:
    """``(node_id, ip, ranks)`` for each node of this job's latest Ray Train attempt that is dead or unreachable.

    The attempt's workers come from Ray Train's state actor (the record the
    dashboard's Train view shows). Ray marks a node dead only after several
    missed health checks, so a node that Ray still lists as alive counts as
    lost when its raylet refuses or does not answer a connection.
    """
    import ray
    from gnnray import ray_internals

    try:
        state = ray_internals.train_state_actor()
        if state is None:  # state tracking off: nothing recorded
            return []
        runs, attempts = ray.get([state.get_train_runs.remote(), state.get_train_run_attempts.remote()], timeout=10)
        job = ray.get_runtime_context().get_job_id()
        latest = max((a for run_id, by_id in attempts.items() if run_id in runs and runs[run_id].job_id == job
                      for a in by_id.values()), key=lambda a: a.start_time_ns, default=None)
        if latest is None:
            return []
        known = {n["NodeID"]: n for n in ray.nodes()}
    except Exception:  # best effort, as node_of
        return []
    ranks: dict[str, list[int]] = {}
    for w in latest.workers:
        ranks.setdefault(w.node_id, []).append(w.world_rank)
    lost = []
    for node_id, node_ranks in ranks.items():
        node = known.get(node_id)
        if node is None or not node.get("Alive") or not _answers(node["NodeManagerAddress"], node["NodeManagerPort"]):
            lost.append((node_id, node["NodeManagerAddress"] if node else "?", sorted(node_ranks)))
    return lost


def _answers(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether a raylet accepts a TCP connection: refused at once when its process is gone, silent when its host is."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
