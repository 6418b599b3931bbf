"""The evaluation sampler: one actor per node for a worker group's workers, its own actor for any other caller."""

from __future__ import annotations

import numpy as np
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from conftest import tiny_graph
from gnnray.sampler.sampler import Sampler, start_evaluation_sampler
from gnnray.store.handle import publish


@ray.remote(num_cpus=0)
class GroupWorker:
    """Stands for a train worker: an actor in a placement group, asking for its node's evaluation sampler."""

    def sampler(self, handle, fanouts):
        actor = start_evaluation_sampler(handle, fanouts)
        return actor._actor_id.hex(), actor

    def sample(self, actor, seeds):
        return ray.get(actor.sample.remote(seeds))


def test_a_groups_workers_on_a_node_share_one_sampler_and_each_group_has_its_own(ray_cluster):
    graph = tiny_graph(num_nodes=300, num_edges=2000)
    handle = publish(graph)
    groups = [placement_group([{"CPU": 0.01}]) for _ in range(2)]
    ray.get([g.ready() for g in groups])
    try:
        workers = [GroupWorker.options(scheduling_strategy=PlacementGroupSchedulingStrategy(g)).remote()
                   for g in groups for _ in range(2)]
        asked = ray.get([w.sampler.remote(handle, [-1, -1]) for w in workers])
        ids = [i for i, _ in asked]
        assert ids[0] == ids[1] and ids[2] == ids[3] and ids[0] != ids[2], ids
        other = ray.get(workers[0].sampler.remote(handle, [3, 3]))[0]
        assert other not in ids  # other fanouts, another sampler
        # The shared actor samples as the Sampler does here (all neighbors: no randomness).
        seeds = graph.split("valid")[:20]
        want = Sampler(graph, [-1, -1]).sample(seeds).pack(Sampler(graph, [-1, -1]).id_dtype)
        for w in workers[:2]:
            assert np.array_equal(ray.get(w.sample.remote(asked[0][1], seeds)), want)
    finally:
        for g in groups:
            remove_placement_group(g)


def test_outside_a_placement_group_each_call_starts_its_own_sampler(ray_cluster):
    handle = publish(tiny_graph(num_nodes=100, num_edges=500))
    first, second = start_evaluation_sampler(handle, [2]), start_evaluation_sampler(handle, [2])
    assert first._actor_id != second._actor_id


def test_the_evaluation_sampler_never_loads_torch(ray_cluster):
    """It packs numpy batches: its process maps no libtorch (torch costs a process about 280 MB of its own)."""
    graph = tiny_graph(num_nodes=100, num_edges=500)
    actor = start_evaluation_sampler(publish(graph), [2], threads=2)
    packed = ray.get(actor.sample.remote(graph.split("valid")[:10]))
    assert packed.dtype == np.int32 and packed.size > 0
    pid = ray.get(actor.__ray_call__.remote(lambda self: __import__("os").getpid()))
    maps = open(f"/proc/{pid}/maps").read()  # the session's cluster is this machine
    assert "libtorch" not in maps, [line for line in maps.splitlines() if "libtorch" in line][:3]
