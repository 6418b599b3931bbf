"""Tests of gnnray.pipeline.pace: where training batches are sampled, and how many actors keep pace."""

from __future__ import annotations

import pytest

from conftest import tiny_graph
from gnnray.config import parse_args
from gnnray.errors import ConfigError
from gnnray.pipeline.pace import SEEDS_PER_CORE, actors_for_pace, check_device_sampling, csc_bytes, sample_on

GIB = 2**30


def test_a_choice_on_the_command_line_is_kept():
    assert sample_on("device", False, 10 * GIB, None, 64, 1024)[0] == "device"
    assert sample_on("actors", True, 1, 80 * GIB, 1, 1024)[0] == "actors"


def test_auto_samples_in_actors_on_cpu_workers():
    where, why = sample_on("auto", False, 1, None, 1, 1024)
    assert where == "actors" and "CPU" in why


def test_auto_samples_on_the_gpu_where_the_cores_cannot_keep_pace_and_the_structure_fits():
    # 1024 seeds every 4 ms: 256,000 seeds/s, more than 12 cores of 20,000.
    where, why = sample_on("auto", True, 1 * GIB, 80 * GIB, 12, 1024, seeds_per_core=20_000, step_s=0.004)
    assert where == "device" and "256,000" in why
    # Enough cores per GPU: the actors keep pace.
    assert sample_on("auto", True, 1 * GIB, 80 * GIB, 16, 64, seeds_per_core=20_000, step_s=0.004)[0] == "actors"
    # With the module's own pace and step: the products-shaped step needs the GPU at 12 cores a GPU.
    assert sample_on("auto", True, 1 * GIB, 80 * GIB, 12, 1024)[0] == "device"
    # The structure takes more than a quarter of the GPU, or the GPU's memory is unknown: actors.
    assert sample_on("auto", True, 30 * GIB, 80 * GIB, 12, 1024)[0] == "actors"
    assert sample_on("auto", True, 1 * GIB, None, 12, 1024)[0] == "actors"


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
    from gnnray.pipeline.pace import measured_pace

    g = tiny_graph(num_nodes=2000, num_edges=40_000)
    dense, sparse = measured_pace(g, (25, 25), 256), measured_pace(g, (1,), 256)
    assert 0 < dense < sparse  # 25 x 25 picks a seed cost more than one pick


def test_csc_bytes_counts_the_structure_and_labels():
    g = tiny_graph()
    assert csc_bytes(g) == g.indptr.nbytes + g.indices.nbytes + g.label.nbytes


@pytest.mark.parametrize("extra, says", [
    (["--sampler", "graphbolt"], "--sampler graphbolt"),
    (["--embedding-dim", "8"], "--embedding-dim"),
])
def test_device_sampling_refuses_what_it_does_not_serve(extra, says):
    with pytest.raises(ConfigError, match=says):
        check_device_sampling(parse_args(["--sample-on", "device"] + extra))
    check_device_sampling(parse_args(["--sample-on", "actors"] + extra))  # the actors serve both
