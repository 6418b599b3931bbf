"""What figure 2 times: the plain sampling loop, and the real pipeline with per-call stamps from the actors."""

from __future__ import annotations

import math
import os
import time

import numpy as np

from bench import cpu
from bench.common import REPO, Settings, job_config, threads
from gnnray.data.graph import Graph


def same_seed_batches(train_idx: np.ndarray, s: Settings, rows: int) -> tuple[list, int]:
    """The first ``rows`` seed batches of the job's ``SeedPlan`` with one worker, and the epochs they span."""
    from gnnray.seeds import SeedPlan

    plan = SeedPlan.for_run(train_idx, s.batch_size, 1, s.seed)
    epochs = math.ceil(rows / plan.rows_per_epoch)
    return [b for e in range(epochs) for b in plan.batches(e)][:rows], epochs


def plain_sampling(graph: Graph, fanouts: tuple, batches: list, warmup: int, barrier=None) -> dict:
    """Sample ``batches`` with ``Sampler`` in a plain loop on one thread; steady batches/s and CPU ms per batch.

    With ``barrier`` (a :class:`Barrier` actor), the timed part starts when
    every process has warmed up, so that they run at once.
    """
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
    """``SamplerActor`` plus one column: when the actor started and finished each call, and its CPU time.

    A consumer's arrival times over a run of a few seconds mostly show how
    fast it drains rows buffered while it started; the actors' own
    timestamps give their steady rate, the time inside the call (sampling +
    packing) against the time between calls shows what Ray Data's per-call
    work and waiting cost, and the actor process's CPU time (all its threads,
    so Ray's too) is the cost that does not depend on how busy the machine
    is. Each row carries its call's stamps (start, finish, pid, CPU seconds at
    the finish, rows in the call): five float64 a row. Built with
    ``SamplerActor``'s arguments, by the job's own :func:`minibatch_stream`
    (see :func:`stamped_stream`).
    """

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
    """Steady rates from per-row call stamps, leaving out the calls that hold the first ``warmup`` rows.

    Returns rows/s of all actors, ms per row inside calls, and CPU ms per row
    of the actor processes.
    """
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
    """``k`` stamped sampler actors in the job's Ray Data stream, read as a train worker reads it.

    The stream is the job's (:func:`stamped_stream`: its seed blocks, actor
    pool of ``k`` with ``num_cpus=1``, and ``--max-ahead`` bound for one train
    worker), cut to its first ``k * sampler_batches`` rows; it is consumed as
    a train worker consumes it, in whole blocks without block prefetch (so
    the bound counts as in the job), rows sliced out with ``from_arrow`` and
    each unpacked with ``MiniBatch.unpack``. The rate is the actors' steady
    rate after the calls that hold the first ``k * sampler_warmup`` rows (so
    start-up is excluded), from the times the actors finished each call; it
    includes sampling, packing and Ray Data's work in the actor (batch
    conversion, the object store put). The consumer must keep up for that
    rate to be the pipeline's: its unpack time and how far it lags the actors
    at the end are recorded, and so are the cores each group of processes used (:mod:`bench.cpu`) from the
    warm-up's end until the stream ends: where the machine's CPU goes beside the actors.
    """
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
