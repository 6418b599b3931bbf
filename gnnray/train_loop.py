"""Stage 6 (train worker): the training loop each Ray Train worker runs.

Input: this rank's shard of the sampled mini-batch stream, the node-shared
graph (features for the gather, the structure for evaluation sampling) and the
job configuration. Output: per-epoch ``ray.train.report`` with metrics and a
checkpoint (rank 0 writes it).

Each rank takes exactly ``steps_per_epoch`` rows per epoch from one stream that
spans the run; the seeds stage made the row count divisible by the number of
ranks, so every rank takes the same number of optimizer steps.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F

from gnnray import checkpoint
from gnnray.batch import MiniBatch, from_arrow
from gnnray.config import JobConfig
from gnnray.embedding import NodeEmbedding
from gnnray.graph_store import Graph, GraphHandle
from gnnray.metrics import TrainMetrics
from gnnray.prefetch import Prefetcher
from gnnray.sampling import Sampler
from gnnray.seeds import steps_per_epoch

ModelFactory = Callable[[int, int, JobConfig], torch.nn.Module]


@dataclass(frozen=True)
class WorkerSetup:
    """What the driver hands every train worker.

    Attributes:
        cfg: The job configuration.
        graph: Handle of the node-shared graph.
        first_epoch: The epoch the seed stream starts at.
        resume_from: Checkpoint directory to restore, chosen by the driver.
        restarts: How many times the driver restarted the run so far.
        metrics_log: File rank 0 appends each epoch's metrics to, as JSON
            lines; the driver prints them as they arrive.
        model_factory: ``(in_feats, num_classes, cfg) -> nn.Module`` whose
            ``forward(blocks, x)`` returns logits; GraphSAGE by default.
    """

    cfg: JobConfig
    graph: GraphHandle
    first_epoch: int
    resume_from: Optional[str] = None
    restarts: int = 0
    metrics_log: Optional[str] = None
    model_factory: Optional[ModelFactory] = None


def default_model(in_feats: int, num_classes: int, cfg: JobConfig) -> torch.nn.Module:
    """The model ``--model`` names (GraphSAGE by default), sized by the configuration."""
    from gnnray.model import build_model

    return build_model(in_feats, num_classes, cfg.sampler.num_layers, cfg.model.hidden, cfg.model.dropout,
                       name=cfg.model.name, heads=cfg.model.heads)


def train_loop(config: dict) -> None:
    """The ``train_loop_per_worker`` of the job's ``TorchTrainer``; ``config["setup"]`` is a :class:`WorkerSetup`."""
    import ray.train
    import ray.train.torch

    setup: WorkerSetup = config["setup"]
    cfg = setup.cfg
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank

    graph = setup.graph.get()
    model = (setup.model_factory or default_model)(graph.feat_dim + cfg.data.embedding_dim, graph.num_classes, cfg)
    # Replicated on every rank, outside DDP; see gnnray.embedding for how the ranks stay consistent.
    embedding = (NodeEmbedding(graph.num_nodes, cfg.data.embedding_dim, cfg.train.embedding_lr or cfg.train.lr,
                               cfg.train.seed) if cfg.data.embedding_dim else None)
    state = checkpoint.load_state(setup.resume_from) if setup.resume_from else None
    if state:
        model.load_state_dict(state["model"])
        if embedding:
            embedding.load_state_dict(state["embedding"])
    model = ray.train.torch.prepare_model(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    start, best_val = setup.first_epoch, 0.0
    if state:  # after prepare_model: load_state_dict moves the state to the parameters' device
        optimizer.load_state_dict(state["optimizer"])
        start, best_val = state["epoch"] + 1, state["best_val_acc"]

    steps = steps_per_epoch(len(graph.train_idx), cfg.sampler.batch_size, world)
    shard = ray.train.get_dataset_shard("train")
    # Whole blocks, rows sliced out by from_arrow: Ray Data's own per-row
    # batching costs more than the slicing (docs/performance.md).
    blocks = shard.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=1)
    rows = (row for block in blocks for row in from_arrow(block))
    evaluator = _Evaluator(graph, cfg, rank, world, device, embedding)
    exported = TrainMetrics(cfg.run.name, rank)

    with Prefetcher(rows, graph.feat, device, depth=cfg.train.prefetch) as batches:
        for _ in range((start - setup.first_epoch) * steps):  # stream starts before the checkpoint: skip
            next(batches)
        for epoch in range(start, cfg.train.epochs):
            stats = _train_epoch(model, optimizer, batches, steps, graph.num_classes, device, exported, embedding)
            val_acc = evaluator.accuracy(model, "valid")
            best_val = max(best_val, val_acc)
            metrics = dict(epoch=epoch, **stats, val_acc=val_acc, best_val_acc=best_val, restarts=setup.restarts)
            if epoch == cfg.train.epochs - 1:
                metrics["test_acc"] = evaluator.accuracy(model, "test")
            metrics["worker_uss_mb"] = _max_private_memory_mb(device)
            exported.epoch(epoch, metrics)
            _report(metrics, model, optimizer, rank, setup.metrics_log, embedding, _saved_config(setup))


def _train_epoch(model, optimizer, batches: Iterator[MiniBatch], steps: int, num_classes: int, device,
                 exported: Optional[TrainMetrics] = None, embedding: Optional[NodeEmbedding] = None) -> dict:
    from torchmetrics import MeanMetric, SumMetric
    from torchmetrics.classification import MulticlassAccuracy

    loss_avg, wait_avg = MeanMetric().to(device), MeanMetric().to(device)
    seeds_sum, acc = SumMetric().to(device), MulticlassAccuracy(num_classes, average="micro").to(device)
    model.train()
    start = time.perf_counter()
    wait = 0.0
    for _ in range(steps):
        t = time.perf_counter()
        mb = next(batches)
        waited = time.perf_counter() - t
        wait += waited
        logits = model(mb.blocks(), model_input(mb, embedding))
        # An empty batch (a split smaller than the ranks) still steps, with a
        # zero loss, so every rank joins the same DDP all-reduces.
        loss = F.cross_entropy(logits, mb.labels) if mb.num_seeds else logits.sum() * 0.0
        optimizer.zero_grad(set_to_none=True)
        if embedding:
            embedding.zero_grad()
        loss.backward()
        optimizer.step()
        if embedding:
            embedding.step()  # sparse all-reduce over the ranks, then SparseAdam
        if mb.num_seeds:
            loss_avg.update(loss.detach(), weight=mb.num_seeds)
            acc.update(logits.argmax(1), mb.labels)
        seeds_sum.update(mb.num_seeds)
        if exported:
            exported.step(time.perf_counter() - t, waited, mb.num_seeds)
    elapsed = time.perf_counter() - start
    wait_avg.update(wait / elapsed)
    seeds = float(seeds_sum.compute())
    return dict(loss=float(loss_avg.compute()), train_acc=float(acc.compute()), epoch_time=elapsed,
                seeds_per_s=seeds / elapsed, data_wait=float(wait_avg.compute()))


class _Evaluator:
    """Sampled evaluation of a split: each rank takes every ``world``-th node, so the ranks cover each node once."""

    def __init__(self, graph: Graph, cfg: JobConfig, rank: int, world: int, device,
                 embedding: Optional[NodeEmbedding] = None):
        self._graph, self._cfg, self._rank, self._world, self._device = graph, cfg, rank, world, device
        self._embedding = embedding
        self._sampler = Sampler(graph, cfg.sampler.fanouts)

    def accuracy(self, model, split: str) -> float:
        from torchmetrics.classification import MulticlassAccuracy

        ids = self._graph.split(split)[self._rank::self._world]
        chunks = [ids[i:i + self._cfg.train.eval_batch_size] for i in range(0, len(ids), self._cfg.train.eval_batch_size)]
        acc = MulticlassAccuracy(self._graph.num_classes, average="micro").to(self._device)
        net = getattr(model, "module", model)  # no DDP hooks needed without backward
        net.eval()
        packed = (self._sampler.sample(chunk).pack(self._sampler.id_dtype) for chunk in chunks)
        with torch.no_grad(), Prefetcher(packed, self._graph.feat, self._device, self._cfg.train.prefetch) as batches:
            for mb in batches:
                acc.update(net(mb.blocks(), model_input(mb, self._embedding)).argmax(1), mb.labels)
        return float(acc.compute())  # synchronised across ranks by torchmetrics


def model_input(mb: MiniBatch, embedding: Optional[NodeEmbedding]) -> torch.Tensor:
    """The model's input for ``mb``: its features, then its input nodes' embeddings if the job learns them."""
    if embedding is None:
        return mb.x
    return torch.cat([mb.x, embedding(mb.input_nodes).to(mb.x.device)], dim=1)


def _saved_config(setup: WorkerSetup) -> dict:
    """The configuration a checkpoint stores, so that ``jobs/predict.py`` can rebuild model and graph."""
    return {**dataclasses.asdict(setup.cfg), "custom_model": setup.model_factory is not None}


def _max_private_memory_mb(device) -> float:
    """The largest private memory (USS, MiB) of the ranks' processes; flat over epochs in a healthy run.

    USS leaves out the node-shared graph, so it shows what each process holds
    by itself (``worker_uss_mb`` in the metrics). Free memory the C allocator
    keeps is handed back first (glibc ``malloc_trim``): it is not growth, and
    returning it once an epoch is cheap.
    """
    import ctypes

    import psutil
    import torch.distributed as dist

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    uss = torch.tensor(psutil.Process().memory_full_info().uss / 2**20, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(uss, op=dist.ReduceOp.MAX)
    return float(uss)


def _report(metrics: dict, model, optimizer, rank: int, metrics_log: Optional[str],
            embedding: Optional[NodeEmbedding] = None, config: Optional[dict] = None) -> None:
    import ray.train

    if rank != 0:
        ray.train.report(metrics)
        return
    # The log line goes first: a crash between the two then repeats the
    # epoch's line after the restart, rather than losing it while its
    # checkpoint exists.
    if metrics_log:
        with open(metrics_log, "a") as f:
            f.write(json.dumps(metrics) + "\n")
    with tempfile.TemporaryDirectory() as tmp:
        extra = {"embedding": embedding.state_dict()} if embedding else None
        checkpoint.save(tmp, getattr(model, "module", model), optimizer, metrics, extra=extra, config=config)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
