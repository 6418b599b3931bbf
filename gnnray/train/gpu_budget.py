"""A train worker's GPU as one budget: the device sampler's structure first, the feature placement's share after.

Torch-free, pure rules: the worker applies them to its own GPU
(:func:`gnnray.train.placement.free_for_features`), and the driver's plan
(:mod:`gnnray.driver.pace`) decides ``--sample-on`` with the same share and
the same count of bytes, so that the two never disagree on what fits.
"""

from __future__ import annotations

from gnnray.errors import ConfigError, size_text

# Share of a GPU's memory the graph's structure may take: the model, its activations and (with
# --feature-placement) the feature table need the rest.
CSC_SHARE = 0.25


def csc_bytes(graph) -> int:
    """What the device sampler holds of ``graph`` on the device: its CSC, labels and relation codes (as int64,
    which index the fanouts, where the graph has relations)."""
    codes = 8 * len(graph.etype) if graph.typed and graph.edge_types else 0
    return sum(a.nbytes for a in (graph.indptr, graph.indices, graph.label)) + codes


def gpu_budget(total: int, free: int, structure: int) -> tuple[int, str]:
    """``(free bytes the feature placement sizes from, why)`` on a worker's GPU of ``total`` bytes with ``free``
    free after the model: the device sampler's ``structure`` (0: sampling elsewhere) is reserved first, so the
    structure and the placement's share of the rest never add up past ``free``.

    Raises:
        ConfigError: The structure takes more than :data:`CSC_SHARE` of the GPU or more than its free memory.
    """
    if structure > min(CSC_SHARE * total, free):
        raise ConfigError(f"--sample-on device: the graph's structure ({size_text(structure)}) does not fit this "
                          f"worker's GPU (a quarter of its {size_text(total)}, and {size_text(free)} free after the "
                          f"model): use --sample-on actors")
    if not structure:
        return free, f"{size_text(free)} free on the GPU after the model"
    return free - structure, (f"{size_text(free)} free on the GPU after the model, {size_text(structure)} of it "
                              f"kept for the graph's structure")
