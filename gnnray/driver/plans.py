"""The driver's decisions before training, each printed where it was a choice: the CPU plan, where batches are
sampled, where workers go beside the feature shards, and whether layer-wise evaluation fits the stores."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from gnnray.config import JobConfig
from gnnray.cpus import CpuPolicy, samplers_per_node
from gnnray.data.graph import Graph
from gnnray.driver import pace, preflight
from gnnray.store.handle import GraphHandle
from gnnray.train.gpu_budget import csc_bytes


def layerwise_fits(cfg: JobConfig, pub, use_gpu: bool, model_factory) -> JobConfig:
    """``cfg``, its final evaluation sampled where layer-wise inference's hidden tables do not fit the stores as the
    shards are placed now and ``--eval-fallback`` allows it (:func:`preflight.check_layerwise` raises otherwise)."""
    from gnnray.driver import console

    if model_factory is not None:  # a user model's widths (and whether it infers layer-wise) are its own
        return cfg
    note = preflight.check_layerwise(cfg, pub.graph.num_nodes, pub.graph.nbytes, pub.handle.features,
                                     preflight.nodes(), use_gpu)
    if note:
        console.say(note)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval="sampled"))
    return cfg


def workers(cfg: JobConfig, use_gpu: bool, local: bool, nodes: list) -> JobConfig:
    """``cfg`` with ``--num-workers auto`` resolved, printed with why: one worker per GPU of the cluster, or on CPU
    nodes one per :data:`gnnray.driver.pace.THREADS_AT_MOST` cores of each (ARGO's several processes a host:
    one worker's step hardly speeds up past that many threads)."""
    from gnnray.driver import console

    if not cfg.train.auto_workers:
        return cfg
    if use_gpu:
        count, why = max(1, int(sum(n.gpus for n in nodes))), "one per GPU"
    else:
        cores = [_node_cores(local, n) for n in nodes if n.cpus > 0] or [_node_cores(local)]
        count = sum(math.ceil(c / pace.THREADS_AT_MOST) for c in cores)
        counted = "this run's share of the host" if local else "as Ray counts them"
        why = f"one per {pace.THREADS_AT_MOST} cores of each CPU node ({', '.join(map(str, cores))} cores, {counted})"
    console.say(f"workers plan: {count} train worker(s), {why}")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, num_workers=(count,)))


def _node_cores(local: bool, node=None) -> int:
    """A node's cores to plan for: this run's share of the host's real cores on a local cluster (Ray's logical
    CPUs are only what the run asked for), else the node's CPUs as Ray counts them."""
    from gnnray.cpus import node_cpus
    from gnnray.leases import host_share

    return host_share(node_cpus()).cores if local or node is None else int(node.cpus)


def sampling(cfg: JobConfig, graph: Graph, use_gpu: bool, local: bool = True) -> JobConfig:
    """``cfg`` with ``--sample-on`` resolved to actors or device and, where actors sample and
    ``--sampler-actors`` is not given, their pool sized (on GPU workers :func:`gpu_sampling`, on CPU workers
    :func:`gnnray.driver.pace.plan_cpu_node`), printed with why."""
    from gnnray.driver import console

    requested, actors = cfg.sampler.sample_on, cfg.sampler.actors
    nodes = preflight.nodes()  # asked once: each call is a round trip to the cluster's GCS
    if use_gpu:
        where, why, actors = gpu_sampling(cfg, graph, nodes)
    elif requested == "auto" or requested == "actors" and actors is None:
        where, why, per_node = _cpu_sampling(cfg, graph, local, nodes)
        where = where if requested == "auto" else requested
        if actors is None and where == "actors" and per_node:  # the plan's cores for sampling, on every CPU node
            actors = (1, per_node * max(1, sum(1 for n in nodes if n.cpus > 0)))  # MIN 1: it always starts
    else:
        where, why = requested, "--sample-on " + requested
    if actors != cfg.sampler.actors:
        why += f"; --sampler-actors {actors[0]},{actors[1]}"
    cfg = dataclasses.replace(cfg, sampler=dataclasses.replace(cfg.sampler, sample_on=where, actors=actors))
    pace.check_device_sampling(cfg)
    place = ("in sampler actors" if where == "actors" else "on each train worker's device" if use_gpu
             else "in each train worker, on a thread at idle priority")
    console.say(f"sampling plan: {place} ({why})")
    return cfg


def gpu_sampling(cfg: JobConfig, graph: Graph, nodes: list) -> tuple[str, str, Optional[tuple]]:
    """``(actors | device, why, --sampler-actors)`` for GPU train workers on ``nodes``.

    Where: :func:`gnnray.driver.pace.sample_on` at this graph's measured
    sampling pace, with the GPU nodes' own GPU memory
    (:func:`gnnray.driver.preflight.gpu_memory`), asked only where the cores
    per GPU could not keep pace: a CPU head node plans as a GPU head node
    does. The pool, where actors sample and ``--sampler-actors`` is not
    given: per train worker the actors that keep pace with its steps
    (:func:`gnnray.driver.pace.actors_for_pace`), as many as its node's
    cores per GPU give beside the worker.
    """
    s = cfg.sampler
    gpus = [n for n in nodes if n.gpus > 0]
    per_gpu = min((n.cpus / n.gpus for n in gpus), default=0.0)
    refused = _actors_only(cfg) if s.sample_on == "auto" else ""
    # The rule needs a pace, and so does a pool to size.
    sized = s.sample_on == "auto" and not refused or s.sample_on != "device" and s.actors is None
    measured = sized and s.backend == "native"  # this graph's pace, not a figure's
    seeds = pace.measured_pace(graph, s.fanouts, s.batch_size, cfg.run.seed) if measured else pace.SEEDS_PER_CORE
    if refused:
        where, why = "actors", refused
    else:
        memory, unknown = None, ""
        if s.sample_on == "auto" and not pace.keeps_pace(per_gpu, s.batch_size, seeds):
            memory, unknown = preflight.gpu_memory(nodes)
        where, why = pace.sample_on(s.sample_on, csc_bytes(graph), memory, per_gpu, s.batch_size, seeds,
                                    unknown=unknown)
    if where != "actors" or s.actors is not None:
        return where, why, s.actors
    cores = max(0, math.floor((per_gpu - cfg.train.cpus_per_worker) / s.cpus_per_actor))
    each = pace.actors_for_pace(pace.GPU_STEP_S, s.batch_size, cores, seeds)
    rate = f"{seeds:,.0f} seeds/s a core" + ("" if measured else " assumed")
    why += f"; {each} actor(s) a GPU worker keep pace with its steps ({rate}, {cores} core(s) to spare a GPU)"
    return where, why, (1, each * cfg.train.workers_max)  # MIN 1: it always starts


def _actors_only(cfg: JobConfig) -> str:
    """Why only sampler actors serve this run's batches, or ``""``."""
    if cfg.sampler.backend != "native":
        return f"--sampler {cfg.sampler.backend} samples in actors only"
    if cfg.data.embedding_dim:
        return "--embedding-dim rows are looked up by the actors' prefetch thread"
    return ""


def _cpu_sampling(cfg: JobConfig, graph: Graph, local: bool, nodes: list) -> tuple[str, str, int]:
    """Where CPU workers' batches are sampled and the actors a node gets there (:func:`cpu_sampling`), for the
    cluster's smallest CPU node."""
    if refused := _actors_only(cfg):
        return "actors", refused, 0
    if cfg.data.feature_shards > 1:  # a worker sampling its own batches would wait for them there
        return "actors", "--feature-shards: rows of other nodes are fetched on the prefetch thread, beside the step", 0
    nodes = [n for n in nodes if n.cpus > 0]
    cores = min((_node_cores(local, n) for n in nodes), default=_node_cores(local))
    return cpu_sampling(cfg, graph, cores, math.ceil(cfg.train.workers_max / max(1, len(nodes))))


def cpu_sampling(cfg: JobConfig, graph: Graph, cores: int, workers: int) -> tuple[str, str, int]:
    """``(actors | device, why, sampler actors a node)`` for ``workers`` CPU train workers on a node of ``cores``
    cores: in the workers where the node's sampling needs less than a core, from the native sampler measured
    here on the run's graph and the step estimated from the batch it sampled
    (:func:`gnnray.driver.pace.plan_cpu_node`); else in as many actors as the sampling needs cores."""
    seconds, layers = pace.measure(graph, cfg.sampler.fanouts, cfg.sampler.batch_size, cfg.run.seed)
    gflop = pace.step_gflop(layers, graph.feat_dim + cfg.data.embedding_dim, cfg.model.hidden, graph.num_classes)
    plan = pace.plan_cpu_node(cores, pace.Paces(seconds, gflop / pace.CORE_GFLOPS, gflop), workers)
    return ("device" if plan.in_workers else "actors"), f"{cores} cores a node: {plan.why()}", plan.sampler_cores


def cpu_policy(cfg: JobConfig, use_gpu: bool) -> Optional[CpuPolicy]:
    """The job's CPU plan (``--cpu-plan``), printed once as this node's plan; ``None`` when off."""
    from gnnray.driver import console

    if cfg.train.cpu_plan == "off":
        return None
    nodes = [n for n in preflight.nodes() if n.cpus > 0]
    samplers = 0 if cfg.sampler.sample_on == "device" else samplers_per_node(cfg.sampler.actors_max, len(nodes))
    policy = CpuPolicy(True, samplers, use_gpu, cfg.train.trainer_threads)
    # The line shows this node with its share of the workers; each worker plans from its own node's cores.
    console.say(policy.plan(math.ceil(cfg.train.workers_max / max(1, len(nodes)))).line())
    return policy


# Every Ray node carries its id under this label with no set-up; Ray's own code places work by it.
NODE_ID_LABEL = "ray.io/node-id"


def beside_shards(cfg: JobConfig, handle: GraphHandle, use_gpu: bool, cluster: list) -> Optional[list]:
    """With ``--feature-shards``: Ray Train's ``label_selector``, one per worker, that puts workers on shard nodes.

    A worker beside a shard reads its rows zero-copy: ``(1 - h)(K - 1)/K``
    of a batch's rows are remote, against ``1 - h`` on a node without one.
    Why a label selector on the node id: Ray Train applies it to the worker's
    bundle of its own placement group (restarts and its controller work as
    without), and unlike a custom resource it needs nothing declared when a
    node starts. Workers go round-robin over the shard nodes (GPU nodes
    first, as the shards were placed), as many on each as its CPUs and GPUs
    hold after room for its share of the sampler actors (they start at the
    same time, spread over the nodes, and must not take a worker's place);
    the workers left get ``{}``: anywhere. ``None`` when the features are
    not sharded or no shard node has room.

    Args:
        cluster: The alive nodes (:func:`gnnray.driver.preflight.nodes`).
    """
    features = handle.features
    if features is None:
        return None
    cpu_nodes = max(1, sum(1 for n in cluster if n.cpus > 0))
    sampler_cpus = math.ceil(cfg.sampler.actors_max / cpu_nodes) * cfg.sampler.cpus_per_actor
    by_id = {n.node_id: n for n in cluster}
    room = {}
    for s in features.shards:
        node = by_id.get(s.node_id)
        if node is None or s.node_id in room:
            continue
        fit = (node.cpus - sampler_cpus) // cfg.train.cpus_per_worker
        room[s.node_id] = int(max(0, min(fit, node.gpus) if use_gpu else fit))
    selectors = []
    workers = cfg.train.workers_max
    while len(selectors) < workers and any(room.values()):
        for node_id in room:
            if room[node_id] > 0 and len(selectors) < workers:
                selectors.append({NODE_ID_LABEL: node_id})
                room[node_id] -= 1
    if not selectors:
        return None
    return selectors + [{}] * (workers - len(selectors))
