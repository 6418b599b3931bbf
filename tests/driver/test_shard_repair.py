"""Losing shard nodes: two at once, on five simulated nodes (80 MiB object stores each).

A typed graph's features are read into driver memory at load (authors' rows are
their neighbors' mean), so the driver spills them once, a file per shard, under
the run's directory and keeps none; the two lost shards are rebuilt from those
files, each on its own alive node that held no shard, and the reader then gets
exactly the table again.
"""

from __future__ import annotations

import dataclasses
import pickle
import re

import numpy as np
import pytest

from conftest import SHARD_NODE_STORE
from gnnray.config import DataConfig, JobConfig, RunConfig
from gnnray.data.feature_source import SpilledRows
from gnnray.data.load import load_graph
from gnnray.driver import launch
from gnnray.train.feature_reader import reader_for

CFG = DataConfig(dataset="synthetic-hetero", synthetic_nodes=4000, synthetic_feat_dim=24, feature_shards=3,
                 feature_cache=0.1)


def test_two_lost_shard_nodes_are_rebuilt_on_two_other_nodes(cluster, five_shard_nodes, tmp_path):
    """Shards of 192 KB: above Ray's 100 KiB inline limit, so they live in their nodes' stores."""
    from ray.experimental import get_object_locations

    pub = launch.load_and_publish(JobConfig(data=CFG, run=RunConfig(name="repair", storage_path=str(tmp_path))))
    assert isinstance(pub.source, SpilledRows)  # no rows kept by the driver: one file per shard
    assert len(pickle.dumps(pub.source)) < 2_000
    spilled = (tmp_path / "repair" / "feature-spill").iterdir()  # named by their contents' digests
    assert sorted(re.sub("-[0-9a-f]{20}[.]", ".", p.name) for p in spilled) == [f"shard-{i}-of-3.npy" for i in range(3)]
    before = pub.handle.features.shards
    by_id = {n.node_id: n for n in five_shard_nodes}
    assert all(s.node_id in by_id for s in before)
    for s in before[:2]:  # two at once, before anything notices
        cluster.remove_node(by_id[s.node_id], allow_graceful=False)
    cluster.wait_for_nodes()

    after = launch.rebuild_lost_shards(pub).handle.features.shards
    assert after[2] == before[2]  # the survivor stays
    spares = {n.node_id for n in five_shard_nodes} - {s.node_id for s in before}
    assert {after[0].node_id, after[1].node_id} == spares  # one each, on the nodes that held none
    repaired = dataclasses.replace(pub.handle, features=dataclasses.replace(pub.handle.features, shards=after))
    full = load_graph(dataclasses.replace(CFG, feature_shards=1)).feat
    ids = np.random.default_rng(0).permutation(full.shape[0])
    out = np.full((ids.size, full.shape[1]), np.nan, dtype=np.float32)
    reader_for(pub.graph, repaired.features).gather(ids, out)
    assert np.array_equal(out, full[ids])
    locations = get_object_locations([s.ref[0] for s in after])
    for s in after:  # made on their nodes, and only there
        assert locations[s.ref[0]]["node_ids"] == [s.node_id]
