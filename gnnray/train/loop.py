"""Stage 7 (train worker): the training loop each Ray Train worker runs.

Input: this rank's shard of the sampled mini-batch stream, the node-shared
graph (features for the gather, the structure for evaluation sampling) and the
job configuration. Output: per-epoch ``ray.train.report`` with metrics and,
when ``--checkpoint-interval`` says one is due, a checkpoint (rank 0 writes it);
checkpoints within an epoch every ``--checkpoint-every`` steps and, in an
elastic run, on a preemption notice (``train/step_checkpoints.py``).

Each rank takes exactly ``steps_per_epoch`` rows per epoch from one stream that
spans the run; the seeds stage made the row count divisible by the number of
ranks and hands each rank its own piece of every step, in order, so after
``k`` steps the ranks have trained exactly the epoch's first ``k`` steps.

An elastic run (``--num-workers MIN,MAX``) runs this function once per worker
group: Ray Train restarts it with the new world size at every resize. Its
stream, made for the group when rank 0 first asks for it, starts at the newest
checkpoint (``controller/split.py``), and every rank restores that checkpoint.
"""

from __future__ import annotations

import time
from typing import Iterator, Optional

import torch

from gnnray.batch import MiniBatch, from_arrow
from gnnray.config import JobConfig
from gnnray.errors import GnnrayError
from gnnray.logs import quiet_console
from gnnray.metrics import TrainMetrics
from gnnray.models.model import model_for
from gnnray.seeds import SeedPlan, plan_key, rank_rows, steps_per_epoch, streams
from gnnray.stack import check_here
from gnnray.train import captured, checkpoint
from gnnray.train.device_sampler import device_batches
from gnnray.train.embedding import NodeEmbedding, ShardedEmbedding
from gnnray.train.evaluate import Evaluator
from gnnray.train.feature_reader import reader_for
from gnnray.train.gpu_budget import csc_bytes
from gnnray.train.layerwise import EmbeddingRows, infer, supports_layerwise
from gnnray.train.placement import free_for_features, place
from gnnray.train.prefetch import Prefetcher
from gnnray.train.report import PrivateMemory, Progress, events, log_event, report, saved_config
from gnnray.train.setup import WorkerSetup
from gnnray.train.step import seed_dropout, train_epoch
from gnnray.train.step_checkpoints import StepCheckpoints
from gnnray.train.stream_start import StreamStart


def train_loop(config: dict) -> None:
    """The ``train_loop_per_worker`` of the job's Ray Train trainer; ``config["setup"]`` is a :class:`WorkerSetup`.

    Its steps, in order: where this group's stream starts (:class:`StreamStart`), the model and embedding
    (:func:`build`), the checkpoint restored into them (:func:`restore`), DDP and the optimizer
    (:func:`prepare`), this rank's batches (:func:`open_batches`), then each epoch trained, evaluated and
    reported (:meth:`Rank.run_epoch`).
    """
    import ray.train
    import ray.train.torch

    setup: WorkerSetup = config["setup"]
    cfg = setup.cfg
    # Ray Train's per-report INFO lines reach the root logger's console here;
    # its app log file keeps them (docs/running.md#monitoring).
    quiet_console("", cfg.run.verbose)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    check_here(setup.stack, f"rank {rank}")  # a node that joined later is checked by its first process
    # An elastic group's stream is made when rank 0 first asks for it, and says where it starts: asked first, so
    # that its sampler pool starts while the model is built.
    shard = ray.train.get_dataset_shard("train") if cfg.train.elastic else None
    # The stream starts there; the checkpoint holds the model of that point.
    begin = StreamStart.of(setup, world, events)
    if begin.epoch >= cfg.train.epochs:  # an elastic run that finished just before this group started
        return
    device = ray.train.torch.get_device()
    # Threads and cores before the first parallel region (the plan's other parts came with the process).
    cpu_used = setup.cpu.apply_trainer(ctx.get_local_rank(), ctx.get_local_world_size()) if setup.cpu else {}
    torch.manual_seed(cfg.run.seed)  # identical initial weights on every rank (dropout: seed_dropout, per epoch)

    graph = setup.graph.get()
    features = reader_for(graph, setup.graph.features)
    model, embedding = build(setup, graph)
    state = restore(begin.checkpoint, model, embedding)
    # A lone GPU rank's step is captured as a CUDA graph; Adam must then keep its step count on the device.
    why_not = captured.refusal(device, world, model, embedding) if cfg.train.capture_step == "auto" else "off"
    model, optimizer = prepare(model, state, cfg, capturable=why_not is None)
    if shard is None and streams(cfg):
        shard = ray.train.get_dataset_shard("train")
    me = Rank(setup, rank, world, device, graph, features, model, optimizer, embedding, cpu_used, begin,
              best_val=state["best_val_acc"] if state else 0.0)
    me.capture(why_not)
    with open_batches(shard, me) as batches:
        for epoch in range(begin.epoch, cfg.train.epochs):
            me.run_epoch(epoch, batches)


def build(setup: WorkerSetup, graph) -> tuple:
    """The model and, with ``--embedding-dim``, the node embedding: ``(model, embedding or None)``.

    The embedding stays outside DDP: replicated on every rank, or with ``--feature-shards`` held by owners on
    the shard nodes; gnnray.train.embedding says how the ranks stay consistent.
    """
    cfg = setup.cfg
    in_feats = setup.graph.feat_dim + cfg.data.embedding_dim
    model = (setup.model_factory(in_feats, graph.num_classes, cfg) if setup.model_factory
             else model_for(in_feats, graph.num_classes, cfg, graph.num_relations))
    lr = cfg.train.embedding_lr or cfg.train.lr
    if setup.embedding_owners:
        return model, ShardedEmbedding(setup.embedding_owners, graph.num_nodes, cfg.data.embedding_dim, lr,
                                       cfg.data.feature_timeout)
    if cfg.data.embedding_dim:
        return model, NodeEmbedding(graph.num_nodes, cfg.data.embedding_dim, lr, cfg.run.seed)
    return model, None


def restore(path: Optional[str], model, embedding) -> Optional[dict]:
    """Restore the checkpoint at ``path`` (if any) into the model and embedding; its state, for the optimizer.

    The owners of a sharded table are reset without one: they outlive a failed attempt. The embedding's rows
    are read by whoever holds them, from the files that hold them, whatever the shards of the run that wrote
    it (gnnray.train.checkpoint).
    """
    state = checkpoint.load_state(path) if path else None
    if state:
        model.load_state_dict(state["model"])
    if path and embedding or isinstance(embedding, ShardedEmbedding):
        embedding.load(path)
    return state


def prepare(model, state: Optional[dict], cfg: JobConfig, capturable: bool = False) -> tuple:
    """Ray Train: the model in DDP on this worker's device, and its optimizer (restored from ``state``).

    GPU ranks keep gnnray's SyncBatchNorm too: torch's reads back to the host on every call
    (gnnray.models.model.SyncBatchNorm).
    """
    import ray.train.torch

    model = ray.train.torch.prepare_model(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                                 capturable=capturable)
    if state:  # after prepare_model: load_state_dict moves the state to the parameters' device
        optimizer.load_state_dict(state["optimizer"])
        capture_where(optimizer, capturable)  # the checkpoint's groups say how the run that wrote it stepped
    return model, optimizer


def capture_where(optimizer, capturable: bool) -> None:
    """Make Adam capturable (its step counts on the parameters' device) or not (on the host), whatever the
    checkpoint it was loaded from: a run resumed on CPUs from a captured GPU run's checkpoint, or the reverse."""
    for group in optimizer.param_groups:
        group["capturable"] = capturable
        for p in group["params"]:
            st = optimizer.state.get(p, {})
            if "step" in st:
                st["step"] = st["step"].to(torch.float32).to(p.device if capturable else "cpu")


class Rank:
    """What one rank trains, evaluates and reports with, epoch after epoch (:meth:`run_epoch`)."""

    def __init__(self, setup: WorkerSetup, rank: int, world: int, device, graph, features, model, optimizer,
                 embedding, cpu_used: dict, begin: StreamStart, best_val: float):
        cfg = self.cfg = setup.cfg
        self.setup, self.rank, self.world, self.device = setup, rank, world, device
        self.graph, self.features, self.model, self.embedding = graph, features, model, embedding
        self.optimizer, self.cpu_used, self.begin, self.best_val = optimizer, cpu_used, begin, best_val
        self.captured: Optional[captured.CapturedStep] = None  # set by capture()
        # Steps per epoch are those of the largest group: a fixed run's only one, an elastic run's global batch.
        self.steps = steps_per_epoch(len(graph.train_idx), cfg.sampler.batch_size, cfg.train.workers_max)
        self.evaluator = Evaluator(graph, cfg, rank, world, device, embedding, reader_for(graph, setup.graph.features),
                                   setup.graph, setup.stack)
        self.exported = TrainMetrics(cfg.run.name, rank)
        self.progress = Progress(setup.run_dir if rank == 0 else None)
        self.config_saved = saved_config(cfg, setup.model_factory is not None)
        self.memory = PrivateMemory()
        self.saves = StepCheckpoints(cfg, rank, world, model, optimizer, embedding, self.config_saved,
                                     checkpoint.Schedule(cfg.run.checkpoint_interval), setup.run_dir,
                                     plan_key(len(graph.train_idx), cfg.sampler.batch_size, cfg.train.num_workers))
        self.saves.restarts = begin.restarts
        # After the model: what a table on the device may take is measured with the model there, and the device
        # sampler's structure (copied when the batches open) is kept out of it: one budget of this worker's GPU.
        structure = csc_bytes(graph) if cfg.sampler.sample_on == "device" else 0
        self.placed = place(cfg.data.feature_placement, features, device, graph.indptr,
                            free_for_features(device, structure))
        _log_placement(self.placed, rank, setup.run_dir)
        if rank == 0 and setup.run_dir:  # where this run's batches are sampled, as the plan resolved it
            where = "actors" if cfg.sampler.sample_on == "actors" else f"worker ({torch.device(device).type})"
            log_event(setup.run_dir, "sampling", where=where, threads=torch.get_num_threads())

    def capture(self, why_not: Optional[str]) -> None:
        """Replay the step from a CUDA graph unless ``why_not`` says why it cannot be (rank 0 logs which)."""
        run_dir = self.setup.run_dir if self.rank == 0 else None

        def said(replayed: bool, why: str = "") -> None:  # the run's event log; bench.gpu.placements reads it
            if run_dir:
                log_event(run_dir, "step", captured=replayed, why_not=why)

        self.captured = (captured.CapturedStep(self.model, self.optimizer, self.device, lambda why: said(False, why))
                         if why_not is None else None)
        said(why_not is None, why_not or "")

    def run_epoch(self, epoch: int, batches: Iterator[MiniBatch]) -> None:
        """Train the epoch (from the checkpoint's step if it was cut short), evaluate (sampled, all ranks
        together; after the last epoch also layer-wise, gnnray.train.layerwise), report."""
        cfg, saves = self.cfg, self.saves
        done = self.begin.step if epoch == self.begin.epoch else 0
        seed_dropout(cfg.run.seed, self.rank, epoch, done)
        fetched = self.features.stats()
        saves.best_val = self.best_val

        def after_step(step: int) -> None:
            self.progress.update(epoch, done + step, self.steps)
            saves.after_step(epoch, done + step, self.steps)

        stats = train_epoch(self.model, self.optimizer, of_epoch(batches, epoch, self.rank), self.steps - done,
                            self.graph.num_classes, self.device, self.exported, self.embedding, after_step,
                            self.captured)
        if self.setup.graph.features is not None:  # what sharding cost this rank (the prefetch thread's gathers)
            stats.update(self.exported.features(self.features.stats().since(fetched)))
        started = time.monotonic()
        val_acc = self.evaluator.accuracy(self.model, "valid")
        self.best_val = max(self.best_val, val_acc)
        metrics = dict(epoch=epoch, **stats, val_acc=val_acc, best_val_acc=self.best_val, restarts=saves.restarts,
                       world_size=self.world, first_step=done)
        last = epoch == cfg.train.epochs - 1
        if last:
            metrics["test_acc"] = self.evaluator.accuracy(self.model, "test")
        metrics["eval_time"] = time.monotonic() - started  # sampled validation (and test), this rank
        if last and cfg.train.eval == "layerwise" and supports_layerwise(self.model):
            metrics.update(final_layerwise(self.model, self.graph, self.setup, self.embedding, self.device,
                                           self.rank, self.world, metrics["test_acc"]))
        metrics["worker_uss_mb"] = self.memory.max_mb(self.device, fresh=last)
        if self.cpu_used:  # what the CPU plan gave this rank (docs/cpu-plan.md#the-budget)
            metrics.update(cpu_threads=self.cpu_used["torch_threads"], cpu_cores=self.cpu_used["cores"],
                           cpu_nice=self.cpu_used["nice"])
        self.exported.epoch(epoch, metrics)
        # Ray Train: every rank reports every epoch; rank 0 attaches a checkpoint when one is due.
        save = saves.at_epoch_end(last)
        report(metrics, self.model, self.optimizer, self.rank, self.setup.run_dir, self.embedding,
               self.config_saved if save else None, save)
        saves.epoch_ended(save, time.monotonic() - started)


def open_batches(shard, me: Rank):
    """Ray Train: this rank's batches of the mini-batch stream, a context manager (its prefetch thread).

    Whole blocks, rows sliced out by from_arrow: cheaper than Ray Data's per-row batching. No extra block
    prefetch: the split iterator already fetches one block ahead and the Prefetcher prepares --prefetch
    batches (read_ahead.py). The embedding's rows are looked up on the prefetch thread too (counted in
    data_wait, as features are).
    """
    cfg = me.cfg
    if cfg.sampler.sample_on == "device":  # seed rows, sampled here on the device (resolved by the driver)
        if shard is not None:
            blocks = shard.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=0)
            rows = (row for block in blocks for row in block["row"].tolist())
        else:
            rows = rank_rows(SeedPlan.for_run(me.graph.train_idx, cfg.sampler.batch_size, me.world, cfg.run.seed),
                             me.rank, me.begin.epoch, cfg.train.epochs, me.begin.step)
        return device_batches(rows, me.graph, cfg, me.world, me.features, me.device, me.placed)
    blocks = shard.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0)
    rows = (row for block in blocks for row in from_arrow(block))
    return Prefetcher(rows, me.features, me.device, depth=cfg.train.prefetch, embedding=me.embedding,
                      placed=me.placed)


def _log_placement(placed, rank: int, run_dir: Optional[str]) -> None:
    """Where this rank gathers features: in its worker log, and rank 0's in the run's event log."""
    import logging

    what = dict(placement="host") if placed is None else dict(placement=placed.mode, resident_rows=placed.resident_rows,
                                                              note=placed.note)
    logging.getLogger(__name__).info("rank %d features: %s", rank, what)
    if rank == 0 and run_dir:
        log_event(run_dir, "features", **what)


def final_layerwise(model, graph, setup: WorkerSetup, embedding, device, rank: int, world: int,
                    sampled_test_acc: float) -> dict:
    """The final accuracies by layer-wise inference on the ranks (``--eval layerwise``), as the report holds them."""
    inputs = [reader_for(graph, setup.graph.features)]
    if embedding is not None:
        inputs.append(EmbeddingRows(embedding))
    result = infer(model, graph, inputs, setup.cfg.train.inference_batch_size, device, rank, world,
                   shards=setup.graph.features)
    acc = result.accuracy
    return {"eval": "layerwise", "val_acc_layerwise": acc["valid"], "test_acc": acc["test"],
            "test_acc_sampled": sampled_test_acc, "inference_s": result.seconds}


def of_epoch(batches: Iterator[MiniBatch], epoch: int, rank: int) -> Iterator[MiniBatch]:
    """``batches`` of ``epoch``; a batch of another epoch means the stream and the plan disagree: raise."""
    for mb in batches:
        if mb.epoch != epoch:
            raise GnnrayError(f"rank {rank} got a mini-batch of epoch {mb.epoch} while training epoch {epoch}: the "
                              f"stream does not follow the seed plan (a bug; the run can resume from its last "
                              f"checkpoint)")
        yield mb
