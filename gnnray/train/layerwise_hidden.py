"""With stage 7 (train worker), ``--feature-shards K``: layer-wise inference's hidden tables, sharded like the features.

Without shards every node holds each hidden table whole (:func:`gnnray.train.layerwise._share`):
``N x width x 4`` bytes per table, 113.7 GB for papers100M at hidden 256. With
them, the table is cut along the feature shards' node ranges, and shard ``k``'s
server (:class:`gnnray.store.shards.ShardServer`) holds range ``k``'s rows in
its node's store:

- the ranks on shard ``k``'s node split range ``k`` between them and compute it
  (:func:`assign`); a range whose node runs no rank is split over all ranks;
- each chunk a rank computes goes to its range's server at once (:meth:`Tables.keep`),
  so a rank holds a chunk, never its slice;
- the next layer reads the rows a chunk needs from each server that holds
  some (:class:`HiddenRows`: one streaming call per chunk and shard, under ``--feature-timeout``),
  in pieces that Ray sends inside its replies, not through the object store
  (:mod:`gnnray.store.hidden_server`), and keeps none of them;
- once every rank finished layer ``i``, table ``i - 1`` is dropped.

So a shard node's store holds at most its range's rows of two tables, the one
a layer reads and the one it writes: 2 x table / K for equal widths
(:func:`gnnray.store.shards.hidden_nbytes`, checked before training by
:func:`gnnray.driver.preflight.check_layerwise`). docs/scaling.md#where-layer-wise-inferences-hidden-tables-live
has the measurement.
"""

from __future__ import annotations

import uuid
from typing import Optional

import numpy as np

from gnnray.store.calls import GATHER, wait_calls, wait_streams
from gnnray.store.hidden_server import piece_rows
from gnnray.store.shards import ShardedFeatures, route
from gnnray.train.feature_reader import FeatureReader

# Chunks a rank may have on their way to the servers while it computes the next one.
IN_FLIGHT = 2


def assign(shards: ShardedFeatures, nodes: list, rank: int) -> list:
    """This rank's ``(lo, hi, shard)`` ranges: its part of every range it computes.

    Args:
        shards: The feature shards (their node ranges and nodes).
        nodes: Each rank's node id, in rank order.
        rank: This rank.
    """
    ranges = []
    for k, s in enumerate(shards.shards):
        ranks = [r for r, n in enumerate(nodes) if n == s.node_id] or list(range(len(nodes)))
        if rank in ranks:
            i, m = ranks.index(rank), len(ranks)
            lo, hi = s.lo + (s.hi - s.lo) * i // m, s.lo + (s.hi - s.lo) * (i + 1) // m
            if hi > lo:
                ranges.append((lo, hi, k))
    return ranges


class HiddenRows(FeatureReader):
    """Rows of hidden table ``layer`` held by the shard servers, fetched per chunk (never stored whole)."""

    def __init__(self, shards: ShardedFeatures, token: str, layer: int, dim: int):
        super().__init__()
        self._h, self._token, self._layer, self.dim = shards, token, layer, dim
        self._starts = np.array([s.lo for s in shards.shards], dtype=np.int64)

    def gather(self, ids, out):
        ids = np.asarray(ids, dtype=np.int64)
        order, at = route(self._starts, ids)
        piece = piece_rows(self.dim)
        calls = []
        for k, s in enumerate(self._h.shards):
            pos = order[at[k]:at[k + 1]]
            if pos.size:
                calls.append((s, pos, s.server.hidden.options(num_returns="streaming").remote(
                    self._token, self._layer, ids[pos], piece)))
        done = [0] * len(calls)

        def put(i, rows):
            out[calls[i][1][done[i]:done[i] + len(rows)]] = rows
            done[i] += len(rows)

        wait_streams([(s, gen) for s, _, gen in calls], self._h.timeout_s, GATHER, put)
        if done != [len(pos) for _, pos, _ in calls]:
            raise RuntimeError(f"hidden rows: {sum(done)} of {len(ids)} rows arrived (a bug)")
        st = self._stats
        st.batches, st.rows, st.remote_calls = st.batches + 1, st.rows + len(ids), st.remote_calls + len(calls)


class Tables:
    """One evaluation's hidden tables on the shard servers, as seen by one rank.

    Args:
        shards: The feature shards, whose servers hold the tables.
        rank, world: This rank and the number of ranks (a torch.distributed group when above 1).
        device: The ranks' device, for the barrier between layers.
    """

    def __init__(self, shards: ShardedFeatures, rank: int, world: int, device):
        import ray

        self._h, self._rank, self._world, self._device = shards, rank, world, device
        me = (ray.get_runtime_context().get_node_id(), uuid.uuid4().hex)
        if rank == 0:  # before any rank keeps rows: the other ranks wait for rank 0 in the exchange below
            self._wait([(s, s.server.begin.remote(me[1])) for s in shards.shards], "did not begin hidden rows")
        everyone = [me]
        if world > 1:
            import torch.distributed as dist

            everyone = [None] * world
            dist.all_gather_object(everyone, me)
        self.token = everyone[0][1]  # rank 0's: one evaluation, one name on every server
        self.ranges = assign(shards, [n for n, _ in everyone], rank)
        self._pending: list = []

    def keep(self, layer: int, shard: int, lo: int, rows: np.ndarray) -> None:
        """Send a chunk of table ``layer`` (node ids ``lo..``) to its range's server; at most IN_FLIGHT on the way."""
        s = self._h.shards[shard]
        self._pending.append((s, s.server.keep.remote(self.token, layer, lo, rows)))
        if len(self._pending) > IN_FLIGHT:
            self._wait(self._pending[:1], "did not keep hidden rows")
            self._pending = self._pending[1:]

    def reader(self, layer: int, width: int) -> HiddenRows:
        """Table ``layer`` once every rank wrote its part; table ``layer - 1`` is dropped from then on."""
        self._wait(self._pending, "did not keep hidden rows")
        self._pending = []
        self.barrier()  # every rank wrote table ``layer`` and read table ``layer - 1`` for the last time
        if layer > 0:
            self._drop(layer - 1)
        return HiddenRows(self._h, self.token, layer, width)

    def close(self, failed: bool = False) -> None:
        """Drop what is left of the tables: on every rank after its last read of them, or after a failure
        (then without waiting; the servers also drop them when the next evaluation starts)."""
        if failed and self._rank == 0:
            for s in self._h.shards:
                s.server.drop.remote(self.token, None)
        elif not failed:
            self._drop(None)

    def barrier(self) -> None:
        if self._world > 1:
            import torch
            import torch.distributed as dist

            dist.all_reduce(torch.zeros(1, device=self._device))  # works the same on gloo and NCCL

    def _drop(self, layer: Optional[int]) -> None:
        if self._rank == 0:  # one rank asks each server; the others went on to the next layer
            self._wait([(s, s.server.drop.remote(self.token, layer)) for s in self._h.shards],
                       "did not drop hidden rows")

    def _wait(self, calls: list, failing: str) -> None:
        wait_calls(calls, self._h.timeout_s, failing)
