"""The driver's decisions before training, each printed where it was a choice: the CPU plan, where batches are
sampled, where workers go beside the feature shards, and whether layer-wise evaluation fits the stores."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from gnnray.config import JobConfig
from gnnray.cpus import CpuPolicy, samplers_per_node
from gnnray.data.graph import Graph
from gnnray.store.handle import GraphHandle
from gnnray.driver import preflight


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


def sampling(cfg: JobConfig, graph: Graph, use_gpu: bool) -> JobConfig:
    """``cfg`` with ``--sample-on`` resolved to actors or device (:func:`gnnray.pipeline.pace.sample_on`), printed
    where there was a choice (a GPU run, or one that named it): a CPU run's console stays as it was."""
    from gnnray.driver import console
    from gnnray.pipeline.pace import check_device_sampling, csc_bytes, gpu_bytes, measured_pace, sample_on

    gpus = [n for n in preflight.nodes() if n.gpus > 0]
    requested = cfg.sampler.sample_on
    pace = {}
    if requested == "auto" and use_gpu and cfg.sampler.backend == "native":  # this graph's pace, not a figure's
        pace["seeds_per_core"] = measured_pace(graph, cfg.sampler.fanouts, cfg.sampler.batch_size, cfg.run.seed)
    where, why = sample_on(requested, use_gpu, csc_bytes(graph), gpu_bytes() if use_gpu else None,
                           min((n.cpus / n.gpus for n in gpus), default=0.0), cfg.sampler.batch_size, **pace)
    cfg = dataclasses.replace(cfg, sampler=dataclasses.replace(cfg.sampler, sample_on=where))
    check_device_sampling(cfg)
    if use_gpu or requested != "auto":
        place = "on each train worker's device" if where == "device" else "in sampler actors"
        console.say(f"sampling plan: {place} ({why})")
    return cfg


def cpu_policy(cfg: JobConfig, use_gpu: bool) -> Optional[CpuPolicy]:
    """The job's CPU plan (``--cpu-plan``), printed once as this node's plan; ``None`` when off."""
    from gnnray.driver import console

    if cfg.train.cpu_plan == "off":
        return None
    nodes = [n for n in preflight.nodes() if n.cpus > 0]
    policy = CpuPolicy(True, samplers_per_node(cfg.sampler.actors_max, len(nodes)), use_gpu,
                       cfg.train.trainer_threads)
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
