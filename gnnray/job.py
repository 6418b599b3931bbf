"""The driver: loads the graph, publishes it once, wires the stages, runs Ray Train.

The stages are listed in ``gnnray/__init__.py``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from gnnray import checkpoint, cluster
from gnnray.config import JobConfig, parse_args
from gnnray.errors import CheckpointError, ClusterError, ConfigError, GnnrayError
from gnnray.graph_store import Graph, GraphHandle, publish
from gnnray.train_loop import ModelFactory, WorkerSetup, train_loop

METRICS_LOG = "metrics.jsonl"


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


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; returns the process exit code."""
    import ray.train

    try:
        cfg = parse_args(argv)
        summary = run(cfg)
    except GnnrayError as e:
        print(f"gnnray: error: {e}", file=sys.stderr)
        return 2
    except ray.train.TrainingFailedError as e:
        print(f"gnnray: training failed: {_one_line(e)}", file=sys.stderr)
        return 1
    print(summary.line(), flush=True)
    return 0


def run(cfg: JobConfig, model_factory: Optional[ModelFactory] = None) -> Summary:
    """Train as ``cfg`` says on the connected (or a new local) Ray cluster.

    Args:
        cfg: The job configuration.
        model_factory: Optional ``(in_feats, num_classes, cfg) -> nn.Module``
            with ``forward(blocks, x)``; GraphSAGE by default.

    Raises:
        GnnrayError: Bad options, data or cluster; raised before training starts.
        ray.train.TrainingFailedError: Training failed more than ``max_failures`` times.
    """
    import ray.train

    from gnnray.datasets import load_graph

    run_dir = _check_storage(cfg)
    graph = load_graph(cfg.data)
    print(f"graph {graph.name}: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges, {graph.feat_dim} features, "
          f"{graph.num_classes} classes, train/valid/test {len(graph.train_idx):,}/{len(graph.valid_idx):,}/"
          f"{len(graph.test_idx):,}, {graph.nbytes / 2**20:.1f} MiB", flush=True)
    local = _init_ray(cfg)
    use_gpu = _resolve_gpu(cfg, local)
    cluster.check_object_store(graph.nbytes, cluster.nodes())
    handle = publish(graph)  # this process owns the graph: it must outlive the workers
    graph = handle.get()  # views on the store from here on: the loading copy is freed

    restarts = 0
    while True:
        latest = _resume_point(cfg, run_dir)
        if latest and latest.epoch + 1 >= cfg.train.epochs:
            print(f"run {cfg.run.name!r} already finished {latest.epoch + 1} epochs; nothing to do "
                  "(use a new --name, or more --epochs to continue)", flush=True)
            return _summary(_final_eval(cfg, latest, graph, handle, model_factory, run_dir), restarts)
        first_epoch = latest.epoch + 1 if latest else 0
        if latest:
            print(f"resuming run {cfg.run.name!r} from epoch {first_epoch} ({latest.path})", flush=True)
        setup = WorkerSetup(cfg, handle, first_epoch, latest.path if latest else None, restarts,
                            os.path.join(run_dir, METRICS_LOG), model_factory)
        try:
            with _EpochPrinter(setup.metrics_log, cfg.train.epochs):
                _fit(cfg, setup, graph, use_gpu)
        except ray.train.TrainingFailedError as e:
            if restarts >= cfg.run.max_failures:
                raise
            restarts += 1
            print(f"training failed ({_one_line(e)}); restart {restarts}/{cfg.run.max_failures} "
                  "from the last checkpoint", flush=True)
            continue
        latest, _ = checkpoint.latest_valid(run_dir)
        return _summary(_final_eval(cfg, latest, graph, handle, model_factory, run_dir), restarts)


def _final_eval(cfg: JobConfig, latest: checkpoint.CheckpointInfo, graph: Graph, handle: GraphHandle,
                model_factory: Optional[ModelFactory], run_dir: str) -> checkpoint.CheckpointInfo:
    """With ``--eval layerwise``, replace the last checkpoint's sampled accuracies by layer-wise inference's.

    The sampled test accuracy is kept as ``test_acc_sampled``; the result is
    written into the checkpoint's ``meta.json``, so it is computed once.
    """
    from gnnray import inference

    if cfg.train.eval != "layerwise" or latest.metrics.get("eval") == "layerwise":
        return latest
    model, embedding = inference.load_model(latest.path, cfg, graph.feat_dim, graph.num_classes, model_factory)
    if not inference.supports_layerwise(model):
        print(f"note: {type(model).__name__} has no layer(i, block, h): final accuracies are sampled", flush=True)
        return latest
    result = inference.run(graph, handle, model, embedding=embedding, work_dir=os.path.join(run_dir, "inference"),
                           batch_size=cfg.train.inference_batch_size,
                           actors=(cfg.sampler.actors_min, cfg.sampler.actors_max),
                           cpus_per_actor=cfg.sampler.cpus_per_actor)
    print(f"layer-wise inference: {result.num_nodes:,} nodes in {result.seconds:.1f}s, "
          f"val_acc={result.accuracy['valid']:.4f} test_acc={result.accuracy['test']:.4f}", flush=True)
    update = {"eval": "layerwise", "val_acc_layerwise": result.accuracy["valid"],
              "test_acc": result.accuracy["test"], "inference_s": result.seconds}
    if "test_acc" in latest.metrics:
        update["test_acc_sampled"] = latest.metrics["test_acc"]
    checkpoint.update_metrics(latest.path, update)
    return checkpoint.read_info(latest.path) or latest


def _fit(cfg: JobConfig, setup: WorkerSetup, graph: Graph, use_gpu: bool) -> None:
    import ray.data
    import ray.train
    from ray.train.torch import TorchTrainer

    from gnnray.sampling import SamplerActor
    from gnnray.seeds import SeedPlan, seed_dataset

    plan = SeedPlan.for_run(graph.train_idx, cfg.sampler.batch_size, cfg.train.num_workers, cfg.train.seed)
    seeds = seed_dataset(plan, setup.first_epoch, cfg.train.epochs)
    minibatches = seeds.map_batches(
        SamplerActor,
        fn_constructor_kwargs=dict(graph=setup.graph, fanouts=cfg.sampler.fanouts, plan=plan, run=cfg.run.name),
        batch_size=None,  # a whole seed block per call (see SamplerActor)
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(min_size=cfg.sampler.actors_min, max_size=cfg.sampler.actors_max),
        num_cpus=cfg.sampler.cpus_per_actor,
    )
    # Order kept so each rank's steps follow the epochs in sequence; Ray
    # Train splits with equal=True, so every rank gets the same row count.
    options = ray.data.ExecutionOptions(preserve_order=True)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"setup": setup},
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.train.num_workers, use_gpu=use_gpu,
            resources_per_worker={"CPU": cfg.train.cpus_per_worker, **({"GPU": 1} if use_gpu else {})},
        ),
        run_config=ray.train.RunConfig(
            name=cfg.run.name,
            storage_path=cfg.run.storage_path,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.run.keep_checkpoints),
            # Restarts are the driver's (see run): the seed stream must restart
            # at the checkpoint's epoch, which only a new dataset can do. That
            # includes node preemptions, which Ray Train would otherwise retry
            # itself, from the attempt's first epoch.
            failure_config=ray.train.FailureConfig(max_failures=0, max_preemption_failures=0),
        ),
        datasets={"train": minibatches},
        dataset_config=ray.train.DataConfig(datasets_to_split=["train"], execution_options=options),
    )
    trainer.fit()


class _EpochPrinter:
    """Print one line per epoch on the driver as rank 0 appends to the metrics log."""

    def __init__(self, path: str, epochs: int):
        self._path = path
        self._epochs = epochs
        self._seen: list[float] = []  # when the driver saw each epoch's line
        self._offset = os.path.getsize(path) if os.path.exists(path) else 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "_EpochPrinter":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(0.5)
            self._print_new()
            if stopping:
                return

    def _print_new(self) -> None:
        if not os.path.exists(self._path):
            return
        with open(self._path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self._offset += len(complete)
        for line in complete.decode().splitlines():
            m = json.loads(line)
            print(epoch_line(m, self._eta(m)), flush=True)

    def _eta(self, m: dict) -> Optional[float]:
        """Seconds until the last epoch ends: epochs left times the mean epoch seen so far.

        Between two lines the driver sees a whole epoch (training, evaluation,
        checkpoint); for the first line it has only rank 0's training time.
        """
        self._seen.append(time.monotonic())
        left = self._epochs - 1 - m["epoch"]
        if left <= 0:
            return None
        if len(self._seen) >= 2:
            return left * (self._seen[-1] - self._seen[0]) / (len(self._seen) - 1)
        return left * m["epoch_time"]


def epoch_line(m: dict, eta_s: Optional[float] = None) -> str:
    """The driver's per-epoch line (grep-friendly ``key=value`` pairs), with ``eta=`` when ``eta_s`` is given."""
    line = (f"epoch={m['epoch']} loss={m['loss']:.4f} train_acc={m['train_acc']:.4f} val_acc={m['val_acc']:.4f} "
            f"seeds_per_s={m['seeds_per_s']:.0f} data_wait={m['data_wait']:.2f} epoch_time={m['epoch_time']:.1f}s")
    line += f" eta={eta_s:.0f}s" if eta_s is not None else ""
    return line + (f" test_acc={m['test_acc']:.4f}" if "test_acc" in m else "")


def _resume_point(cfg: JobConfig, run_dir: str) -> Optional[checkpoint.CheckpointInfo]:
    """The newest valid checkpoint of the run (``None``: start fresh), saying which ones were skipped and why.

    Raises:
        CheckpointError: Only corrupt checkpoints are left: starting over would
            silently discard the run, so the user decides.
    """
    extra = ("embedding",) if cfg.data.embedding_dim else ()
    latest, bad = checkpoint.latest_valid(run_dir, extra)
    corrupt = {}
    for path in bad:
        reason = checkpoint.corrupt_reason(path, extra)
        if reason:
            corrupt[path] = reason
        print(f"warning: skipping {'corrupt' if reason else 'incomplete'} checkpoint {path} "
              f"({reason or 'partly written: a crash while it was saved'})", flush=True)
    if latest is None and corrupt:
        path, reason = max(corrupt.items())
        raise CheckpointError(f"run {cfg.run.name!r} cannot resume: checkpoint {path} is corrupt ({reason}) and no "
                              f"older good one is left; delete the run's checkpoint_* directories to start it "
                              f"over, or use a new --name")
    return latest


def _summary(info: checkpoint.CheckpointInfo, restarts: int) -> Summary:
    m = info.metrics
    return Summary(float(m["best_val_acc"]), float(m.get("test_acc", float("nan"))), info.path, m, restarts)


def _check_storage(cfg: JobConfig) -> str:
    if "://" in cfg.run.storage_path:
        raise ConfigError(f"--storage-path {cfg.run.storage_path!r}: only file system paths are supported (use a "
                          "directory, or a shared file system such as NFS on multi-node clusters)")
    run_dir = os.path.join(os.path.abspath(os.path.expanduser(cfg.run.storage_path)), cfg.run.name)
    try:
        os.makedirs(run_dir, exist_ok=True)
        probe = os.path.join(run_dir, ".write-test")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"--storage-path {cfg.run.storage_path!r}: cannot write checkpoints to {run_dir} "
                          f"({e.strerror}); choose a writable directory") from None
    return run_dir


def _init_ray(cfg: JobConfig) -> bool:
    """Connect to ``RAY_ADDRESS`` or start a local cluster; return whether it is local (fixed size)."""
    import ray
    import ray.data

    os.environ.setdefault("DGLBACKEND", "pytorch")
    local = False
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init()
        else:
            local = True
            # A local cluster gets enough logical CPUs for every worker and
            # sampler actor plus one for Ray Data's own tasks; on a small
            # machine they then share cores rather than wait forever.
            need = (cfg.train.num_workers * cfg.train.cpus_per_worker
                    + cfg.sampler.actors_max * cfg.sampler.cpus_per_actor + 1)
            # address="local": a new cluster even if another runs on this
            # machine (joining one is what RAY_ADDRESS is for).
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(need + 0.999)))
    ray.data.DataContext.get_current().enable_progress_bars = sys.stdout.isatty()
    return local


def _resolve_gpu(cfg: JobConfig, local: bool) -> bool:
    """Whether to train on GPUs; raises :class:`ClusterError` if a fixed-size cluster can never run the job."""
    nodes = cluster.nodes()
    use_gpu = bool(cfg.train.use_gpu if cfg.train.use_gpu is not None else sum(n.gpus for n in nodes) >= 1)
    try:
        cluster.check_resources(cfg, use_gpu, nodes)
    except ClusterError as e:
        if local or not cluster.autoscaling():
            raise
        print(f"waiting for the autoscaler to add nodes: {e}", flush=True)
    return use_gpu


def _one_line(e: BaseException) -> str:
    """The failure in one line: the root failed rank's error, and its node when its process died or went silent.

    A rank whose process died (or whose node was lost) is the root cause;
    the other ranks' errors (collective timeouts, connection resets) follow
    from it, so it is reported first.
    """
    failures = getattr(e, "worker_failures", None)
    if failures:
        ranked = sorted(failures.items(), key=lambda kv: (not _node_of(kv[1]), kv[0]))
        rank, err = ranked[0]
        lines = [l for l in str(err).strip().splitlines() if l.strip()]
        return f"rank {rank}{_node_of(err)}: {lines[-1] if lines else type(err).__name__}"
    lines = [l for l in str(e).strip().splitlines() if l.strip()]
    return lines[-1] if lines else type(e).__name__


def _node_of(err: BaseException) -> str:
    """`` on node IP (ID)`` of a worker whose actor died or became unreachable, so a lost node is named.

    Ray Train notices a lost node by a failed health check of its workers,
    seconds before Ray marks the node dead, so the node is looked up through
    the worker's actor rather than the list of dead nodes.
    """
    import ray
    import ray.exceptions

    cause = getattr(err, "health_check_failure", None) or err
    actor_id = getattr(cause, "actor_id", None) if isinstance(cause, ray.exceptions.RayActorError) else None
    if not actor_id:
        return ""
    try:
        import ray._private.state

        node_id = ray._private.state.actors(actor_id)["Address"]["NodeID"]
        ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), "?")
    except Exception:  # best effort: the message stays useful without it
        return ""
    return f" on node {ip} ({node_id[:8]})"
