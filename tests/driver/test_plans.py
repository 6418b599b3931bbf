"""Multi-node placement, simulated: two extra nodes join the session's cluster (``ray.cluster_utils``).

Shown: the job's train workers and sampler actors spread over nodes; each node's
object store holds the graph once however many processes read it; a sampler
actor reads the graph from its own node's copy; with ``--feature-shards`` the
train workers run on shard nodes, as far as those have room.
"""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest

from gnnray.config import parse_args
from gnnray.data.synthetic import make_synthetic
from gnnray.store.handle import GraphHandle, publish

JOB = ["--dataset", "synthetic", "--synthetic-nodes", "2000", "--synthetic-feat-dim", "16", "--fanouts", "5,5",
       "--batch-size", "128", "--hidden", "32", "--num-workers", "2", "--sample-on", "actors", "--sampler-actors", "2", "--epochs", "1",
       "--eval", "sampled"]


@pytest.fixture(scope="module")
def nodes(cluster, ray_cluster):
    """Node ids ``(head, a, b)``: the session's head plus two simulated nodes with 2 and 3 CPUs, removed after."""
    ray = ray_cluster
    added = []
    try:
        for cpus in (2, 3):
            added.append(cluster.add_node(num_cpus=cpus, object_store_memory=200 * 2**20))
        cluster.wait_for_nodes()
        yield (cluster.head_node.node_id, *(n.node_id for n in added))
    finally:
        for n in added:
            cluster.remove_node(n)
        cluster.wait_for_nodes()
        # The session's cluster still schedules work on its head alone.
        assert ray.get(ray.remote(lambda: ray.get_runtime_context().get_node_id()).remote(), timeout=120) == \
            cluster.head_node.node_id


def _on(node_id: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def _store_bytes(ray, node_id: str) -> int:
    """Bytes in ``node_id``'s object store, from its raylet."""
    from ray._private.internal_api import node_stats

    node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    reply = node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=False)
    return reply.store_stats.object_store_bytes_used


def test_graph_once_per_node_and_read_locally(ray_cluster, nodes):
    """Two sampler actors on each simulated node: one copy per node, mapped by both, none from another node."""
    ray = ray_cluster
    from ray.experimental import get_object_locations

    graph = make_synthetic(20_000, 8, 128, 10, 0)  # ~12 MiB: a copy is plain in the store's byte count
    handle = publish(graph)

    # Defined in the test so that cloudpickle ships them by value (tests/ is not on the workers' path).
    def mapping_of(array: np.ndarray) -> tuple[str, str, str]:
        """``(device, inode, path)`` of the memory mapping that holds ``array``'s data in this process."""
        address = array.ctypes.data
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= address < end:
                    return fields[3], fields[4], fields[5].strip() if len(fields) > 5 else ""
        raise AssertionError("address not mapped")

    def make_reader():
        @ray.remote(num_cpus=0)
        class Reader:
            def __init__(self, handle: GraphHandle):
                from gnnray.sampler.sampler import SamplerActor
                from gnnray.seeds import SeedPlan

                self.actor = SamplerActor(handle, (5, 5), SeedPlan.for_run(np.arange(64), 64, 1, 0))

            def sample_and_locate(self) -> dict:
                out = self.actor({"row": np.array([0])})
                g = self.actor._sampler._graph  # the arrays this actor's sampler reads
                return dict(node=ray.get_runtime_context().get_node_id(), rows=out.num_rows,
                            indices=mapping_of(g.indices), feat=mapping_of(g.feat),
                            read_only=not (g.indices.flags.writeable or g.feat.flags.writeable))

        return Reader

    Reader = make_reader()
    head, a, b = nodes
    readers = {node: [Reader.options(scheduling_strategy=_on(node)).remote(handle) for _ in range(2)] for node in (a, b)}
    seen = {node: ray.get([r.sample_and_locate.remote() for r in rs], timeout=300) for node, rs in readers.items()}
    driver = handle.get()

    for node, reports in seen.items():
        assert all(r["node"] == node and r["rows"] == 1 and r["read_only"] for r in reports)
        # Both actors on a node map the same store pages (one copy), and it is not the head's.
        assert reports[0]["indices"] == reports[1]["indices"] and reports[0]["feat"] == reports[1]["feat"]
        assert reports[0]["indices"][:2] != mapping_of(driver.indices)[:2]
    assert seen[a][0]["indices"][:2] != seen[b][0]["indices"][:2]  # each node reads its own copy

    ref = handle._ref[0]
    location = get_object_locations([ref], timeout_ms=30_000)[ref]
    assert sorted(location["node_ids"]) == sorted([head, a, b])  # one copy on each node that read it
    assert location["object_size"] >= graph.nbytes
    for node in (a, b):  # two readers, one copy: the graph plus a little (other objects are tiny)
        assert graph.nbytes <= _store_bytes(ray, node) < 1.5 * graph.nbytes
    for rs in readers.values():
        for r in rs:
            ray.kill(r)


def test_job_spreads_workers_and_samplers_over_nodes(ray_cluster, nodes, tmp_path, monkeypatch):
    """The head is kept busy, so the job's 2 train workers and 2 sampler actors (1 CPU each) must use both nodes."""
    ray = ray_cluster
    from ray._private.state import actors as actor_table
    from ray.experimental import get_object_locations

    import gnnray.driver.fit
    import gnnray.store.handle

    head, a, b = nodes
    head_cpus = int(next(n for n in ray.nodes() if n["NodeID"] == head)["Resources"]["CPU"])

    @ray.remote(num_cpus=head_cpus)
    class Blocker:  # holds all of the head's CPUs while alive
        def ready(self):
            return True

    hold = Blocker.options(scheduling_strategy=_on(head)).remote()
    ray.get(hold.ready.remote(), timeout=120)

    published: list[GraphHandle] = []

    def publish_and_keep(graph):
        published.append(publish(graph))
        return published[-1]

    monkeypatch.setattr(gnnray.store.handle, "publish", publish_and_keep)
    before = set(actor_table())
    graph_nodes: set[str] = set()
    stop = threading.Event()

    def watch_graph():  # the graph is freed when the run ends: look while it runs
        while not stop.wait(0.5):
            if published:
                ref = published[0]._ref[0]
                graph_nodes.update(get_object_locations([ref], timeout_ms=10_000).get(ref, {}).get("node_ids", []))

    watcher = threading.Thread(target=watch_graph, daemon=True)
    watcher.start()
    try:
        gnnray.driver.fit.run(parse_args(JOB + ["--storage-path", str(tmp_path), "--name", f"placement-{uuid.uuid4().hex[:6]}"]))
    finally:
        stop.set()
        watcher.join(timeout=30)
        ray.kill(hold)

    new = [info for aid, info in actor_table().items() if aid not in before]
    workers = {i["Address"]["NodeID"] for i in new if "TrainWorker" in i["ActorClassName"]}
    samplers = {i["Address"]["NodeID"] for i in new if "SamplerActor" in i["ActorClassName"]}
    assert workers and samplers, sorted({i["ActorClassName"] for i in new})
    assert workers | samplers == {a, b}  # 4 one-CPU actors, at most 3 CPUs a node: both nodes
    # The graph reached every node where a worker or sampler read it (and stays on the head, its owner).
    assert graph_nodes >= workers | samplers | {head}


# ----------------------------------------------------------------------------- workers beside their shards


def _sharded(node_ids: list):
    """A stand-in graph handle whose features have one shard on each of ``node_ids`` (beside_shards reads no more)."""
    from types import SimpleNamespace

    from gnnray.store.shards import Shard, ShardedFeatures

    shards = tuple(Shard(i * 10, (i + 1) * 10, n, "10.0.0.1", [None], None, [None]) for i, n in enumerate(node_ids))
    return SimpleNamespace(features=ShardedFeatures(shards, 10 * len(node_ids), 4, "float32", None, 60.0))


def _node(node_id: str, cpus: float, gpus: float = 0):
    from gnnray.driver.preflight import Node

    return Node(node_id, "10.0.0.1", cpus, gpus, 2**30)


def _selected(cfg, handle, cluster, use_gpu=False):
    from gnnray.driver.plans import NODE_ID_LABEL, beside_shards

    selectors = beside_shards(cfg, handle, use_gpu, cluster)
    return None if selectors is None else [s.get(NODE_ID_LABEL) for s in selectors]


def test_beside_shards_spreads_workers_over_shard_nodes_as_far_as_they_fit():
    head = _node("head", 6)
    handle = _sharded(["a", "b", "c"])
    two_cpus = [head] + [_node(n, 2) for n in "abc"]
    # One sampler actor over 4 nodes: each shard node keeps 1 CPU for it and has room for one 1-CPU worker.
    cfg = parse_args(["--num-workers", "2", "--sampler-actors", "1"])
    assert _selected(cfg, handle, two_cpus) == ["a", "b"]  # distinct nodes, in shard order
    cfg = parse_args(["--num-workers", "4", "--sampler-actors", "1"])
    assert _selected(cfg, handle, two_cpus) == ["a", "b", "c", None]  # the fourth anywhere
    # Room for two each: round-robin, so that no node gets a second worker before every node has one.
    big = [head] + [_node(n, 8) for n in "abc"]
    cfg = parse_args(["--num-workers", "5", "--sampler-actors", "1", "--cpus-per-worker", "3"])
    assert _selected(cfg, handle, big) == ["a", "b", "c", "a", "b"]
    # Sampler actors spread over the nodes take their share: 8 actors over 4 nodes leave no room on 2-CPU nodes.
    cfg = parse_args(["--num-workers", "2", "--sampler-actors", "1,8"])
    assert _selected(cfg, handle, two_cpus) is None
    # A shard node that is gone (lost, not yet repaired) is skipped.
    cfg = parse_args(["--num-workers", "2", "--sampler-actors", "1"])
    assert _selected(cfg, handle, [head, _node("b", 2), _node("c", 2)]) == ["b", "c"]


def test_beside_shards_needs_sharded_features_and_gpus_for_gpu_workers():
    cfg = parse_args(["--num-workers", "2", "--sampler-actors", "1"])
    cluster = [_node("head", 6)] + [_node(n, 16) for n in "ab"]
    from types import SimpleNamespace

    assert _selected(cfg, SimpleNamespace(features=None), cluster) is None  # replicated: Ray Train places them
    handle = _sharded(["a", "b"])
    assert _selected(cfg, handle, cluster, use_gpu=True) is None  # no GPU on the shard nodes
    gpu = [_node("head", 6), _node("a", 16, gpus=1), _node("b", 16)]
    assert _selected(cfg, handle, gpu, use_gpu=True) == ["a", None]


@pytest.fixture
def two_cpu_shard_nodes(cluster, ray_cluster):
    """Three simulated nodes of 2 CPUs and a 100 MiB store: room for a train worker and a sampler actor each."""
    added = [cluster.add_node(num_cpus=2, object_store_memory=100 * 2**20) for _ in range(3)]
    cluster.wait_for_nodes()
    try:
        yield [n.node_id for n in added]
    finally:
        for n in added:
            cluster.remove_node(n)
        cluster.wait_for_nodes()


def test_train_workers_run_beside_their_shards(ray_cluster, two_cpu_shard_nodes, tmp_path, monkeypatch):
    """K=3, no cache, two workers: each on its own shard node, so a third of its rows are local, not none."""
    from ray._private.state import actors as actor_table

    from gnnray.driver import launch
    import gnnray.driver.fit

    published = []
    original = launch.load_and_publish

    def recording(*args, **kwargs):
        published.append(original(*args, **kwargs))
        return published[-1]

    monkeypatch.setattr(launch, "load_and_publish", recording)
    before = set(actor_table())
    args = ["--dataset", "synthetic", "--synthetic-nodes", "3000", "--synthetic-feat-dim", "16", "--fanouts", "5,5",
            "--batch-size", "128", "--hidden", "16", "--num-workers", "2", "--sample-on", "actors", "--sampler-actors", "1", "--epochs", "1",
            "--eval", "sampled", "--feature-shards", "3", "--feature-cache", "0"]
    summary = gnnray.driver.fit.run(parse_args(args + ["--storage-path", str(tmp_path),
                                                       "--name", f"beside-{uuid.uuid4().hex[:6]}"]))
    shard_nodes = {s.node_id for s in published[-1].handle.features.shards}
    workers = [i["Address"]["NodeID"] for aid, i in actor_table().items()
               if aid not in before and "TrainWorker" in i["ActorClassName"]]
    assert len(workers) == 2 and len(set(workers)) == 2, workers
    assert set(workers) <= shard_nodes, (workers, shard_nodes)
    # Rank 0 reads its own shard's third of the rows locally; a worker beside no shard would fetch them all.
    assert summary.metrics["remote_row_share"] == pytest.approx(2 / 3, abs=0.1)


def test_num_workers_auto_is_one_per_gpu_or_one_per_16_cores_of_each_cpu_node():
    from gnnray.driver.plans import workers
    from gnnray.driver.preflight import Node

    auto = parse_args(["--num-workers", "auto"])
    cpu_nodes = [Node("a", "10.0.0.1", 64, 0, 0), Node("b", "10.0.0.2", 2, 0, 0), Node("c", "10.0.0.3", 17, 0, 0)]
    assert workers(auto, False, False, cpu_nodes).train.num_workers == (4 + 1 + 2,)
    gpu_nodes = [Node("a", "10.0.0.1", 4, 0, 0), Node("b", "10.0.0.2", 96, 8, 0), Node("c", "10.0.0.3", 48, 4, 0)]
    assert workers(auto, True, False, gpu_nodes).train.num_workers == (12,)
    fixed = parse_args(["--num-workers", "3"])
    assert workers(fixed, False, False, cpu_nodes) is fixed  # the user's choice stands


GIB = 2**30
# The products-shaped step's batch at 20,000 seeds/s a core: 12 cores per GPU cannot keep pace (256,000 seeds/s).
PACE = 20_000


@pytest.fixture
def gpu_plan(monkeypatch):
    """plans.sampling against stand-in nodes: the pace fixed at :data:`PACE`, the GPU nodes' memory what the test
    sets (``asked`` records each probe's nodes), and the driver's own CUDA refused."""
    import torch

    from gnnray.driver import pace, plans, preflight

    def refused(*args, **kwargs):
        raise AssertionError("the driver's own GPU was consulted")

    for name in ("is_available", "device_count", "get_device_properties", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, refused)
    monkeypatch.setattr(pace, "measured_pace", lambda *a, **k: PACE)
    state = {"memory": (80 * GIB, ""), "asked": []}

    def gpu_memory(cluster):
        state["asked"].append(cluster)
        return state["memory"]

    monkeypatch.setattr(preflight, "gpu_memory", gpu_memory)

    def plan(args, cluster):
        monkeypatch.setattr(preflight, "nodes", lambda: cluster)
        return plans.sampling(parse_args(args), _tiny(), True, local=False)

    plan.state = state
    return plan


def _tiny():
    from conftest import tiny_graph

    return tiny_graph()


def test_a_cpu_head_node_plans_gpu_sampling_as_a_gpu_head_node_does(gpu_plan, capsys):
    gpu_node = _node("g", 12, 1)
    lines, choices = [], []
    for cluster in ([_node("head", 8, 0), gpu_node], [gpu_node]):
        cfg = gpu_plan(["--num-workers", "1", "--sampler-actors", "2"], cluster)
        choices.append(cfg.sampler.sample_on)
        lines.append(capsys.readouterr().out)
    assert choices == ["device", "device"] and lines[0] == lines[1]
    assert [[n.node_id for n in c if n.gpus] for c in gpu_plan.state["asked"]] == [["g"], ["g"]]
    assert "a GPU step assumed 4 ms" in lines[0] and "fits a quarter of the GPU's memory" in lines[0]
    gpu_plan.state["memory"] = (None, "the GPU workers' memory is unknown: node(s) 10.0.0.1 did not say within 30 s")
    cfg = gpu_plan(["--num-workers", "1", "--sampler-actors", "2"], [_node("head", 8, 0), gpu_node])
    assert cfg.sampler.sample_on == "actors" and "did not say within 30 s" in capsys.readouterr().out


def test_no_gpu_is_asked_where_the_cores_keep_pace_or_actors_are_asked_for(gpu_plan):
    for args, cluster in ((["--sample-on", "auto"], [_node("g", 96, 2)]),  # 48 cores a GPU sample 960,000 seeds/s
                          (["--sample-on", "actors"], [_node("g", 12, 1)]),
                          (["--sampler", "graphbolt"], [_node("g", 12, 1)])):
        assert gpu_plan(args + ["--sampler-actors", "2"], cluster).sampler.sample_on == "actors"
    assert gpu_plan.state["asked"] == []


def test_the_pool_beside_gpu_workers_keeps_pace_with_their_steps(gpu_plan, capsys):
    # 8 workers on 96-core nodes of 8 GPUs: 11 cores a GPU beside its worker, fewer than the 13 that 256,000
    # seeds/s need, so 11 actors a worker.
    cluster = [_node("head", 8, 0), _node("g1", 96, 8), _node("g2", 96, 8)]
    cfg = gpu_plan(["--sample-on", "actors", "--num-workers", "16"], cluster)
    assert cfg.sampler.actors == (1, 11 * 16)
    assert "--sampler-actors 1,176" in capsys.readouterr().out
    # Cores to spare: as many as the steps need, ceil(256,000 / 20,000) = 13 a worker.
    cfg = gpu_plan(["--sample-on", "actors", "--num-workers", "2"], [_node("g", 64, 2)])
    assert cfg.sampler.actors == (1, 13 * 2)
    # The user's pool stands.
    assert gpu_plan(["--sample-on", "actors", "--sampler-actors", "2,4"], cluster).sampler.actors == (2, 4)


def test_the_gpu_nodes_are_asked_for_their_gpus_memory(ray_cluster, cluster, monkeypatch, capsys):
    """A CPU head node and a simulated GPU node: the probe runs on the GPU node, and where it cannot read a GPU
    (no CUDA driver on this machine) the plan says the memory is unknown and takes the actors."""
    from gnnray.driver import pace, plans, preflight

    added = cluster.add_node(num_cpus=1, num_gpus=1)
    try:
        cluster.wait_for_nodes()
        here = preflight.nodes()
        assert added.node_id in [n.node_id for n in here if n.gpus]
        memory, why = preflight.gpu_memory(here)
        if pace.gpu_bytes() is None:  # this machine has no CUDA driver: nor does its simulated GPU node
            assert memory is None and "could not read their GPU" in why
        monkeypatch.setattr(pace, "measured_pace", lambda *a, **k: PACE)
        cfg = plans.sampling(parse_args(["--num-workers", "1", "--sampler-actors", "2"]), _tiny(), True, False)
        if memory is None:
            assert cfg.sampler.sample_on == "actors" and "memory is unknown" in capsys.readouterr().out
    finally:
        cluster.remove_node(added)
        cluster.wait_for_nodes()
