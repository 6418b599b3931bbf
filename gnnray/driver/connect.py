"""Stage 0 (driver): start a local Ray cluster, or join a running one, and say what it is.

A local cluster is sized for the job and registered on the host (runs sharing a host split its cores); joining
checks the address and the token before Ray's client would retry them. Ray Train's state is tracked only where
the dashboard answers, so that a cluster without one prints nothing about it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import sys
import warnings

from gnnray import cpus, ray_internals, stack
from gnnray.config import JobConfig
from gnnray.driver import pace, preflight
from gnnray.errors import ClusterError

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

    from gnnray.driver import console
    from gnnray.logs import drop_records

    expected = preflight.check_driver(cfg.sampler.backend)  # before Ray starts: a missing pin fails at once
    # Ray Train's controller takes one report per worker per poll (2 s by default), and a worker's report waits
    # for the previous one to be taken: short epochs would each last a poll (docs/performance.md#time-between-epochs).
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.05")
    # Raised by Ray Train's own use of ExecutionOptions (in this process and in its controller), not by
    # anything a user can change: hidden here and in the processes of a local cluster, which inherit it.
    warnings.filterwarnings("ignore", message=_RAY_DEPRECATION)
    if not cfg.run.verbose:  # Ray's notice that a new local cluster uses its default, token authentication
        drop_records(ray_internals.TOKEN_SETUP_LOGGER, "Token authentication is enabled")
    console.skip_ray_noise(cfg.run.verbose)  # before a new raylet's first lines reach this console
    local, started = False, None
    if ray.is_initialized() and os.environ.get("RAY_ADDRESS") == _own_address[0] and cfg.train.cpu_plan == "on":  # another run on this process's
        register_run()  # local cluster (the Python API): registered again, under the name its processes carry
    if not ray.is_initialized():
        if _own_address[0] and os.environ.get("RAY_ADDRESS") == _own_address[0]:  # this process's last local
            del os.environ["RAY_ADDRESS"]  # cluster, shut down since
        options = dict(logging_config=ray.LoggingConfig(log_level="INFO" if cfg.run.verbose else "WARNING"),
                       log_to_driver=True)
        job_env = run_env(cfg, expected)
        if os.environ.get("RAY_ADDRESS"):
            started = _connect(options, job_env)
        else:
            local, started = True, _start_local(cfg, options, job_env)
    import ray.data

    console.quiet_ray(cfg.run.verbose)
    ray.data.DataContext.get_current().enable_progress_bars = cfg.run.verbose and sys.stdout.isatty()
    cluster = preflight.nodes()
    # A cluster this process started runs on this machine, from this environment: nothing to compare (the task
    # that would check costs a worker process, a CPU-second on 2 cores).
    checked = len(cluster) if local else preflight.check_versions(cluster, expected)
    dashboard = track_train_state()
    if started is not None:
        console.say(console.cluster_line(local, started.address_info["gcs_address"], dashboard,
                                         len(cluster), checked, expected))
        for line in preflight.full_disks(cluster, here=local):  # said once, as the cluster is
            console.say(line)
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
    url = ray_internals.dashboard_url()
    answers = bool(url) and _answers(url)
    if TRACKING not in os.environ or _own_tracking[0]:
        _own_tracking[0] = True
        if answers:
            os.environ[TRACKING] = "1"
        else:
            os.environ.pop(TRACKING, None)
    return url if answers else ""


def run_env(cfg: JobConfig, expected: dict) -> dict:
    """The environment every process of the run starts with (variables read when a library loads, so not set
    in code): a local cluster's processes inherit it, a joined cluster's get it through the job's runtime env."""
    env = dict(cpus.JOB_ENV) if cfg.train.cpu_plan == "on" else {}  # OpenMP's wait policy
    env[stack.DRIVER_ENV] = json.dumps(expected)  # what every process of the run checks its node against
    # torch's CPU allocator asks for transparent huge pages for blocks of 2 MB and more: a step's large
    # temporaries, fresh each step, otherwise fault in 4 KB at a time (products-shaped SAGE step 594 -> 378 ms).
    env["THP_MEM_ALLOC_ENABLE"] = os.environ.get("THP_MEM_ALLOC_ENABLE", "1")
    if not cfg.run.verbose:  # torch's C++ warnings off: c10d's store warns of each peer no DNS names
        env["TORCH_CPP_LOG_LEVEL"] = os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env


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

    metadata = ray_internals.auth_token_header()
    if metadata is None:
        raise ClusterError(f"RAY_AUTH_MODE=token, but no auth token to join RAY_ADDRESS={address} with. "
                           f"{_TOKEN_HELP}")
    with grpc.insecure_channel(address) as channel:
        try:
            ray_internals.ask_cluster_id(channel, metadata, timeout_s)
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
    # --num-workers auto is decided once the cluster runs (its GPUs are Ray's to find): a CPU host's workers, or
    # every core for a GPU host's.
    cores = cpus.node_cores()
    workers = math.ceil(cores / pace.THREADS_AT_MOST) if cfg.train.auto_workers else cfg.train.workers_max
    need = workers * cfg.train.cpus_per_worker + cfg.sampler.actors_max * cfg.sampler.cpus_per_actor + 1
    need = max(need, cores) if cfg.train.auto_workers else need
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


def resolve_gpu(cfg: JobConfig, local: bool) -> tuple[JobConfig, bool]:
    """Whether to train on GPUs, and ``cfg`` with ``--num-workers auto`` resolved (:func:`plans.workers`); raises
    :class:`ClusterError` if a fixed-size cluster can never run the job."""
    from gnnray.driver import console, plans

    nodes = preflight.nodes()
    use_gpu = bool(cfg.train.use_gpu if cfg.train.use_gpu is not None else sum(n.gpus for n in nodes) >= 1)
    cfg = plans.workers(cfg, use_gpu, local, nodes)
    try:
        preflight.check_resources(cfg, use_gpu, nodes)
    except ClusterError as e:
        if local or not preflight.autoscaling():
            raise
        console.say(f"waiting for the autoscaler to add nodes: {e}")
    return cfg, use_gpu
