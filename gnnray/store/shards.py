"""``--feature-shards K`` (driver places, shard nodes serve): the feature table split over K nodes.

Shard ``k`` holds the rows of node ids ``[lo_k, hi_k)`` (contiguous ranges: the
owner of a row is one ``searchsorted``; no partitioning step). For each shard
the driver runs one task pinned to the shard's node (``NodeAffinitySchedulingStrategy``,
not soft) that produces the rows there from a
:class:`~gnnray.data.feature_source.FeatureSource` and returns them: the array is
stored in that node's object store and owned by the driver, so it outlives the
processes that read it and Ray never moves it. Nothing ``ray.get`` s a shard
from another node (that would pull the whole shard): a :class:`ShardServer`
actor on the shard's node reads it zero-copy and answers one gather call per
(mini-batch, shard) with just the rows asked for.

The cache: the ``--feature-cache`` share of nodes with the highest in-degree
(the ones neighbor sampling reaches most), their rows gathered once from the
servers by a task on the driver's node (its result stays in that node's
store; the driver process never holds the rows); each node pulls one copy the
first time a process there reads it.

Lost shards (:func:`repair`, after a failed attempt) are made again from the
same source, each on its own alive node that still has room for it.

What readers do with this handle is :mod:`gnnray.train.feature_reader`; how they wait for the servers'
answers, :mod:`gnnray.store.calls`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy as np

from gnnray.data.feature_source import FeatureSource, check_finite
from gnnray.errors import ClusterError, FeatureShardError, size_text
from gnnray.stack import check_node
from gnnray.store.calls import GATHER, wait_calls
from gnnray.store.hidden_server import HiddenRowsHeld

# Share of a node's object store the graph may take (as preflight.GRAPH_STORE_FRACTION): the rest holds
# mini-batches in flight and the rows being fetched.
STORE_FRACTION = 0.9


@dataclass(frozen=True)
class Shard:
    """One shard: rows ``[lo, hi)`` on one node.

    Attributes:
        lo, hi: Its node-id range.
        node_id: The node that holds it (hex id).
        address: That node's IP, for messages.
        ref: ``[ObjectRef]`` of its ``(hi - lo, dim)`` rows; in a list so that
            passing the handle never resolves it.
        server: The :class:`ShardServer` actor on that node.
        made: ``[ObjectRef]`` of the shard task's row count: raises its error, if any.
    """

    lo: int
    hi: int
    node_id: str
    address: str
    ref: list
    server: object
    made: list

    def where(self) -> str:
        return f"node {self.address} ({self.node_id[:8]})"


@dataclass(frozen=True)
class ShardedFeatures:
    """The picklable handle of a sharded feature table (``GraphHandle.features``).

    Attributes:
        shards: The shards, in row order.
        num_rows, dim: The table's shape.
        dtype: Its storage type (``float32`` or ``float16``).
        cache: ``[ObjectRef]`` of ``{"slot": int32 (num_rows,) cache row of
            each node or -1, "rows": (cached, dim)}``, or ``None`` without a cache.
        timeout_s: Seconds a remote gather may take.
    """

    shards: tuple
    num_rows: int
    dim: int
    dtype: str
    cache: Optional[list]
    timeout_s: float
    cache_bytes: int = 0

    @property
    def shard_bytes(self) -> int:
        return shard_nbytes(self.num_rows, self.dim, self.dtype, len(self.shards))


class ShardServer(HiddenRowsHeld):
    """Serves one shard's rows on its node: one :meth:`gather` call per (mini-batch, shard).

    It also holds its range's rows of layer-wise inference's hidden tables (:class:`HiddenRowsHeld`).
    """

    def __init__(self, ref: list):
        import ray

        check_node("a shard server")
        super().__init__()
        self._rows = ray.get(ref[0])  # local: a zero-copy view on this node's store

    def gather(self, local_ids: np.ndarray) -> np.ndarray:
        # Gathered here so that only the rows asked for cross the network, once, in the stored dtype.
        return np.take(self._rows, local_ids, axis=0)

    def ping(self) -> bool:
        return True


def _make_shard(source: FeatureSource, lo: int, hi: int, structure: list, dtype: str) -> tuple[np.ndarray, int]:
    """Task run on the shard's node: its rows, produced there (read, generated or received), and their count.

    Two returns: the driver checks the small second one (it raises the task's
    error, e.g. a :class:`DatasetError`) without pulling the rows.
    """
    import ray

    label = ray.get(structure[0])["label"] if hasattr(source, "centroids") else None
    rows = np.ascontiguousarray(source.rows(lo, hi, label), dtype=dtype)
    check_finite(rows, source.where, lo)
    return rows, rows.shape[0]


def shard_bounds(num_rows: int, k: int) -> np.ndarray:
    """Row ranges of ``k`` shards: ``bounds[i]:bounds[i + 1]``, sizes differing by one row at most."""
    return np.linspace(0, num_rows, k + 1).round().astype(np.int64)


def cache_ids(indptr: np.ndarray, fraction: float) -> np.ndarray:
    """The ``fraction`` of node ids with the highest in-degree, sorted (ties: lower id first)."""
    n = indptr.shape[0] - 1
    count = int(round(fraction * n))
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    degree = np.diff(indptr)
    return np.sort(np.argsort(-degree, kind="stable")[:count]).astype(np.int64)


def choose_nodes(k: int, structure_bytes: int, shard_bytes: int, cache_bytes: int, cluster: list,
                 driver_node: str, held: Optional[dict] = None) -> list:
    """``k`` distinct nodes to get one more shard each: those whose store fits the structure, the cache, the
    shards they hold already (``held``: bytes by node id; given when repairing) and one more shard.

    Nodes holding no shard first, then GPU nodes (the train workers run there), the driver's node last.

    Raises:
        ClusterError: Fewer than ``k`` nodes fit (saying how many more nodes of what store size are
            missing), or a node cannot hold even the structure and cache.
    """
    for n in cluster:
        if structure_bytes + cache_bytes > STORE_FRACTION * n.object_store_bytes:
            raise ClusterError(
                f"node {n.address} ({n.node_id[:8]}) has an object store of {size_text(n.object_store_bytes)}; "
                f"the graph structure ({size_text(structure_bytes)}) and the feature cache "
                f"({size_text(cache_bytes)}) must fit in {STORE_FRACTION:.0%} of it on every node. Lower "
                f"--feature-cache, or give every node a larger store (`ray start --object-store-memory BYTES`)")
    has = held or {}
    need = structure_bytes + shard_bytes + cache_bytes
    fits = [n for n in cluster if need + has.get(n.node_id, 0) <= STORE_FRACTION * n.object_store_bytes]
    # The driver's node last: it holds the primary copies of the structure and the cache already.
    fits.sort(key=lambda n: (has.get(n.node_id, 0), n.node_id == driver_node, -n.gpus, -n.object_store_bytes,
                             n.node_id))
    if len(fits) < k:
        missing = (f"missing: {k - len(fits)} more node(s) with an object store of at least "
                   f"{size_text(need / STORE_FRACTION)}")
        if held is not None:
            raise ClusterError(
                f"cannot rebuild {k} lost feature shard(s): each needs its own alive node with room for the "
                f"structure ({size_text(structure_bytes)}) + cache ({size_text(cache_bytes)}) + the shards it "
                f"holds already + one shard of {size_text(shard_bytes)} (at most {STORE_FRACTION:.0%} of its "
                f"store), and {len(fits)} of the {len(cluster)} alive nodes have it; {missing}. Add nodes and run "
                f"again with the same --name (it resumes)")
        raise ClusterError(
            f"--feature-shards {k}: each shard node needs {size_text(need)} of object store (structure "
            f"{size_text(structure_bytes)} + shard {size_text(shard_bytes)} + cache {size_text(cache_bytes)}, "
            f"at most {STORE_FRACTION:.0%} of its store) and {len(fits)} of the cluster's {len(cluster)} nodes "
            f"can hold that ({missing}); add nodes, raise --feature-shards (smaller shards) or lower "
            f"--feature-cache")
    return fits[:k]


def build(source: FeatureSource, structure_ref: list, indptr: np.ndarray, nodes: list, dtype: str,
          cache_fraction: float, timeout_s: float, alive: Callable[[], list], structure_bytes: int) -> ShardedFeatures:
    """Create one shard per node of ``nodes`` (in row order), its server, and the cache (call on the driver).

    ``alive()`` lists the cluster's alive nodes, to place a shard elsewhere if its node is lost meanwhile.
    """
    bounds = shard_bounds(source.num_rows, len(nodes))
    shards = tuple(_create(source, int(bounds[i]), int(bounds[i + 1]), node, structure_ref, dtype)
                   for i, node in enumerate(nodes))
    handle = ShardedFeatures(shards, source.num_rows, source.dim, dtype, None, timeout_s,
                             cache_nbytes(source.num_rows, source.dim, dtype, cache_fraction))
    try:
        _wait_ready(handle)
    except FeatureShardError:  # a node lost meanwhile (it may still be listed alive): once more, elsewhere
        handle = repair(handle, source, structure_ref, alive(), structure_bytes)
    return replace(handle, cache=_build_cache(handle, indptr, cache_fraction))


def repair(handle: ShardedFeatures, source: FeatureSource, structure_ref: list, cluster: list,
           structure_bytes: int) -> ShardedFeatures:
    """Rebuild the shards whose node or server was lost (after a failed attempt, on the driver).

    Each lost shard goes to its own alive node that still fits it beside what it holds
    (:func:`choose_nodes`); if there are not enough, :class:`ClusterError` says what is missing.
    """
    import ray

    lost = _lost(handle, {n.node_id for n in cluster})
    if not lost:
        return handle
    held: dict = {}
    for i, s in enumerate(handle.shards):
        if i not in lost:
            held[s.node_id] = held.get(s.node_id, 0) + handle.shard_bytes
    gone = {handle.shards[i].node_id for i in lost}
    usable = [n for n in cluster if n.node_id not in gone]
    nodes = choose_nodes(len(lost), structure_bytes, handle.shard_bytes, handle.cache_bytes, usable,
                         ray.get_runtime_context().get_node_id(), held)
    shards = list(handle.shards)
    for i, node in zip(lost, nodes):
        shards[i] = _create(source, handle.shards[i].lo, handle.shards[i].hi, node, structure_ref, handle.dtype)
    handle = replace(handle, shards=tuple(shards))
    _wait_ready(handle)
    return handle


def _lost(handle: ShardedFeatures, alive: set) -> list:
    """Indices of the shards whose node is not in ``alive`` or whose server does not answer a ping."""
    import ray

    lost = [i for i, s in enumerate(handle.shards) if s.node_id not in alive]
    pings = {handle.shards[i].server.ping.remote(): i for i in range(len(handle.shards)) if i not in lost}
    done, _ = ray.wait(list(pings), num_returns=len(pings), timeout=handle.timeout_s) if pings else ([], [])
    for ref, i in pings.items():
        try:
            if ref not in done:
                raise TimeoutError
            ray.get(ref)
        except Exception:  # any failure of the ping: the shard is rebuilt
            lost.append(i)
    return sorted(lost)


def _create(source: FeatureSource, lo: int, hi: int, node, structure_ref: list, dtype: str) -> Shard:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    pin = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
    # num_cpus=0: shards are made while workers may hold every CPU (a restart), and must not wait for them.
    part = source.part(lo, hi)
    part.where = source.where  # errors found on the node name the file the rows came from
    ref, made = ray.remote(_make_shard).options(scheduling_strategy=pin, num_cpus=0, max_retries=0,
                                                num_returns=2).remote(part, lo, hi, structure_ref, dtype)
    server = ray.remote(ShardServer).options(scheduling_strategy=pin, num_cpus=0, max_concurrency=8,
                                             max_restarts=0).remote([ref])
    return Shard(lo, hi, node.node_id, node.address, [ref], server, [made])


def _wait_ready(handle: ShardedFeatures) -> None:
    """Wait until every shard is made and served; a data error inside a shard task is raised as itself."""
    wait = max(600.0, handle.timeout_s)  # a shard may be read from disk: minutes, not seconds
    # Not cancelled on a failure: the other shards are fine, and a repair keeps them.
    wait_calls([(s, s.made[0]) for s in handle.shards], wait, "could not be made", cancel=False)
    wait_calls([(s, s.server.ping.remote()) for s in handle.shards], wait, "could not be served", cancel=False)


def route(starts: np.ndarray, ids: np.ndarray, skip: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
    """Positions of ``ids`` grouped by shard: ``order[at[k]:at[k + 1]]`` are those in shard ``k`` (``starts``:
    each shard's first row), and ``order[at[-1]:]`` those masked by ``skip`` (e.g. cached rows).

    One stable sort of the owners, a linear radix sort for small integers: the cost does not grow with K.
    """
    owner = (np.searchsorted(starts, ids, side="right") - 1).astype(np.int16 if len(starts) < 2**15 else np.int64)
    if skip is not None:
        owner[skip] = len(starts)
    order = np.argsort(owner, kind="stable")
    return order, np.searchsorted(owner[order], np.arange(len(starts) + 1))


def _build_cache(handle: ShardedFeatures, indptr: np.ndarray, fraction: float) -> Optional[list]:
    """The cache object, gathered from the servers by a task on the driver's node: it lives in that node's
    store (as durable as the structure) and the driver process never holds its rows."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ids = cache_ids(indptr, fraction)
    if ids.size == 0 or handle.dim == 0:
        return None
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    ref, count = ray.remote(_gather_cache).options(scheduling_strategy=here, num_cpus=0, max_retries=0,
                                                   num_returns=2).remote(handle, ids)
    # The small second return raises the task's error (naming the shard that failed it) without the rows.
    wait_calls([(handle.shards[0], count)], max(600.0, handle.timeout_s), "could not fill the cache")
    return [ref]


def _gather_cache(handle: ShardedFeatures, ids: np.ndarray) -> tuple[dict, int]:
    rows = np.empty((ids.size, handle.dim), dtype=handle.dtype)
    order, at = route(np.array([s.lo for s in handle.shards]), ids)
    parts = [order[at[k]:at[k + 1]] for k in range(len(handle.shards))]
    calls = [(s, s.server.gather.remote(ids[p] - s.lo)) for s, p in zip(handle.shards, parts)]

    def put(k, got):
        rows[parts[k]] = got

    wait_calls(calls, max(600.0, handle.timeout_s), GATHER, put)
    slot = np.full(handle.num_rows, -1, dtype=np.int32)
    slot[ids] = np.arange(ids.size, dtype=np.int32)
    return {"slot": slot, "rows": rows}, ids.size


def shard_nbytes(num_rows: int, dim: int, dtype: str, k: int) -> int:
    """Bytes of the largest of ``k`` shards (:func:`shard_bounds`)."""
    return int(np.diff(shard_bounds(num_rows, k)).max()) * dim * np.dtype(dtype).itemsize


def hidden_nbytes(num_rows: int, widths: list, k: int) -> int:
    """Most bytes of layer-wise inference's hidden tables (float32, ``widths`` in layer order) one of ``k``
    shard servers holds at once: its range's rows of the table a layer reads and of the one it writes."""
    held = [widths[0]] + [a + b for a, b in zip(widths, widths[1:])] if widths else [0]
    return int(np.diff(shard_bounds(num_rows, k)).max()) * max(held) * 4


def node_nbytes(features: ShardedFeatures, widths: list) -> dict:
    """``{node id: (shard bytes, hidden bytes)}``: the feature rows of the shards each node holds and its ranges'
    rows of layer-wise inference's hidden tables at most (:func:`hidden_nbytes`), summed over its shards: a
    :func:`repair` may place a lost shard beside another."""
    held = [widths[0]] + [a + b for a, b in zip(widths, widths[1:])] if widths else [0]
    per: dict = {}
    for s in features.shards:
        rows = s.hi - s.lo
        f, h = per.get(s.node_id, (0, 0))
        per[s.node_id] = (f + rows * features.dim * np.dtype(features.dtype).itemsize, h + rows * max(held) * 4)
    return per


def cache_nbytes(num_rows: int, dim: int, dtype: str, fraction: float) -> int:
    """Bytes of the cache object: its rows plus the int32 slot of every node."""
    return int(round(fraction * num_rows)) * dim * np.dtype(dtype).itemsize + 4 * num_rows if fraction > 0 else 0
