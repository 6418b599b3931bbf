"""Figure 2: one sampler actor's batches/s in the pipeline against the same sampling in a plain loop, and scaling.

Baseline: ``Sampler(graph, fanouts).sample(seeds)`` in the driver with torch
and DGL limited to one thread, over exactly the seed batches the pipeline gets
(the first batches of the job's ``SeedPlan`` over the full training split, even
with ``--quick``). Ours: :func:`bench.sampler_runs.pipeline_rate`.

The machine's speed drifts within minutes, so the rounds alternate: plain
loop, pipeline, plain loop, pipeline, ..., and each pipeline is compared with
the mean of the plain loops just before and after it; the table shows the
median over the rounds. A second row compares CPU time per batch (the actor
process's, all threads, against the plain loop's).

In a Ray worker: the same comparison against the plain loop run as a Ray task
over the node-shared graph, interleaved with the others: the actor samples in
such a process too, so this baseline holds what the process itself costs, and
the ratio what the pipeline adds.

Scaling: 2 actors' total rate against 1 actor's, beside what the hardware
allows: 2 plain loops in 2 processes at once against 1.
"""

from __future__ import annotations

import statistics

import numpy as np

from bench.common import Row, Settings, error_row, verdict
from bench.sampler_runs import Barrier, pipeline_rate, plain_sampling, plain_sampling_task, same_seed_batches
from gnnray.data.graph import Graph

TARGET = ">= 0.9x"
SCALING_TARGET = ">= 0.9x of plain scaling"
ONE_ACTOR = "sampler actor batches/s (k=1)"


def bench_sampler(graph: Graph, handle, seed_ids: np.ndarray, s: Settings) -> list[Row]:
    batches, epochs = same_seed_batches(seed_ids, s, 2 * s.sampler_batches)
    batches = batches[:s.sampler_batches]

    def plain_loop() -> dict:
        r = plain_sampling(graph, s.fanouts, batches, s.sampler_warmup)
        print(f"[2] plain loop, 1 thread: {r['batches_per_s']:.1f} batches/s ({1000 / r['batches_per_s']:.0f} "
              f"ms/batch, {r['cpu_ms']:.0f} ms of CPU)", flush=True)
        return r

    def pipeline(k: int) -> dict:
        m = pipeline_rate(handle, seed_ids, s, k, epochs)
        print(f"[2] pipeline k={k}: {m['total_batches_per_s']:.1f} batches/s total, "
              f"{m['per_actor_batches_per_s']:.1f} per actor (rows per actor: {m['rows_by_actor']}); in the actor "
              f"{m['in_call_ms']:.1f} ms/batch sampling+packing, {m['between_calls_ms']:.1f} ms between calls, "
              f"{m['cpu_ms']:.0f} ms of CPU; first batch {m['first_batch_done_s']:.1f} s after start; consumer "
              f"{m['consumer_lag_end_s']:.2f} s behind at the end; unpack {m['unpack_ms']:.2f} ms; cores used: "
              f"{m['cores_by_process']}", flush=True)
        return m

    rows = []
    # The pipeline runs interleaved with two baselines: the plain loop here in
    # the driver, and the same loop in a Ray worker process (as the actor is).
    plain, in_worker, ones = [plain_loop()], [plain_processes(handle, batches, s, 1)[0]], []
    try:
        for _ in range(s.sampler_rounds):
            ones.append(pipeline(1))
            plain.append(plain_loop())
            in_worker.append(plain_processes(handle, batches, s, 1)[0])
    except Exception as exc:  # noqa: BLE001 - recorded in the table
        rows.append(error_row(ONE_ACTOR, TARGET, exc))
    if ones:
        rows += overhead_rows(ones, plain, in_worker)
    try:
        rows.append(scaling_row(pipeline(2), plain_processes(handle, batches, s, 2), ones, in_worker))
    except Exception as exc:  # noqa: BLE001 - recorded in the table
        rows.append(error_row("sampler batches/s, 2 actors vs 1", SCALING_TARGET, exc))
    return rows


def plain_processes(handle, batches: list, s: Settings, n: int) -> list[dict]:
    """``n`` plain loops at once, each in a Ray worker process over the node-shared graph."""
    import ray

    task = ray.remote(num_cpus=1)(plain_sampling_task)
    barrier = ray.remote(num_cpus=0)(Barrier).remote(n)
    loops = ray.get([task.remote(handle, s.fanouts, batches, s.sampler_warmup, barrier) for _ in range(n)])
    print(f"[2] {n} plain loop(s) in {n} Ray worker process(es) at once: "
          f"{sum(r['batches_per_s'] for r in loops):.1f} batches/s in total "
          f"({statistics.mean(r['cpu_ms'] for r in loops):.0f} ms of CPU/batch)", flush=True)
    return loops


def overhead_rows(ones: list[dict], plain: list[dict], in_worker: list[dict]) -> list[Row]:
    """Rate and CPU rows against the plain loop, and the rate row against the loop in a Ray worker."""
    rate, cpu = ("per_actor_batches_per_s", "batches_per_s", "b/s"), ("cpu_ms", "cpu_ms", "ms")
    rows = []
    for figure, plains, (ours_key, base_key, unit) in ((ONE_ACTOR, plain, rate),
                                                       ("sampler CPU ms/batch (k=1)", plain, cpu),
                                                       ("sampler k=1 vs plain loop in a Ray worker", in_worker, rate)):
        got = []  # each pipeline against the mean of the plain loops just before and after it; > 1 is faster
        for i, m in enumerate(ones):
            base = statistics.mean(p[base_key] for p in plains[i:i + 2])
            got.append(m[ours_key] / base if unit == "b/s" else base / m[ours_key])
        ratio = statistics.median(got)
        rows.append(Row(figure, ours=f"{statistics.median(m[ours_key] for m in ones):.1f} {unit}",
                        baseline=f"{statistics.median(p[base_key] for p in plains):.1f} {unit}",
                        ratio=f"{ratio:.2f}x", target=TARGET, met=verdict(ratio >= 0.9),
                        detail=dict(baselines=plains, pipelines=ones, ratios=got)))
    return rows


def scaling_row(two: dict, two_plain: list[dict], ones: list[dict], in_worker: list[dict]) -> Row:
    """2 actors against 1, beside 2 plain loops in 2 processes against 1."""
    hw = sum(r["batches_per_s"] for r in two_plain) / statistics.median(r["batches_per_s"] for r in in_worker)
    one = statistics.median(m["total_batches_per_s"] for m in ones)
    scaling = two["total_batches_per_s"] / one
    return Row("sampler batches/s, 2 actors vs 1", ours=f"{scaling:.2f}x ({two['total_batches_per_s']:.1f} b/s)",
               baseline=f"{hw:.2f}x (plain loops)", ratio=f"{scaling / hw:.2f}x", target=SCALING_TARGET,
               met=verdict(scaling >= 0.9 * hw),
               detail=dict(pipeline=two, plain_scaling=hw, one_actor_batches_per_s=one))
