"""The stream's sampler pool: started whole, kept whole."""

from __future__ import annotations

from gnnray.config import parse_args
from gnnray.data.synthetic import make_synthetic
from gnnray.driver.stream import minibatch_stream
from gnnray.seeds import SeedPlan


def test_the_pool_starts_at_max_and_never_scales_down_while_the_stream_runs(ray_cluster):
    """Every actor starts with the stream and none is released while it runs: an actor Ray Data adds later takes
    10-40 s to start, and is cancelled while it starts if the stream ends first (Ray then prints "Failed to kill
    actor ... Socket closed" on every driver's console)."""
    cfg = parse_args(["--synthetic-nodes", "400", "--sampler-actors", "1,3"])
    graph = make_synthetic(400, 4, 8, 3, seed=0)
    ds = minibatch_stream(cfg, None, SeedPlan.for_run(graph.train_idx, 8, cfg.train.workers_max, 0), 0)  # not run: no graph
    pool = ds._logical_plan.dag.compute
    assert (pool.min_size, pool.initial_size, pool.max_size) == (1, 3, 3)
    # Ray Data's autoscaler releases an actor whose utilization falls to this threshold (0.5 by default):
    # the read-ahead bound idles the pool whenever the workers lag, which would release one and start another.
    assert ds.context.autoscaling_config.actor_pool_util_downscaling_threshold < 0
