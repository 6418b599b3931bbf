"""Bounded read-ahead (``--max-ahead``): the sampler pool stays a bounded number of batches ahead of the workers."""

from __future__ import annotations

import threading
import time

import pytest

from gnnray.config import parse_args
from gnnray.data.store import publish
from gnnray.data.synthetic import make_synthetic
from gnnray.pipeline.batch import from_arrow
from gnnray.pipeline.seeds import SeedPlan
from gnnray.pipeline.stream import execution_options, minibatch_stream, seed_block_rows

WORKERS, EPOCHS = 2, 3


def _store_bytes(ray) -> int:
    """Bytes of the objects the cluster holds now (Ray's state API)."""
    from ray.util.state import list_objects

    objects = list_objects(address=ray.get_runtime_context().gcs_address, limit=10_000, detail=True,
                           raise_on_missing_output=False)
    return sum(max(o.object_size or 0, 0) for o in {o.object_id: o for o in objects}.values())


def _slow_workers(ray, tmp_path, max_ahead: int) -> dict:
    """Stream EPOCHS epochs to WORKERS consumers slower than the sampler; return the worst gaps seen."""
    from gnnray.pipeline.sampler import SamplerActor

    log = tmp_path / f"produced-{max_ahead}"

    class CountingSampler(SamplerActor):  # defined here: cloudpickle ships it by value
        def __call__(self, rows):
            table = super().__call__(rows)
            with open(log, "a") as f:  # appended after sampling: what exists in the store from now on
                f.write(f"{table.num_rows} {table.nbytes}\n")
            return table

    def produced() -> tuple[int, int]:
        lines = log.read_text().split("\n")[:-1] if log.exists() else []
        rows = [tuple(map(int, l.split())) for l in lines]
        return sum(r for r, _ in rows), max((b // r for r, b in rows if r), default=0)

    cfg = parse_args(["--synthetic-nodes", "4000", "--batch-size", "32", "--fanouts", "5,5", "--epochs",
                      str(EPOCHS), "--num-workers", str(WORKERS), "--sampler-actors", "1,2",
                      "--max-ahead", str(max_ahead)])
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
                time.sleep(0.03)

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
    return dict(worst_rows=worst_rows, worst_bytes=worst_bytes, max_row_bytes=max_row_bytes, total=total,
                bound=max_ahead * WORKERS + seed_block_rows(cfg))


@pytest.mark.parametrize("max_ahead", [2, 6])
def test_sampler_stays_within_max_ahead_of_slow_workers(ray_cluster, tmp_path, max_ahead):
    """Over several epochs, with workers slower than the sampler, production never outruns consumption by more
    than max_ahead x workers + one block, and the object store holds the graph plus at most that many batches."""
    r = _slow_workers(ray_cluster, tmp_path, max_ahead)
    assert r["total"] > 4 * r["bound"]  # the stream is much longer than the bound
    assert 0 < r["worst_rows"] <= r["bound"], r
    # The store: the batches ahead, plus the seed row numbers and Ray Data's small metadata objects.
    assert r["worst_bytes"] <= r["bound"] * r["max_row_bytes"] + 8 * r["total"] + 2**20, r


def test_a_large_bound_lets_the_sampler_run_ahead(ray_cluster, tmp_path):
    """The measurement above can fail: with a bound as long as the stream, sampling races ahead of slow workers."""
    r = _slow_workers(ray_cluster, tmp_path, 10_000)
    assert r["worst_rows"] > 6 * WORKERS + 16, r
