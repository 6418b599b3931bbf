"""The driver's training run: resume point, Ray Train attempts with restarts, final evaluation, summary.

The stages it wires are listed in ``gnnray/__init__.py``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from gnnray import stack
from gnnray.config import JobConfig
from gnnray.data.graph import Graph
from gnnray.data.load import check_dataset
from gnnray.driver import attempt, connect, launch, plans, preflight
from gnnray.driver.failures import one_line, rank_error, stack_mismatch
from gnnray.errors import CheckpointError, ClusterError, ConfigError
from gnnray.store.handle import GraphHandle

# torch, Ray Train and what imports them (the console too, through gnnray.train.report) are imported where
# used: the driver starts Ray first, and a local cluster starts while torch is imported (launch.load_and_publish).
if TYPE_CHECKING:
    from gnnray.train import checkpoint
    from gnnray.train.setup import ModelFactory, WorkerSetup


@dataclass(frozen=True)
class Summary:
    """The outcome of a run.

    Attributes:
        best_val_acc: Best validation accuracy over all epochs.
        test_acc: Test accuracy after the last epoch (layer-wise with ``--eval layerwise``,
            the sampled one is then ``metrics["test_acc_sampled"]``).
        checkpoint: Directory of the last checkpoint.
        metrics: The last epoch's reported metrics.
        restarts: Restarts from a checkpoint after failures.
    """

    best_val_acc: float
    test_acc: float
    checkpoint: str
    metrics: dict
    restarts: int

    def line(self) -> str:
        sampled = self.metrics.get("test_acc_sampled")  # set when test_acc is layer-wise
        return (f"best_val_acc={self.best_val_acc:.4f} test_acc={self.test_acc:.4f} "
                + (f"test_acc_sampled={sampled:.4f} " if sampled is not None else "")
                + f"epochs={self.metrics['epoch'] + 1} restarts={self.restarts} checkpoint={self.checkpoint}")


def run(cfg: JobConfig, model_factory: Optional[ModelFactory] = None) -> Summary:
    """Train as ``cfg`` says on the connected (or a new local) Ray cluster.

    Args:
        cfg: The job configuration.
        model_factory: Optional ``(in_feats, num_classes, cfg) -> nn.Module``
            with ``forward(layers, x)``; the ``--model`` one by default.

    Raises:
        GnnrayError: Bad options, data or cluster; raised before training starts.
        ray.train.TrainingFailedError: Training failed more than ``max_failures`` times.
    """
    from gnnray import leases

    try:
        return _run(cfg, model_factory)
    finally:  # however it ends: later runs on the host stop leaving it a share (a notebook runs many)
        leases.release_run()


def _run(cfg: JobConfig, model_factory: Optional[ModelFactory]) -> Summary:
    if cfg.train.elastic and cfg.data.feature_shards > 1:
        raise ConfigError(f"--num-workers {cfg.train.workers_min},{cfg.train.workers_max} with --feature-shards "
                          f"{cfg.data.feature_shards}: an elastic run cannot rebuild a feature shard lost with its "
                          f"node (the driver rebuilds shards between its own restarts, and Ray Train restarts an "
                          f"elastic run within one fit); give a fixed --num-workers N with --max-failures, or drop "
                          f"--feature-shards")
    run_dir = preflight.check_storage(cfg)
    check_dataset(cfg.data)  # a mistyped --dataset fails at once, before Ray starts
    # Ray starts while the graph loads: its processes' start overlaps reading and building the graph.
    pub = launch.load_and_publish(cfg, overlap_ray=True)

    import ray.train

    from gnnray.driver import console
    from gnnray.train import checkpoint
    from gnnray.train.placement import feature_line
    from gnnray.train.setup import WorkerSetup
    from gnnray.train.stream_start import StreamStart

    graph = pub.graph
    cfg, use_gpu = connect.resolve_gpu(cfg, pub.local)
    cfg = plans.sampling(cfg, graph, use_gpu, pub.local)  # the stream and workers follow the resolved --sample-on
    cfg = plans.layerwise_fits(cfg, pub, use_gpu, model_factory)
    owners = _embedding_owners(cfg, pub)
    cpu = plans.cpu_policy(cfg, use_gpu)
    placement = feature_line(cfg, pub.handle, use_gpu)  # where workers gather features (--feature-placement)
    if placement:
        console.say(placement)

    restarts = 0
    while True:
        latest = _resume_point(cfg, run_dir)
        if latest and latest.epoch + 1 >= cfg.train.epochs:
            console.say(f"run {cfg.run.name!r} already finished {latest.epoch + 1} epochs; nothing to do "
                        "(use a new --name, or more --epochs to continue)")
            return _summary(_final_eval(cfg, latest, graph, pub.handle, model_factory), restarts)
        # A fixed run's start; an elastic group's is taken by the same rule when its stream is made (ElasticSplit).
        start = StreamStart.after(latest, cfg, len(graph.train_idx), restarts)
        if latest and latest.step != start.step:
            console.say(f"note: {latest.path} was written within epoch {start.epoch} under another --batch-size "
                        f"or --num-workers; epoch {start.epoch} starts over")
        if latest:
            console.say(f"resuming run {cfg.run.name!r} from epoch {start.epoch}"
                        + (f" step {start.step}" if start.step else "") + f" ({latest.path})")
        setup = WorkerSetup(cfg, pub.handle, start.epoch, start.checkpoint, restarts, run_dir,
                            model_factory, owners, cpu, start.step, stack.versions(cfg.sampler.backend))
        if cfg.train.elastic:  # Ray Train resizes and restarts it, all within one fit
            with console.EpochPrinter(run_dir, cfg.train.epochs, cfg.train.num_workers), _not_restarted():
                attempt.build(cfg, setup, graph, use_gpu, pub.local).fit()
            latest, _ = checkpoint.latest_valid(run_dir)
            return _summary(_final_eval(cfg, latest, graph, pub.handle, model_factory),
                            int(latest.metrics.get("restarts", 0)))
        try:
            with console.EpochPrinter(run_dir, cfg.train.epochs), _not_restarted():
                attempt.build(cfg, setup, graph, use_gpu, pub.local).fit()
        except ray.train.TrainingFailedError as e:
            if restarts >= cfg.run.max_failures:
                raise
            restarts += 1
            console.say(f"training failed ({one_line(e)}); restart {restarts}/{cfg.run.max_failures} "
                        "from the last checkpoint")
            pub = launch.rebuild_lost_shards(pub)
            cfg = plans.layerwise_fits(cfg, pub, use_gpu, model_factory)  # the repair may have put two shards on a node
            owners = _embedding_owners(cfg, pub, owners)
            continue
        latest, _ = checkpoint.latest_valid(run_dir)
        return _summary(_final_eval(cfg, latest, graph, pub.handle, model_factory), restarts)


@contextlib.contextmanager
def _not_restarted():
    """Failures a restart would only meet again, said in one line and not restarted: a rank's node with another
    stack than the driver's (a :class:`ClusterError`: every restart would place a rank there again), and an
    option a rank's own machine cannot serve (its :class:`ConfigError`, e.g. a structure its GPU cannot hold)."""
    import ray.train

    try:
        yield
    except ray.train.TrainingFailedError as e:
        line = stack_mismatch(e)
        if line:
            raise ClusterError(line) from None
        line = rank_error(e, ConfigError)
        if line:
            raise ConfigError(line) from None
        raise


def _embedding_owners(cfg: JobConfig, pub: launch.Published, owners: Optional[tuple] = None) -> Optional[tuple]:
    """With ``--feature-shards`` and ``--embedding-dim``: the embedding shards' owners, beside the feature shards.

    After a failure they are made again if one was lost; the restarted attempt
    loads their rows from the checkpoint (or resets them) either way.
    """
    import ray
    import ray.exceptions

    from gnnray.train.embedding import create_owners

    features = pub.handle.features
    if features is None or not cfg.data.embedding_dim:
        return None
    if owners:
        try:
            ray.get([o[3].ping.remote() for o in owners], timeout=cfg.data.feature_timeout)
            if [o[2] for o in owners] == [f"node {s.address} ({s.node_id[:8]})" for s in features.shards]:
                return owners
        except (ray.exceptions.RayError, TimeoutError):
            pass
    return create_owners([(s.lo, s.hi, s.node_id, s.address) for s in features.shards], cfg.data.embedding_dim,
                         cfg.train.embedding_lr or cfg.train.lr, cfg.run.seed)


def _final_eval(cfg: JobConfig, latest: checkpoint.CheckpointInfo, graph: Graph, handle: GraphHandle,
                model_factory: Optional[ModelFactory]) -> checkpoint.CheckpointInfo:
    """With ``--eval layerwise``, the last checkpoint with layer-wise accuracies.

    The train workers computed them after the last epoch (the sampled test
    accuracy is then ``test_acc_sampled``). A checkpoint without them (a run
    trained under ``--eval sampled``, or a model without ``layer``) gets them
    here from one Ray task, written into its ``meta.json``, so they are
    computed once.
    """
    from gnnray.driver import console
    from gnnray.inference import layerwise_task
    from gnnray.train import checkpoint

    if cfg.train.eval != "layerwise":
        return latest
    m = latest.metrics
    if m.get("eval") != "layerwise":
        # ``embedding``: the checkpoint directory, whose embedding shard files the inference task reads.
        model, embedding = layerwise_task.load_model(latest.path, cfg, handle.feat_dim, graph.num_classes,
                                                     model_factory)
        if not layerwise_task.supports_layerwise(model):
            console.say(f"note: {type(model).__name__} has no layer(i, layer, h): final accuracies are sampled")
            return latest
        result = layerwise_task.run(graph, handle, model, embedding=embedding,
                                    batch_size=cfg.train.inference_batch_size, use_gpu=cfg.train.use_gpu)
        update = {"eval": "layerwise", "val_acc_layerwise": result.accuracy["valid"],
                  "test_acc": result.accuracy["test"], "inference_s": result.seconds}
        if "test_acc" in m:
            update["test_acc_sampled"] = m["test_acc"]
        checkpoint.update_metrics(latest.path, update)
        latest = checkpoint.read_info(latest.path) or latest
        m = latest.metrics
    console.say(f"layer-wise inference: {graph.num_nodes:,} nodes in {m.get('inference_s', float('nan')):.2f}s, "
                f"val_acc={m['val_acc_layerwise']:.4f} test_acc={m['test_acc']:.4f}")
    return latest


def _resume_point(cfg: JobConfig, run_dir: str) -> Optional[checkpoint.CheckpointInfo]:
    """The newest valid checkpoint of the run (``None``: start fresh), saying which ones were skipped and why.

    Raises:
        CheckpointError: Only corrupt checkpoints are left: starting over would
            silently discard the run, so the user decides.
    """
    from gnnray.driver import console
    from gnnray.train import checkpoint

    extra = ("embedding",) if cfg.data.embedding_dim else ()
    latest, bad = checkpoint.latest_valid(run_dir, extra)
    corrupt = {}
    for path in bad:
        reason = checkpoint.corrupt_reason(path, extra)
        if reason:
            corrupt[path] = reason
        console.say(f"warning: skipping {'corrupt' if reason else 'incomplete'} checkpoint {path} "
                    f"({reason or 'partly written: a crash while it was saved'})")
    if latest is None and corrupt:
        path, reason = max(corrupt.items())
        raise CheckpointError(f"run {cfg.run.name!r} cannot resume: checkpoint {path} is corrupt ({reason}) and no "
                              f"older good one is left; delete the run's checkpoint_* directories to start it "
                              f"over, or use a new --name")
    return latest


def _summary(info: checkpoint.CheckpointInfo, restarts: int) -> Summary:
    m = info.metrics
    return Summary(float(m["best_val_acc"]), float(m.get("test_acc", float("nan"))), info.path, m, restarts)
