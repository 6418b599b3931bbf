"""Stage 7 (train worker): the training loop each Ray Train worker runs.

Input: this rank's shard of the sampled mini-batch stream, the node-shared
graph (features for the gather, the structure for evaluation sampling) and the
job configuration. Output: per-epoch ``ray.train.report`` with metrics and,
when ``--checkpoint-interval`` says one is due, a checkpoint (rank 0 writes it).

Each rank takes exactly ``steps_per_epoch`` rows per epoch from one stream that
spans the run; the seeds stage made the row count divisible by the number of
ranks, so every rank takes the same number of optimizer steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F

from gnnray.config import JobConfig
from gnnray.cpus import CpuPolicy
from gnnray.data.store import GraphHandle
from gnnray.logs import quiet_console
from gnnray.metrics import TrainMetrics
from gnnray.pipeline.batch import MiniBatch, from_arrow
from gnnray.pipeline.features import reader_for
from gnnray.pipeline.prefetch import Prefetcher
from gnnray.pipeline.seeds import steps_per_epoch
from gnnray.train import checkpoint
from gnnray.train.embedding import EmbeddingTable, NodeEmbedding, ShardedEmbedding
from gnnray.train.evaluate import Evaluator
from gnnray.train.model import model_for
from gnnray.train.report import METRICS_LOG, PrivateMemory, Progress, report, saved_config

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
        run_dir: The run's directory: rank 0 appends each epoch's metrics to
            its ``metrics.jsonl`` and records progress there; the driver
            prints both as they arrive.
        model_factory: ``(in_feats, num_classes, cfg) -> nn.Module`` whose
            ``forward(blocks, x)`` returns logits; ``--model`` by default.
        embedding_owners: With ``--feature-shards`` and ``--embedding-dim``:
            the owners of the embedding table's shards (``train.embedding.create_owners``).
        cpu: The job's CPU plan (:mod:`gnnray.cpus`); ``None`` leaves Ray's defaults.
    """

    cfg: JobConfig
    graph: GraphHandle
    first_epoch: int
    resume_from: Optional[str] = None
    restarts: int = 0
    run_dir: Optional[str] = None
    model_factory: Optional[ModelFactory] = None
    embedding_owners: Optional[tuple] = None
    cpu: Optional[CpuPolicy] = None


def train_loop(config: dict) -> None:
    """The ``train_loop_per_worker`` of the job's ``TorchTrainer``; ``config["setup"]`` is a :class:`WorkerSetup`."""
    import os

    import ray.train
    import ray.train.torch

    setup: WorkerSetup = config["setup"]
    cfg = setup.cfg
    # Ray Train's per-report INFO lines reach the root logger's console here;
    # its app log file keeps them (README, "Logs").
    quiet_console("", cfg.run.verbose)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    # Threads and cores before the first parallel region (the plan's other parts came with the process).
    cpu_used = setup.cpu.apply_trainer(ctx.get_local_rank(), ctx.get_local_world_size()) if setup.cpu else {}
    torch.manual_seed(cfg.run.seed)  # identical initial weights on every rank

    # 1. The node-shared graph and its features (sharded or not), the model and, with --embedding-dim, the
    # node embeddings.
    graph = setup.graph.get()
    features = reader_for(graph, setup.graph.features)
    in_feats = setup.graph.feat_dim + cfg.data.embedding_dim
    model = (setup.model_factory(in_feats, graph.num_classes, cfg) if setup.model_factory
             else model_for(in_feats, graph.num_classes, cfg, graph.num_relations))
    # Outside DDP: replicated on every rank, or with --feature-shards held by owners on the shard nodes; see
    # gnnray.train.embedding for how the ranks stay consistent.
    embedding_lr = cfg.train.embedding_lr or cfg.train.lr
    embedding = None
    if setup.embedding_owners:
        embedding = ShardedEmbedding(setup.embedding_owners, graph.num_nodes, cfg.data.embedding_dim, embedding_lr,
                                     cfg.data.feature_timeout)
    elif cfg.data.embedding_dim:
        embedding = NodeEmbedding(graph.num_nodes, cfg.data.embedding_dim, embedding_lr, cfg.run.seed)

    # 2. Restore the checkpoint the driver chose, if any (the owners of a sharded table are reset without one:
    # they outlive a failed attempt). The embedding's rows are read by whoever holds them, from the files that
    # hold them, whatever the shards of the run that wrote it (gnnray.train.checkpoint).
    state = checkpoint.load_state(setup.resume_from) if setup.resume_from else None
    if state:
        model.load_state_dict(state["model"])
    if setup.resume_from and embedding or isinstance(embedding, ShardedEmbedding):
        embedding.load(setup.resume_from)

    # 3. Ray Train: wrap the model in DDP and move it to this worker's device.
    model = ray.train.torch.prepare_model(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    start, best_val = setup.first_epoch, 0.0
    if state:  # after prepare_model: load_state_dict moves the state to the parameters' device
        optimizer.load_state_dict(state["optimizer"])
        start, best_val = state["epoch"] + 1, state["best_val_acc"]

    # 4. Ray Train: this rank's shard of the mini-batch stream. Whole blocks,
    # rows sliced out by from_arrow: cheaper than Ray Data's per-row batching.
    # No extra block prefetch: the split iterator already fetches one block
    # ahead and the Prefetcher prepares --prefetch batches (read_ahead.py).
    steps = steps_per_epoch(len(graph.train_idx), cfg.sampler.batch_size, world)
    shard = ray.train.get_dataset_shard("train")
    blocks = shard.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0)
    rows = (row for block in blocks for row in from_arrow(block))
    evaluator = Evaluator(graph, cfg, rank, world, device, embedding, reader_for(graph, setup.graph.features))
    exported = TrainMetrics(cfg.run.name, rank)
    progress = Progress(setup.run_dir if rank == 0 else None)
    metrics_log = os.path.join(setup.run_dir, METRICS_LOG) if setup.run_dir and rank == 0 else None

    # The embedding's rows are looked up on the prefetch thread too (counted in data_wait, as features are).
    with Prefetcher(rows, features, device, depth=cfg.train.prefetch, embedding=embedding) as batches:
        for _ in range((start - setup.first_epoch) * steps):  # stream starts before the checkpoint: skip
            next(batches)
        memory, schedule = PrivateMemory(), checkpoint.Schedule(cfg.run.checkpoint_interval)
        for epoch in range(start, cfg.train.epochs):
            # 5. Train one epoch, then evaluate (sampled, all ranks together).
            fetched = features.stats()
            stats = train_epoch(model, optimizer, batches, steps, graph.num_classes, device, exported, embedding,
                                lambda step: progress.update(epoch, step, steps))
            if setup.graph.features is not None:  # what sharding cost this rank (the prefetch thread's gathers)
                stats.update(exported.features(features.stats().since(fetched)))
            val_acc = evaluator.accuracy(model, "valid")
            best_val = max(best_val, val_acc)
            metrics = dict(epoch=epoch, **stats, val_acc=val_acc, best_val_acc=best_val, restarts=setup.restarts)
            last = epoch == cfg.train.epochs - 1
            if last:
                metrics["test_acc"] = evaluator.accuracy(model, "test")
            metrics["worker_uss_mb"] = memory.max_mb(device, fresh=last)
            if cpu_used:  # what the CPU plan gave this rank (README, "The CPU plan")
                metrics.update(cpu_threads=cpu_used["torch_threads"], cpu_cores=cpu_used["cores"],
                               cpu_nice=cpu_used["nice"])
            exported.epoch(epoch, metrics)
            # 6. Ray Train: every rank reports every epoch; rank 0 attaches a checkpoint when one is due.
            save = rank == 0 and schedule.due(final=last)
            report(metrics, model, optimizer, rank, metrics_log, embedding,
                   saved_config(cfg, setup.model_factory is not None) if save else None, save)
            if save:
                schedule.saved()


def train_epoch(model, optimizer, batches: Iterator[MiniBatch], steps: int, num_classes: int, device,
                exported: Optional[TrainMetrics] = None, embedding: Optional[EmbeddingTable] = None,
                on_step: Optional[Callable[[int], None]] = None) -> dict:
    """Take ``steps`` optimizer steps over ``batches``; return the epoch's metrics, reduced over the ranks.

    A batch's ``x`` is the model's whole input: with ``embedding``, ``batches`` is a
    :class:`Prefetcher` given it, which appended the embedding's rows.
    """
    from torchmetrics import MeanMetric, SumMetric
    from torchmetrics.classification import MulticlassAccuracy

    loss_avg, wait_avg = MeanMetric().to(device), MeanMetric().to(device)
    seeds_sum, acc = SumMetric().to(device), MulticlassAccuracy(num_classes, average="micro").to(device)
    model.train()
    start = time.perf_counter()
    wait = 0.0
    for step in range(steps):
        t = time.perf_counter()
        mb = next(batches)
        waited = time.perf_counter() - t
        wait += waited
        logits = model(mb.blocks(), mb.x)
        # An empty batch (a split smaller than the ranks) still steps, with a
        # zero loss, so every rank joins the same DDP all-reduces.
        loss = F.cross_entropy(logits, mb.labels) if mb.num_seeds else logits.sum() * 0.0
        optimizer.zero_grad(set_to_none=True)
        if embedding:
            embedding.zero_grad()
        loss.backward()
        optimizer.step()
        if embedding:
            embedding.step()  # sparse all-reduce over the ranks, then DGL's SparseAdam on the rows' holders
        if mb.num_seeds:
            loss_avg.update(loss.detach(), weight=mb.num_seeds)
            acc.update(logits.argmax(1), mb.labels)
        seeds_sum.update(mb.num_seeds)
        if exported:
            exported.step(time.perf_counter() - t, waited, mb.num_seeds)
        if on_step:
            on_step(step + 1)
    elapsed = time.perf_counter() - start
    wait_avg.update(wait / elapsed)
    seeds = float(seeds_sum.compute())
    return dict(loss=float(loss_avg.compute()), train_acc=float(acc.compute()), epoch_time=elapsed,
                seeds_per_s=seeds / elapsed, data_wait=float(wait_avg.compute()))
