"""Driver checks made before anything waits: a writable storage path, a cluster that answers, runs the driver's
stack on every node (:mod:`gnnray.stack`), and can ever run the job; a warning for a node whose disk is too full
for Ray to spill objects to.

Ray waits for resources it lacks, expecting an autoscaler to add nodes; on a
cluster of fixed size that wait never ends. So the driver compares what the
job needs with what the nodes have and raises :class:`ClusterError` when the
job can never start: train workers (each on one node), sampler actors, one CPU
for Ray Data's tasks, and an object store per node that holds the graph.

A cluster counts as autoscaling when its autoscaler reported node types it can
add (the test Ray Data uses); then only the object store is checked against
the current nodes, and Ray Train itself checks the autoscaler's maxima.
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass
from typing import Optional

from gnnray.config import JobConfig
from gnnray.driver.pace import gpu_bytes
from gnnray.driver.stream import sampler_actors
from gnnray.errors import ClusterError, ConfigError, last_line, size_text

# Share of a node's object store the graph may take: the rest holds the
# mini-batches in flight and Ray's own objects.
GRAPH_STORE_FRACTION = 0.9

# How long a node may take to start a process for the version check (a new worker, its runtime env).
VERSION_CHECK_TIMEOUT_S = 60.0
# How long a TCP connection to RAY_ADDRESS may take: Ray itself retries for minutes where nothing listens.
CONNECT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Node:
    """What one alive node offers.

    Attributes:
        node_id: Ray's node id (hex).
        address: Its IP address.
        cpus: Logical CPUs.
        gpus: GPUs.
        object_store_bytes: Capacity of its object store.
    """

    node_id: str
    address: str
    cpus: float
    gpus: float
    object_store_bytes: int


def nodes() -> list[Node]:
    """The alive nodes of the connected cluster."""
    import ray

    return [Node(n["NodeID"], n.get("NodeManagerAddress", "?"), float(n["Resources"].get("CPU", 0)),
                 float(n["Resources"].get("GPU", 0)), int(n["Resources"].get("object_store_memory", 0)))
            for n in ray.nodes() if n.get("Alive")]


def check_address(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise :class:`ClusterError` unless something accepts a TCP connection at ``RAY_ADDRESS`` (``host:port``).

    Other forms (``auto``, ``ray://...``) are left to Ray.
    """
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return
    except OSError as e:
        why = "no answer" if isinstance(e, socket.timeout) else (e.strerror or str(e)).lower()
    raise ClusterError(f"RAY_ADDRESS={address}: no Ray cluster answers there ({why} within {timeout_s:g} s); start "
                       f"one (`ray start --head --port {port}` on {host}), set RAY_ADDRESS to the address `ray status` "
                       f"prints on a running cluster's head, or unset RAY_ADDRESS to run on a new local cluster")


def check_versions(cluster: list[Node], expected: dict, timeout_s: float = VERSION_CHECK_TIMEOUT_S) -> int:
    """Raise :class:`ClusterError` naming each node of ``cluster`` whose stack differs from ``expected`` (the
    driver's, :func:`gnnray.stack.versions`) or that did not answer; return how many nodes answered.

    A task without CPUs on each node reads the installed packages' metadata
    (nothing is imported) and digests gnnray's sources. A node where that task
    fails (gnnray not importable there) is named with its error; one that
    cannot start it within ``timeout_s`` is named, not passed; one that died
    meanwhile is gone from the cluster and left out.
    """
    import ray

    from gnnray import stack

    backend = "graphbolt" if "dgl" in expected else "native"
    refs, ready, pending = _on_each_node(cluster, stack.versions, backend, timeout_s=timeout_s)
    wrong, failed = [], {}
    for ref in ready:
        try:
            diff = stack.differences(ray.get(ref), expected)
        except ray.exceptions.RayError as e:  # the probe ran and failed there (gnnray not importable, ...)
            failed[refs[ref].node_id] = f": the version check failed there ({last_line(e)})"
            continue
        if diff:
            wrong.append(f"node {refs[ref].address} ({refs[ref].node_id[:8]}) has {', '.join(diff)}")
    failed.update((refs[r].node_id, f" did not answer the version check within {timeout_s:g} s") for r in pending)
    alive = {n.node_id for n in nodes()}
    wrong += [f"node {n.address} ({n.node_id[:8]}){failed[n.node_id]}" for n in cluster
              if n.node_id in failed and n.node_id in alive]
    if wrong:
        names = ", ".join(expected)
        raise ClusterError(f"every node needs the driver's {names}, and {'; '.join(sorted(wrong))}: install the "
                           f"driver's versions on every node (pip install -e . into the same environment, or one "
                           f"image for all), and check that each node can start Ray workers")
    return len(ready)


def _on_each_node(cluster: list[Node], fn, *args, timeout_s: float = VERSION_CHECK_TIMEOUT_S, **options) -> tuple:
    """Call ``fn(*args)`` in a task without CPUs (``options``: what else it holds) on each node of ``cluster``,
    once: ``({ref: node}, refs ready within timeout_s, refs not)``."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0, **options)(fn)
    refs = {task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False))
            .remote(*args): n for n in cluster}
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    return refs, ready, pending


# How long the GPU nodes may take to say their GPU's memory: a worker process to start, the CUDA driver to load.
GPU_PROBE_TIMEOUT_S = 30.0


def gpu_memory(cluster: list[Node], timeout_s: float = GPU_PROBE_TIMEOUT_S) -> tuple[Optional[int], str]:
    """``(bytes, "")``: the smallest GPU memory of ``cluster``'s GPU nodes, each read in a task that holds a
    sliver of one of that node's GPUs (:func:`gnnray.driver.pace.gpu_bytes`): the train workers' GPUs, where
    the driver's node (a CPU head node in the usual cluster) may have none. ``(None, why)`` where no GPU node
    is up, one did not answer within ``timeout_s`` (its GPUs all held, or a node still starting), or one could
    not read its GPU."""
    import ray

    gpu_nodes = [n for n in cluster if n.gpus > 0]
    if not gpu_nodes:
        return None, "the GPU workers' memory is unknown: no GPU node is up yet"
    refs, ready, pending = _on_each_node(gpu_nodes, gpu_bytes, timeout_s=timeout_s, num_gpus=0.01)
    for ref in pending:
        ray.cancel(ref, force=True)
    if pending:
        late = ", ".join(refs[r].address for r in pending)
        return None, f"the GPU workers' memory is unknown: node(s) {late} did not say within {timeout_s:g} s"
    sizes = {}
    for ref in ready:
        try:
            sizes[ref] = ray.get(ref)
        except ray.exceptions.RayError:
            sizes[ref] = None
    unread = ", ".join(sorted({refs[r].address for r, b in sizes.items() if b is None}))
    if unread:
        return None, f"the GPU workers' memory is unknown: node(s) {unread} could not read their GPU"
    return min(sizes.values()), ""


# The share of a disk's capacity past which a raylet refuses to spill objects there (Ray's
# local_fs_capacity_threshold; a raylet reads RAY_local_fs_capacity_threshold, as the probe on its node does).
DISK_THRESHOLD_ENV, DISK_THRESHOLD = "RAY_local_fs_capacity_threshold", 0.95


def spill_disk() -> tuple:
    """(path, free bytes, capacity in bytes, Ray's threshold) of the disk this node's raylet spills objects to,
    read in a task on that node."""
    import os
    import shutil

    from gnnray import ray_internals

    path = ray_internals.session_dir()
    usage = shutil.disk_usage(path)
    return path, usage.free, usage.total, float(os.environ.get(DISK_THRESHOLD_ENV, DISK_THRESHOLD))


def full_disks(cluster: list[Node], here: bool = False) -> list[str]:
    """A warning for each node of ``cluster`` whose spill disk is past Ray's threshold (none where all answer
    in time below it).

    Such a raylet logs an error every 10 s for as long as it runs, which the
    console leaves out (:data:`gnnray.driver.console.RAY_WORKER_NOISE`): this
    says it once, with what to do. The check reads the session directory, where
    Ray spills unless the cluster was started with its own spilling config.
    With ``here`` (a cluster this process started, on this machine) it reads it
    in this process: a task would start a worker process for it.
    """
    import ray

    answers = [(n, spill_disk()) for n in cluster[:1]] if here else []
    if not here:
        refs, ready, _ = _on_each_node(cluster, spill_disk)
        for ref in ready:
            try:
                answers.append((refs[ref], ray.get(ref)))
            except ray.exceptions.RayError:  # a node that died since the version check: nothing to warn of
                continue
    lines = []
    for n, (path, free, total, threshold) in answers:
        used = 1 - free / total if total else 1.0
        if used >= threshold:
            lines.append(f"warning: node {n.address} ({n.node_id[:8]}): the disk of {path} is {used:.1%} full "
                         f"({size_text(free)} free of {size_text(total)}), past the {threshold:.0%} at which Ray "
                         f"stops spilling objects there, so a run whose objects outgrow the object store fails; "
                         f"free space on that disk")
    return sorted(lines)


def check_driver(backend: str) -> dict:
    """This driver's stack (:func:`gnnray.stack.versions`), or :class:`ClusterError` if it lacks a pin the job
    needs (Ray's; DGL's for ``--sampler graphbolt``)."""
    from gnnray import stack

    mine = stack.versions(backend)
    need = stack.required(backend)
    diff = stack.differences(mine, need)
    if diff:
        want = " ".join(f"{k}=={v}" for k, v in need.items())
        hint = (f"install the dgl extra ({stack.DGL_INSTALL}) or use --sampler native" if "dgl" in need and
                mine.get("dgl") != need["dgl"] else "pip install -e . installs it")
        raise ClusterError(f"gnnray needs {want}, and this driver has {', '.join(d.split(' (')[0] for d in diff)}: "
                           f"{hint}")
    return mine


def autoscaling() -> bool:
    """Whether the cluster's autoscaler reported node types it can add (``False`` for local and fixed clusters)."""
    # No public API reads the autoscaler's node types (ray.autoscaler.sdk only requests resources).
    try:
        from gnnray import ray_internals

        config = ray_internals.cluster_config()
    except Exception:  # if it moves, do not block a cluster that may scale
        return True
    if not config or not config.node_group_configs:
        return False
    return any(g.max_count == -1 or g.max_count > g.min_count
               for g in config.node_group_configs if g.resources and g.max_count != 0)


def check_resources(cfg: JobConfig, use_gpu: bool, cluster: list[Node]) -> None:
    """Raise :class:`ClusterError` if ``cluster`` can never run the job's workers and actors at once.

    Only what is certainly needed is checked: each train worker on one node
    (``--cpus-per-worker`` CPUs, and a GPU with ``use_gpu``), the smallest
    sampler pool (``--sampler-actors MIN``), and one CPU for Ray Data's tasks,
    which run while workers and actors hold theirs. An elastic run needs its
    MIN workers, and room for the sampler actors beside the group Ray Train
    would start (:func:`_check_elastic_room`).
    """
    t, s = cfg.train, cfg.sampler
    where = _describe(cluster)
    workers, flag = t.workers_min, ",".join(map(str, t.num_workers))
    actors = sampler_actors(cfg, workers)[0]
    slots = sum(_worker_slots(n, t.cpus_per_worker, use_gpu) for n in cluster)
    if slots < workers:
        each = f"{t.cpus_per_worker:g} CPU{'' if t.cpus_per_worker == 1 else 's'}" + (" and 1 GPU" if use_gpu else "")
        fix = "lower --num-workers or --cpus-per-worker" + (", or pass --use-gpu no" if use_gpu else "")
        raise ClusterError(f"--num-workers {flag}: each train worker needs {each} on one node, and the "
                           f"cluster ({where}) fits {slots:g}; {fix}, or add nodes")
    need = workers * t.cpus_per_worker + actors * s.cpus_per_actor + 1
    total = sum(n.cpus for n in cluster)
    if total < need:
        raise ClusterError(f"the job needs {need:g} CPUs at once ({workers} train workers x "
                           f"{t.cpus_per_worker:g} + {actors} sampler actors x {s.cpus_per_actor:g} + 1 for "
                           f"Ray Data's tasks) and the cluster ({where}) has {total:g}; lower --num-workers, "
                           "--cpus-per-worker, --sampler-actors MIN or --cpus-per-sampler, or add nodes")
    if not any(n.cpus >= s.cpus_per_actor for n in cluster):
        raise ClusterError(f"--cpus-per-sampler {s.cpus_per_actor:g}: no node has that many CPUs ({where})")
    if t.elastic:
        _check_elastic_room(cfg, use_gpu, cluster)


def _check_elastic_room(cfg: JobConfig, use_gpu: bool, cluster: list[Node]) -> None:
    """An elastic group leaves room for its sampler actors on ``cluster``, or :class:`ClusterError`.

    Ray Train sizes an elastic group by the workers that fit into the nodes'
    resources (up to MAX), as if nothing else ran: on nodes of CPUs only it
    may take every CPU, and the sampler actors the workers wait for could
    never start.
    """
    t, s = cfg.train, cfg.sampler
    total = sum(n.cpus for n in cluster)

    def room(workers: int) -> tuple[float, float]:  # CPUs left beside ``workers`` workers, CPUs the actors need
        return total - workers * t.cpus_per_worker, sampler_actors(cfg, workers)[0] * s.cpus_per_actor + 1

    workers = int(min(t.workers_max, sum(_worker_slots(n, t.cpus_per_worker, use_gpu) for n in cluster)))
    left, need = room(workers)
    if left >= need:
        return
    best = max((w for w in range(t.workers_min, workers) if room(w)[0] >= room(w)[1]), default=None)
    fix = f"lower MAX to {best}" if best else "lower MIN"
    raise ClusterError(f"--num-workers {t.workers_min},{t.workers_max}: Ray Train sizes an elastic group by the "
                       f"workers the nodes fit ({_describe(cluster)}), here {workers}, which leaves {left:g} CPUs "
                       f"where the sampler actors and Ray Data's tasks need {need:g}; {fix}, raise "
                       f"--cpus-per-worker, or add nodes")


def _worker_slots(node: Node, cpus_per_worker: float, use_gpu: bool) -> float:
    """Train workers that fit on ``node``, counted as Ray Train counts them."""
    return min(_fits(node.cpus, cpus_per_worker), _fits(node.gpus, 1) if use_gpu else math.inf)


def check_object_store(graph_bytes: int, cluster: list[Node]) -> None:
    """Raise :class:`ClusterError` if some node's object store cannot hold the graph (its copy for that node).

    Without this check Ray would put the graph on disk (fallback allocation)
    or spill mini-batches continually; both are slow and say little.
    """
    for n in cluster:
        if graph_bytes > GRAPH_STORE_FRACTION * n.object_store_bytes:
            raise ClusterError(
                f"the graph takes {size_text(graph_bytes)} but the object store of node {n.address} "
                f"({n.node_id[:8]}) holds {size_text(n.object_store_bytes)}; it may use at most "
                f"{GRAPH_STORE_FRACTION:.0%} of it. Give every node a larger store: `ray start "
                f"--object-store-memory BYTES` (or `ray.init(object_store_memory=BYTES)` before calling gnnray), "
                f"at least {size_text(math.ceil(graph_bytes / GRAPH_STORE_FRACTION))}; or split the features over "
                f"nodes with --feature-shards K")


def check_layerwise(cfg: JobConfig, num_nodes: int, graph_bytes: int, features, cluster: list[Node],
                    use_gpu: bool) -> Optional[str]:
    """With ``--eval layerwise``: do its hidden tables fit the object stores that would hold them? Checked before
    training, for the built-in models (``--hidden`` wide, times ``--heads`` for gat and rgat).

    Without ``--feature-shards`` each node with a train worker holds every
    hidden table whole beside the graph (one worker keeps them in its own
    memory instead: not checked); with them each shard node holds its range of
    the two tables a layer reads and writes beside its structure, shard and
    cache (:mod:`gnnray.train.layerwise_hidden`).

    Args:
        graph_bytes: The graph in the store (with shards: the structure alone).
        features: The feature shards (``ShardedFeatures``), or ``None``.

    Returns:
        ``None`` where they fit; else, with ``--eval-fallback``, the note that evaluation will be sampled.

    Raises:
        ClusterError: They do not fit and ``--eval-fallback`` is off; it says what a node needs and what to do.
    """
    from gnnray.store.shards import hidden_nbytes, node_nbytes

    layers = cfg.sampler.num_layers
    if cfg.train.eval != "layerwise" or layers < 2 or (features is None and cfg.train.workers_max < 2):
        return None
    width = cfg.model.hidden * (cfg.model.heads if cfg.model.name in ("gat", "rgat") else 1)
    widths = [width] * (layers - 1)
    table = f"{num_nodes:,} nodes x {width} x 4 B"
    if features is None:
        hidden = num_nodes * sum(widths) * 4
        nodes = [n for n in cluster if _worker_slots(n, cfg.train.cpus_per_worker, use_gpu) >= 1]
        need = {n.node_id: graph_bytes + hidden for n in nodes}
        what = (f"each node with a train worker holds every hidden table whole, {len(widths)} x {table} = "
                f"{size_text(hidden)}, beside the graph's {size_text(graph_bytes)}")
        fix = "shard them with --feature-shards K (a shard node then holds 2 x table / K)"
    else:
        k = len(features.shards)
        hidden = hidden_nbytes(num_nodes, widths, k)
        # Per node, as placed: a repair may have put two shards on one node.
        held = node_nbytes(features, widths)
        nodes = [n for n in cluster if n.node_id in held]
        need = {n.node_id: graph_bytes + sum(held[n.node_id]) + features.cache_bytes for n in nodes}
        two = max((sum(1 for s in features.shards if s.node_id == n.node_id) for n in nodes), default=1)
        what = (f"each feature-shard node holds its range of {min(2, len(widths))} hidden table(s) of {table}, "
                f"{size_text(hidden)} at K={k}, beside structure {size_text(graph_bytes)} + shard "
                f"{size_text(features.shard_bytes)} + cache {size_text(features.cache_bytes)}"
                + (f"; a node holding {two} shards since a repair, {two} times the ranges" if two > 1 else ""))
        fix = "raise --feature-shards (2 x table / K per node)"
    short = [n for n in nodes if need[n.node_id] > GRAPH_STORE_FRACTION * n.object_store_bytes]
    if not short:
        return None
    n = min(short, key=lambda n: GRAPH_STORE_FRACTION * n.object_store_bytes - need[n.node_id])
    need = need[n.node_id]
    text = (f"--eval layerwise needs {size_text(need)} of object store per node ({what}; at most "
            f"{GRAPH_STORE_FRACTION:.0%} of a store) and node {n.address} ({n.node_id[:8]}) has "
            f"{size_text(n.object_store_bytes)}")
    if cfg.train.eval_fallback:
        return f"note: {text}; the final evaluation will be sampled (--eval-fallback)"
    raise ClusterError(f"{text}: {fix}, give those nodes stores of at least "
                       f"{size_text(math.ceil(need / GRAPH_STORE_FRACTION))} (`ray start --object-store-memory "
                       f"BYTES`), pass --eval sampled, or add --eval-fallback to evaluate sampled where it does "
                       f"not fit")


def _fits(have: float, each: float) -> float:
    return math.floor(have / each + 1e-9)


def _describe(cluster: list[Node]) -> str:
    gpus = sum(n.gpus for n in cluster)
    return (f"{len(cluster)} node{'s' if len(cluster) != 1 else ''}, CPUs per node "
            f"{', '.join(f'{n.cpus:g}' for n in cluster)}" + (f", {gpus:g} GPUs" if gpus else ", no GPU"))


def check_storage(cfg: JobConfig) -> str:
    """Return the run's directory ``STORAGE_PATH/NAME`` (a path, or a URI such as ``s3://BUCKET/PREFIX/NAME``),
    created; raise :class:`ConfigError` if a file cannot be written there.

    An object store that refuses (no such bucket, no credentials, no network)
    is named here, before anything starts, in one line with what it said.
    """
    from gnnray import run_storage

    given = cfg.run.storage_path
    run_dir = run_storage.run_dir(given, cfg.run.name)
    try:
        run_storage.check_writable(run_dir)
    except ConfigError:  # says what to do already
        raise
    except (OSError, ValueError) as e:  # pyarrow: OSError from the store, ArrowInvalid (a ValueError) for the URI
        why = " ".join(str(e).split()) or type(e).__name__
        if not run_storage.is_uri(run_dir):
            why = getattr(e, "strerror", None) or why
            raise ConfigError(f"--storage-path {given!r}: cannot write checkpoints to {run_dir} ({why}); choose a "
                              "writable directory") from None
        raise ConfigError(f"--storage-path {given!r}: cannot write to {run_dir} ({why}); check the bucket's name, "
                          "the credentials (environment, ~/.aws, the node's role) and, for an S3-compatible store, "
                          "AWS_ENDPOINT_URL") from None
    return run_dir
