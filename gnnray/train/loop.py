"""Stage 7 (train worker): the training loop each Ray Train worker runs.

Input: this rank's shard of the sampled mini-batch stream, the node-shared
graph (features for the gather, the structure for evaluation sampling) and the
job configuration. Output: per-epoch ``ray.train.report`` with metrics and,
when ``--checkpoint-interval`` says one is due, a checkpoint (rank 0 writes it);
checkpoints within an epoch every ``--checkpoint-every`` steps and, in an
elastic run, on a preemption notice (:class:`StepCheckpoints`).

Each rank takes exactly ``steps_per_epoch`` rows per epoch from one stream that
spans the run; the seeds stage made the row count divisible by the number of
ranks and hands each rank its own piece of every step, in order, so after
``k`` steps the ranks have trained exactly the epoch's first ``k`` steps.

An elastic run (``--num-workers MIN,MAX``) runs this function once per worker
group: Ray Train restarts it with the new world size at every resize. Its
stream, made for the group when rank 0 first asks for it, starts at the newest
checkpoint (``driver/split.py``), and every rank restores that checkpoint.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from gnnray.config import JobConfig
from gnnray.errors import GnnrayError
from gnnray.logs import quiet_console
from gnnray.metrics import TrainMetrics
from gnnray.pipeline.batch import MiniBatch, from_arrow
from gnnray.pipeline.feature_reader import reader_for
from gnnray.pipeline.device_sampler import device_batches
from gnnray.pipeline.placement import place
from gnnray.pipeline.prefetch import Prefetcher
from gnnray.pipeline.seeds import plan_key, steps_per_epoch
from gnnray.stack import check_here
from gnnray.train import checkpoint
from gnnray.train.embedding import NodeEmbedding, ShardedEmbedding
from gnnray.train.evaluate import Evaluator
from gnnray.train.layerwise import EmbeddingRows, infer, supports_layerwise
from gnnray.train.model import model_for
from gnnray.train.report import PrivateMemory, Progress, events, log_event, report, report_position, saved_config
from gnnray.train.setup import WorkerSetup
from gnnray.train.step import seed_dropout, train_epoch


@dataclass(frozen=True)
class StreamStart:
    """Where this worker group's stream starts and the checkpoint that holds the model of that point.

    Attributes:
        epoch, step: The stream's first step.
        checkpoint: The checkpoint to restore (``None``: start fresh).
        restarts: Restarts before this group (driver restarts, or Ray Train's in an elastic run).
    """

    epoch: int
    step: int
    checkpoint: Optional[str]
    restarts: int

    @staticmethod
    def of(setup: WorkerSetup, world: int) -> "StreamStart":
        """The driver's choice (a fixed run), or what this elastic group's stream logged when it was made."""
        if not setup.cfg.train.elastic:
            return StreamStart(setup.first_epoch, setup.first_step, setup.resume_from, setup.restarts)
        start = [e for e in events(setup.run_dir) if e["event"] == "start"][-1]
        if start["world_size"] != world:
            raise GnnrayError(f"the stream was made for {start['world_size']} workers and this worker group has "
                              f"{world}: does another run of --name {setup.cfg.run.name!r} write to {setup.run_dir}?")
        return StreamStart(start["epoch"], start["step"], start["checkpoint"], start["attempt"])


def train_loop(config: dict) -> None:
    """The ``train_loop_per_worker`` of the job's ``TorchTrainer``; ``config["setup"]`` is a :class:`WorkerSetup`."""
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
    # 0. An elastic group's stream is made when rank 0 first asks for it, and says where it starts: asked first, so
    # that its sampler pool starts while the model is built.
    shard = ray.train.get_dataset_shard("train") if cfg.train.elastic else None
    begin = StreamStart.of(setup, world)  # the stream starts there; the checkpoint holds the model of that point
    if begin.epoch >= cfg.train.epochs:  # an elastic run that finished just before this group started
        return
    device = ray.train.torch.get_device()
    # Threads and cores before the first parallel region (the plan's other parts came with the process).
    cpu_used = setup.cpu.apply_trainer(ctx.get_local_rank(), ctx.get_local_world_size()) if setup.cpu else {}
    torch.manual_seed(cfg.run.seed)  # identical initial weights on every rank (dropout: seed_dropout, per epoch)

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

    # 2. Restore the chosen checkpoint, if any (the owners of a sharded table are reset without one: they
    # outlive a failed attempt). The embedding's rows are read by whoever holds them, from the files that
    # hold them, whatever the shards of the run that wrote it (gnnray.train.checkpoint).
    state = checkpoint.load_state(begin.checkpoint) if begin.checkpoint else None
    if state:
        model.load_state_dict(state["model"])
    if begin.checkpoint and embedding or isinstance(embedding, ShardedEmbedding):
        embedding.load(begin.checkpoint)

    # 3. Ray Train: wrap the model in DDP and move it to this worker's device. GPU ranks keep gnnray's
    # SyncBatchNorm too: torch's reads back to the host on every call (gnnray.train.model.SyncBatchNorm).
    model = ray.train.torch.prepare_model(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    best_val = 0.0
    if state:  # after prepare_model: load_state_dict moves the state to the parameters' device
        optimizer.load_state_dict(state["optimizer"])
        best_val = state["best_val_acc"]

    # 4. Ray Train: this rank's shard of the mini-batch stream. Whole blocks,
    # rows sliced out by from_arrow: cheaper than Ray Data's per-row batching.
    # No extra block prefetch: the split iterator already fetches one block
    # ahead and the Prefetcher prepares --prefetch batches (read_ahead.py).
    # Steps per epoch are those of the largest group: a fixed run's only one, an elastic run's global batch.
    steps = steps_per_epoch(len(graph.train_idx), cfg.sampler.batch_size, cfg.train.workers_max)
    if shard is None:
        shard = ray.train.get_dataset_shard("train")
    evaluator = Evaluator(graph, cfg, rank, world, device, embedding, reader_for(graph, setup.graph.features),
                          setup.graph, setup.stack)
    exported = TrainMetrics(cfg.run.name, rank)
    progress = Progress(setup.run_dir if rank == 0 else None)
    config_saved = saved_config(cfg, setup.model_factory is not None)
    memory, schedule = PrivateMemory(), checkpoint.Schedule(cfg.run.checkpoint_interval)
    saves = StepCheckpoints(cfg, rank, world, model, optimizer, embedding, config_saved, schedule, setup.run_dir,
                            plan_key(len(graph.train_idx), cfg.sampler.batch_size, cfg.train.num_workers))
    saves.restarts = begin.restarts
    # After the model: what a table on the device may take is measured with the model there.
    placed = place(cfg.data.feature_placement, features, device, graph.indptr)
    _log_placement(placed, rank, setup.run_dir)

    if cfg.sampler.sample_on == "device":  # seed rows, sampled here on the device (resolved by the driver)
        batches_in = device_batches(shard.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=0),
                                    graph, cfg, world, features, device)
    else:
        blocks = shard.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0)
        rows = (row for block in blocks for row in from_arrow(block))
        batches_in = Prefetcher(rows, features, device, depth=cfg.train.prefetch, embedding=embedding, placed=placed)
    # The embedding's rows are looked up on the prefetch thread too (counted in data_wait, as features are).
    with batches_in as batches:
        for epoch in range(begin.epoch, cfg.train.epochs):
            # 5. Train the epoch (from the checkpoint's step if it was cut short), then evaluate (sampled, all
            # ranks together; after the last epoch also layer-wise, gnnray.train.layerwise).
            done = begin.step if epoch == begin.epoch else 0
            seed_dropout(cfg.run.seed, rank, epoch, done)
            fetched = features.stats()
            saves.best_val = best_val

            def after_step(step: int, epoch=epoch, done=done) -> None:
                progress.update(epoch, done + step, steps)
                saves.after_step(epoch, done + step, steps)

            stats = train_epoch(model, optimizer, of_epoch(batches, epoch, rank), steps - done, graph.num_classes,
                                device, exported, embedding, after_step)
            if setup.graph.features is not None:  # what sharding cost this rank (the prefetch thread's gathers)
                stats.update(exported.features(features.stats().since(fetched)))
            started = time.monotonic()
            val_acc = evaluator.accuracy(model, "valid")
            best_val = max(best_val, val_acc)
            metrics = dict(epoch=epoch, **stats, val_acc=val_acc, best_val_acc=best_val, restarts=saves.restarts,
                           world_size=world, first_step=done)
            last = epoch == cfg.train.epochs - 1
            if last:
                metrics["test_acc"] = evaluator.accuracy(model, "test")
            metrics["eval_time"] = time.monotonic() - started  # sampled validation (and test), this rank
            if last and cfg.train.eval == "layerwise" and supports_layerwise(model):
                metrics.update(final_layerwise(model, graph, setup, embedding, device, rank, world,
                                               metrics["test_acc"]))
            metrics["worker_uss_mb"] = memory.max_mb(device, fresh=last)
            if cpu_used:  # what the CPU plan gave this rank (docs/cpu-plan.md#the-plan)
                metrics.update(cpu_threads=cpu_used["torch_threads"], cpu_cores=cpu_used["cores"],
                               cpu_nice=cpu_used["nice"])
            exported.epoch(epoch, metrics)
            # 6. Ray Train: every rank reports every epoch; rank 0 attaches a checkpoint when one is due.
            save = saves.at_epoch_end(last)
            report(metrics, model, optimizer, rank, setup.run_dir, embedding, config_saved if save else None, save)
            saves.epoch_ended(save, time.monotonic() - started)


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


class StepCheckpoints:
    """Checkpoints within an epoch: every ``--checkpoint-every`` steps and, in an elastic run, on a preemption notice.

    Every rank calls :meth:`after_step` after each step, so every rank takes
    part in the same ``ray.train.report`` calls: a checkpoint within an epoch
    is due after the same step on all ranks (a step count, or the notice that
    ``ray.train.get_preemption_info``, a barrier, gives every rank alike).
    The notice is asked for about every :data:`CHECK_S` seconds, a number of
    steps rank 0 sets at each epoch's end from its step time (the barrier is a
    round trip to Ray Train's synchronisation actor; its cost is in
    docs/elastic.md#preemption-no-step-lost-to-a-drained-node). Without ``--checkpoint-every`` a fixed run does nothing
    here.

    On a preemption notice rank 0 writes a checkpoint at once, and training
    goes on while the deadline is far; near it (:meth:`_near_deadline`, rank
    0's view given to all), a last checkpoint is written and every rank waits
    for Ray Train to restart the group without the drained node, so that no
    step is trained twice. A notice without a deadline holds right after the
    first checkpoint: Ray Train then restarts the group after its own default
    wait.
    """

    SAFETY_S = 5.0  # beside the measured step, checkpoint and evaluation times (_near_deadline)
    CHECK_S = 1.0  # how often to ask for a preemption notice; Ray Train's watcher looks every 5 s
    FIRST_CHECK_STEPS = 16  # until the first epoch's end has measured a step
    HOLD_PAST_DEADLINE_S = 120.0  # Ray Train restarts the group at the deadline; past this something is wrong

    def __init__(self, cfg: JobConfig, rank: int, world: int, model, optimizer, embedding, config: dict,
                 schedule: checkpoint.Schedule, run_dir: Optional[str], plan: list):
        self._every, self._elastic = cfg.run.checkpoint_every, cfg.train.elastic
        self._rank, self._world = rank, world
        self._model, self._optimizer, self._embedding, self._config = model, optimizer, embedding, config
        self._schedule, self._run_dir, self._plan = schedule, run_dir, plan
        self.best_val, self.restarts = 0.0, 0
        self._since = 0  # steps since the last checkpoint, the same on every rank
        self._steps, self._check_every = 0, self.FIRST_CHECK_STEPS  # steps of this group; same on every rank
        self._notice = None  # the preemption notice, once seen
        self._hold_after_epoch = False
        # Rank 0's recent step times and longest checkpoint and epoch end, for _near_deadline. The first step
        # of a group waits for the stream to start: not a step time.
        self._steps_s: collections.deque = collections.deque(maxlen=20)
        self._last_step_at = math.inf
        self._save_s = self._eval_s = 0.0

    def after_step(self, epoch: int, done: int, steps: int) -> None:
        """After step ``done`` (1-based) of ``epoch``'s ``steps``."""
        import ray.train

        now = time.monotonic()
        if now > self._last_step_at:
            self._steps_s.append(now - self._last_step_at)
        self._since += 1
        self._steps += 1
        within = done < steps  # the epoch's last step is checkpointed (or not) at the epoch's end
        noticed = False
        if self._elastic and self._notice is None and self._steps % self._check_every == 0:
            self._notice = ray.train.get_preemption_info()  # every rank at the same step: a barrier
            noticed = self._notice is not None
            if noticed and self._rank == 0 and self._run_dir:
                log_event(self._run_dir, "preempted", nodes=list(self._notice.preempted_node_ids),
                          deadline_ms=self._notice.deadline_ms, epoch=epoch, step=done, world_size=self._world)
        if within and (noticed or (self._every and self._since >= self._every)):
            self._save(epoch, done)
        if self._notice is not None and self._agreed_near_deadline():
            if not within:
                self._hold_after_epoch = True  # once the epoch-end checkpoint is written
            else:
                if self._since:
                    self._save(epoch, done)
                self._hold()
        self._last_step_at = time.monotonic()

    def at_epoch_end(self, last: bool) -> bool:
        """Whether rank 0 attaches a checkpoint to the epoch's report. With ``--checkpoint-every`` every rank
        learns it (they all count the steps since the last checkpoint), and in an elastic run the steps between
        two looks for a preemption notice."""
        due = self._rank == 0 and bool(self._schedule.due(final=last) or self._notice is not None
                                       or (self._every and self._since >= self._every))
        if self._every or self._elastic:
            import ray.train.collective

            step_s = sum(self._steps_s) / len(self._steps_s) if self._steps_s else 0.0
            check_every = max(1, min(1000, round(self.CHECK_S / step_s))) if step_s else self._check_every
            due, self._check_every = ray.train.collective.broadcast_from_rank_zero(
                (due, check_every) if self._rank == 0 else None)
        return bool(due)

    def epoch_ended(self, saved: bool, eval_s: float) -> None:
        """After the epoch's report; ``saved``: rank 0 attached a checkpoint to it."""
        self._eval_s = max(self._eval_s, eval_s)
        if saved:
            self._since = 0
            self._schedule.saved()
        if self._hold_after_epoch:
            self._hold()
        self._last_step_at = time.monotonic()

    def _save(self, epoch: int, done: int) -> None:
        started = time.monotonic()
        position = dict(epoch=epoch - 1, step=done, best_val_acc=self.best_val, world_size=self._world,
                        restarts=self.restarts, plan=self._plan)
        report_position(position, self._model, self._optimizer, self._rank, self._run_dir, self._embedding,
                        self._config)
        self._since = 0
        self._save_s = max(self._save_s, time.monotonic() - started)
        if self._rank == 0:
            self._schedule.saved()

    def _agreed_near_deadline(self) -> bool:
        import ray.train.collective

        near = self._near_deadline() if self._rank == 0 else None
        return bool(ray.train.collective.broadcast_from_rank_zero(near))

    def _near_deadline(self) -> bool:
        """Rank 0: whether the next step, a checkpoint and an evaluation might not fit before the deadline."""
        if self._notice.deadline_ms is None:
            return True
        left = self._notice.deadline_ms / 1000 - time.time()
        step_s = max(self._steps_s, default=0.0)
        return left < self.SAFETY_S + 3 * step_s + 2 * self._save_s + self._eval_s

    def _hold(self) -> None:
        """Wait, training nothing, until Ray Train ends this group at the deadline (then restarts it smaller)."""
        deadline = self._notice.deadline_ms / 1000 if self._notice.deadline_ms else time.time() + 120.0
        while time.time() < deadline + self.HOLD_PAST_DEADLINE_S:
            time.sleep(0.5)
        raise GnnrayError(f"rank {self._rank} waited {self.HOLD_PAST_DEADLINE_S:.0f} s past the preemption deadline "
                          f"of nodes {', '.join(n[:8] for n in self._notice.preempted_node_ids)} and Ray Train did "
                          f"not restart the worker group")
