"""Tests of gnnray.driver.pace: where training batches are sampled, and how many actors keep pace."""

from __future__ import annotations

import pytest

from conftest import tiny_graph
from gnnray.config import parse_args
from gnnray.errors import ConfigError
from gnnray.driver.pace import (SEEDS_PER_CORE, THREADS_AT_MOST, Paces, actors_for_pace, check_device_sampling,
                                keeps_pace, plan_cpu_node, sample_on, speedup, step_gflop)

GIB = 2**30


def test_a_choice_on_the_command_line_is_kept():
    assert sample_on("device", 10 * GIB, None, 64, 1024)[0] == "device"
    assert sample_on("actors", 1, 80 * GIB, 1, 1024)[0] == "actors"


def test_auto_samples_on_the_gpu_where_the_cores_cannot_keep_pace_and_the_structure_fits():
    # 1024 seeds every 4 ms: 256,000 seeds/s, more than 12 cores of 20,000.
    where, why = sample_on("auto", 1 * GIB, 80 * GIB, 12, 1024, seeds_per_core=20_000, step_s=0.004)
    assert where == "device" and "256,000" in why
    # Enough cores per GPU: the actors keep pace.
    assert sample_on("auto", 1 * GIB, 80 * GIB, 16, 64, seeds_per_core=20_000, step_s=0.004)[0] == "actors"
    # With the module's own pace and step: the products-shaped step needs the GPU at 12 cores a GPU.
    assert sample_on("auto", 1 * GIB, 80 * GIB, 12, 1024)[0] == "device"
    # The structure takes more than a quarter of the GPU, or the GPU's memory is unknown: actors.
    assert sample_on("auto", 30 * GIB, 80 * GIB, 12, 1024)[0] == "actors"
    assert sample_on("auto", 1 * GIB, None, 12, 1024)[0] == "actors"


def test_the_why_says_the_gpu_step_was_assumed_and_what_the_memory_was():
    # Nothing measures the GPU's step before training: each auto line says what the rule took for it.
    for cores in (12, 64):
        why = sample_on("auto", 1 * GIB, 80 * GIB, cores, 1024)[1]
        assert "a GPU step assumed 4 ms: the products-shaped step's ceiling on an H200" in why
    assert "a GPU step assumed 10 ms" in sample_on("auto", 1 * GIB, 80 * GIB, 1, 1024, step_s=0.01)[1]
    assert "H200" not in sample_on("auto", 1 * GIB, 80 * GIB, 1, 1024, step_s=0.01)[1]
    where, why = sample_on("auto", 1 * GIB, None, 12, 1024, unknown="node 10.0.0.2 did not say within 30 s")
    assert where == "actors" and why.endswith("; node 10.0.0.2 did not say within 30 s")
    where, why = sample_on("auto", 30 * GIB, 80 * GIB, 12, 1024)
    assert where == "actors" and "(30.00 GiB of structure against a GPU's 80.00 GiB)" in why


def test_keeps_pace_is_the_rule_that_spares_asking_a_gpu():
    # 12 cores of 20,000 seeds/s against 256,000: the GPU is asked; 16 of them sample 320,000: it is not.
    assert not keeps_pace(12, 1024, 20_000, 0.004) and keeps_pace(16, 1024, 20_000, 0.004)
    assert sample_on("auto", 1 * GIB, None, 16, 1024, seeds_per_core=20_000)[0] == "actors"


def test_the_gpu_probe_imports_no_torch():
    """It runs in a task on each GPU node for the driver's plan: loading torch there would cost seconds."""
    import subprocess
    import sys

    code = "import sys; from gnnray.driver.pace import gpu_bytes; b = gpu_bytes(); print('torch' in sys.modules, b)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    imported, size = out.stdout.split()
    assert imported == "False", out.stderr
    assert size == "None" or int(size) > 2**30  # no CUDA driver here, or a GPU's memory


@pytest.mark.parametrize("step_s, batch, cores, want", [
    (0.004, 1024, 16, 13),  # 256,000 seeds/s over 20,000 each: 12.8 -> 13
    (0.004, 1024, 8, 8),  # capped by the node's cores
    (0.1, 1024, 8, 1),  # a slow step needs one
    (0.05, 1000, 8, 1),  # exactly one actor's pace
    (0.0499, 1000, 8, 2),  # just above it
])
def test_actors_follow_the_step_rate(step_s, batch, cores, want):
    assert actors_for_pace(step_s, batch, cores, seeds_per_actor=20_000) == want


def test_actors_for_pace_defaults_to_the_measured_pace():
    # 102,400 seeds/s at the measured pace a core.
    assert actors_for_pace(0.01, 1024, 64) == -(-102_400 // SEEDS_PER_CORE)


def test_measured_pace_is_seeds_per_cpu_second_of_the_native_sampler():
    from gnnray.driver.pace import measured_pace

    g = tiny_graph(num_nodes=2000, num_edges=40_000)
    dense, sparse = measured_pace(g, (25, 25), 256), measured_pace(g, (1,), 256)
    assert 0 < dense < sparse  # 25 x 25 picks a seed cost more than one pick


@pytest.mark.parametrize("extra, says", [
    (["--sampler", "graphbolt"], "--sampler graphbolt"),
    (["--embedding-dim", "8"], "--embedding-dim"),
])
def test_device_sampling_refuses_what_it_does_not_serve(extra, says):
    with pytest.raises(ConfigError, match=says):
        check_device_sampling(parse_args(["--sample-on", "device"] + extra))
    check_device_sampling(parse_args(["--sample-on", "actors"] + extra))  # the actors serve both


# One core's seconds per batch, measured on this 2-core host (pace.measure, step_gflop): arxiv structure with fanouts
# 10,10,10 and SAGE 3x256 (8 ms to sample, a 17.2 GFLOP step), the products-shaped graph with 15,10,5 (31 ms,
# 22.1 GFLOP); docs/cpu-plan.md#the-budget works these through.
ARXIV, PRODUCTS = Paces(0.008, 17.2 / 40, 17.2), Paces(0.031, 22.1 / 40, 22.1)


@pytest.mark.parametrize("cores, paces, workers, threads, samplers", [
    (2, ARXIV, 1, 2, 0),  # this machine: sampling needs 0.03 of a core, each worker samples its own
    (2, PRODUCTS, 1, 2, 0),
    (16, PRODUCTS, 1, 16, 0),  # 0.45 of a core
    (64, ARXIV, 4, 16, 0),  # ARGO's several processes: a worker per 16 cores; 0.6 of a core
    (64, PRODUCTS, 4, 15, 2),  # 1.74 cores of sampling: two cores of actors, 15 threads each for 4 workers
    (128, ARXIV, 8, 15, 2),  # 1.15 cores
    (128, PRODUCTS, 8, 15, 4),  # 3.48 cores
])
def test_a_cpu_node_is_planned_as_one_budget(cores, paces, workers, threads, samplers):
    plan = plan_cpu_node(cores, paces)
    assert (plan.workers, plan.threads, plan.sampler_cores) == (workers, threads, samplers)
    assert plan.workers * plan.threads + plan.sampler_cores <= cores  # never more than the node has
    assert plan.in_workers == (samplers == 0) and (plan.need < 1) == plan.in_workers
    assert plan.why().endswith("less than one") == plan.in_workers


def test_the_plans_workers_and_the_users():
    assert plan_cpu_node(2, ARXIV, workers=2).threads == 1  # --num-workers 2 on 2 cores: a thread each
    assert plan_cpu_node(4, PRODUCTS, workers=8).in_workers  # more workers than cores: no core to spare
    # A step as cheap as sampling: the actors take cores, at least one thread is left to each worker.
    cheap = plan_cpu_node(8, Paces(0.01, 0.01), workers=2)
    assert cheap.sampler_cores >= 1 and cheap.threads >= 1 and 2 * cheap.threads + cheap.sampler_cores <= 8


def test_a_workers_speedup_flattens_past_its_thread_bound():
    assert speedup(1) == 1
    assert speedup(THREADS_AT_MOST) == pytest.approx(THREADS_AT_MOST / 2)
    assert speedup(4 * THREADS_AT_MOST) < 2 * speedup(THREADS_AT_MOST)  # 4x the threads, not 2x the speed


def test_step_gflop_counts_dense_products_and_aggregations():
    # Two layers: 100 destinations over 1,000 edges from 8 features to 16, then 10 over 90 edges to 3 classes.
    forward = 4 * 100 * 8 * 16 + 1000 * 8 + 4 * 10 * 16 * 3 + 90 * 16
    assert step_gflop([(100, 1000), (10, 90)], 8, 16, 3) == pytest.approx(3 * forward / 1e9)


def test_measure_times_a_batch_and_returns_its_layers():
    from gnnray.driver.pace import measure

    g = tiny_graph(num_nodes=2000, num_edges=40_000)
    seconds, layers = measure(g, (5, 5), 64)
    assert seconds > 0 and len(layers) == 2
    (dst0, edges0), (dst1, edges1) = layers
    assert dst1 == 64 and edges1 <= 5 * 64 and dst0 > dst1 and edges0 <= 5 * dst0  # input layer first


def test_the_job_plans_a_2_core_host_and_a_64_core_node_apart():
    """What the driver prints for this graph on this machine's 2 cores and on a simulated 64-core node: the
    workers --num-workers auto gives each, then where they sample and why."""
    from gnnray.data.synthetic import make_synthetic
    from gnnray.driver.plans import cpu_sampling, workers
    from gnnray.driver.preflight import Node

    auto = parse_args(["--num-workers", "auto", "--fanouts", "10,10,10", "--hidden", "256"])
    graph = make_synthetic(num_nodes=20_000, num_classes=40, feat_dim=128, avg_degree=10, seed=0)
    lines = {}
    for cores in (2, 64):
        cfg = workers(auto, False, False, [Node("n", "10.0.0.1", cores, 0, 0)])
        lines[cores] = (cfg.train.num_workers, cpu_sampling(cfg, graph, cores, cfg.train.workers_max))
    assert lines[2][0] == (1,) and lines[64][0] == (4,)
    for cores, (count, (where, why, actors)) in lines.items():
        assert (where, actors) == ("device", 0)
        assert f"{cores} cores a node" in why and f"{count[0]} worker(s) need" in why
        assert f"on {cores // count[0]} threads" in why
