"""The one line a failed attempt is reported by: the root failed rank's error, and its node when it was lost."""

from __future__ import annotations

from gnnray.errors import last_line


def one_line(e: BaseException) -> str:
    """The failure in one line: the root failed rank's error, and its node when its process died or went silent.

    A rank whose process died (or whose node was lost) is the root cause;
    the other ranks' errors (collective timeouts, connection resets) follow
    from it, so it is reported first.
    """
    failures = getattr(e, "worker_failures", None)
    if failures:
        ranked = sorted(failures.items(), key=lambda kv: (not node_of(kv[1]), kv[0]))
        rank, err = ranked[0]
        return f"rank {rank}{node_of(err)}: {last_line(err)}"
    return last_line(e)


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
        node_id = get_actor(actor_id, timeout=10).node_id
        ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), "?")
    except Exception:  # best effort (the state API needs the dashboard): the message stays useful without it
        return ""
    return f" on node {ip} ({node_id[:8]})"
