"""The ``sampler`` stage: one sampler actor's batches/s in the job's stream against the same sampling in a plain loop.

Baselines, interleaved with the pipeline in rounds: the plain loop on one thread in the driver, and the same
loop in a Ray worker process (where the actor samples too: the ratio is what the pipeline adds); each
pipeline against the mean of the loops just before and after it, the median over rounds. Also 2 actors against
1, beside 2 plain loops in 2 processes against 1 (what the hardware allows).
"""

from __future__ import annotations

import math
import os
import statistics
import time

import numpy as np

from bench import cpu
from bench.harness import REPO, Row, error_row, threads, verdict
from bench.settings import Settings, job_config
from gnnray.data.graph import Graph

TARGET = ">= 0.9x"
SCALING_TARGET = ">= 0.9x of plain scaling"
ONE_ACTOR = "sampler actor batches/s (k=1)"


def same_seed_batches(train_idx: np.ndarray, s: Settings, rows: int) -> tuple[list, int]:
    """The first ``rows`` seed batches of the job's ``SeedPlan`` with one worker, and the epochs they span."""
    from gnnray.seeds import SeedPlan

    plan = SeedPlan.for_run(train_idx, s.batch_size, 1, s.seed)
    epochs = math.ceil(rows / plan.rows_per_epoch)
    return [b for e in range(epochs) for b in plan.batches(e)][:rows], epochs


def plain_sampling(graph: Graph, fanouts: tuple, batches: list, warmup: int, barrier=None) -> dict:
    """Sample ``batches`` in a plain loop on one thread: batches/s and CPU ms a batch after ``warmup``; with
    ``barrier`` (a :class:`Barrier` actor) the timed part starts once every process has warmed up."""
    from gnnray.sampler.sampler import Sampler

    with threads(1):
        sampler = Sampler(graph, fanouts)
        for seeds in batches[:warmup]:
            sampler.sample(seeds)
        if barrier is not None:
            import ray

            ray.get(barrier.arrive.remote())
            while not ray.get(barrier.ready.remote()):
                time.sleep(0.01)
        start, cpu = time.perf_counter(), time.process_time()
        for seeds in batches[warmup:]:
            sampler.sample(seeds)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    n = len(batches) - warmup
    return dict(batches_per_s=n / elapsed, cpu_ms=1000 * cpu / n)


class Barrier:
    """Lets processes that each ``arrive`` poll until all ``n`` have (a Ray actor)."""

    def __init__(self, n: int):
        self._n, self._arrived = n, 0

    def arrive(self) -> None:
        self._arrived += 1

    def ready(self) -> bool:
        return self._arrived >= self._n


def plain_sampling_task(handle, fanouts: tuple, batches: list, warmup: int, barrier) -> dict:
    """:func:`plain_sampling` in a Ray worker over the node-shared graph."""
    return plain_sampling(handle.get(), fanouts, batches, warmup, barrier)


class StampedSamplerActor:
    """``SamplerActor`` plus a column of its call's stamps (start, finish, pid, CPU seconds at the finish, rows):
    the actors' own times give their steady rate, in-call against between-call time, and CPU per row."""

    def __init__(self, graph, fanouts, plan, run: str = "gnnray", cpu=None):
        from gnnray.sampler.sampler import SamplerActor

        self._actor = SamplerActor(graph, fanouts, plan, run, cpu)

    def __call__(self, rows: dict):
        import pyarrow as pa

        start = time.time()
        out = self._actor(rows)
        stamp = [start, time.time(), os.getpid(), time.process_time(), out.num_rows] * out.num_rows
        return out.append_column("stamp", pa.FixedSizeListArray.from_arrays(pa.array(stamp, pa.float64()), 5))


def stamped_stream(cfg, handle, plan):
    """The job's stream (:func:`gnnray.driver.stream.minibatch_stream`, read-ahead bound included) of stamped actors."""
    from gnnray.driver.stream import minibatch_stream

    return minibatch_stream(cfg, handle, plan, 0, actor_cls=StampedSamplerActor)


def call_stats(stamps: np.ndarray, warmup: int, actors: int) -> dict:
    """Rows/s of all actors, ms a row inside calls and CPU ms a row, from the call stamps after the calls that
    hold the first ``warmup`` rows."""
    calls = np.unique(stamps, axis=0)  # one line per call: start, finish, pid, cpu, rows
    calls = calls[np.argsort(calls[:, 1])]
    first = int(np.searchsorted(np.cumsum(calls[:, 4]), warmup))  # the call that holds row ``warmup``
    if first >= len(calls) - 1:
        raise RuntimeError(f"only {len(calls)} calls; need more after the first {warmup} rows")
    steady = calls[first + 1:]
    rate = steady[:, 4].sum() / (calls[-1, 1] - calls[first, 1])
    in_call = 1000 * float(np.sum(steady[:, 1] - steady[:, 0]) / steady[:, 4].sum())
    cpu, rows = 0.0, 0
    for pid in np.unique(calls[:, 2]):
        mine = calls[calls[:, 2] == pid]
        mine = mine[np.argsort(mine[:, 3])]
        skip = max(1, min(int(np.searchsorted(np.cumsum(mine[:, 4]), warmup // actors)) + 1, len(mine) - 1))
        cpu += mine[-1, 3] - mine[skip - 1, 3]
        rows += int(mine[skip:, 4].sum())
    return dict(rate=rate, in_call_ms=in_call, cpu_ms=1000 * cpu / rows, calls=len(calls))


def pipeline_rate(handle, seed_ids: np.ndarray, s: Settings, k: int, epochs: int) -> dict:
    """``k`` stamped sampler actors in the job's own stream (its read-ahead bound for one worker), consumed as a
    train worker consumes it (whole blocks, no prefetch, each row unpacked); the actors' steady rate after the
    first ``k * sampler_warmup`` rows, the consumer's unpack time and lag, and the cores each process group used."""
    import dataclasses

    from gnnray.batch import MiniBatch, from_arrow
    from gnnray.config import DataConfig
    from gnnray.seeds import SeedPlan
    from gnnray.store.handle import readonly_tensor

    # Only the stream is built from it: no run, so no data and no storage.
    cfg = job_config(DataConfig(), dataclasses.replace(s, workers=1, samplers=k, epochs=epochs), REPO,
                     f"bench-sampler-{k}")
    plan = SeedPlan.for_run(seed_ids, s.batch_size, 1, s.seed)
    ds = stamped_stream(cfg, handle, plan).limit(k * s.sampler_batches)
    start, stamps, arrived, unpack_s, window = time.time(), [], [], 0.0, []
    for block in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0):
        stamps += block.column("stamp").to_pylist()
        for packed in from_arrow(block):
            t = time.perf_counter()
            mb = MiniBatch.unpack(readonly_tensor(packed))
            unpack_s += time.perf_counter() - t
            assert mb.num_seeds > 0
            arrived.append(time.time())
        if not window and len(arrived) >= k * s.sampler_warmup:
            window.append((time.perf_counter(), cpu.snapshot()))
    window.append((time.perf_counter(), cpu.snapshot()))
    (t0, a), (t1, b) = window[0], window[-1]
    cores = {g: round(v / (t1 - t0), 3) for g, v in sorted(cpu.between(a, b).items())}
    stamps = np.array(stamps)
    calls = call_stats(stamps, k * s.sampler_warmup, k)
    rate, busy = calls["rate"], calls["in_call_ms"]
    return dict(actors=k, batches=len(stamps), calls=calls["calls"], warmup=k * s.sampler_warmup,
                max_ahead=cfg.sampler.max_ahead, rows_per_call=float(np.median(stamps[:, 4])),
                total_batches_per_s=rate, per_actor_batches_per_s=rate / k,
                rows_by_actor=np.unique(stamps[:, 2], return_counts=True)[1].tolist(),
                in_call_ms=busy, between_calls_ms=1000 * k / rate - busy, cpu_ms=calls["cpu_ms"],
                first_batch_done_s=float(stamps[:, 1].min() - start),
                consumer_lag_end_s=arrived[-1] - float(stamps[:, 1].max()), unpack_ms=1000 * unpack_s / len(stamps),
                cores_by_process=cores)


def bench_sampler(graph: Graph, handle, seed_ids: np.ndarray, s: Settings) -> list[Row]:
    batches, epochs = same_seed_batches(seed_ids, s, 2 * s.sampler_batches)
    batches = batches[:s.sampler_batches]

    def plain_loop() -> dict:
        r = plain_sampling(graph, s.fanouts, batches, s.sampler_warmup)
        print(f"[2] plain loop, 1 thread: {r['batches_per_s']:.1f} batches/s, {r['cpu_ms']:.0f} ms of CPU", flush=True)
        return r

    def pipeline(k: int) -> dict:
        m = pipeline_rate(handle, seed_ids, s, k, epochs)
        print(f"[2] pipeline k={k}: {m['total_batches_per_s']:.1f} batches/s total, {m['per_actor_batches_per_s']:.1f} "
              f"per actor; in the actor {m['in_call_ms']:.1f} ms/batch in calls, {m['between_calls_ms']:.1f} ms "
              f"between, {m['cpu_ms']:.0f} ms of CPU; consumer {m['consumer_lag_end_s']:.2f} s behind at the end; "
              f"cores used: {m['cores_by_process']}", flush=True)
        return m

    rows = []
    plain, in_worker, ones = [plain_loop()], [plain_processes(handle, batches, s, 1)[0]], []
    try:
        for _ in range(s.sampler_rounds):
            ones.append(pipeline(1))
            plain.append(plain_loop())
            in_worker.append(plain_processes(handle, batches, s, 1)[0])
    except Exception as exc:  # noqa: BLE001 - recorded in the table
        rows.append(error_row(ONE_ACTOR, TARGET, exc))
    rate, cpu_ms = ("per_actor_batches_per_s", "batches_per_s", "b/s"), ("cpu_ms", "cpu_ms", "ms")
    for figure, plains, (ours_key, base_key, unit) in ((ONE_ACTOR, plain, rate),
                                                       ("sampler CPU ms/batch (k=1)", plain, cpu_ms),
                                                       ("sampler k=1 vs plain loop in a Ray worker", in_worker, rate)):
        if not ones:
            break
        got = []  # each pipeline against the mean of the plain loops just before and after it; > 1 is faster
        for i, m in enumerate(ones):
            base = statistics.mean(p[base_key] for p in plains[i:i + 2])
            got.append(m[ours_key] / base if unit == "b/s" else base / m[ours_key])
        ratio = statistics.median(got)
        rows.append(Row(figure, ours=f"{statistics.median(m[ours_key] for m in ones):.1f} {unit}",
                        baseline=f"{statistics.median(p[base_key] for p in plains):.1f} {unit}",
                        ratio=f"{ratio:.2f}x", target=TARGET, met=verdict(ratio >= 0.9),
                        detail=dict(baselines=plains, pipelines=ones, ratios=got)))
    try:
        two, two_plain = pipeline(2), plain_processes(handle, batches, s, 2)
        hw = sum(r["batches_per_s"] for r in two_plain) / statistics.median(r["batches_per_s"] for r in in_worker)
        one = statistics.median(m["total_batches_per_s"] for m in ones)
        scaling = two["total_batches_per_s"] / one
        rows.append(Row("sampler batches/s, 2 actors vs 1", ours=f"{scaling:.2f}x ({two['total_batches_per_s']:.1f} "
                        "b/s)", baseline=f"{hw:.2f}x (plain loops)", ratio=f"{scaling / hw:.2f}x",
                        target=SCALING_TARGET, met=verdict(scaling >= 0.9 * hw),
                        detail=dict(pipeline=two, plain_scaling=hw, one_actor_batches_per_s=one)))
    except Exception as exc:  # noqa: BLE001 - recorded in the table
        rows.append(error_row("sampler batches/s, 2 actors vs 1", SCALING_TARGET, exc))
    return rows


def plain_processes(handle, batches: list, s: Settings, n: int) -> list[dict]:
    """``n`` plain loops at once, each in a Ray worker process over the node-shared graph."""
    import ray

    task = ray.remote(num_cpus=1)(plain_sampling_task)
    barrier = ray.remote(num_cpus=0)(Barrier).remote(n)
    loops = ray.get([task.remote(handle, s.fanouts, batches, s.sampler_warmup, barrier) for _ in range(n)])
    print(f"[2] {n} plain loop(s) in Ray worker processes at once: "
          f"{sum(r['batches_per_s'] for r in loops):.1f} batches/s in total", flush=True)
    return loops
