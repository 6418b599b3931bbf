"""Bounded read-ahead (``--max-ahead``): the sampler pool stays a bounded number of batches ahead of the workers,
is refused where it could not move, keeps every actor busy, and costs nothing while it holds."""

from __future__ import annotations

import os
import threading
import time

import pytest

import numpy as np

from gnnray.batch import from_arrow
from gnnray.config import parse_args
from gnnray.data.synthetic import make_synthetic
from gnnray.driver.stream import execution_options, minibatch_stream, read_ahead_rows
from gnnray.errors import ConfigError
from gnnray.seeds import ROWS_PER_BLOCK, SeedPlan, block_rows, seed_dataset
from gnnray.store.handle import publish

WORKERS, EPOCHS = 1, 3


def _store_bytes(ray) -> int:
    """Bytes of the objects the cluster holds now (Ray's state API)."""
    from ray.util.state import list_objects

    objects = list_objects(address=ray.get_runtime_context().gcs_address, limit=10_000, detail=True,
                           raise_on_missing_output=False)
    return sum(max(o.object_size or 0, 0) for o in {o.object_id: o for o in objects}.values())


def _slow_workers(ray, tmp_path, max_ahead: str) -> dict:
    """Stream EPOCHS epochs to WORKERS consumers slower than the sampler; return the worst gaps seen."""
    from gnnray.sampler.sampler import SamplerActor

    log, started = tmp_path / f"produced-{max_ahead}", tmp_path / f"started-{max_ahead}"

    class CountingSampler(SamplerActor):  # defined here: cloudpickle ships it by value
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            with open(started, "a") as f:
                f.write(f"{os.getpid()}\n")

        def __call__(self, rows):
            table = super().__call__(rows)
            with open(log, "a") as f:  # appended after sampling: what exists in the store from now on
                f.write(f"{table.num_rows} {table.nbytes}\n")
            return table

    def produced() -> tuple[int, int]:
        lines = log.read_text().split("\n")[:-1] if log.exists() else []
        rows = [tuple(map(int, l.split())) for l in lines]
        return sum(r for r, _ in rows), max((b // r for r, b in rows if r), default=0)

    cfg = parse_args(["--synthetic-nodes", "4000", "--batch-size", "8", "--fanouts", "5,5", "--epochs",
                      str(EPOCHS), "--num-workers", str(WORKERS), "--sample-on", "actors", "--sampler-actors", "1,2",
                      "--max-ahead", max_ahead])
    graph = make_synthetic(4000, 4, 16, 6, seed=0)
    handle = publish(graph)
    plan = SeedPlan.for_run(graph.train_idx, cfg.sampler.batch_size, WORKERS, 0)
    store_before = _store_bytes(ray)

    ds = minibatch_stream(cfg, handle, plan, 0, actor_cls=CountingSampler)
    ds.context.execution_options = execution_options()
    splits = ds.streaming_split(WORKERS, equal=True)
    consumed = [0] * WORKERS

    def worker(i: int) -> None:  # reads as the train loop does, and is slower than sampling
        for block in splits[i].iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0):
            consumed[i] += block.num_rows
            for _ in from_arrow(block):
                time.sleep(0.01)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(WORKERS)]
    for t in threads:
        t.start()
    worst_rows, worst_bytes, max_row_bytes = 0, 0, 0
    while any(t.is_alive() for t in threads):
        made, row_bytes = produced()
        ahead = made - sum(consumed)  # consumed is read after made: the gap is never overstated
        worst_rows, max_row_bytes = max(worst_rows, ahead), max(max_row_bytes, row_bytes)
        worst_bytes = max(worst_bytes, _store_bytes(ray) - store_before)
        time.sleep(0.1)
    for t in threads:
        t.join()
    total = plan.rows_per_epoch * EPOCHS
    assert produced()[0] == sum(consumed) == total
    block = block_rows(plan, 0, EPOCHS)
    # What the policy admits (its limit, plus the block admitted last) and the two blocks each worker's iterator
    # holds: everything sampled that the workers have not received.
    return dict(worst_rows=worst_rows, worst_bytes=worst_bytes, max_row_bytes=max_row_bytes, total=total,
                bound=read_ahead_rows(cfg, block) + block + 2 * WORKERS * block,
                actors_started=len(started.read_text().split()))


# auto, and the smallest --max-ahead accepted: (3 x workers + 2 actors) x 16-row blocks / workers.
@pytest.mark.parametrize("max_ahead", ["auto", str((3 * WORKERS + 2) * ROWS_PER_BLOCK // WORKERS)])
def test_sampler_stays_within_max_ahead_of_slow_workers(ray_cluster, tmp_path, max_ahead):
    """Over several epochs, with workers slower than the sampler, production never outruns consumption by more
    than the limit (max_ahead x workers) + one block, and the object store holds the graph plus at most that
    many batches."""
    r = _slow_workers(ray_cluster, tmp_path, max_ahead)
    assert r["total"] > 4 * r["bound"]  # the stream is much longer than the bound
    assert 0 < r["worst_rows"] <= r["bound"], r
    # The store: the batches ahead, plus the seed row numbers and Ray Data's small metadata objects.
    assert r["worst_bytes"] <= r["bound"] * r["max_row_bytes"] + 8 * r["total"] + 2**20, r
    # The pool (--sampler-actors 1,2) starts whole and keeps its actors while the bound idles them: none is added
    # later, so none is cancelled while it starts when the stream ends (Ray's "Failed to kill actor" line).
    assert r["actors_started"] == 2, r


def test_a_large_bound_lets_the_sampler_run_ahead(ray_cluster, tmp_path):
    """The measurement above can fail: with a bound as long as the stream, sampling races ahead of slow workers."""
    r = _slow_workers(ray_cluster, tmp_path, "10000")
    assert r["worst_rows"] > (3 * WORKERS + 2) * ROWS_PER_BLOCK + ROWS_PER_BLOCK, r


def test_max_ahead_below_what_the_split_needs_is_refused():
    """The equal split needs a block per worker and each actor one to sample: less is a clear error."""
    cfg = parse_args(["--num-workers", "4", "--sampler-actors", "1,2", "--max-ahead", "55"])
    with pytest.raises(ConfigError, match=r"--max-ahead 55: .* at least 56 mini-batches ahead of each worker"):
        read_ahead_rows(cfg, ROWS_PER_BLOCK)
    # 56 x 4 workers, less the 2 blocks each worker's iterator holds: a block per worker and per actor.
    assert read_ahead_rows(parse_args(["--num-workers", "4", "--sampler-actors", "1,2", "--max-ahead", "56"]),
                           ROWS_PER_BLOCK) == (4 + 2) * ROWS_PER_BLOCK
    # auto: a block per worker and three per actor (one sampled, one queued, one waiting to be handed out).
    assert read_ahead_rows(parse_args(["--num-workers", "4", "--sampler-actors", "1,2"]), ROWS_PER_BLOCK) == \
        (4 + 3 * 2) * ROWS_PER_BLOCK


def test_block_size_and_limit_agree_for_a_long_run(ray_cluster, monkeypatch):
    """A run too long for 16-row blocks gets larger ones, and the limit grows with the blocks the stream has."""
    import gnnray.seeds

    monkeypatch.setattr(gnnray.seeds, "_MAX_BLOCKS", 8)
    plan = SeedPlan.for_run(np.arange(1000), batch_size=4, num_workers=2, seed=0)  # 250 rows per epoch
    block = block_rows(plan, 0, 3)
    assert block == -(-750 // 8) > ROWS_PER_BLOCK
    sizes = [len(batch["row"]) for batch in seed_dataset(plan, 0, 3).iter_batches(batch_size=None)]
    assert max(sizes) == block and sum(sizes) == 750
    cfg = parse_args(["--num-workers", "2", "--sampler-actors", "1,2"])
    assert read_ahead_rows(cfg, block) == (2 + 3 * 2) * block
    with pytest.raises(ConfigError, match="at least"):  # enough for 16-row blocks, not for this run's
        read_ahead_rows(parse_args(["--num-workers", "2", "--sampler-actors", "1,2", "--max-ahead", "64"]), block)


def test_four_workers_keep_both_actors_sampling(ray_cluster, tmp_path):
    """With 4 workers and 2 actors at the default bound, both actors sample at once (counted, not timed)."""
    from gnnray.sampler.sampler import SamplerActor

    log = tmp_path / "calls"

    class SlowSampler(SamplerActor):  # long calls, so that overlapping calls are seen if the bound allows them
        def __call__(self, rows):
            with open(log, "a") as f:
                f.write("+\n")
            time.sleep(0.3)
            table = super().__call__(rows)
            with open(log, "a") as f:
                f.write("-\n")
            return table

    workers = 4
    cfg = parse_args(["--synthetic-nodes", "4000", "--batch-size", "8", "--fanouts", "3", "--epochs", "1",
                      "--num-workers", str(workers), "--sample-on", "actors", "--sampler-actors", "2"])
    graph = make_synthetic(4000, 4, 16, 6, seed=0)
    plan = SeedPlan.for_run(graph.train_idx, cfg.sampler.batch_size, workers, 0)
    ds = minibatch_stream(cfg, publish(graph), plan, 0, actor_cls=SlowSampler)
    ds.context.execution_options = execution_options()
    splits = ds.streaming_split(workers, equal=True)
    counts = [0] * workers

    def worker(i: int) -> None:
        for block in splits[i].iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0):
            counts[i] += block.num_rows

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert sum(counts) == plan.rows_per_epoch and len(set(counts)) == 1
    running, most = 0, 0
    for event in log.read_text().split():  # appends are atomic: the file's order is the calls' order
        running += 1 if event == "+" else -1
        most = max(most, running)
    assert most == 2, f"at most {most} sampler call(s) ran at once"


def test_the_held_stream_leaves_its_executor_idle(ray_cluster, tmp_path):
    """While the bound holds every actor back, the process that executes the stream sleeps: over a few seconds
    of slow consumers its CPU time is a small share of the time (without the pause it spins on a core)."""
    import psutil

    cfg = parse_args(["--synthetic-nodes", "4000", "--batch-size", "8", "--fanouts", "3", "--epochs", "2",
                      "--num-workers", "1", "--sample-on", "actors", "--sampler-actors", "1"])
    graph = make_synthetic(4000, 4, 16, 6, seed=0)
    plan = SeedPlan.for_run(graph.train_idx, cfg.sampler.batch_size, 1, 0)
    ds = minibatch_stream(cfg, publish(graph), plan, 0)
    ds.context.execution_options = execution_options()
    (split,) = ds.streaming_split(1, equal=True)
    blocks = iter(split.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0))
    next(blocks)  # the stream runs; the sampler soon fills the bound and is held there
    time.sleep(3)
    from ray.util.state import get_actor

    coordinator = psutil.Process(get_actor(split._coord_actor._actor_id.hex()).pid)
    before, start = coordinator.cpu_times(), time.monotonic()
    time.sleep(4)  # nothing consumed: held the whole time
    after, elapsed = coordinator.cpu_times(), time.monotonic() - start
    used = (after.user + after.system) - (before.user + before.system)
    assert used < 0.15 * elapsed, f"the stream's executor used {used:.2f} CPU-s in {elapsed:.1f} s while held"
    for _ in blocks:  # drain, so the stream ends cleanly
        pass
