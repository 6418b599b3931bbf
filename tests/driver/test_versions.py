"""Versions checked at start: every node's Ray and DGL against the pinned ones, refused in one line."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest

from conftest import _simulated_nodes
from drills import REPO, SMALL, own_stderr
from gnnray.driver import preflight
from gnnray.driver.cli import main
from gnnray.errors import ClusterError
from gnnray.train.report import METRICS_LOG


def test_pins_are_pyprojects():
    """The versions the driver checks are the ones the package installs."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {m[1]: m[2] for m in (re.match(r"([A-Za-z0-9_-]+)(?:\[[^]]*\])?==([\w.]+)$", d) for d in deps) if m}
    assert preflight.PINNED == {name: pins[name] for name in preflight.PINNED}


def test_installed_versions_reads_metadata_without_importing():
    code = ("import sys; from gnnray.driver.preflight import installed_versions; "
            "print(installed_versions(('dgl', 'no-such-package-gnnray')), 'dgl' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == f"{{'dgl': '{preflight.PINNED['dgl']}', 'no-such-package-gnnray': None}} False", \
        out.stderr[-2000:]


def test_every_node_answers_with_the_pinned_versions(ray_cluster, cluster):
    with _simulated_nodes(cluster, 1):
        nodes = preflight.nodes()
        assert len(nodes) == 2
        assert preflight.check_versions(nodes) == 2


def test_a_node_without_a_pinned_package_or_version_is_named(ray_cluster):
    nodes = preflight.nodes()
    with pytest.raises(ClusterError) as err:
        preflight.check_versions(nodes, {"ray": "2.59.0", "no-such-package-gnnray": "1.0"})
    message = str(err.value)
    assert f"node {nodes[0].address} ({nodes[0].node_id[:8]}) has ray {preflight.PINNED['ray']}, " \
           "no-such-package-gnnray missing" in message, message
    assert "ray==2.59.0 no-such-package-gnnray==1.0 on every node" in message, message


def test_a_mismatch_stops_the_job_in_one_line_before_training(ray_cluster, tmp_path, monkeypatch, capsys):
    """The real check, on the session's cluster, against a pin its nodes do not have (DGL 2.0.0)."""
    import ray._private.state

    monkeypatch.setitem(preflight.PINNED, "dgl", "2.0.0")
    actors = len(ray._private.state.actors())  # the GCS table keeps dead ones
    assert main(SMALL + ["--storage-path", str(tmp_path), "--name", "pinned"]) == 2
    err = own_stderr(capsys.readouterr().err).strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith("gnnray: error: gnnray needs ray==2.60.0 dgl==2.0.0 on every node and node ") and \
        f"has dgl {preflight.installed_versions(('dgl',))['dgl']}" in err, err
    assert len(ray._private.state.actors()) == actors, "an actor started before the versions were checked"
    assert not (tmp_path / "pinned" / METRICS_LOG).exists()
