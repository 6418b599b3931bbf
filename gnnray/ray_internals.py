"""Every use of Ray's private modules, in one place: what gnnray needs that no public Ray API gives.

Each was read from Ray 2.60.0, the version :data:`gnnray.stack.RAY` pins and every node of a run must run
(:mod:`gnnray.stack`). When that pin moves, this is the file to read again against the new Ray; a test
(tests/test_layout.py) keeps private Ray out of every other module of the package.

Imports are lazy: importing this module costs nothing, and each function loads only what it uses. The
base classes gnnray subclasses (Ray Data's backpressure policy and execution callback in
``driver/read_ahead.py``) and Ray Train's framework names (``train/process_group.py``) come as this module's
attributes, loaded on first use.
"""

from __future__ import annotations

from typing import Optional

# The logger of Ray's notice that a new local cluster uses its default, token authentication
# (ray/_private/authentication/authentication_token_setup.py).
TOKEN_SETUP_LOGGER = "ray._private.authentication.authentication_token_setup"

# Name here -> (module, name there): Ray Data's execution internals that read_ahead.py builds on, and Ray
# Train's framework names (process_group.py's backend names torch, whose version the Train view shows).
_LAZY = {
    "BackpressurePolicy": ("ray.data._internal.execution.backpressure_policy", "BackpressurePolicy"),
    "ENABLED_BACKPRESSURE_POLICIES": ("ray.data._internal.execution.backpressure_policy",
                                      "ENABLED_BACKPRESSURE_POLICIES"),
    "ENABLED_BACKPRESSURE_POLICIES_CONFIG_KEY": ("ray.data._internal.execution.backpressure_policy",
                                                 "ENABLED_BACKPRESSURE_POLICIES_CONFIG_KEY"),
    "ExecutionCallback": ("ray.data._internal.execution.execution_callback", "ExecutionCallback"),
    "TrainingFramework": ("ray.train.v2._internal.util", "TrainingFramework"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, there = _LAZY[name]
        return getattr(importlib.import_module(module), there)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def start_train_singletons(coordinator: bool = True) -> None:
    """Start the cluster-wide actors Ray Train's controller waits for, if not running yet; do not wait.

    On a new cluster the controller would start each in turn (a process of
    its own, seconds each) before it starts the workers; started here, they
    start while the controller does. Each is Ray's own get-or-create of a
    named detached actor, so the controller finds them. ``coordinator``:
    also Ray Data's autoscaling coordinator (a run of :func:`lean_trainer`
    on a cluster this process started asks it nothing, and has no stream
    that would).
    """
    from ray._private.ray_constants import env_bool
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )
    from ray.train.constants import RAY_TRAIN_ENABLE_STATE_TRACKING
    from ray.train.v2._internal.state.state_actor import get_or_create_state_actor

    if coordinator:
        get_or_create_autoscaling_coordinator()
    if env_bool(RAY_TRAIN_ENABLE_STATE_TRACKING, False):  # as Ray Train's trainers decide it
        get_or_create_state_actor()


def worker_devices() -> list:
    """The devices Ray gave this train worker (Ray Train's own choice, as ``ray.train.torch.get_device`` makes
    it)."""
    from ray.air._internal.torch_utils import get_devices

    return get_devices()


def train_state_actor():
    """Ray Train's state actor (the record the dashboard's Train view shows), or ``None`` with tracking off."""
    from ray.train.v2._internal.state.state_actor import get_state_actor

    return get_state_actor()


def actor_table(actor_id: Optional[str] = None) -> dict:
    """The GCS's own actor table (one entry by hex id, or all by id): it answers where no dashboard runs."""
    from ray._private.state import state

    return state.actor_table(actor_id)


def store_stats(node: dict, *fields: str) -> dict:
    """``fields`` of a node's object store stats (``object_store_bytes_used``, ...) as its raylet reports them;
    ``node`` is an entry of ``ray.nodes()``."""
    from ray._private.internal_api import node_stats

    stats = node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=False).store_stats
    return {f: int(getattr(stats, f)) for f in fields}


def cluster_config():
    """The autoscaler's cluster config as the GCS holds it (``None`` where none was reported)."""
    import ray._private.state

    return ray._private.state.state.get_cluster_config()


def dashboard_url() -> str:
    """The connected cluster's dashboard address, ``""`` where it has none."""
    import ray._private.worker

    return ray._private.worker.get_dashboard_url() or ""


def log_deduplicators() -> tuple:
    """The two objects that print other processes' stdout and stderr lines on the driver's console."""
    from ray._private import ray_logging

    return ray_logging.stdout_deduplicator, ray_logging.stderr_deduplicator


def auth_token_header() -> Optional[tuple]:
    """What Ray sends a GCS under token authentication (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``): ``()`` without it, ``None`` when it is on and no token
    is found, else the header's items."""
    from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, get_authentication_mode
    from ray.exceptions import AuthenticationError

    if get_authentication_mode() != AuthenticationMode.TOKEN:
        return ()
    loader = AuthenticationTokenLoader.instance()
    try:
        found = loader.has_token()
    except AuthenticationError:  # how Ray 2.60 says there is none
        found = False
    return tuple(loader.get_token_for_http_header().items()) if found else None


def ask_cluster_id(channel, metadata: tuple, timeout_s: float) -> None:
    """One ``GetClusterId`` call to the GCS on a gRPC ``channel``: raises ``grpc.RpcError`` as the GCS answers."""
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
        gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s, metadata=metadata)


def session_dir() -> str:
    """This node's Ray session directory, where a cluster Ray started with its defaults spills objects (the
    raylet's disk monitor watches it); called in a task on the node."""
    import ray._private.worker

    return ray._private.worker._global_node.get_session_dir_path()


def plain_framework_versions() -> None:
    """In Ray Train's controller: the framework versions it sends its state actor become plain strings.

    Ray Train reads them on rank 0 as each module's ``__version__``; torch's is
    a ``TorchVersion``, a ``str`` subclass of torch's, and unpickling one in the
    state actor imports the whole of torch there (0.26 GB of that process's own
    memory) for a version the Train view shows as text. Idempotent.
    """
    from ray.train.v2._internal.callbacks import state_manager

    if not hasattr(state_manager, "_gnnray_read_versions"):
        state_manager._gnnray_read_versions = state_manager._get_framework_version
        state_manager._get_framework_version = _plain_versions


def _plain_versions(framework) -> dict:
    """Ray Train's ``_get_framework_version`` on rank 0 (called there by reference), its values as ``str``."""
    from ray.train.v2._internal.callbacks import state_manager

    read = getattr(state_manager, "_gnnray_read_versions", state_manager._get_framework_version)
    return {name: str(version) for name, version in read(framework).items()}


def lean_trainer(local: bool):
    """Ray Train's ``DataParallelTrainer``, less the controller callbacks a run without them needs not start.

    Each is a process of its own that imports Ray Train or Ray Data (2.8-3.0 CPU-seconds each, before the
    first step, on 2 cores): the dataset manager, which Ray Train starts even when it is given no dataset (a
    fixed run whose workers sample their own rows has none), and on a cluster this process started (``local``)
    the placement-group cleaner, which removes the workers' placement group should the controller die while the
    cluster lives on: a local cluster ends with this process. There a fixed worker group also asks no
    autoscaler for its resources (Ray Data's autoscaling coordinator, which forwards the request): the cluster
    has none.
    """
    from ray.train.v2._internal.callbacks import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    class FixedOnLocalCluster(FixedScalingPolicy):
        def after_controller_start(self, train_run_context) -> None:  # no coordinator client: nothing is sent
            self._requester_id = f"train-{train_run_context.run_id}"

        def _maybe_send_resource_request(self) -> None:
            pass

        def _send_resource_request(self) -> None:
            pass

    class LeanTrainer(DataParallelTrainer):
        def _create_default_callbacks(self):
            unneeded = (() if self.datasets else (DatasetsCallback,)) + (
                (PlacementGroupCleanerCallback,) if local else ())
            return [c for c in super()._create_default_callbacks() if not isinstance(c, unneeded)]

        def _initialize_and_run_controller(self, **kwargs):
            if local and type(kwargs.get("scaling_policy")) is FixedScalingPolicy:
                kwargs["scaling_policy"] = FixedOnLocalCluster(self.scaling_config)
            return super()._initialize_and_run_controller(**kwargs)

    return LeanTrainer
