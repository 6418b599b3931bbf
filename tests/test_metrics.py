"""Monitoring: the job's Prometheus metrics, read back from each node's Ray metrics endpoint, and the epoch line."""

from __future__ import annotations

import math

import pytest

from gnnray.config import parse_args
from gnnray.driver.console import epoch_line
from s3_server import STORAGE_KINDS
from gnnray.seeds import steps_per_epoch
from shared_runs import SCRIPT_EPOCHS

EPOCHS, WORKERS, BATCH, FANOUTS = SCRIPT_EPOCHS, 2, 128, (5, 5)  # shared_runs.SYNTHETIC's


@pytest.fixture(scope="module")
def monitored_run(script_run):
    """The script's run (shared_runs.py, shared with tests/test_job.py), scraped while it ran: (scraper, its
    stdout, its logged epochs, its training set's size)."""
    assert script_run.proc.returncode == 0, script_run.proc.stderr[-3000:]
    cfg = parse_args(script_run.args)
    assert (cfg.train.workers_min, cfg.sampler.batch_size, tuple(cfg.sampler.fanouts)) == (WORKERS, BATCH, FANOUTS)
    return script_run.scraper, script_run.proc.stdout, script_run.logged, script_run.n_train


def test_train_worker_metrics(monitored_run):
    scraper, _, logged, n_train = monitored_run
    steps = steps_per_epoch(n_train, BATCH, WORKERS)
    ranks = {str(r) for r in range(WORKERS)}
    seeds = scraper.values("gnnray_train_seeds_total")
    assert {dict(k[1])["rank"] for k in seeds} == ranks
    assert sum(seeds.values()) == EPOCHS * n_train  # every training node once per epoch, padding not counted
    for rank in ranks:
        for hist in ("gnnray_train_step_seconds", "gnnray_train_data_wait_seconds"):
            (count,) = scraper.values(f"{hist}_count", rank=rank).values()
            assert count == EPOCHS * steps, hist
            buckets = sorted((float(dict(k[1])["le"]), v) for k, v in scraper.values(f"{hist}_bucket", rank=rank).items())
            assert buckets[-1] == (math.inf, count) and all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:]))
        assert list(scraper.values("gnnray_train_epochs_completed", rank=rank).values()) == [EPOCHS]
    # The last values scraped are the last epoch's, as logged by rank 0 (reduced over ranks).
    last = logged[-1]
    for gauge, key in [("gnnray_train_loss", "loss"), ("gnnray_train_acc", "train_acc"), ("gnnray_val_acc", "val_acc"),
                       ("gnnray_train_seeds_per_s", "seeds_per_s"), ("gnnray_train_data_wait_fraction", "data_wait"),
                       ("gnnray_train_world_size", "world_size")]:
        (value,) = scraper.values(gauge, rank="0").values()
        assert value == pytest.approx(last[key], rel=1e-6), gauge
    assert 0 < last["loss"] < 10 and 0 <= last["val_acc"] <= 1 and 0 <= last["data_wait"] <= 1


def test_sampler_actor_metrics(monitored_run):
    scraper, _, _, n_train = monitored_run
    batches = scraper.values("gnnray_sampler_minibatches_total")
    assert 1 <= len(batches) <= 2  # one series per actor of the 1..2 pool
    total = sum(batches.values())
    assert total == EPOCHS * steps_per_epoch(n_train, BATCH, WORKERS) * WORKERS  # each training step's batch once
    # Edges per mini-batch: more than one per seed, at most what the fanouts allow (input layer first).
    per_batch = scraper.total("gnnray_sampler_edges_total") / total
    most = BATCH * FANOUTS[1] + BATCH * (1 + FANOUTS[1]) * FANOUTS[0]
    assert BATCH < per_batch <= most
    rates = scraper.values("gnnray_sampler_minibatches_per_s")
    edge_rates = scraper.values("gnnray_sampler_edges_per_s")
    assert rates and all(v > 0 for v in rates.values())
    assert sum(edge_rates.values()) > sum(rates.values())
    assert all(len(dict(k[1])["actor"]) >= 16 for k in batches)  # tagged with the Ray actor id


def test_driver_prints_eta_per_epoch(monitored_run):
    _, out, logged, _ = monitored_run
    lines = [l for l in out.splitlines() if l.startswith("epoch=")]
    assert len(lines) == EPOCHS
    first, last = lines
    for key in ("loss=", "train_acc=", "val_acc=", "seeds_per_s=", "data_wait=", "epoch_time="):
        assert key in first and key in last
    eta = float(first.split(" eta=")[1].split("s")[0])
    assert eta >= 0 and " eta=" not in last and " test_acc=" in last  # nothing left after the last epoch


@STORAGE_KINDS
def test_epoch_printer_eta(storage_path, capsys):
    """Before a second line arrives, the ETA is the epochs left times rank 0's epoch time; none after the last.
    The driver reads the lines where rank 0 keeps them, in a directory or a bucket (its log rewritten whole)."""
    import json

    from gnnray import run_storage
    from gnnray.driver.console import EpochPrinter

    log = run_storage.join(storage_path, "metrics.jsonl")
    m = dict(epoch=0, loss=1.0, train_acc=0.5, val_acc=0.5, seeds_per_s=100.0, data_wait=0.1, epoch_time=10.0)
    run_storage.append(log, (json.dumps(dict(m, epoch=-1)) + "\n").encode())  # a resumed run's: not printed
    with EpochPrinter(storage_path, epochs=3, bar=False):  # prints at the latest when it stops
        run_storage.append(log, (json.dumps(m) + "\n" + json.dumps(dict(m, epoch=2, test_acc=0.5)) + "\n").encode())
    first, last = capsys.readouterr().out.splitlines()
    assert first.startswith("epoch=0 ") and first.endswith(" eta=20s")
    assert last.startswith("epoch=2 ") and " eta=" not in last


def test_epoch_line_eta_format():
    m = dict(epoch=3, loss=0.5, train_acc=0.8, val_acc=0.7, seeds_per_s=1234.4, data_wait=0.25, epoch_time=12.34)
    assert epoch_line(m) == ("epoch=3 loss=0.5000 train_acc=0.8000 val_acc=0.7000 seeds_per_s=1234 "
                             "data_wait=0.25 epoch_time=12.3s")
    assert epoch_line(m, 61.6).endswith(" epoch_time=12.3s eta=62s")
