"""``--feature-shards K`` (driver places, shard nodes serve): the feature table split over K nodes.

Shard ``k`` holds the rows of node ids ``[lo_k, hi_k)`` (contiguous ranges: the
owner of a row is one ``searchsorted``; no partitioning step). For each shard
the driver runs one task pinned to the shard's node (``NodeAffinitySchedulingStrategy``,
not soft) that produces the rows there from a
:class:`~gnnray.data.features.FeatureSource` and returns them: the array is
stored in that node's object store and owned by the driver, so it outlives the
processes that read it and Ray never moves it. Nothing ``ray.get`` s a shard
from another node (that would pull the whole shard): a :class:`ShardServer`
actor on the shard's node reads it zero-copy and answers one gather call per
(mini-batch, shard) with just the rows asked for.

The cache: the ``--feature-cache`` share of nodes with the highest in-degree
(the ones neighbor sampling reaches most), their rows gathered once from the
servers and put into the object store; each node pulls one copy the first
time a process there reads it.

What readers do with this handle is :mod:`gnnray.pipeline.features`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy as np

from gnnray.data.features import FeatureSource, check_finite
from gnnray.errors import ClusterError, DatasetError, FeatureShardError, last_line, size_text

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


class ShardServer:
    """Serves one shard's rows on its node: one :meth:`gather` call per (mini-batch, shard)."""

    def __init__(self, ref: list):
        import ray

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
                 driver_node: str) -> list:
    """The ``k`` nodes to hold shards: those whose store fits structure, shard and cache; GPU nodes first.

    Raises:
        ClusterError: Fewer than ``k`` nodes fit, or a node cannot hold even the structure and cache.
    """
    need = structure_bytes + shard_bytes + cache_bytes
    for n in cluster:
        if structure_bytes + cache_bytes > STORE_FRACTION * n.object_store_bytes:
            raise ClusterError(
                f"node {n.address} ({n.node_id[:8]}) has an object store of {size_text(n.object_store_bytes)}; "
                f"the graph structure ({size_text(structure_bytes)}) and the feature cache "
                f"({size_text(cache_bytes)}) must fit in {STORE_FRACTION:.0%} of it on every node. Lower "
                f"--feature-cache, or give every node a larger store (`ray start --object-store-memory BYTES`)")
    fits = [n for n in cluster if need <= STORE_FRACTION * n.object_store_bytes]
    # GPU nodes first (the train workers run there: their reads of a local shard stay on the node), the
    # driver's node last (it holds the primary copies of the structure and the cache already).
    fits.sort(key=lambda n: (n.node_id == driver_node, -n.gpus, -n.object_store_bytes, n.node_id))
    if len(fits) < k:
        raise ClusterError(
            f"--feature-shards {k}: each shard node needs {size_text(need)} of object store (structure "
            f"{size_text(structure_bytes)} + shard {size_text(shard_bytes)} + cache {size_text(cache_bytes)}, "
            f"at most {STORE_FRACTION:.0%} of its store) and {len(fits)} of the cluster's {len(cluster)} nodes "
            f"can hold that; add nodes, raise --feature-shards (smaller shards) or lower --feature-cache")
    return fits[:k]


def build(source: FeatureSource, structure_ref: list, indptr: np.ndarray, nodes: list, dtype: str,
          cache_fraction: float, timeout_s: float, alive: Callable[[], list], structure_bytes: int) -> ShardedFeatures:
    """Create one shard per node of ``nodes`` (in row order), its server, and the cache (call on the driver).

    ``alive()`` lists the cluster's alive nodes, to place a shard elsewhere if its node is lost meanwhile.
    """
    bounds = shard_bounds(source.num_rows, len(nodes))
    shards = tuple(_create(source, int(bounds[i]), int(bounds[i + 1]), node, structure_ref, dtype)
                   for i, node in enumerate(nodes))
    handle = ShardedFeatures(shards, source.num_rows, source.dim, dtype, None, timeout_s)
    try:
        _wait_ready(handle)
    except FeatureShardError:  # a node lost meanwhile (it may still be listed alive): once more, elsewhere
        handle = repair(handle, source, structure_ref, alive(), structure_bytes)
    cache = _build_cache(handle, indptr, cache_fraction)
    return replace(handle, cache=cache, cache_bytes=cache_nbytes(source.num_rows, source.dim, dtype, cache_fraction))


def repair(handle: ShardedFeatures, source: FeatureSource, structure_ref: list, cluster: list,
           structure_bytes: int) -> ShardedFeatures:
    """Rebuild the shards whose node or server was lost on other nodes (after a failed attempt, on the driver)."""
    import ray

    alive = {n.node_id for n in cluster}
    lost = []
    for i, s in enumerate(handle.shards):
        ok = s.node_id in alive
        if ok:
            try:
                ray.get(s.server.ping.remote(), timeout=handle.timeout_s)
            except Exception:
                ok = False
        if not ok:
            lost.append(i)
    if not lost:
        return handle
    holding = {s.node_id for i, s in enumerate(handle.shards) if i not in lost}
    gone = {handle.shards[i].node_id for i in lost}
    usable = [n for n in cluster if n.node_id not in gone]
    candidates = choose_nodes(1, structure_bytes, handle.shard_bytes, handle.cache_bytes,
                              [n for n in usable if n.node_id not in holding] or usable, "")
    shards = list(handle.shards)
    for j, i in enumerate(lost):
        node = candidates[j % len(candidates)]
        shards[i] = _create(source, handle.shards[i].lo, handle.shards[i].hi, node, structure_ref, handle.dtype)
    handle = replace(handle, shards=tuple(shards))
    _wait_ready(handle)
    return handle


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
    import ray
    import ray.exceptions

    wait = max(600.0, handle.timeout_s)  # a shard may be read from disk: minutes, not seconds
    for s in handle.shards:
        try:
            ray.get(s.made[0], timeout=wait)
            ray.get(s.server.ping.remote(), timeout=wait)
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, DatasetError):
                raise exc.cause from None
            raise FeatureShardError(f"feature shard {s.lo}:{s.hi} could not be made on {s.where()}: "
                                    f"{last_line(exc)}") from None
        except ray.exceptions.GetTimeoutError:
            raise FeatureShardError(f"feature shard {s.lo}:{s.hi} was not ready on {s.where()} after "
                                    f"{wait:.0f}s") from None
        except ray.exceptions.RayError as exc:  # its node or server lost
            raise FeatureShardError(f"feature shard {s.lo}:{s.hi} could not be served on {s.where()}: "
                                    f"{last_line(exc)}") from None


def _build_cache(handle: ShardedFeatures, indptr: np.ndarray, fraction: float) -> Optional[list]:
    import ray

    ids = cache_ids(indptr, fraction)
    if ids.size == 0 or handle.dim == 0:
        return None
    rows = np.empty((ids.size, handle.dim), dtype=handle.dtype)
    starts = np.array([s.lo for s in handle.shards])
    owner = np.searchsorted(starts, ids, side="right") - 1
    calls = [(owner == k, s.server.gather.remote(ids[owner == k] - s.lo)) for k, s in enumerate(handle.shards)]
    for mask, call in calls:
        rows[mask] = ray.get(call, timeout=max(600.0, handle.timeout_s))
    slot = np.full(handle.num_rows, -1, dtype=np.int32)
    slot[ids] = np.arange(ids.size, dtype=np.int32)
    return [ray.put({"slot": slot, "rows": rows})]


def shard_nbytes(num_rows: int, dim: int, dtype: str, k: int) -> int:
    """Bytes of the largest of ``k`` shards (:func:`shard_bounds`)."""
    return int(np.diff(shard_bounds(num_rows, k)).max()) * dim * np.dtype(dtype).itemsize


def cache_nbytes(num_rows: int, dim: int, dtype: str, fraction: float) -> int:
    """Bytes of the cache object: its rows plus the int32 slot of every node."""
    return int(round(fraction * num_rows)) * dim * np.dtype(dtype).itemsize + 4 * num_rows if fraction > 0 else 0
