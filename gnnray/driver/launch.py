"""What training and prediction share on the driver: connect to Ray, load the graph, publish it once per node."""

from __future__ import annotations

import os
import sys
import warnings

from gnnray.config import JobConfig
from gnnray.data.graph import Graph
from gnnray.data.store import GraphHandle
from gnnray.driver import console, preflight
from gnnray.errors import ClusterError

_RAY_DEPRECATION = "`ExecutionOptions.exclude_resources` is deprecated"


def init_ray(cfg: JobConfig) -> bool:
    """Connect to ``RAY_ADDRESS`` or start a local cluster; return whether it is local (fixed size).

    Ray's own INFO logs stay in its session logs unless ``--verbose``
    (:func:`gnnray.driver.console.quiet_ray`).
    """
    import ray
    import ray.data

    os.environ.setdefault("DGLBACKEND", "pytorch")
    # The dashboard's Train view lists only runs whose driver tracks Train state.
    os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")
    # Raised by Ray Train's own use of ExecutionOptions (in this process and in its controller), not by
    # anything a user can change: hidden here and in the processes of a local cluster, which inherit it.
    warnings.filterwarnings("ignore", message=_RAY_DEPRECATION)
    local = False
    if not ray.is_initialized():
        options = dict(logging_config=ray.LoggingConfig(log_level="INFO" if cfg.run.verbose else "WARNING"),
                       log_to_driver=True)
        if os.environ.get("RAY_ADDRESS"):
            ray.init(**options)
        else:
            local = True
            # A local cluster gets enough logical CPUs for every worker and
            # sampler actor plus one for Ray Data's own tasks; on a small
            # machine they then share cores rather than wait forever.
            need = (cfg.train.num_workers * cfg.train.cpus_per_worker
                    + cfg.sampler.actors_max * cfg.sampler.cpus_per_actor + 1)
            # address="local": a new cluster even if another runs on this
            # machine (joining one is what RAY_ADDRESS is for).
            os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"),
                                                                  f"ignore:{_RAY_DEPRECATION}"]))
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(need + 0.999)), **options)
    console.quiet_ray(cfg.run.verbose)
    ray.data.DataContext.get_current().enable_progress_bars = cfg.run.verbose and sys.stdout.isatty()
    return local


def resolve_gpu(cfg: JobConfig, local: bool) -> bool:
    """Whether to train on GPUs; raises :class:`ClusterError` if a fixed-size cluster can never run the job."""
    nodes = preflight.nodes()
    use_gpu = bool(cfg.train.use_gpu if cfg.train.use_gpu is not None else sum(n.gpus for n in nodes) >= 1)
    try:
        preflight.check_resources(cfg, use_gpu, nodes)
    except ClusterError as e:
        if local or not preflight.autoscaling():
            raise
        console.say(f"waiting for the autoscaler to add nodes: {e}")
    return use_gpu


def load_and_publish(cfg: JobConfig) -> tuple[Graph, GraphHandle, bool]:
    """Load the graph, then :func:`publish_checked`."""
    from gnnray.data.load import load_graph

    return publish_checked(cfg, load_graph(cfg.data, cfg.run.seed))


def publish_checked(cfg: JobConfig, graph: Graph) -> tuple[Graph, GraphHandle, bool]:
    """Connect to Ray and put ``graph`` into the object store once, if every node's store can hold it.

    Returns:
        The graph as read-only views on the store (the loading copy is freed),
        its handle (this process owns the object: it must outlive every user),
        and whether the cluster is local.
    """
    from gnnray.data.store import publish

    console.say(console.graph_line(graph))
    local = init_ray(cfg)
    preflight.check_object_store(graph.nbytes, preflight.nodes())
    handle = publish(graph)
    return handle.get(), handle, local
