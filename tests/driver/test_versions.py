"""The stack checked at start: every node runs the driver's Python, Ray, torch, numpy, pyarrow, pandas, psutil and
sampler library, and the pinned Ray; a node that differs or does not answer is refused in one line, before anything
starts."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib

import numpy as np
import pytest

from conftest import _simulated_nodes, other_versions
from drills import REPO, SMALL, own_stderr
from gnnray import stack
from gnnray.driver import preflight
from gnnray.driver.cli import main
from gnnray.errors import ClusterError
from gnnray.run_storage import METRICS_LOG


def _pins(deps: list[str]) -> dict:
    return {m[1]: m[2] for m in (re.match(r"([A-Za-z0-9_-]+)(?:\[[^]]*\])?==([\w.]+)$", d) for d in deps) if m}


def test_pins_are_pyprojects():
    """The versions the driver requires are the ones the package installs: Ray, and DGL in the dgl extra."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert _pins(project["dependencies"])["ray"] == stack.RAY
    assert _pins(project["optional-dependencies"]["dgl"])["dgl"] == stack.DGL


def test_versions_read_metadata_without_importing():
    code = ("import sys, json; from gnnray.stack import versions; "
            "print(json.dumps([versions(), versions('graphbolt'), sorted({'torch', 'numba', 'dgl'} & set(sys.modules))]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    import json

    native, graphbolt, imported = json.loads(out.stdout)
    assert imported == [], out.stderr[-2000:]
    assert list(native) == ["python", "ray", "torch", "numpy", "pyarrow", "pandas", "psutil", "numba", "gnnray"]
    assert native["python"] == f"{sys.version_info[0]}.{sys.version_info[1]}" and native["ray"] == stack.RAY
    assert "+" not in native["torch"] and native["numba"]  # torch's build label (+cpu, +cu130) is not compared
    assert list(graphbolt)[-2:] == ["dgl", "gnnray"] and native["gnnray"] == stack.sources()


def test_differences_name_what_differs_from_the_driver():
    driver = {"python": "3.11", "torch": "2.13.0", "numpy": "2.4.6"}
    assert stack.differences(driver, driver) == []
    assert stack.differences({"python": "3.12", "torch": "2.13.0"}, driver) == [
        "python 3.12 (driver: 3.11)", "numpy missing (driver: 2.4.6)"]


def test_every_node_answers_with_the_drivers_stack(ray_cluster, cluster):
    with _simulated_nodes(cluster, 1):
        nodes = preflight.nodes()
        assert len(nodes) == 2
        assert preflight.check_versions(nodes, stack.versions()) == 2


def test_a_node_with_another_stack_is_named(ray_cluster, cluster, tmp_path):
    """A node whose environment reports numpy 9.9.9 and torch 0.1.0 is named with both, the others are not."""
    with _simulated_nodes(cluster, 1, other_versions(tmp_path, {"numpy": "9.9.9", "torch": "0.1.0+cu999"})) as [node]:
        with pytest.raises(ClusterError) as err:
            preflight.check_versions(preflight.nodes(), stack.versions())
    message, mine = str(err.value), stack.versions()
    assert message.count(" has ") == 1 and f"node {node.node_ip_address} ({node.node_id[:8]}) has " in message
    assert f"torch 0.1.0 (driver: {mine['torch']}), numpy 9.9.9 (driver: {mine['numpy']})" in message, message


def test_a_node_that_cannot_answer_is_named(ray_cluster, cluster):
    """A node that cannot start the check's process in time is refused by name, not passed."""
    with _simulated_nodes(cluster, 1) as [node]:
        nodes = preflight.nodes()
        with pytest.raises(ClusterError, match=rf"node {re.escape(node.node_ip_address)} \({node.node_id[:8]}\) did "
                                               r"not answer the version check within 0.001 s"):
            preflight.check_versions(nodes, stack.versions(), timeout_s=0.001)


def test_a_node_whose_probe_fails_there_is_named_with_its_error(ray_cluster, cluster, tmp_path):
    """A node where gnnray cannot be imported: the check's own failure is what the driver says, not a silence."""
    # Ray puts the driver's sys.path first on its workers', so the node's import of gnnray is refused where
    # every import is looked up, before any path: a finder of the node's sitecustomize.
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class Broken:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'gnnray':\n"
        "            raise ImportError('gnnray is broken on this node')\n"
        "sys.meta_path.insert(0, Broken())\n")
    with _simulated_nodes(cluster, 1, other_versions(tmp_path, {})) as [node]:
        with pytest.raises(ClusterError) as err:
            preflight.check_versions(preflight.nodes(), stack.versions())
    message = str(err.value)
    assert (f"node {node.node_ip_address} ({node.node_id[:8]}): the version check failed there (" in message
            and "gnnray is broken on this node" in message and "did not answer" not in message), message


def test_a_node_with_other_gnnray_sources_is_named(ray_cluster, cluster, tmp_path):
    """The same gnnray version number, one module changed: the node runs other code, and is refused."""
    copy = tmp_path / "copy"
    shutil.copytree(REPO / "gnnray", copy / "gnnray", ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "gnnray" / "errors.py", "a") as f:
        f.write("# changed on this node\n")
    # The node's gnnray is the copy, whatever Ray puts first on its workers' sys.path.
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "from importlib.machinery import PathFinder\n"
        "class Copy:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        return PathFinder.find_spec(name, [{str(copy)!r}]) if name == 'gnnray' else None\n"
        "sys.meta_path.insert(0, Copy())\n")
    with _simulated_nodes(cluster, 1, other_versions(tmp_path, {})) as [node]:
        with pytest.raises(ClusterError) as err:
            preflight.check_versions(preflight.nodes(), stack.versions())
    assert (f"node {node.node_ip_address} ({node.node_id[:8]}) has gnnray src-" in str(err.value)
            and f"(driver: {stack.sources()})" in str(err.value)), str(err.value)


def test_shard_servers_embedding_owners_and_the_inference_task_check_their_node(ray_cluster, cluster, tmp_path):
    """The processes the driver places on shard nodes check the node against the driver's stack, as it hands it
    to the job's processes (their environment), when they start."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from gnnray.inference.layerwise_task import _predict
    from gnnray.store.shards import ShardServer
    from gnnray.train.embedding import EmbeddingOwner

    env = {**other_versions(tmp_path, {"numpy": "9.9.9"}), stack.DRIVER_ENV: json.dumps(stack.versions())}
    with _simulated_nodes(cluster, 1, env) as [node]:
        there = dict(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False))
        server = ray.remote(ShardServer).options(max_restarts=0, **there).remote([ray.put(np.zeros(3))])
        owner = ray.remote(EmbeddingOwner).options(max_restarts=0, **there).remote(0, 4, 2, 0.1, 0)
        task = ray.remote(_predict).options(max_retries=0, **there).remote(None, None, [None], 1, False)
        found = {}
        for who, ref in [("a shard server", server.__ray_ready__.remote()),
                         ("an embedding owner", owner.__ray_ready__.remote()), ("the inference task", task)]:
            with pytest.raises(ray.exceptions.RayError) as err:
                ray.get(ref, timeout=120)
            found[who] = str(err.value)
    for who, message in found.items():
        assert f"{who} on node {node.node_ip_address} ({node.node_id[:8]}) has numpy 9.9.9 (driver: " in message, who


def test_the_driver_without_dgl_refuses_graphbolt_in_one_line():
    if stack.installed(["dgl"])["dgl"] == stack.DGL:
        assert preflight.check_driver("graphbolt")["dgl"] == stack.DGL
        return
    with pytest.raises(ClusterError, match=r"gnnray needs ray==2\.60\.0 dgl==2\.1\.0, and this driver has dgl "
                                           r"missing: install the dgl extra \(pip install -e '\.\[dgl\]'"):
        preflight.check_driver("graphbolt")


def test_a_mismatch_stops_the_job_in_one_line_before_training(ray_cluster, cluster, tmp_path, capsys):
    """The real job, on the session's cluster plus a node whose numpy differs: refused before any actor starts."""
    import ray._private.state

    with _simulated_nodes(cluster, 1, other_versions(tmp_path / "site", {"numpy": "9.9.9"})) as [node]:
        actors = len(ray._private.state.actors())  # the GCS table keeps dead ones
        assert main(SMALL + ["--storage-path", str(tmp_path), "--name", "pinned"]) == 2
        assert len(ray._private.state.actors()) == actors, "an actor started before the versions were checked"
    err = own_stderr(capsys.readouterr().err).strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith("gnnray: error: every node needs the driver's python, ray, torch, numpy, pyarrow, pandas, "
                          f"psutil, numba, gnnray, and node {node.node_ip_address} ({node.node_id[:8]}) has numpy "
                          "9.9.9 (driver: "), err
    assert not (tmp_path / "pinned" / METRICS_LOG).exists()


def test_a_sampler_actor_on_a_node_with_another_stack_refuses_to_start(ray_cluster, cluster, tmp_path):
    """The check each sampler actor makes when it starts, on a node that joined after the driver's check."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from conftest import tiny_graph
    from gnnray.sampler.sampler import SamplerActor
    from gnnray.seeds import SeedPlan
    from gnnray.store.handle import publish

    graph = tiny_graph()
    handle, plan = publish(graph), SeedPlan.for_run(graph.train_idx, 4, 1, 0)
    with _simulated_nodes(cluster, 1, other_versions(tmp_path, {"numba": "0.1.0"})) as [node]:
        on_new_node = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        actor = ray.remote(SamplerActor).options(num_cpus=0, scheduling_strategy=on_new_node, max_restarts=0).remote(
            handle, (2,), plan, stack=stack.versions())
        with pytest.raises(ray.exceptions.RayActorError) as err:
            ray.get(actor.__ray_ready__.remote(), timeout=120)
    message = str(err.value)
    assert f"a sampler actor on node {node.node_ip_address} ({node.node_id[:8]}) has numba 0.1.0 (driver: " in message


@pytest.mark.slow
def test_a_node_that_joins_later_with_another_stack_is_refused_by_name(ray_cluster, cluster, tmp_path):
    """An elastic run grows onto a node that joined after its start-up check and whose numpy differs: the rank
    placed there stops the attempt, and the run ends, not restarted, with one line naming the node and the
    difference (a ClusterError: exit 2)."""
    from drills import JOB_TIMEOUT_S, JobThread, logged, wait_until
    from gnnray.driver.failures import one_line

    args = ["--dataset", "synthetic", "--synthetic-nodes", "3000", "--synthetic-feat-dim", "16", "--fanouts", "5,5",
            "--batch-size", "32", "--hidden", "16", "--sample-on", "actors", "--sampler-actors", "1,1", "--eval", "sampled",
            "--cpus-per-worker", "4", "--num-workers", "1,2", "--resize-interval", "1", "--epochs", "2000",
            "--storage-path", str(tmp_path), "--name", "joins"]  # the head (6 CPUs) fits one 4-CPU worker
    job = JobThread(args)
    node = None
    try:
        wait_until(lambda: logged(tmp_path, "joins"), JOB_TIMEOUT_S, "the first epoch", job)
        node = cluster.add_node(num_cpus=5, object_store_memory=80 * 2**20,
                                env_vars=other_versions(tmp_path / "site", {"numpy": "9.9.9"}))
        job.join()
    finally:
        if node is not None:
            cluster.remove_node(node)
            cluster.wait_for_nodes()
    assert isinstance(job.error, ClusterError), f"the run went on with a node of another stack: {job.error!r}"
    line = one_line(job.error)
    assert "\n" not in line and re.search(rf"rank \d on node {re.escape(node.node_ip_address)} \({node.node_id[:8]}\) "
                                         r"has numpy 9\.9\.9 \(driver: ", line), line
