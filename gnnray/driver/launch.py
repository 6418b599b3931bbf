"""What training and prediction share on the driver: connect to Ray, load the graph, publish it once per node."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import socket
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from gnnray import cpus, stack, storage
from gnnray.config import JobConfig
from gnnray.data.features import FeatureSource
from gnnray.data.graph import Graph
from gnnray.data.store import GraphHandle
from gnnray.driver import preflight
from gnnray.errors import ClusterError

# gnnray.driver.console is imported where used, once Ray has started: it imports torch (through
# gnnray.train.report), which a thread imports meanwhile (load_and_publish).

# How long an autoscaling cluster may take to add the nodes the feature shards need, and how often to look.
AUTOSCALE_WAIT_S = 900
AUTOSCALE_POLL_S = 10.0
_RAY_DEPRECATION = "`ExecutionOptions.exclude_resources` is deprecated"


def init_ray(cfg: JobConfig) -> bool:
    """Connect to ``RAY_ADDRESS`` or start a local cluster, check its versions; return whether it is local (fixed
    size).

    Says which cluster and dashboard the run uses. Ray's own INFO logs stay in its session logs unless
    ``--verbose`` (:func:`gnnray.driver.console.quiet_ray`).

    Raises:
        ClusterError: Nothing answers at ``RAY_ADDRESS``, the driver lacks a pinned version, or a node's stack
            differs from the driver's (:func:`gnnray.driver.preflight.check_versions`).
    """
    import ray

    from gnnray.logs import drop_records

    expected = preflight.check_driver(cfg.sampler.backend)  # before Ray starts: a missing pin fails at once
    # Ray Train's controller takes one report per worker per poll (2 s by default), and a worker's report waits
    # for the previous one to be taken: short epochs would each last a poll (docs/performance.md#time-between-epochs).
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.05")
    # Raised by Ray Train's own use of ExecutionOptions (in this process and in its controller), not by
    # anything a user can change: hidden here and in the processes of a local cluster, which inherit it.
    warnings.filterwarnings("ignore", message=_RAY_DEPRECATION)
    if not cfg.run.verbose:  # Ray's notice that a new local cluster uses its default, token authentication
        drop_records("ray._private.authentication.authentication_token_setup", "Token authentication is enabled")
    local, started = False, None
    if ray.is_initialized() and os.environ.get("RAY_ADDRESS") == _own_address[0] and cfg.train.cpu_plan == "on":  # another run on this process's
        register_run()  # local cluster (the Python API): registered again, under the name its processes carry
    if not ray.is_initialized():
        if _own_address[0] and os.environ.get("RAY_ADDRESS") == _own_address[0]:  # this process's last local
            del os.environ["RAY_ADDRESS"]  # cluster, shut down since
        options = dict(logging_config=ray.LoggingConfig(log_level="INFO" if cfg.run.verbose else "WARNING"),
                       log_to_driver=True)
        # Read by OpenMP when a process loads it: set for every process of the job.
        job_env = dict(cpus.JOB_ENV) if cfg.train.cpu_plan == "on" else {}
        job_env[stack.DRIVER_ENV] = json.dumps(expected)  # what every process of the run checks its node against
        if os.environ.get("RAY_ADDRESS"):
            started = _connect(options, job_env)
        else:
            local, started = True, _start_local(cfg, options, job_env)
    import ray.data

    from gnnray.driver import console

    console.quiet_ray(cfg.run.verbose)
    ray.data.DataContext.get_current().enable_progress_bars = cfg.run.verbose and sys.stdout.isatty()
    cluster = preflight.nodes()
    checked = preflight.check_versions(cluster, expected)
    dashboard = track_train_state()
    if started is not None:
        console.say(console.cluster_line(local, started.address_info["gcs_address"], dashboard,
                                         len(cluster), checked, expected))
    return local


# Whether this process set RAY_TRAIN_ENABLE_STATE_TRACKING (then a later cluster decides it again).
_own_tracking: list = [False]
TRACKING = "RAY_TRAIN_ENABLE_STATE_TRACKING"


def track_train_state() -> str:
    """Turn on Ray Train's state tracking (the dashboard's Train view) only where the dashboard answers, and
    return its address ("" where none does).

    The state API is served by the dashboard: without it, tracking fails in
    Ray Train's state actor with a traceback. A value the user set is kept.
    """
    import ray

    url = ray._private.worker.get_dashboard_url() or ""
    answers = bool(url) and _answers(url)
    if TRACKING not in os.environ or _own_tracking[0]:
        _own_tracking[0] = True
        if answers:
            os.environ[TRACKING] = "1"
        else:
            os.environ.pop(TRACKING, None)
    return url if answers else ""


def _answers(url: str) -> bool:
    """Whether the dashboard at ``url`` (host:port) answers an HTTP request within 2 s."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{url}/api/version", timeout=2):
            return True
    except urllib.error.HTTPError:  # it answered, with an error: it is up
        return True
    except (OSError, ValueError):
        return False


# The RAY_ADDRESS this process set for its local cluster (see _start_local).
_own_address: list = [None]


def _connect(options: dict, job_env: dict):
    """``ray.init`` on the cluster at ``RAY_ADDRESS``; :class:`ClusterError` at once if nothing listens there."""
    import ray

    address = os.environ["RAY_ADDRESS"]
    preflight.check_address(address)
    check_token(address)
    # The job's processes are the cluster's: the warning hidden here (init_ray) is hidden there through the
    # job's runtime env.
    env = {**job_env, "PYTHONWARNINGS": _ignore_deprecation()}
    try:
        return ray.init(**options, runtime_env={"env_vars": env})
    except ConnectionError as e:
        raise ClusterError(
            f"cannot connect to the Ray cluster at RAY_ADDRESS={address} ({e}). Check that "
            f"it is up (ray status). {_TOKEN_HELP}") from None


# What works with a cluster that `ray start` began with its default, token authentication.
_TOKEN_HELP = ("On a node of the cluster use RAY_ADDRESS=auto (Ray then reads ~/.ray/auth_token); elsewhere set "
               "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the token in the head's ~/.ray/auth_token (or "
               "RAY_AUTH_TOKEN_PATH to a file holding it), or submit the job with `ray job submit`")


def check_token(address: str, timeout_s: float = preflight.CONNECT_TIMEOUT_S) -> None:
    """Raise :class:`ClusterError` if the cluster at ``RAY_ADDRESS`` (``host:port``) refuses this process's auth
    token, or its lack of one; other failures are left to ``ray.init``.

    One call to the cluster's GCS with what Ray would send (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``): Ray's own client retries a refused token once a second
    for 20 s, a log line each time, before it fails.
    """
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit() or os.environ.get("RAY_USE_TLS", "0") not in ("", "0"):
        return
    import grpc
    from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, get_authentication_mode
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    from ray.exceptions import AuthenticationError

    metadata: tuple = ()
    if get_authentication_mode() == AuthenticationMode.TOKEN:
        loader = AuthenticationTokenLoader.instance()
        try:
            found = loader.has_token()
        except AuthenticationError:  # how Ray 2.60 says there is none
            found = False
        if not found:
            raise ClusterError(f"RAY_AUTH_MODE=token, but no auth token to join RAY_ADDRESS={address} with. "
                               f"{_TOKEN_HELP}")
        metadata = tuple(loader.get_token_for_http_header().items())
    with grpc.insecure_channel(address) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAUTHENTICATED:
                return  # not the token's fault: ray.init says what is
            what = "refuses the auth token this process sent" if metadata else "requires an auth token"
            raise ClusterError(f"the Ray cluster at RAY_ADDRESS={address} {what} (token authentication). "
                               f"{_TOKEN_HELP}") from None


def _start_local(cfg: JobConfig, options: dict, job_env: dict):
    """Start a new local cluster (even if another runs on this machine: joining one is what RAY_ADDRESS is for).

    Its GCS port is chosen first and ``RAY_ADDRESS`` names it before its processes start: they inherit it,
    so whatever finds "the" cluster by itself (Ray Train's controller, state actor and placement-group
    cleaner use the state API, which would take the newest Ray instance on the machine) finds this one.
    """
    import ray

    # Logical CPUs for every worker and sampler actor plus one for Ray Data's own tasks, no more: they are
    # what the job asks Ray for, not cores (the CPU plan decides those), and runs started beside this one on
    # the host claim theirs too. On a small machine they then share cores rather than wait forever.
    need = cfg.train.workers_max * cfg.train.cpus_per_worker + cfg.sampler.actors_max * cfg.sampler.cpus_per_actor + 1
    # Registered before the cluster starts: its workers plan for this run's share of the host's cores, and
    # runs started at the same time see each other (gnnray.leases).
    if cfg.train.cpu_plan == "on":
        register_run()  # in $GNNRAY_HOST_RUN, which the cluster's processes inherit
    os.environ["PYTHONWARNINGS"] = _ignore_deprecation()
    port = _free_port()
    os.environ["RAY_ADDRESS"] = _own_address[0] = f"{ray.util.get_node_ip_address()}:{port}"
    # A local cluster's processes inherit the job's environment from this one; a job runtime env
    # instead would keep every actor off the idle workers Ray starts with the cluster (they have none).
    with _environ({**job_env, "RAY_GCS_SERVER_PORT": str(port)}):
        started = ray.init(address="local", num_cpus=math.ceil(need), **options)
    os.environ["RAY_ADDRESS"] = _own_address[0] = started.address_info["gcs_address"]
    return started


def register_run() -> None:
    """Register this run on the host (:func:`gnnray.leases.register_run`), or say why it plans alone."""
    from gnnray import leases
    from gnnray.driver import console

    try:
        leases.register_run()
    except OSError as e:
        console.say(f"warning: {e}; this run plans for the whole host, as if alone on it")


def _ignore_deprecation() -> str:
    """``PYTHONWARNINGS`` with Ray Train's deprecation warning (see init_ray) ignored too."""
    return ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), f"ignore:{_RAY_DEPRECATION}"]))


def _free_port() -> int:
    """A TCP port free now (the kernel's choice, so concurrent runs get different ones)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environ(values: dict):
    """``os.environ`` with ``values`` set, restored afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def resolve_gpu(cfg: JobConfig, local: bool) -> bool:
    """Whether to train on GPUs; raises :class:`ClusterError` if a fixed-size cluster can never run the job."""
    from gnnray.driver import console

    nodes = preflight.nodes()
    use_gpu = bool(cfg.train.use_gpu if cfg.train.use_gpu is not None else sum(n.gpus for n in nodes) >= 1)
    try:
        preflight.check_resources(cfg, use_gpu, nodes)
    except ClusterError as e:
        if local or not preflight.autoscaling():
            raise
        console.say(f"waiting for the autoscaler to add nodes: {e}")
    return use_gpu


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
        from gnnray.pipeline.pick import warm_up

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
    threading.Thread(target=_import_torch, name="import torch", daemon=True).start()
    if overlap_ray:
        loading = _Thread(_load, cfg, model_check)
        local = init_ray(cfg)
        loaded = loading.result()
    else:
        loaded, local = _load(cfg, model_check), None
    if cfg.data.feature_shards == 1:
        return Published(*publish_checked(cfg, loaded, local))
    # A table read into memory is written once, a file per shard, and dropped here (the only reference):
    # shards, and lost ones later, are made from those files on their nodes.
    graph, source = loaded
    del loaded
    source = _spill(cfg, graph, source)
    return _publish_sharded(cfg, graph, source, local)


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
    from gnnray.data.features import spill
    from gnnray.data.shards import shard_bounds

    run_dir = storage.run_dir(cfg.run.storage_path, cfg.run.name)
    return spill(source, shard_bounds(source.num_rows, cfg.data.feature_shards),
                 storage.join(run_dir, "feature-spill"), cfg.data.feature_dtype, graph.label)


def _import_torch() -> None:
    import torch  # noqa: F401


def _publish_sharded(cfg: JobConfig, graph: Graph, source: FeatureSource, local: Optional[bool] = None) -> Published:
    """Publish the structure once per node, then the feature table as ``--feature-shards`` shards (``shards.build``)."""
    from gnnray.data import shards
    from gnnray.data.store import publish

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

    from gnnray.data import shards
    from gnnray.driver import console

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
    from gnnray.data import shards
    from gnnray.driver import console

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
    from gnnray.data.store import publish

    local = init_ray(cfg) if local is None else local
    from gnnray.driver import console  # after Ray started (see load_and_publish)

    console.say(console.graph_line(graph))
    preflight.check_object_store(graph.nbytes, preflight.nodes())
    handle = publish(graph)
    return handle.get(), handle, local
