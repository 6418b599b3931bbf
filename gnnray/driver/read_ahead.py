"""Bounded read-ahead (``--max-ahead``): a Ray Data backpressure policy that counts mini-batches.

The sampler operator may take a new seed block only while the mini-batches
it was given, minus those Ray Data has handed to the train workers' split
iterators, are fewer than the limit (:func:`gnnray.driver.stream.read_ahead_rows`:
``max_ahead x workers`` less the blocks those iterators hold). So at most
``max_ahead x workers`` batches plus one seed block are sampled ahead of the
workers, in any epoch of any run, whatever the size of the object store.

Why a policy of our own: Ray Data's built-in limits are byte budgets. By
default they scale with the node's object store, and a budget exhausted to
zero still lets one output through per scheduling round (its liveness guard),
so one busy sampler actor is never held back. The stream's rows are training
steps, so the bound that keeps a long run honest is a count of rows.

The policy plugs into Ray Data's executor through ``DataContext``'s
``backpressure_policies.enabled`` config, which the dataset carries to the
process that executes it. Ray Data exports no public base class for it: the
classes come from ``ray.data._internal``, through :mod:`gnnray.ray_internals`.

Why a pause while the bound holds (:class:`PauseWhileHeld`): Ray Data's
scheduling loop blocks in ``ray.wait`` only while some task runs. With every
sampler held back and nothing running it loops without pause, a busy core in
the process that executes the stream (the split coordinator) for as long as
the workers take to catch up. The pause makes that loop sleep instead.
"""

from __future__ import annotations

import time

from gnnray.ray_internals import (  # Ray Data's execution internals
    ENABLED_BACKPRESSURE_POLICIES,
    ENABLED_BACKPRESSURE_POLICIES_CONFIG_KEY,
    BackpressurePolicy,
    ExecutionCallback,
)

_LIMIT_KEY = "gnnray.max_ahead_rows"
_OPERATOR_KEY = "gnnray.max_ahead_operator"


def bound_read_ahead(dataset, operator_name: str, max_rows: int) -> None:
    """Let the operator named ``operator_name`` run at most ``max_rows`` rows ahead of the dataset's consumers."""
    ctx = dataset.context
    ctx.set_config(_LIMIT_KEY, int(max_rows))
    ctx.set_config(_OPERATOR_KEY, operator_name)
    policies = ctx.get_config(ENABLED_BACKPRESSURE_POLICIES_CONFIG_KEY, ENABLED_BACKPRESSURE_POLICIES)
    ctx.set_config(ENABLED_BACKPRESSURE_POLICIES_CONFIG_KEY,
                   [p for p in policies if p is not MaxAheadPolicy] + [MaxAheadPolicy])
    if PauseWhileHeld not in ctx.custom_execution_callback_classes:
        ctx.custom_execution_callback_classes.append(PauseWhileHeld)


class MaxAheadPolicy(BackpressurePolicy):
    """Admit a new input into the bounded operator only while it is fewer than the limit's rows ahead."""

    @property
    def name(self) -> str:
        return "MaxAhead"

    def can_add_input(self, op) -> bool:
        limit = self._data_context.get_config(_LIMIT_KEY, None)
        if limit is None or op.name != self._data_context.get_config(_OPERATOR_KEY, None):
            return True
        return rows_ahead(op, self._topology) < limit


def rows_ahead(op, topology) -> int:
    """Rows given to ``op`` that the consumers have not taken yet (queued, being sampled, or sampled and waiting)."""
    last = next(o for o in topology if not o.output_dependencies)
    waiting = sum(q.num_rows() for q in topology[last].output_queue._queues)
    return op.metrics.num_row_inputs_received - (last.metrics.row_outputs_taken - waiting)


# While nothing runs, the loop looks every _POLL_S whether the workers have taken enough to release the
# bound, for at most _PAUSE_S: a check is microseconds, a pass of the loop about a millisecond.
_POLL_S, _PAUSE_S = 0.005, 0.1


class PauseWhileHeld(ExecutionCallback):
    """After a scheduling step that left no task running, sleep until the bound releases (or briefly)."""

    def on_execution_step(self, executor) -> None:
        topology = executor._topology
        if any(op.get_active_tasks() for op in topology):
            return  # the loop's own ray.wait blocks
        ctx = executor._data_context
        limit, name = ctx.get_config(_LIMIT_KEY, None), ctx.get_config(_OPERATOR_KEY, None)
        op = next((o for o in topology if o.name == name), None)
        deadline = time.monotonic() + _PAUSE_S
        while True:
            time.sleep(_POLL_S)
            if op is None or limit is None or rows_ahead(op, topology) < limit or time.monotonic() > deadline:
                return
