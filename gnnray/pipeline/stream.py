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


def minibatch_stream(cfg: JobConfig, graph: GraphHandle, plan: SeedPlan, first_epoch: int, actor_cls=None):
    """The dataset of packed mini-batches for epochs ``first_epoch .. cfg.train.epochs - 1``.

    ``actor_cls`` replaces :class:`~gnnray.pipeline.sampler.SamplerActor`
    (a subclass that records what it samples, in tests and the benchmark).
    """
    import ray.data

    from gnnray.pipeline.read_ahead import bound_read_ahead
    from gnnray.pipeline.sampler import SamplerActor
    from gnnray.pipeline.seeds import seed_dataset

    actor_cls = actor_cls or SamplerActor

    block = seed_block_rows(cfg)
    seeds = seed_dataset(plan, first_epoch, cfg.train.epochs, block)
    ds = seeds.map_batches(
        actor_cls,
        fn_constructor_kwargs=dict(graph=graph, fanouts=cfg.sampler.fanouts, plan=plan, run=cfg.run.name),
        batch_size=None,  # a whole seed block per call (see SamplerActor)
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(min_size=cfg.sampler.actors_min, max_size=cfg.sampler.actors_max),
        num_cpus=cfg.sampler.cpus_per_actor,
    )
    # Each worker's split iterator holds up to two blocks beyond the rows it
    # has yielded (the one it fetches ahead, the one being read): they count
    # against the limit, so at most max_ahead x workers + one block are ahead.
    limit = cfg.sampler.max_ahead * cfg.train.num_workers - 2 * cfg.train.num_workers * block
    bound_read_ahead(ds, f"MapBatches({actor_cls.__name__})", limit)  # Ray Data's name of the operator
    return ds


def seed_block_rows(cfg: JobConfig) -> int:
    """Rows (mini-batches) per seed block, i.e. per sampler call.

    As many as :data:`~gnnray.pipeline.seeds.ROWS_PER_BLOCK`, but small enough
    that the read-ahead limit, less the blocks the workers' iterators hold,
    still gives every actor a block to sample.
    """
    from gnnray.pipeline.seeds import ROWS_PER_BLOCK

    workers, limit = cfg.train.num_workers, cfg.sampler.max_ahead * cfg.train.num_workers
    return max(1, min(ROWS_PER_BLOCK, limit // (cfg.sampler.actors_max + 2 * workers)))


def execution_options():
    """How the train workers consume the stream: in order, so each rank's steps follow the epochs in sequence."""
    import ray.data

    return ray.data.ExecutionOptions(preserve_order=True)
