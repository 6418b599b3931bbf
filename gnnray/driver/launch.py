"""What training and prediction share on the driver: load the graph and publish it once per node (Ray started by
:mod:`gnnray.driver.connect`)."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from gnnray import run_storage
from gnnray.config import JobConfig
from gnnray.data.feature_source import FeatureSource
from gnnray.data.graph import Graph
from gnnray.driver import preflight
from gnnray.driver.connect import init_ray
from gnnray.errors import ClusterError
from gnnray.heap import trim_heap
from gnnray.store.handle import GraphHandle

# gnnray.driver.console is imported where used, once Ray has started.

# How long an autoscaling cluster may take to add the nodes the feature shards need, and how often to look.
AUTOSCALE_WAIT_S = 900
AUTOSCALE_POLL_S = 10.0


@dataclass
class Published:
    """What the driver keeps of a published graph.

    Attributes:
        graph: The graph as read-only views on the store (the loading copy is
            freed); with ``--feature-shards K > 1`` its ``feat`` is a
            ``(num_nodes, 0)`` placeholder and the driver holds no feature rows.
        handle: Its handle (this process owns the objects: it must outlive
            every user); ``handle.features`` names the shards.
        local: Whether the cluster is a local one (fixed size).
        source: Where the shards' rows come from, to rebuild lost ones on any
            node: files, a generator, or the spill of a table that was read into
            memory (``features.spill``); never rows held by the driver.
    """

    graph: Graph
    handle: GraphHandle
    local: bool
    source: Optional[FeatureSource] = None


def _check_fanouts(cfg: JobConfig, graph) -> None:
    """A relation the graph lacks is refused here, not in every actor and worker. The sampler's kernels are
    compiled here too (or loaded from numba's cache), while Ray starts: the sampler actors on this node find them."""
    from gnnray.data.typed import fanout_table

    fanout_table(cfg.sampler.fanouts, graph)
    if cfg.sampler.eval_fanouts is not None:
        fanout_table(cfg.sampler.eval_fanouts, graph, "--eval-fanouts")
    if cfg.sampler.backend == "native":
        from gnnray.sampler.pick import warm_up

        warm_up(graph.indptr.dtype, graph.indices.dtype, None if graph.etype is None else graph.etype.dtype)


class _Thread(threading.Thread):
    """``fn(*args)`` on a daemon thread; :meth:`result` waits and returns it, or raises its exception here."""

    def __init__(self, fn: Callable, *args):
        super().__init__(name=fn.__name__, daemon=True)
        self._fn, self._args, self._out, self._error = fn, args, None, None
        self.start()

    def run(self) -> None:
        try:
            self._out = self._fn(*self._args)
        except BaseException as e:  # re-raised by result(), in the caller's thread
            self._error = e

    def result(self):
        self.join()
        if self._error is not None:
            raise self._error
        out, self._out = self._out, None  # the caller's reference is the only one: dropping it frees the result
        return out


def load_and_publish(cfg: JobConfig, model_check: Optional[Callable[[int, int], None]] = None,
                     overlap_ray: bool = False) -> Published:
    """Load the graph and connect to Ray, then :func:`publish_checked`, or place the feature shards.

    ``model_check(feat_dim, num_classes)`` runs after loading, before Ray starts (predict's model check).
    ``overlap_ray`` (training, :func:`gnnray.driver.fit.run`): the graph loads on a thread while Ray starts
    (in this, the main thread: Ray installs its signal handlers only there); a loading error is raised
    once Ray has started, a cluster error at once.
    Meanwhile a thread imports torch, which the driver needs next: loading and starting Ray (on a new
    local cluster, seconds of waiting for its processes) leave a core to spare.
    """
    _import_fork_hooks()
    _import_torch_meanwhile()
    run_storage.clean_leftovers(run_storage.run_dir(cfg.run.storage_path, cfg.run.name))  # of writes killed last time
    if overlap_ray:
        loading = _Thread(_load, cfg, model_check)
        local = init_ray(cfg)
        loaded = loading.result()
    else:
        loaded, local = _load(cfg, model_check), None
    if cfg.data.feature_shards == 1:
        published = Published(*publish_checked(cfg, loaded, local))
        del loaded
    else:
        # A table read into memory is written once, a file per shard, and dropped here (the only reference):
        # shards, and lost ones later, are made from those files on their nodes.
        graph, source = loaded
        del loaded
        source = _spill(cfg, graph, source)
        published = _publish_sharded(cfg, graph, source, local)
        del graph, source
    trim_heap()  # what glibc keeps of the freed loading copy goes back to the OS
    return published


def _load(cfg: JobConfig, model_check: Optional[Callable[[int, int], None]]):
    """The graph (``--feature-shards 1``), or the structure and its feature source, checked."""
    from gnnray.data.load import load_graph, load_structure

    if cfg.data.feature_shards == 1:
        graph = load_graph(cfg.data, cfg.run.seed)
        _check_fanouts(cfg, graph)
        if model_check:
            model_check(graph.feat_dim, graph.num_classes)
        if graph.feat.dtype != np.dtype(cfg.data.feature_dtype):
            graph = dataclasses.replace(graph, feat=graph.feat.astype(cfg.data.feature_dtype))
        return graph
    graph, source = load_structure(cfg.data, cfg.run.seed)
    _check_fanouts(cfg, graph)
    if model_check:
        model_check(source.dim, graph.num_classes)
    return graph, source


def _spill(cfg: JobConfig, graph: Graph, source: FeatureSource) -> FeatureSource:
    """``features.spill`` under the run's directory (``STORAGE_PATH/NAME/feature-spill``)."""
    from gnnray.data.feature_source import spill
    from gnnray.store.shards import shard_bounds

    run_dir = run_storage.run_dir(cfg.run.storage_path, cfg.run.name)
    return spill(source, shard_bounds(source.num_rows, cfg.data.feature_shards),
                 run_storage.join(run_dir, "feature-spill"), cfg.data.feature_dtype, graph.label)


def _import_torch() -> None:
    import torch  # noqa: F401


def _import_torch_meanwhile() -> None:
    """Import torch on a thread, which an exit waits for (not a daemon).

    A process that exits while a daemon thread is inside torch's import (a bad
    option or cluster found first) finalizes a half-imported torch, whose
    finalizers then raise on the console ("TypeError: 'NoneType' object is not
    callable" in ``torch/library.py``). Joining it from an ``atexit`` handler
    is too late: imports that register exit handlers then fail.
    """
    threading.Thread(target=_import_torch, name="import torch", daemon=False).start()


def _import_fork_hooks() -> None:
    """Import here, on the thread that starts Ray's processes, the modules whose fork hooks come in pairs.

    A hook pair registered by a thread's import while this thread forks runs
    its "after" half without its "before": concurrent.futures' lock released
    unlocked ("Exception ignored ... release unlocked lock" on the console of
    one of two runs started together), filelock's per-thread list popped empty.
    """
    import concurrent.futures.thread  # noqa: F401
    import logging  # noqa: F401

    import filelock  # noqa: F401


def _publish_sharded(cfg: JobConfig, graph: Graph, source: FeatureSource, local: Optional[bool] = None) -> Published:
    """Publish the structure once per node, then the feature table as ``--feature-shards`` shards (``shards.build``)."""
    from gnnray.store import shards
    from gnnray.store.handle import publish

    d = cfg.data
    table = source.num_rows * source.dim * np.dtype(d.feature_dtype).itemsize
    local = init_ray(cfg) if local is None else local  # None: Ray not started yet
    from gnnray.driver import console  # after Ray started (see above)

    console.say(console.graph_line(graph, source.dim, table))
    shard_bytes = shards.shard_nbytes(source.num_rows, source.dim, d.feature_dtype, d.feature_shards)
    cache_bytes = shards.cache_nbytes(source.num_rows, source.dim, d.feature_dtype, d.feature_cache)
    nodes = _shard_nodes(cfg, local, graph.nbytes, shard_bytes, cache_bytes)
    handle = publish(graph)
    features = shards.build(source, handle._ref, graph.indptr, nodes, d.feature_dtype, d.feature_cache,
                            d.feature_timeout, preflight.nodes, graph.nbytes)
    console.say(f"features: {d.feature_shards} shards of {shard_bytes / 2**20:.1f} MiB on "
                + ", ".join(s.address for s in features.shards)
                + f"; cache {d.feature_cache:.0%} of nodes ({cache_bytes / 2**20:.1f} MiB on every node)")
    handle = dataclasses.replace(handle, features=features, feat_dim=source.dim)
    return Published(handle.get(), handle, local, source)


def _shard_nodes(cfg: JobConfig, local: bool, structure_bytes: int, shard_bytes: int, cache_bytes: int) -> list:
    """The nodes to hold the shards; on an autoscaling cluster, wait (saying so) until there are enough."""
    import ray

    from gnnray.driver import console
    from gnnray.store import shards

    driver_node = ray.get_runtime_context().get_node_id()
    deadline, said = time.monotonic() + AUTOSCALE_WAIT_S, False
    while True:
        try:
            return shards.choose_nodes(cfg.data.feature_shards, structure_bytes, shard_bytes, cache_bytes,
                                       preflight.nodes(), driver_node)
        except ClusterError as e:
            if local or not preflight.autoscaling() or time.monotonic() > deadline:
                raise
            if not said:
                console.say(f"waiting up to {AUTOSCALE_WAIT_S / 60:.0f} min for the autoscaler to add nodes: {e}")
                said = True
            time.sleep(AUTOSCALE_POLL_S)


def rebuild_lost_shards(pub: Published) -> Published:
    """After a failed attempt: make the shards whose node or server was lost again, on alive nodes."""
    from gnnray.driver import console
    from gnnray.store import shards

    if pub.handle.features is None:
        return pub
    features = shards.repair(pub.handle.features, pub.source, pub.handle._ref, preflight.nodes(), pub.graph.nbytes)
    if features is pub.handle.features:
        return pub
    console.say("features: rebuilt lost shards on " + ", ".join(s.address for s in features.shards))
    return dataclasses.replace(pub, handle=dataclasses.replace(pub.handle, features=features))


def publish_checked(cfg: JobConfig, graph: Graph, local: Optional[bool] = None) -> tuple[Graph, GraphHandle, bool]:
    """Connect to Ray (``local=None``: not started yet) and put ``graph`` into the object store once, if every
    node's store can hold it.

    Returns:
        The graph as read-only views on the store (the loading copy is freed
        once the caller drops its reference), its handle (this process owns
        the object: it must outlive every user), and whether the cluster is local.
    """
    from gnnray.store.handle import publish

    local = init_ray(cfg) if local is None else local
    from gnnray.driver import console  # after Ray started (see load_and_publish)

    console.say(console.graph_line(graph))
    preflight.check_object_store(graph.nbytes, preflight.nodes())
    handle = publish(graph)
    return handle.get(), handle, local
