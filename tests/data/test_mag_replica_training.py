"""The scaled-down MAG240M replica (``mag_replica.py``, OGB-LSC's exact layout) trains end to end through the
job, float16, with its features on every node and split over three simulated nodes (``--feature-shards 3``)."""

from __future__ import annotations

import uuid

import pytest

from gnnray.config import parse_args
from gnnray.driver.fit import run
from mag_replica import write_mag240m_replica


@pytest.mark.slow  # two whole runs on simulated nodes, about 2 minutes
def test_mag240m_replica_trains_with_and_without_feature_shards(shard_nodes, tmp_path):
    root = write_mag240m_replica(tmp_path / "data", scale=20_000)  # 12 K nodes, 768 float16 features
    # Full neighborhoods, one worker and actor, no dropout: both runs see the same batches, so they differ only
    # in where the feature rows come from.
    args = ["--dataset", "mag240m", "--data-dir", str(root), "--feature-dtype", "float16", "--model", "rgat",
            "--hidden", "8", "--heads", "2", "--fanouts=-1,-1", "--batch-size", "32", "--dropout", "0",
            "--num-workers", "1", "--sampler-actors", "1", "--epochs", "1", "--storage-path", str(tmp_path)]
    runs = [run(parse_args(args + extra + ["--name", f"mag-{uuid.uuid4().hex[:6]}"]))
            for extra in ([], ["--feature-shards", "3"])]
    replicated, sharded = runs
    assert sharded.metrics["loss"] == pytest.approx(replicated.metrics["loss"], rel=1e-6)
    assert sharded.metrics["remote_bytes_per_batch"] > 0
    assert sharded.test_acc == pytest.approx(replicated.test_acc, abs=1e-9)  # layer-wise, from the checkpoint
