"""The real job with ``--feature-shards`` on three simulated nodes (80 MiB object stores each).

Shown: a feature table larger than those nodes' stores trains with K=3 and
stops with the clear store error at K=1; layer-wise inference's hidden tables
too large for the stores stop the run before training (or evaluate sampled); K=1 and K=3 train on the same
features (same first-epoch loss); remote bytes per batch are counted
(metrics.jsonl and Prometheus) and drop as the cache grows; shards stay on
their nodes; losing a shard's node fails its attempt naming it, and with
``--max-failures 1`` the run recovers, the shard rebuilt on an alive node.
Typed graphs' shards (papers' features and the filled-in ones of authors):
tests/data/test_mag_replica_training.py.
"""

from __future__ import annotations

import uuid

import pytest

from drills import JOB_TIMEOUT_S, JobThread, logged, wait_until
from gnnray.config import parse_args
from gnnray.driver import launch
from gnnray.driver.fit import run
from gnnray.errors import ClusterError

# Full neighborhoods (--fanouts=-1,-1), one sampler actor, one train worker and no dropout: the same batches in
# the same order and the same arithmetic on every run (two ranks could each get a different share of the
# stream; dropout runs are not bit-reproducible here), so two runs differ only in where the features come from.
EXACT = ["--dataset", "synthetic", "--synthetic-nodes", "3000", "--synthetic-feat-dim", "16",
         "--synthetic-avg-degree", "4", "--fanouts=-1,-1", "--batch-size", "128", "--hidden", "16", "--dropout", "0",
         "--num-workers", "1", "--sample-on", "actors", "--sampler-actors", "1", "--epochs", "1", "--eval", "sampled"]


@pytest.fixture
def published(monkeypatch):
    """Record what each run publishes (keeping it alive after the run, so its shards can be inspected)."""
    seen = []
    original = launch.load_and_publish

    def recording(*args, **kwargs):
        seen.append(original(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(launch, "load_and_publish", recording)
    return seen


def _run(args: list, tmp_path, **kw):
    name = f"shards-{uuid.uuid4().hex[:6]}"
    summary = run(parse_args(args + ["--storage-path", str(tmp_path), "--name", name]), **kw)
    return summary, logged(tmp_path, name)


@pytest.mark.slow
def test_table_larger_than_a_node_store_trains_sharded(shard_nodes, tmp_path, published):
    """50k nodes x 480 float32 features = 96 MB, more than each shard node's 80 MiB store (fewer, wider rows
    than 100k x 240: half the steps and the graph to build for the same table)."""
    from ray.experimental import get_object_locations

    big = ["--dataset", "synthetic", "--synthetic-nodes", "50000", "--synthetic-feat-dim", "480",
           "--synthetic-avg-degree", "4", "--fanouts", "4,4", "--batch-size", "512", "--hidden", "32", "--lr", "0.01",
           "--num-workers", "2", "--sample-on", "actors", "--sampler-actors", "1", "--epochs", "2", "--eval", "sampled"]
    with pytest.raises(ClusterError, match="--feature-shards"):
        _run(big, tmp_path)
    summary, epochs = _run(big + ["--feature-shards", "3"], tmp_path)
    assert summary.best_val_acc > 0.8, epochs
    features = published[-1].handle.features
    assert {s.node_id for s in features.shards} == {n.node_id for n in shard_nodes}
    locations = get_object_locations([s.ref[0] for s in features.shards])
    for s in features.shards:  # after two epochs of remote reads, still exactly where they were made
        assert locations[s.ref[0]]["node_ids"] == [s.node_id]


def test_sharded_embeddings_train_as_replicated_ones(shard_nodes, tmp_path):
    """--embedding-dim with --feature-shards 3: owners on the shard nodes apply SparseAdam; same run as K=1."""
    args = EXACT + ["--embedding-dim", "8", "--eval", "layerwise"]
    replicated, _ = _run(args, tmp_path)
    sharded, _ = _run(args + ["--feature-shards", "3"], tmp_path)
    assert "remote_bytes_per_batch" not in replicated.metrics and sharded.metrics["remote_bytes_per_batch"] > 0
    for key in ("loss", "train_acc", "val_acc"):
        assert sharded.metrics[key] == pytest.approx(replicated.metrics[key], rel=1e-6), key
    # Layer-wise inference reads the table the owners trained, through the checkpoint.
    assert sharded.test_acc == pytest.approx(replicated.test_acc, abs=1e-9)
    # jobs/predict.py rebuilds the run's graph with its shards, and predicts what the replicated run does.
    import pyarrow.parquet as pq

    from gnnray.driver.predict_job import main as predict

    preds = []
    for summary in (replicated, sharded):
        out = tmp_path / f"{len(preds)}.parquet"
        assert predict(["--checkpoint", summary.checkpoint, "--output", str(out)]) == 0
        preds.append(pq.read_table(out).sort_by("id").column("pred").to_pylist())
    assert preds[0] == preds[1] and len(preds[0]) == 3000


def test_layerwise_tables_larger_than_the_stores_are_refused_before_training(shard_nodes, tmp_path, capsys):
    """Layer-wise inference's hidden tables, each shard node's range of two (2 x 240,000 x 128 x 4 B / 3 =
    78 MiB), cannot fit the 80 MiB stores: refused before training in one line, or, with --eval-fallback,
    said and evaluated sampled."""
    args = ["--dataset", "synthetic", "--synthetic-nodes", "240000", "--synthetic-feat-dim", "4",
            "--synthetic-avg-degree", "4", "--fanouts", "1,1,1", "--batch-size", "8192", "--hidden", "128",
            "--num-workers", "1", "--sample-on", "actors", "--sampler-actors", "1", "--epochs", "1", "--feature-shards", "3"]
    with pytest.raises(ClusterError, match="--eval layerwise needs") as e:
        _run(args, tmp_path)
    assert "\n" not in str(e.value) and "--eval-fallback" in str(e.value) and "78.1 MiB at K=3" in str(e.value)
    assert not list(tmp_path.glob("*/metrics.jsonl"))  # nothing trained
    summary, _ = _run(args + ["--eval-fallback"], tmp_path)
    assert "note: --eval layerwise needs" in capsys.readouterr().out
    assert "eval" not in summary.metrics and "test_acc_sampled" not in summary.metrics  # sampled: no layer-wise


@pytest.mark.slow  # a run of 3 epochs and a restart on three shard nodes, then one epoch more at K=1: about 3 min
def test_a_killed_embedding_owner_restarts_from_the_bucket_and_resumes_on_one_table(shard_nodes, s3_server,
                                                                                    tmp_path, capsys):
    """--embedding-dim with --feature-shards 3, the run kept in a bucket: an embedding owner is killed (SIGKILL)
    after epoch 0's checkpoint; the attempt fails naming its shard, and the driver's restart makes new owners,
    each reading its rows back from the checkpoint's shard objects, written there by the owners themselves.
    The finished run then resumes with K=1 (the replicated table) from those shard files."""
    import os
    import signal
    import sys

    import numpy as np
    from ray import cloudpickle

    from drills import RecordingModel, alive_actors
    from gnnray import run_storage
    from gnnray.train import checkpoint
    from gnnray.train.embedding import init_rows

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    where, name = s3_server.fresh_prefix("owner"), "owner"
    records = tmp_path / "records"
    records.mkdir()
    args = EXACT + ["--embedding-dim", "8", "--checkpoint-interval", "0", "--storage-path", where, "--name", name]
    recording = lambda f, c, cfg: RecordingModel(f, c, cfg, str(records))  # noqa: E731
    job = JobThread(args + ["--feature-shards", "3", "--epochs", "3", "--max-failures", "1"], model_factory=recording)
    wait_until(lambda: len(logged(where, name)) >= 1, JOB_TIMEOUT_S, "epoch 0", job)
    (records / "pause-1").touch()  # the worker waits in its next step while an owner is killed
    owners = alive_actors("EmbeddingOwner")
    assert len(owners) == 3, owners
    os.kill(owners[1].pid, signal.SIGKILL)
    (records / "pause-1").unlink()
    job.join()
    assert job.error is None, repr(job.error)
    assert job.summary.restarts == 1 and job.summary.checkpoint.startswith(run_storage.join(where, name) + "/")
    assert [m["restarts"] for m in logged(where, name)][-1] == 1 and logged(where, name)[-1]["epoch"] == 2
    assert "embedding shard" in capsys.readouterr().out
    shards = checkpoint.read_meta(job.summary.checkpoint)["embedding"]["shards"]
    assert [(s["lo"], s["hi"]) for s in shards] == [(0, 1000), (1000, 2000), (2000, 3000)]
    assert "embedding" not in checkpoint.load_state(job.summary.checkpoint)  # no process gathered the table
    rows = checkpoint.read_rows(job.summary.checkpoint, 0, 3000)
    assert rows["step"].max() > 0 and not np.array_equal(rows["weight"], init_rows(0, 0, 3000, 8))

    resumed = run(parse_args(args + ["--epochs", "4"]), model_factory=recording)
    assert [m["epoch"] for m in logged(where, name)][-1] == 3
    assert [(s["lo"], s["hi"]) for s in checkpoint.read_meta(resumed.checkpoint)["embedding"]["shards"]] == \
        [(0, 3000)]
    after = checkpoint.read_rows(resumed.checkpoint, 0, 3000)
    assert (after["step"] >= rows["step"]).all() and after["step"].sum() > rows["step"].sum()  # continued


# Last: it removes one of the module's shard nodes.
@pytest.mark.slow
def test_remote_bytes_drop_with_the_cache_and_a_lost_shard_node_is_rebuilt(cluster, shard_nodes, tmp_path, published,
                                                                           ray_cluster, capsys):
    """A run with --feature-cache 0.3 against the drill's first epoch (no cache, the same batches): the same loss,
    remote bytes per batch counted (metrics.jsonl and Prometheus) and fewer with the cache. The drill: a node
    holding a shard is removed mid-run; the attempt fails naming it (the one line that ends a run without
    --max-failures), and the run restarts with the shard rebuilt on an alive node."""
    from shared_runs import Scraper

    exported = {}
    name = f"cache-{uuid.uuid4().hex[:6]}"
    with Scraper(ray_cluster, name) as scraper:
        run(parse_args(EXACT + ["--feature-shards", "3", "--feature-cache", "0.3", "--storage-path", str(tmp_path),
                                "--name", name]))
        scraper.scrape()
    cached, exported[0.3] = logged(tmp_path, name)[0], scraper.total("gnnray_feature_remote_bytes_total")

    name = "lost"
    with Scraper(ray_cluster, name) as scraper:
        # Epochs take 0.2 s here: enough of them that the run is still training when the node is gone.
        job = JobThread(EXACT + ["--epochs", "40", "--feature-shards", "3", "--feature-cache", "0", "--feature-timeout",
                                 "30", "--max-failures", "1", "--storage-path", str(tmp_path), "--name", name])
        wait_until(lambda: len(logged(tmp_path, name)) >= 1, JOB_TIMEOUT_S, "epoch 0", job)
        alive = {n.node_id: n for n in cluster.worker_nodes}
        victim = next(s for s in published[-1].handle.features.shards if s.node_id in alive)
        cluster.remove_node(alive[victim.node_id], allow_graceful=False)
        job.join()
        cluster.wait_for_nodes()
        scraper.scrape()  # counters stay on the endpoint after their processes end
        exported[0.0] = scraper.total("gnnray_feature_remote_bytes_total")
    uncached = logged(tmp_path, name)[0]
    assert cached["loss"] == pytest.approx(uncached["loss"], rel=1e-6)  # the same features whatever the cache holds
    assert cached["cache_hit_rate"] > uncached["cache_hit_rate"] == 0, (cached, uncached)
    assert uncached["remote_bytes_per_batch"] > cached["remote_bytes_per_batch"] > 0, (cached, uncached)
    assert exported[0.0] > 0 and exported[0.3] > 0, exported  # exported to Prometheus

    assert job.error is None, repr(job.error)
    assert job.summary.restarts == 1
    [failed] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("training failed (")]
    assert f"({victim.node_id[:8]})" in failed, failed
    # Without the cache every batch reads rows of every shard: the epochs after the restart needed the
    # lost shard rebuilt.
    assert [e["epoch"] for e in logged(tmp_path, name)][-1] == 39
