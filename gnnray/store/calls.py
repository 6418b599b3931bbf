"""Calls to the shard servers, waited for together under one deadline, and what their failures say.

Readers (``train/feature_reader.py``, ``train/layerwise_hidden.py``) send one call per shard and wait here: the
first failure (the deadline, a dead server, a lost object, an error in the call) raises a
:class:`~gnnray.errors.FeatureShardError` naming the shard and its node, so a run that loses a shard node
says which one (and, with ``--max-failures``, the driver rebuilds it: :func:`gnnray.store.shards.repair`).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from gnnray.errors import FeatureShardError, GnnrayError, last_line

# What wait_calls says of a failed gather call (and how it knows to name --feature-timeout).
GATHER = "did not deliver rows"
# Ray's cancel of a call can race the call's start on a threaded actor and be lost, leaving the call to run on:
# the calls still pending are cancelled again every RECANCEL_EVERY_S, until they end or RECANCEL_FOR_S pass.
RECANCEL_EVERY_S, RECANCEL_FOR_S = 1.0, 120.0


def wait_calls(calls: list, timeout_s: float, failing: str, each: Optional[Callable] = None,
               cancel: bool = True) -> list:
    """The results of ``calls`` (``(shard, ObjectRef)`` pairs), waited for together under one deadline.

    ``each(i, result)`` runs as each result arrives (the rest may still be on the way). The first failure
    (timeout, dead server, lost object, error in the call) raises :class:`FeatureShardError` naming the
    shard and its node (at the deadline: every shard still pending), after cancelling the calls still
    pending if ``cancel``. A user-facing error inside a call (e.g. a :class:`DatasetError` of a shard task)
    is raised as itself.
    """
    import ray

    refs = [ref for _, ref in calls]
    index = {ref: i for i, ref in enumerate(refs)}
    results: list = [None] * len(calls)
    pending, deadline = refs, time.monotonic() + timeout_s
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                _late([calls[index[r]][0] for r in pending], timeout_s, failing)
            for ref in ready:
                i = index[ref]
                results[i] = _result(calls[i][0], ref, failing)
                if each is not None:
                    each(i, results[i])
    except BaseException:
        if cancel:  # nobody waits for them any more: spare the servers the work
            cancel_until_done(pending)
        raise
    return results


def wait_streams(calls: list, timeout_s: float, failing: str, each: Callable) -> None:
    """:func:`wait_calls` for streaming calls (``(shard, ObjectRefGenerator)`` pairs): ``each(i, piece)`` for every
    piece call ``i`` yields, in order per call, as they arrive; the same deadline and errors."""
    import ray

    index = {id(g): i for i, (_, g) in enumerate(calls)}
    pending, deadline = [g for _, g in calls], time.monotonic() + timeout_s
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                _late([calls[index[id(g)]][0] for g in pending], timeout_s, failing)
            for g in ready:
                i = index[id(g)]
                try:
                    ref = next(g)
                except StopIteration:  # every piece of this call arrived
                    continue
                each(i, _result(calls[i][0], ref, failing))
                pending.append(g)
    except BaseException:
        cancel_until_done(pending)  # nobody waits for them any more: spare the servers the work
        raise


def cancel_until_done(pending: list) -> None:
    """Cancel the calls ``pending`` (object refs or generators) now, and again on a thread while they run."""
    _cancel(pending)
    if pending:
        threading.Thread(target=_cancel_again, args=(list(pending),), name="cancel shard calls", daemon=True).start()


def _cancel_again(pending: list) -> None:
    import ray

    end = time.monotonic() + RECANCEL_FOR_S
    while pending and time.monotonic() < end:
        try:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=RECANCEL_EVERY_S)
        except Exception:  # Ray shut down meanwhile: nothing left to cancel
            return
        _cancel(pending)


def _cancel(refs: list) -> None:
    import ray

    for ref in refs:
        try:
            ray.cancel(ref)
        except Exception:  # already done, or its owner gone: nothing to cancel
            pass


def _late(shards: list, timeout_s: float, failing: str):
    raise FeatureShardError(" and ".join(f"feature shard {s.lo}:{s.hi} on {s.where()}" for s in shards)
                            + f" {failing}: no answer within {timeout_s:g}s"
                            + (" (--feature-timeout)" if failing == GATHER else ""))


def _result(shard, ref, failing: str):
    import ray
    import ray.exceptions as rex

    try:
        return ray.get(ref)
    except rex.RayActorError as exc:
        why = f"its server died, node lost? ({last_line(exc)})"
    except rex.ObjectLostError as exc:
        why = f"the result was lost before it arrived, node lost? ({type(exc).__name__})"
    except rex.TaskCancelledError:
        why = "the call was cancelled"
    except rex.RayTaskError as exc:
        if isinstance(exc.cause, GnnrayError):
            raise exc.cause from None
        why = f"the call failed: {last_line(exc)}"
    except rex.RayError as exc:
        why = last_line(exc)
    raise FeatureShardError(f"feature shard {shard.lo}:{shard.hi} on {shard.where()} {failing}: {why}") from None
