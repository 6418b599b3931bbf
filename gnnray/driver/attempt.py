"""One Ray Train attempt of a run, fixed or elastic, built in one place: the trainer, its backend, the stream's
split and where the stream starts.

- A fixed run (``--num-workers N``): the driver decided where the stream
  starts (``WorkerSetup.first_epoch``, ``first_step``, by
  :meth:`~gnnray.train.stream_start.StreamStart.after`), starts the stream and
  its split here, before ``trainer.fit()``, so that the sampler pool starts
  while Ray Train starts its workers; a failed attempt is the driver's to
  restart (``driver/fit.py``), from the newest checkpoint, with a new stream.
- An elastic run (``--num-workers MIN,MAX``): one attempt that Ray Train
  resizes and restarts. Ray Train starts the group once MIN workers fit
  (asking the autoscaler for MAX), and restarts the training function whenever
  it resizes the group (nodes joined, every ``--resize-interval`` seconds it
  looks) or the group fails (a node lost or drained, a worker raised):
  failures up to ``--max-failures``, preemptions always. Every start gets its
  stream, made where the newest checkpoint says (the same rule) by
  :class:`~gnnray.controller.split.ElasticSplit` in Ray Train's dataset-manager
  actor; the driver only watches (``console.EpochPrinter`` prints the
  resizes). The dashboard shows each start as an attempt of the run.

Ray Train and the stream's modules are imported here, when an attempt is
built: the driver starts Ray before it imports them (``driver/fit.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from gnnray import ray_internals, run_storage
from gnnray.config import JobConfig
from gnnray.data.graph import Graph
from gnnray.driver import plans, preflight
from gnnray.seeds import streams

if TYPE_CHECKING:
    from gnnray.controller.split import StartedSplit
    from gnnray.train.setup import WorkerSetup


@dataclass
class Attempt:
    """A built attempt: ``fit`` runs it; a fixed run's started split ends with it, failed or not."""

    trainer: Any
    split: Optional[StartedSplit] = None

    def fit(self) -> None:
        try:
            self.trainer.fit()
        finally:
            if self.split:
                self.split.shutdown()


def build(cfg: JobConfig, setup: WorkerSetup, graph: Graph, use_gpu: bool, local: bool) -> Attempt:
    """The run's next attempt (module docstring); on a fixed run with a stream, the stream already started."""
    import ray.train

    from gnnray.controller.split import ElasticSplit, split_by_driver
    from gnnray.train.loop import train_loop
    from gnnray.train.process_group import ProcessGroupConfig
    from gnnray.train.report import log_event

    elastic = cfg.train.elastic
    # An elastic run always streams; a fixed run on a cluster this process started, without a stream, asks Ray
    # Data's autoscaling coordinator nothing.
    ray_internals.start_train_singletons(coordinator=not local or streams(cfg))
    if local:  # nothing drains the node of a local cluster; the watcher would be one more process to start
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    split, given = None, {}
    if elastic:
        log_event(setup.run_dir, "fit", num_workers=list(cfg.train.num_workers))  # attempts count from here
        workers = dict(num_workers=(cfg.train.workers_min, cfg.train.workers_max),
                       elastic_resize_monitor_interval_s=cfg.train.resize_interval)
        # Ray Train restarts the group from the newest checkpoint, the stream with it (ElasticSplit): failures up
        # to --max-failures, preemptions (a drained node) whenever they come.
        failures = ray.train.FailureConfig(max_failures=cfg.run.max_failures, max_preemption_failures=-1)
        given = dict(datasets={"train": split_by_driver},
                     dataset_config=ElasticSplit(cfg, setup.graph, graph.train_idx, setup.run_dir, setup.cpu,
                                                 setup.stack))
    else:
        workers = dict(num_workers=cfg.train.workers_max, label_selector=_beside_shards(cfg, setup, use_gpu))
        # Restarts are the driver's (see fit.run): the seed stream must restart at the checkpoint's epoch, which
        # only a new dataset can do. That includes node preemptions, which Ray Train would otherwise retry itself,
        # from the attempt's first epoch.
        failures = ray.train.FailureConfig(max_failures=0, max_preemption_failures=0)
        split = _started_split(cfg, setup, graph) if streams(cfg) else None  # else each worker samples its rows
        if split:
            # Split with equal=True, so every rank gets the same row count; by the driver, and started, so that
            # the sampler pool starts while Ray Train starts its workers (StartedSplit), not when they ask.
            given = dict(datasets={"train": split_by_driver}, dataset_config=split)
    trainer = ray_internals.lean_trainer(local)(
        train_loop,
        train_loop_config={"setup": setup},
        backend_config=ProcessGroupConfig(),  # TorchConfig's work without torch in the controller
        scaling_config=ray.train.ScalingConfig(
            use_gpu=use_gpu, resources_per_worker={"CPU": cfg.train.cpus_per_worker, **({"GPU": 1} if use_gpu else {})},
            **workers),
        run_config=ray.train.RunConfig(
            name=cfg.run.name,
            storage_path=run_storage.normalize(cfg.run.storage_path),  # run_dir is its NAME directory
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.run.keep_checkpoints),
            failure_config=failures,
            logging_config=ray.train.LoggingConfig(log_level="INFO" if cfg.run.verbose else "WARNING"),
        ),
        **given,
    )
    return Attempt(trainer, split)


def _beside_shards(cfg: JobConfig, setup: WorkerSetup, use_gpu: bool) -> Optional[list]:
    """A fixed run's label selectors: workers beside the feature shards where they fit (``None``: Ray Train
    places them all), saying how many could not be."""
    workers = cfg.train.workers_max
    selectors = plans.beside_shards(cfg, setup.graph, use_gpu, preflight.nodes())
    placed = sum(1 for s in selectors or () if s)
    if setup.graph.features is not None and placed < workers:
        from gnnray.driver import console

        console.say(f"note: {placed} of {workers} train workers placed beside a feature shard (the "
                    f"shard nodes' CPUs and GPUs, less room for sampler actors, hold no more); Ray Train places the "
                    f"others")
    return selectors


def _started_split(cfg: JobConfig, setup: WorkerSetup, graph: Graph) -> StartedSplit:
    """A fixed run's stream from where the driver said it starts, split over the ranks and started."""
    from gnnray.controller.split import StartedSplit
    from gnnray.driver.stream import execution_options, minibatch_stream
    from gnnray.sampler.sampler import packed_bytes_at_most
    from gnnray.seeds import SeedPlan

    workers = cfg.train.workers_max
    # Where actors sample, a batch's bytes at most size the stream's blocks (the read-ahead holds them).
    row_bytes = packed_bytes_at_most(graph, cfg.sampler.fanouts, cfg.sampler.batch_size) \
        if cfg.sampler.sample_on != "device" else 0
    plan = SeedPlan.for_run(graph.train_idx, cfg.sampler.batch_size, workers, cfg.run.seed, row_bytes)
    stream = minibatch_stream(cfg, setup.graph, plan, setup.first_epoch, cpu=setup.cpu, first_step=setup.first_step,
                              stack=setup.stack)
    return StartedSplit(stream, workers, execution_options())
