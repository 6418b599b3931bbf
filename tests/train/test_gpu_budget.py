"""Tests of gnnray.train.gpu_budget: a worker's GPU as one budget, the structure first, the features after."""

from __future__ import annotations

import pytest

from conftest import tiny_graph
from gnnray.errors import ConfigError
from gnnray.train.gpu_budget import CSC_SHARE, csc_bytes, gpu_budget

GIB = 2**30


@pytest.mark.parametrize("total", [16 * GIB, 80 * GIB, 141 * GIB])
@pytest.mark.parametrize("used", [0.0, 0.3, 0.7])
@pytest.mark.parametrize("share", [0.0, 0.1, CSC_SHARE])
def test_the_structure_and_the_features_share_one_budget_of_the_gpu(total, used, share):
    from gnnray.train.placement import DEVICE_SHARE

    free, structure = int(total * (1 - used)), int(share * total)
    if structure > free:
        return
    placement_free, why = gpu_budget(total, free, structure)
    assert structure + DEVICE_SHARE * placement_free <= free  # what placement takes beside the structure
    assert placement_free == free - structure and "free on the GPU after the model" in why
    assert ("kept for the graph's structure" in why) == bool(structure)


@pytest.mark.parametrize("total, free, structure", [
    (80 * GIB, 70 * GIB, 21 * GIB),  # more than a quarter of the GPU
    (80 * GIB, 10 * GIB, 12 * GIB),  # more than is free after the model
])
def test_a_structure_the_workers_gpu_cannot_hold_is_refused_in_one_line(total, free, structure):
    with pytest.raises(ConfigError, match="use --sample-on actors") as e:
        gpu_budget(total, free, structure)
    text = str(e.value)
    assert "\n" not in text and f"{structure / GIB:.2f} GiB" in text and f"{total / GIB:.2f} GiB" in text


def test_csc_bytes_counts_the_structure_and_labels():
    g = tiny_graph()
    assert csc_bytes(g) == g.indptr.nbytes + g.indices.nbytes + g.label.nbytes


def test_csc_bytes_counts_relation_codes_as_the_device_holds_them():
    """The device sampler holds a typed graph's codes as int64 (they index the fanouts), 8 bytes an edge."""
    import dataclasses

    import numpy as np

    g = tiny_graph()
    typed = dataclasses.replace(g, etype=np.zeros(len(g.indices), np.int8), edge_types=(("n", "r", "n"),))
    assert csc_bytes(typed) == csc_bytes(g) + 8 * len(g.indices)
