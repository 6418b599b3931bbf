"""Stages 3-4 wired (driver): the Ray Data stream of sampled mini-batches that the train workers split.

Seed rows (:mod:`.seeds`) are mapped by a pool of sampler actors
(:class:`~gnnray.pipeline.sampler.SamplerActor`) that runs at most
``--max-ahead`` batches per worker ahead (:mod:`.read_ahead`); Ray Train
splits the output equally over the ranks, in order.
"""

from __future__ import annotations

from gnnray.config import JobConfig
from gnnray.data.store import GraphHandle
from gnnray.pipeline.seeds import SeedPlan


def minibatch_stream(cfg: JobConfig, graph: GraphHandle, plan: SeedPlan, first_epoch: int):
    """The dataset of packed mini-batches for epochs ``first_epoch .. cfg.train.epochs - 1``."""
    import ray.data

    from gnnray.pipeline.read_ahead import bound_read_ahead
    from gnnray.pipeline.sampler import SamplerActor
    from gnnray.pipeline.seeds import ROWS_PER_BLOCK, seed_dataset

    workers, limit = cfg.train.num_workers, cfg.sampler.max_ahead * cfg.train.num_workers
    # Each worker's split iterator holds up to two blocks beyond the rows it
    # has yielded (the one it fetches ahead, the one being read); they count
    # against the limit. Blocks stay small enough that what is left still
    # gives every actor a block to sample.
    block = max(1, min(ROWS_PER_BLOCK, limit // (cfg.sampler.actors_max + 2 * workers)))
    seeds = seed_dataset(plan, first_epoch, cfg.train.epochs, block)
    ds = seeds.map_batches(
        SamplerActor,
        fn_constructor_kwargs=dict(graph=graph, fanouts=cfg.sampler.fanouts, plan=plan, run=cfg.run.name),
        batch_size=None,  # a whole seed block per call (see SamplerActor)
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(min_size=cfg.sampler.actors_min, max_size=cfg.sampler.actors_max),
        num_cpus=cfg.sampler.cpus_per_actor,
    )
    bound_read_ahead(ds, f"MapBatches({SamplerActor.__name__})", limit - 2 * workers * block)  # Ray Data's op name
    return ds


def execution_options():
    """How the train workers consume the stream: in order, so each rank's steps follow the epochs in sequence."""
    import ray.data

    return ray.data.ExecutionOptions(preserve_order=True)
