"""Stages 3-4 wired (driver): the Ray Data stream of sampled mini-batches that the train workers split.

Seed rows (:mod:`.seeds`) are mapped by a pool of sampler actors
(:class:`~gnnray.sampler.sampler.SamplerActor`) that runs at most
``--max-ahead`` batches per worker ahead (:mod:`.read_ahead`); Ray Train
splits the output equally over the ranks, in order, each rank its own
steps. The seed blocks keep their size whatever the bound (Ray Data's work
per sampler call is spread over a block's rows); the bound is then computed
from that size.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from gnnray.config import JobConfig
from gnnray.cpus import CpuPolicy
from gnnray.errors import ConfigError
from gnnray.seeds import SeedPlan
from gnnray.store.handle import GraphHandle


def minibatch_stream(cfg: JobConfig, graph: GraphHandle, plan: SeedPlan, first_epoch: int, actor_cls=None,
                     cpu: Optional[CpuPolicy] = None, first_step: int = 0, stack: Optional[dict] = None):
    """The dataset of packed mini-batches from step ``first_step`` of ``first_epoch`` to the end of
    ``cfg.train.epochs - 1``, for ``plan.ranks`` train workers.

    ``actor_cls`` replaces :class:`~gnnray.sampler.sampler.SamplerActor`
    (a subclass that records what it samples, in tests and the benchmark);
    ``cpu`` is the job's CPU plan, which each actor applies to itself;
    ``stack`` the driver's software stack, which each actor checks. The
    pool's size follows the workers (:func:`sampler_actors`). With
    ``--sample-on device`` (resolved by the driver) the stream is the seed
    rows themselves: each worker samples them (:mod:`.device_sampler`).

    Raises:
        ConfigError: ``--max-ahead`` is too small for the stream (:func:`read_ahead_rows`).
    """
    import ray.data

    from gnnray.driver.read_ahead import bound_read_ahead
    from gnnray.sampler.sampler import SamplerActor
    from gnnray.seeds import block_rows, seed_dataset

    if cfg.sampler.sample_on == "device":  # the workers sample on their devices: they take the seed rows
        return seed_dataset(plan, first_epoch, cfg.train.epochs, first_step)
    actor_cls = actor_cls or SamplerActor
    actors = sampler_actors(cfg, plan.ranks)
    limit = read_ahead_rows(cfg, block_rows(plan, first_epoch, cfg.train.epochs), plan.ranks, actors[1])
    ds = seed_dataset(plan, first_epoch, cfg.train.epochs, first_step).map_batches(
        actor_cls,
        fn_constructor_kwargs=dict(graph=graph, fanouts=cfg.sampler.fanouts, plan=plan, run=cfg.run.name, cpu=cpu,
                                   backend=cfg.sampler.backend, stack=stack),
        batch_size=None,  # a whole seed block per call (see SamplerActor)
        batch_format="numpy",
        # The whole pool starts with the stream and keeps its actors: an actor added later takes 10-40 s to start
        # (imports, the graph's views), and one the stream no longer needs once started is cancelled mid-creation,
        # which Ray reports on every driver's console ("Failed to kill actor ... Socket closed").
        compute=ray.data.ActorPoolStrategy(min_size=actors[0], max_size=actors[1], initial_size=actors[1]),
        num_cpus=cfg.sampler.cpus_per_actor,
    )
    ds.context.autoscaling_config = dataclasses.replace(ds.context.autoscaling_config,
                                                        actor_pool_util_downscaling_threshold=-1.0)
    # One output block per seed block, never cut by size: the split hands whole blocks to the ranks in turn,
    # which is what gives each rank its own steps in order (seeds.stream_rows).
    ds.context.target_max_block_size = None
    bound_read_ahead(ds, f"MapBatches({actor_cls.__name__})", limit)  # Ray Data's name of the operator
    return ds


def sampler_actors(cfg: JobConfig, workers: int) -> tuple[int, int]:
    """The sampler pool's (MIN, MAX) for ``workers`` train workers: ``--sampler-actors`` at ``--num-workers``'s
    largest size, scaled with the workers (rounded up, at least 1), so that each worker keeps its share of actors."""
    lo, hi, most = cfg.sampler.actors_min, cfg.sampler.actors_max, cfg.train.workers_max
    if workers >= most:
        return lo, hi
    lo = max(1, math.ceil(lo * workers / most))
    return lo, max(lo, math.ceil(hi * workers / most))


def read_ahead_rows(cfg: JobConfig, block: int, workers: Optional[int] = None, actors: Optional[int] = None) -> int:
    """The read-ahead policy's limit: rows the sampler pool may have taken beyond what the split handed out.

    ``--max-ahead`` counts every mini-batch sampled ahead of a worker's step,
    so the limit is ``--max-ahead`` x workers less the two seed blocks of
    ``block`` rows each worker's split iterator holds (the one it reads, the
    one it fetches next). The least that works leaves the policy one block per
    worker and one per sampler actor: Ray Train's equal split hands a block out
    only once it holds about one for every worker, and each actor needs room
    for the block it samples. Below that the stream moves only by Ray Data's
    liveness guard, one block at a time. ``--max-ahead`` auto gives each actor
    three (the one it samples, one queued behind it, one done and waiting to be
    handed out): with one, an actor idles between calls while its output waits
    (docs/performance.md#where-the-figures-come-from). ``workers`` and ``actors`` (the pool's MAX) default
    to the job's largest.

    Raises:
        ConfigError: ``--max-ahead`` is set below that least.
    """
    workers = workers or cfg.train.workers_max
    actors = actors or cfg.sampler.actors_max
    if cfg.sampler.max_ahead is None:
        return (workers + 3 * actors) * block
    held = 2 * workers * block
    least, total = held + (workers + actors) * block, cfg.sampler.max_ahead * workers
    if total < least:
        raise ConfigError(
            f"--max-ahead {cfg.sampler.max_ahead}: with {workers} train worker(s), up to "
            f"{actors} sampler actor(s) and {block}-row seed blocks, the stream needs at least "
            f"{math.ceil(least / workers)} mini-batches ahead of each worker (two blocks in each worker's "
            f"iterator, one per worker for the equal split, one per actor to sample); raise --max-ahead, leave it "
            f"at auto, or use fewer --sampler-actors")
    return total - held


def execution_options():
    """How the train workers consume the stream: in order, so each rank's steps follow the epochs in sequence."""
    import ray.data

    return ray.data.ExecutionOptions(preserve_order=True)
