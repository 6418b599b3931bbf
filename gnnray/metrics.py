"""Prometheus metrics of the train workers and sampler actors (``ray.util.metrics``).

Each process records into Ray's metrics library; every node's Ray metrics
agent exports them on that node's metrics port (``ray.nodes()[i]
["MetricsExportPort"]``, ``/metrics``), where Prometheus, and through it the
Ray dashboard's Grafana panels, scrape them. Ray prefixes the names with
``ray_`` and counters with ``_total``. Every metric is tagged with the run name
(``run``) and the process: ``rank`` for train workers, ``actor`` for sampler
actors.

==========================================  =========  ==================================================
name                                        kind       meaning
==========================================  =========  ==================================================
``gnnray_train_step_seconds``               histogram  one optimizer step, data wait included
``gnnray_train_data_wait_seconds``          histogram  time a step waited for its mini-batch
``gnnray_train_seeds``                      counter    seed nodes trained (``rate()``: live seeds/s)
``gnnray_train_seeds_per_s``                gauge      last epoch's seeds per second, all ranks
``gnnray_train_data_wait_fraction``         gauge      last epoch's share of step time spent waiting
``gnnray_train_loss``                       gauge      last epoch's mean training loss
``gnnray_train_acc``                        gauge      last epoch's training accuracy
``gnnray_val_acc``                          gauge      validation accuracy after the last epoch
``gnnray_train_epochs_completed``           gauge      epochs finished in the run
``gnnray_train_world_size``                 gauge      train workers (ranks) of the last epoch's group
``gnnray_feature_remote_bytes``             counter    feature bytes fetched from other nodes' shards
``gnnray_feature_remote_rows``              counter    feature rows fetched from other nodes' shards
``gnnray_feature_cached_rows``              counter    feature rows read from the node's cache
``gnnray_feature_remote_bytes_per_batch``   gauge      last epoch's remote feature bytes per mini-batch
``gnnray_feature_cache_hit_rate``           gauge      last epoch's share of rows read from the cache
``gnnray_sampler_minibatches``              counter    mini-batches sampled
``gnnray_sampler_edges``                    counter    edges sampled (all layers of every mini-batch)
``gnnray_sampler_minibatches_per_s``        gauge      mini-batches per second over the last few seconds
``gnnray_sampler_edges_per_s``              gauge      sampled edges per second over the last few seconds
``gnnray_sampler_batch_seconds``            histogram  time to sample one mini-batch
==========================================  =========  ==================================================

The per-epoch gauges hold the values of the driver's epoch line: loss,
accuracies and data-wait fraction are reduced over all ranks (every rank
exports the same value), seeds per second is all ranks' seeds over the rank's
own epoch time; the step histograms and the seeds counter are each rank's own. A sampler's rate gauges count the
time between its calls too, so they show what it delivers;
``gnnray_sampler_batch_seconds`` shows what it could deliver.
"""

from __future__ import annotations

import os
import time

# Seconds: from a fast CPU step of a tiny model to a slow large-fanout one.
_SECONDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


def _metrics(tags: dict[str, str], **specs):
    """Build ``ray.util.metrics`` objects from ``attr=(kind, name, description)``, tagged with ``tags``."""
    from ray.util.metrics import Counter, Gauge, Histogram

    built = {}
    for attr, (kind, name, description) in specs.items():
        if kind == "histogram":
            metric = Histogram(name, description, boundaries=_SECONDS, tag_keys=tuple(tags))
        else:
            metric = {"counter": Counter, "gauge": Gauge}[kind](name, description, tag_keys=tuple(tags))
        built[attr] = metric.set_default_tags(tags)
    return built


class TrainMetrics:
    """The metrics of one train worker (tags ``run`` and ``rank``).

    Args:
        run: The run name.
        rank: The worker's world rank.
    """

    def __init__(self, run: str, rank: int):
        self._m = _metrics(
            {"run": run, "rank": str(rank)},
            step=("histogram", "gnnray_train_step_seconds", "Seconds per optimizer step, data wait included."),
            wait=("histogram", "gnnray_train_data_wait_seconds", "Seconds a step waited for its mini-batch."),
            seeds=("counter", "gnnray_train_seeds", "Seed nodes trained."),
            seeds_per_s=("gauge", "gnnray_train_seeds_per_s", "Seed nodes per second, all ranks, in the last epoch."),
            data_wait=("gauge", "gnnray_train_data_wait_fraction",
                       "Share of the last epoch's step time spent waiting for data."),
            loss=("gauge", "gnnray_train_loss", "Mean training loss of the last epoch."),
            train_acc=("gauge", "gnnray_train_acc", "Training accuracy of the last epoch."),
            val_acc=("gauge", "gnnray_val_acc", "Validation accuracy after the last epoch."),
            epochs=("gauge", "gnnray_train_epochs_completed", "Epochs finished in the run."),
            world_size=("gauge", "gnnray_train_world_size", "Train workers (ranks) of the last epoch's group."),
            remote_bytes=("counter", "gnnray_feature_remote_bytes", "Feature bytes fetched from other nodes."),
            remote_rows=("counter", "gnnray_feature_remote_rows", "Feature rows fetched from other nodes."),
            cached_rows=("counter", "gnnray_feature_cached_rows", "Feature rows read from the node's cache."),
            bytes_per_batch=("gauge", "gnnray_feature_remote_bytes_per_batch",
                             "Remote feature bytes per mini-batch in the last epoch."),
            hit_rate=("gauge", "gnnray_feature_cache_hit_rate", "Share of feature rows read from the cache."),
        )

    def step(self, step_s: float, wait_s: float, seeds: int) -> None:
        """Record one optimizer step of ``seeds`` seed nodes."""
        self._m["step"].observe(float(step_s))
        self._m["wait"].observe(float(wait_s))
        if seeds > 0:  # counters only go up; an empty (padding) batch adds nothing
            self._m["seeds"].inc(int(seeds))

    def features(self, fetched) -> dict:
        """Record an epoch's sharded-feature traffic (a :class:`~gnnray.train.feature_reader.FetchStats`); return
        its per-batch figures for the metrics line."""
        for key, value in (("remote_bytes", fetched.remote_bytes), ("remote_rows", fetched.remote_rows),
                           ("cached_rows", fetched.cached_rows)):
            if value > 0:
                self._m[key].inc(int(value))
        summary = fetched.summary()
        self._m["bytes_per_batch"].set(summary["remote_bytes_per_batch"])
        self._m["hit_rate"].set(summary["cache_hit_rate"])
        return summary

    def epoch(self, epoch: int, stats: dict) -> None:
        """Record the end of ``epoch`` (0-based) with the train loop's per-epoch ``stats``."""
        for key in ("seeds_per_s", "data_wait", "loss", "train_acc", "val_acc", "world_size"):
            if key in stats:
                self._m[key].set(float(stats[key]))
        self._m["epochs"].set(epoch + 1)


class SamplerMetrics:
    """The metrics of one sampler actor (tags ``run`` and ``actor``).

    Args:
        run: The run name.
        window_s: Seconds over which the rate gauges average.
    """

    def __init__(self, run: str, window_s: float = 5.0):
        import ray

        actor = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
        self._m = _metrics(
            {"run": run, "actor": actor or f"pid-{os.getpid()}"},
            batches=("counter", "gnnray_sampler_minibatches", "Mini-batches sampled."),
            edges=("counter", "gnnray_sampler_edges", "Edges sampled, all layers."),
            batches_per_s=("gauge", "gnnray_sampler_minibatches_per_s", "Mini-batches sampled per second."),
            edges_per_s=("gauge", "gnnray_sampler_edges_per_s", "Edges sampled per second."),
            busy=("histogram", "gnnray_sampler_batch_seconds", "Seconds to sample one mini-batch."),
        )
        self._window_s = window_s
        self._start = None  # end time of the call that opened the window
        self._batches = self._edges = 0

    def batch(self, edges: int, busy_s: float) -> None:
        """Record one mini-batch of ``edges`` sampled edges that took ``busy_s`` seconds."""
        now = time.perf_counter()
        self._m["batches"].inc(1)
        if edges > 0:
            self._m["edges"].inc(int(edges))
        self._m["busy"].observe(float(busy_s))
        if self._start is None:  # rates are over whole intervals between calls
            self._start = now
            return
        self._batches += 1
        self._edges += int(edges)
        elapsed = now - self._start
        if elapsed > 0:
            self._m["batches_per_s"].set(self._batches / elapsed)
            self._m["edges_per_s"].set(self._edges / elapsed)
        if elapsed >= self._window_s:
            self._start, self._batches, self._edges = now, 0, 0
