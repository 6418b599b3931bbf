"""The software stack every process of a run shares with its driver: Python, Ray, torch, numpy, the sampler's library.

A node with another Ray can misread Ray's private state (gnnray uses some),
another numpy or torch can unpickle the driver's objects differently, and
another numba or DGL samples otherwise. So the driver checks every node it
sees at start (:func:`gnnray.driver.preflight.check_versions`), and each train
worker and sampler actor checks its own process against the driver's stack
when it starts (:func:`check_here`): a node that joins later (an autoscaler's,
an elastic run's) is checked by the first process Ray places there.

Versions are read from the installed packages' metadata, without importing
them. torch's local label (``+cpu``, ``+cu130``) is not compared: a GPU node
carries another build of the same torch. Python is compared by minor version.
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Optional

from gnnray.errors import ClusterError

# The one pinned version: gnnray relies on internals of this Ray (pyproject.toml pins it; test_versions keeps the two
# equal). The rest must only equal the driver's.
RAY = "2.60.0"
# The sampler's library per --sampler backend; DGL 2.1.0 is the dgl extra's pin.
SAMPLER_LIBRARY = {"native": "numba", "graphbolt": "dgl"}
DGL = "2.1.0"
DGL_INSTALL = "pip install -e '.[dgl]' (torch 2.2.1, numpy < 2, Python 3.10-3.12)"


def installed(names) -> dict:
    """The installed versions of the packages ``names`` (``None``: not installed), read without importing them."""
    found = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def versions(backend: str = "native") -> dict:
    """This process's stack: Python (major.minor), Ray, torch (without its build label), numpy and the sampler's
    library for ``backend``."""
    found = installed(("ray", "torch", "numpy", SAMPLER_LIBRARY[backend]))
    if found["torch"]:
        found["torch"] = found["torch"].split("+")[0]
    return {"python": f"{sys.version_info[0]}.{sys.version_info[1]}", **found}


def differences(found: dict, expected: dict) -> list[str]:
    """``name found (driver: expected)`` for each entry of ``expected`` that ``found`` lacks or has otherwise."""
    return [f"{name} {found.get(name) or 'missing'} (driver: {want or 'missing'})"
            for name, want in expected.items() if found.get(name) != want]


def required(backend: str) -> dict:
    """The pins every node needs whatever the driver has: Ray, and DGL for ``--sampler graphbolt``."""
    return {"ray": RAY, **({"dgl": DGL} if backend == "graphbolt" else {})}


class StackError(ClusterError):
    """A process of the run started on a node whose stack differs from the driver's."""


def check_here(expected: Optional[dict], who: str) -> None:
    """Raise :class:`StackError` naming this node if this process's stack differs from ``expected`` (the
    driver's :func:`versions`); ``None`` checks nothing (code run without a driver: tests, tools)."""
    if not expected:
        return
    diff = differences(versions(_backend(expected)), expected)
    if diff:
        raise StackError(f"{who} on {node_text()} has {', '.join(diff)}: install the driver's versions on every "
                         f"node (pip install -e . in the same environment as the driver's, or the same image)")


def _backend(expected: dict) -> str:
    return "graphbolt" if "dgl" in expected else "native"


def node_text() -> str:
    """``node IP (ID)`` of this process, as the driver's messages name nodes."""
    import ray

    return f"node {ray.util.get_node_ip_address()} ({ray.get_runtime_context().get_node_id()[:8]})"
