"""Sharded features (``--feature-shards``) on three simulated nodes: gathered rows, placement, store bytes.

The reader (``gnnray.train.feature_reader``) must return exactly ``feat[ids]``
whichever way each row arrives: from the node's cache, from a shard on its own
node, or from another node's shard server.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gnnray.config import DataConfig, JobConfig
from gnnray.data.load import load_graph
from gnnray.driver import launch
from gnnray.train.feature_reader import reader_for

CFG = DataConfig(dataset="synthetic", synthetic_nodes=6000, synthetic_feat_dim=24, feature_shards=3,
                 feature_cache=0.1)


@pytest.fixture(scope="module")
def published(shard_nodes, ray_cluster):
    """``(float32 publication, float16 publication, the whole table loaded in memory)``."""
    pub32 = launch.load_and_publish(JobConfig(data=CFG))
    pub16 = launch.load_and_publish(JobConfig(data=dataclasses.replace(CFG, feature_dtype="float16")))
    full = load_graph(dataclasses.replace(CFG, feature_shards=1)).feat
    return pub32, pub16, full


def _gather(pub, ids: np.ndarray):
    reader = reader_for(pub.graph, pub.handle.features)
    out = np.full((len(ids), pub.handle.feat_dim), np.nan, dtype=np.float32)
    reader.gather(ids, out)
    return out, reader.stats()


def _id_cases(pub) -> dict:
    f = pub.handle.features
    cached = np.flatnonzero(_slot(pub) >= 0)
    s1 = f.shards[1]
    uncached_1 = np.setdiff1d(np.arange(s1.lo, s1.hi), cached)
    rng = np.random.default_rng(0)
    return {
        "mixed": rng.integers(0, f.num_rows, 3000),
        "repeats": np.array([7, 7, 7, f.num_rows - 1, 0, f.num_rows - 1]),
        "empty": np.zeros(0, dtype=np.int64),
        "all cached": cached[:50],
        "all remote": uncached_1[:200],
        "int32 ids": rng.integers(0, f.num_rows, 500).astype(np.int32),
    }


def _slot(pub) -> np.ndarray:
    import ray

    return ray.get(pub.handle.features.cache[0])["slot"]


def test_gathered_rows_equal_the_table(published):
    pub, _, full = published
    for case, ids in _id_cases(pub).items():
        out, stats = _gather(pub, ids)
        assert np.array_equal(out, full[ids]), case
        assert stats.local_rows == 0, case  # the driver's node holds no shard
        assert stats.cached_rows + stats.remote_rows == len(ids), case
    out, stats = _gather(pub, _id_cases(pub)["all remote"])
    assert stats.remote_calls == 1 and stats.cached_rows == 0
    assert stats.remote_bytes == stats.remote_rows * full.shape[1] * 4


def test_rows_of_the_local_shard_are_read_on_its_node(published):
    """A reader on a shard's node reads that shard's rows there: no remote call, same values."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    pub, _, full = published
    shard = pub.handle.features.shards[0]
    ids = np.setdiff1d(np.arange(shard.lo, shard.hi), np.flatnonzero(_slot(pub) >= 0))[:300]
    ids = np.r_[ids, ids[:5]]

    def gather_there(pub, ids):  # self-contained: the test module is not importable on Ray's workers
        from gnnray.train.feature_reader import reader_for

        reader = reader_for(pub.graph, pub.handle.features)
        out = np.full((len(ids), pub.handle.feat_dim), np.nan, dtype=np.float32)
        reader.gather(ids, out)
        return out, reader.stats()

    out, stats = ray.get(ray.remote(gather_there).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(shard.node_id, soft=False), num_cpus=0).remote(pub, ids),
        timeout=120)
    assert np.array_equal(out, full[ids])
    assert stats.local_rows == len(ids) and stats.remote_calls == 0


def test_float16_storage_gives_the_stored_values_as_float32(published):
    _, pub16, full = published
    ids = _id_cases(pub16)["mixed"]
    out, stats = _gather(pub16, ids)
    assert out.dtype == np.float32
    assert np.array_equal(out, full[ids].astype(np.float16).astype(np.float32))
    assert not np.array_equal(out, full[ids])  # really rounded to float16
    assert stats.remote_bytes == stats.remote_rows * full.shape[1] * 2  # half the bytes on the wire


def test_each_shard_lives_on_exactly_its_node(published, shard_nodes):
    from ray.experimental import get_object_locations

    pub, _, _ = published
    shards = pub.handle.features.shards
    assert len({s.node_id for s in shards}) == 3
    assert {s.node_id for s in shards} == {n.node_id for n in shard_nodes}  # not the driver's node
    locations = get_object_locations([s.ref[0] for s in shards])
    for s in shards:
        assert locations[s.ref[0]]["node_ids"] == [s.node_id]


def test_each_node_store_holds_one_shard_not_the_table(published):
    """Per node, the job's objects are the structure, its shard and the cache; never another node's shard."""
    from ray.experimental import get_object_locations

    pub, _, full = published
    f = pub.handle.features
    refs = {"structure": pub.handle._ref[0], "cache": f.cache[0], **{f"shard{i}": s.ref[0]
                                                                      for i, s in enumerate(f.shards)}}
    locations = get_object_locations(list(refs.values()))
    for i, s in enumerate(f.shards):
        held = {name for name, ref in refs.items() if s.node_id in locations[ref]["node_ids"]}
        assert f"shard{i}" in held and held <= {"structure", "cache", f"shard{i}"}, (i, held)
        feature_bytes = sum(locations[refs[name]]["object_size"] for name in held if name != "structure")
        # A third of the table, plus the cache's 10% of rows and its int32 slot per node (object headers aside).
        assert feature_bytes < full.nbytes * (1 / 3 + 0.1) + 4 * full.shape[0] + 4096, (i, feature_bytes)


def _graph_dir(path, feat: np.ndarray, order: np.ndarray) -> None:
    """A graph directory whose nodes.parquet lists the nodes in ``order``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n, d = feat.shape
    rng = np.random.default_rng(0)
    pq.write_table(pa.table({"src": rng.integers(0, n, 4 * n), "dst": rng.integers(0, n, 4 * n)}),
                   path / "edges.parquet")
    split = np.array(["train", "valid", "test", "none"])[np.arange(n) % 4]
    pq.write_table(pa.table({"id": order, "label": order % 2, "split": split[order],
                             "feat": pa.FixedSizeListArray.from_arrays(pa.array(feat[order].ravel()), d)}),
                   path / "nodes.parquet", row_group_size=97)
    (path / "meta.json").write_text(f'{{"num_nodes": {n}, "num_classes": 2}}')


def test_graph_directory_shards_are_read_on_their_nodes(shard_nodes, tmp_path):
    """Each shard node reads its rows of nodes.parquet itself (rows in any id order); the driver reads none."""
    import pickle

    from gnnray.data import graph_dir

    n = 3000
    feat = np.random.default_rng(1).standard_normal((n, 5)).astype(np.float32)
    _graph_dir(tmp_path, feat, np.random.default_rng(2).permutation(n))
    cfg = DataConfig(dataset=str(tmp_path), feature_shards=3)
    pub = launch.load_and_publish(JobConfig(data=cfg))
    assert isinstance(pub.source, graph_dir.ParquetRows) and len(pickle.dumps(pub.source)) < 1000
    ids = np.random.default_rng(3).integers(0, n, 2000)
    out, _ = _gather(pub, ids)
    assert np.array_equal(out, feat[ids])
    assert np.array_equal(load_graph(dataclasses.replace(cfg, feature_shards=1)).feat, feat)


def test_bad_rows_in_a_shard_name_the_file(shard_nodes, tmp_path):
    """A NaN found by the shard task on its node is the user's DatasetError, naming the file and column."""
    from gnnray.errors import DatasetError

    n = 40
    feat = np.ones((n, 3), dtype=np.float32)
    feat[33, 1] = np.nan
    _graph_dir(tmp_path, feat, np.arange(n))
    with pytest.raises(DatasetError, match=r"nodes.parquet: column 'feat'.*1 feature rows contain NaN.*node 33"):
        launch.load_and_publish(JobConfig(data=DataConfig(dataset=str(tmp_path), feature_shards=2)))


# Failures of a gather: the real reader and ShardServer over shards put on this node, listed under made-up
# remote nodes (so that every row is fetched through a call), with a server that hangs where needed.

FAR = "f" * 56  # no node has this id: the reader treats every shard as remote


def _servers():
    """(ShardServer actor class, a threaded server that hangs in gather until Ray cancels the call)."""
    import ray

    from gnnray.store.shards import ShardServer

    class Hanging:
        def __init__(self):
            self.started = self.cancelled = 0

        def gather(self, local_ids):
            import time

            import ray

            self.started += 1
            while not ray.get_runtime_context().is_canceled():
                time.sleep(0.05)
            self.cancelled += 1
            raise RuntimeError("cancelled")

        def calls(self):
            return self.started, self.cancelled

    return (ray.remote(ShardServer).options(num_cpus=0, max_concurrency=8),
            ray.remote(Hanging).options(num_cpus=0, max_concurrency=4))


def _far_handle(table: np.ndarray, kinds: list, timeout_s: float = 30):
    """A handle of ``table`` in ``len(kinds)`` shards; ``kinds[k]``: "ok", "dead", "hanging" or "short" (a server
    holding fewer rows than its shard's range)."""
    import ray

    from gnnray.store.shards import Shard, ShardedFeatures, shard_bounds

    served, hanging = _servers()
    bounds = shard_bounds(table.shape[0], len(kinds))
    shards, hangers = [], []
    for k, kind in enumerate(kinds):
        lo, hi = int(bounds[k]), int(bounds[k + 1])
        ref = ray.put(table[lo:(lo + hi) // 2 if kind == "short" else hi].copy())
        server = hanging.remote() if kind == "hanging" else served.remote([ref])
        ray.get(server.__ray_ready__.remote())
        if kind == "dead":
            ray.kill(server)
        if kind == "hanging":
            hangers.append(server)
        shards.append(Shard(lo, hi, FAR, f"10.9.9.{k}", [ref], server, [ray.put(hi - lo)]))
    return ShardedFeatures(tuple(shards), table.shape[0], table.shape[1], str(table.dtype), None, timeout_s), hangers


def _cancelled(hangers) -> bool:
    """Whether no hanging call is left running: each one either saw Ray's cancellation or was cancelled before it
    started (a dead server can fail the gather before a hanging call begins). Polled for up to a minute, since
    cancellation is asynchronous, and the calls must stay settled for a second: an uncancelled call would start and
    never end."""
    import time

    import ray

    deadline, settled_since = time.monotonic() + 60, None
    while time.monotonic() < deadline:
        if all(started == cancelled for started, cancelled in ray.get([h.calls.remote() for h in hangers])):
            settled_since = settled_since or time.monotonic()
            if time.monotonic() - settled_since >= 1:
                return True
        else:
            settled_since = None
        time.sleep(0.1)
    return False


def _every_row(handle) -> np.ndarray:
    return np.arange(handle.num_rows)


@pytest.fixture
def table(ray_cluster):
    return np.random.default_rng(0).standard_normal((3_000, 6)).astype(np.float32)


def test_far_shards_gather_like_near_ones(table):
    """The made-up layout itself works: every row fetched by a call, exactly the table."""
    from gnnray.train.feature_reader import ShardedRows

    handle, _ = _far_handle(table, ["ok", "ok", "ok"])
    reader, out = ShardedRows(handle), np.full(table.shape, np.nan, dtype=np.float32)
    ids = np.random.default_rng(1).permutation(3_000)
    reader.gather(ids, out)
    assert np.array_equal(out, table[ids]) and reader.stats().remote_calls == 3


def test_a_dead_server_names_its_shard_and_node_and_the_other_calls_are_cancelled(table):
    from gnnray.errors import FeatureShardError
    from gnnray.train.feature_reader import ShardedRows

    handle, hangers = _far_handle(table, ["dead", "hanging", "ok"])
    with pytest.raises(FeatureShardError, match=r"feature shard 0:1000 on node 10.9.9.0 \(ffffffff\) did not "
                                                r"deliver rows: its server died"):
        ShardedRows(handle).gather(_every_row(handle), np.empty(table.shape, dtype=np.float32))
    assert _cancelled(hangers)  # without ray.cancel it would hang until the test's end


def test_a_lost_cancel_is_sent_again_until_the_call_ends(table, monkeypatch):
    """Ray's cancel of a threaded actor's call can race the call's start and be lost: here the first cancel of each
    call is dropped, and the call still ends, cancelled again a second later."""
    import ray

    from gnnray.errors import FeatureShardError
    from gnnray.train.feature_reader import ShardedRows

    handle, hangers = _far_handle(table, ["dead", "hanging", "ok"])
    real_cancel, seen = ray.cancel, set()

    def cancel(ref, **kwargs):
        if ref not in seen:  # lost, as in the race
            seen.add(ref)
            return None
        return real_cancel(ref, **kwargs)

    monkeypatch.setattr(ray, "cancel", cancel)
    with pytest.raises(FeatureShardError, match="its server died"):
        ShardedRows(handle).gather(_every_row(handle), np.empty(table.shape, dtype=np.float32))
    assert _cancelled(hangers) and seen


def test_one_deadline_for_all_shards_names_every_late_one(table):
    """Two shards hang: one overall timeout, and the error names both (a shard-by-shard wait names one)."""
    from gnnray.errors import FeatureShardError
    from gnnray.train.feature_reader import ShardedRows

    handle, hangers = _far_handle(table, ["ok", "hanging", "hanging"], timeout_s=2)
    with pytest.raises(FeatureShardError, match=r"feature shard 1000:2000 on node 10.9.9.1 \(ffffffff\) and feature "
                                                r"shard 2000:3000 on node 10.9.9.2 \(ffffffff\) did not deliver rows: "
                                                r"no answer within 2s \(--feature-timeout\)"):
        ShardedRows(handle).gather(_every_row(handle), np.empty(table.shape, dtype=np.float32))
    assert _cancelled(hangers)


def test_an_error_in_the_call_names_its_shard_and_node(table):
    from gnnray.errors import FeatureShardError
    from gnnray.train.feature_reader import ShardedRows

    handle, _ = _far_handle(table, ["ok", "short", "ok"])
    with pytest.raises(FeatureShardError, match=r"feature shard 1000:2000 on node 10.9.9.1 \(ffffffff\) did not "
                                                r"deliver rows: the call failed: .*IndexError"):
        ShardedRows(handle).gather(_every_row(handle), np.empty(table.shape, dtype=np.float32))
