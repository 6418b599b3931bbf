"""The software stack every process of a run shares with its driver: Python, Ray, torch, numpy, pyarrow, pandas,
psutil, the sampler's library and gnnray's own sources.

A node with another Ray can misread Ray's private state (gnnray uses some),
another numpy or torch can unpickle the driver's objects differently (pyarrow
and pandas: Ray Data's blocks), another psutil reports memory otherwise to
Ray's monitor and gnnray's metrics, and another numba or DGL samples otherwise. So the driver checks every node it
sees at start (:func:`gnnray.driver.preflight.check_versions`), and every
process that serves the run (train workers, sampler actors, shard servers,
embedding owners, the inference task) checks its own node against the
driver's stack when it starts (:func:`check_here`, :func:`check_node`): a node
that joins later (an autoscaler's, an elastic run's) is checked by the first
process Ray places there. gnnray is compared by a digest of its sources, not
its version number: a node with other gnnray code runs other code.

A cluster's nodes install one exact stack (:data:`CLUSTER`, written into
``cluster.yaml``'s ``setup_commands`` by ``python -m gnnray.stack``; a test
keeps the two equal), so a node the autoscaler adds after a new release of
torch, numpy or numba still matches the head's driver.

Versions are read from the installed packages' metadata, without importing
them. torch's local label (``+cpu``, ``+cu130``) is not compared: a GPU node
carries another build of the same torch. Python is compared by minor version.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import re
import sys
from pathlib import Path
from typing import Optional

from gnnray.errors import ClusterError

# The one pinned version: gnnray relies on internals of this Ray (pyproject.toml pins it; test_versions keeps the two
# equal). The rest must only equal the driver's.
RAY = "2.60.0"
# The sampler's library per --sampler backend; DGL 2.1.0 is the dgl extra's pin.
SAMPLER_LIBRARY = {"native": "numba", "graphbolt": "dgl"}
DGL = "2.1.0"
DGL_INSTALL = "pip install -e '.[dgl]' (torch 2.2.1, numpy < 2, Python 3.10-3.12)"
# The stack cluster.yaml installs on every node (Python: its images' tag). To move the cluster to new releases,
# change these and run `python -m gnnray.stack cluster.yaml`, which rewrites its setup_commands.
CLUSTER = {"python": "3.11", "ray": RAY, "torch": "2.14.1", "numpy": "2.4.6", "pyarrow": "26.0.1", "pandas": "3.1.1",
           "psutil": "7.2.2", "numba": "0.68.1"}
# Imported by every process of a run beside Ray and torch: their versions must equal the driver's.
SHARED = ("numpy", "pyarrow", "pandas", "psutil")
# The driver's stack (JSON) in the environment of the job's processes: what check_node compares with.
DRIVER_ENV = "GNNRAY_DRIVER_STACK"


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
    """This process's stack: Python (major.minor), Ray, torch (without its build label), :data:`SHARED`, the
    sampler's library for ``backend`` and gnnray (:func:`sources`)."""
    found = installed(("ray", "torch", *SHARED, SAMPLER_LIBRARY[backend]))
    if found["torch"]:
        found["torch"] = found["torch"].split("+")[0]
    return {"python": f"{sys.version_info[0]}.{sys.version_info[1]}", **found, "gnnray": sources()}


@functools.lru_cache(maxsize=None)
def sources() -> str:
    """gnnray's sources as this process runs them: ``src-`` and a digest of every module's path and bytes (the
    same for an installed copy, an editable one or a job's working directory of the same code)."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return "src-" + digest.hexdigest()[:12]


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


def check_node(who: str) -> None:
    """:func:`check_here` against the driver's stack in the job's environment (:data:`DRIVER_ENV`); nothing
    outside a run's processes."""
    expected = os.environ.get(DRIVER_ENV)
    check_here(json.loads(expected) if expected else None, who)


def _backend(expected: dict) -> str:
    return "graphbolt" if "dgl" in expected else "native"


def node_text() -> str:
    """``node IP (ID)`` of this process, as the driver's messages name nodes."""
    import ray

    return f"node {ray.util.get_node_ip_address()} ({ray.get_runtime_context().get_node_id()[:8]})"


def setup_command() -> str:
    """The ``pip install`` of :data:`CLUSTER` (Python aside: the image's) that ``cluster.yaml`` runs on every node,
    beside pyproject.toml's other dependencies as it states them."""
    pins = {name: f"{name}=={version}" for name, version in CLUSTER.items() if name != "python"}
    pins["ray"] = f"ray[default,train,data]=={CLUSTER['ray']}"
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    block = text[text.index("dependencies = ["):]
    deps = [line.strip().strip('",') for line in block[:block.index("]\n")].splitlines()[1:]]
    rest = [d for d in deps if re.match(r"[\w.-]+", d).group(0) not in pins]
    return "pip install -q " + " ".join(f'"{r}"' for r in [*pins.values(), *rest])


def _write_setup(path: str) -> None:
    """Replace the ``setup_commands`` of the cluster config ``path`` with :func:`setup_command`."""
    lines = Path(path).read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("setup_commands:"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip() and not lines[i][0].isspace()),
               len(lines))
    Path(path).write_text("".join(lines[:start + 1]) + f"  - {setup_command()}\n" + "".join(lines[end:]))


if __name__ == "__main__":  # python -m gnnray.stack [CLUSTER_YAML]: print, or write, the nodes' install command
    _write_setup(sys.argv[1]) if sys.argv[1:] else print(setup_command())
