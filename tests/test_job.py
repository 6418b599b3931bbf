"""End-to-end: the real job on the shared Ray cluster (CPU workers, small graphs)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import shared_dataset
from gnnray.config import parse_args
from gnnray.cpus import CpuPlan, node_cpus
from gnnray.driver.cli import main
from gnnray.driver.fit import run
from gnnray.driver.preflight import spill_disk
from gnnray.run_storage import METRICS_LOG
from shared_runs import SYNTHETIC


def _epochs_logged(storage: Path, name: str) -> list[dict]:
    return [json.loads(l) for l in (storage / name / METRICS_LOG).read_text().splitlines()]


def _checkpointed(run_dir: Path) -> list[int]:
    from gnnray.train import checkpoint

    return sorted(checkpoint.read_info(str(d)).epoch for d in run_dir.glob("checkpoint_*") if d.is_dir())


def test_cora_reaches_published_accuracy(cora_run):
    """2 CPU workers on cora reach >= 0.77 sampled test accuracy (full-batch DGL GraphSAGE: 0.79).

    The run is shared with tests/inference (conftest.py: its final accuracies are layer-wise, the sampled
    ones, those --eval sampled gives, are kept beside them).
    """
    summary, storage = cora_run
    assert summary.metrics["test_acc_sampled"] >= 0.77, summary.line()
    logged = _epochs_logged(storage, "cora")
    assert [m["epoch"] for m in logged] == list(range(20))
    # The run trains each of cora's 140 training nodes once per epoch, counted over both ranks. Summed over
    # the run: the ranks split one stream of all epochs' rows, so a rank's epoch may take a row of the
    # next data epoch (one epoch logged 142 seeds) while the run as a whole takes every row once.
    assert sum(m["seeds_per_s"] * m["epoch_time"] for m in logged) == pytest.approx(20 * 140, rel=1e-6)
    assert summary.best_val_acc == max(m["val_acc"] for m in logged)
    # The CPU plan, on by default, as rank 0 applied it (2 workers on this one node) and recorded it.
    plan = CpuPlan(node_cpus(), 2, 0)  # no sampler actors: the workers sample
    assert {m["cpu_threads"] for m in logged} == {plan.trainer_threads()}
    assert logged[0]["cpu_cores"] == list(plan.trainer_cores(0) or range(os.cpu_count()))
    # On this host's cores the plan samples in the workers, at idle priority (docs/cpu-plan.md#the-budget).
    from gnnray.train.report import events

    [sampling] = [e for e in events(str(storage / "cora")) if e["event"] == "sampling"]
    assert sampling["where"] == "worker (cpu)" and sampling["threads"] == plan.trainer_threads()


def test_uneven_split_and_user_model(ray_cluster, tmp_path):
    """Seeds that do not divide by workers x batch size, and a user model with forward(layers, x)."""
    import torch

    class Linear(torch.nn.Module):  # ignores the graph: any forward(layers, x) plugs in
        def __init__(self, in_feats, num_classes):
            super().__init__()
            self.fc = torch.nn.Linear(in_feats, num_classes)

        def forward(self, layers, x):
            return self.fc(x[: layers[-1].num_dst])

    cfg = parse_args(SYNTHETIC + ["--num-workers", "3", "--epochs", "2", "--lr", "0.05", "--storage-path",
                                  str(tmp_path), "--name", "uneven"])
    assert 1800 % (128 * 3) != 0  # 60% of 3000 nodes train
    summary = run(cfg, model_factory=lambda f, c, _cfg: Linear(f, c))
    logged = _epochs_logged(tmp_path, "uneven")
    assert [m["epoch"] for m in logged] == [0, 1] and logged[1]["loss"] < logged[0]["loss"]
    # Even split unevenly, every one of the 1800 training nodes is trained once per epoch, over the three
    # ranks (summed over the run: see test_cora_reaches_published_accuracy).
    assert sum(m["seeds_per_s"] * m["epoch_time"] for m in logged) == pytest.approx(2 * 1800, rel=1e-6)
    # Features alone carry the class (centroid plus noise): the linear model learns well above chance (1/8;
    # about 0.48 after 2 epochs at --lr 0.05).
    assert summary.test_acc > 2 * (1 / 8), summary.line()


def test_sampling_on_the_device_trains_as_the_actors_do(cora_run, tmp_path, capsys):
    """``--sample-on device --feature-placement device`` with the CPU as the device: no sampler actors, each
    worker samples its seed rows itself (gnnray.train.device_sampler) and gathers their features from a table
    on its device (gnnray.train.placement), and cora reaches the actors' run's accuracy (the same flags)."""
    from gnnray.train.report import events

    actors, _ = cora_run
    cora = shared_dataset("cora")
    cfg = parse_args(["--dataset", str(cora), "--normalize-features", "--epochs", "20", "--batch-size", "32",
                      "--fanouts", "10,10", "--hidden", "64", "--lr", "0.01", "--weight-decay", "5e-4",
                      "--num-workers", "2", "--storage-path", str(tmp_path), "--name", "device",
                      "--sample-on", "device", "--feature-placement", "device", "--eval", "sampled"])
    summary = run(cfg)
    assert "sampling plan: in each train worker, on a thread at idle priority (--sample-on device)" in capsys.readouterr().out
    did = [e for e in events(str(tmp_path / "device")) if e["event"] == "features"]
    assert did and did[-1]["placement"] == "device", did  # the worker says what it did
    logged = _epochs_logged(tmp_path, "device")
    assert [m["epoch"] for m in logged] == list(range(20))
    assert sum(m["seeds_per_s"] * m["epoch_time"] for m in logged) == pytest.approx(20 * 140, rel=1e-6)
    # Sampled test accuracy of 1000 nodes: the two runs' draws differ, so within a few points of each other.
    assert summary.test_acc >= 0.77 and abs(summary.test_acc - actors.metrics["test_acc_sampled"]) <= 0.04, (
        summary.line(), actors.line())


@pytest.mark.dgl
def test_graphbolt_sampler_trains_where_the_dgl_extra_is_installed(ray_cluster, tmp_path):
    """``--sampler graphbolt``: the job as with gnnray's sampler, DGL's GraphBolt sampling in the actors."""
    cfg = parse_args(SYNTHETIC + ["--sampler", "graphbolt", "--epochs", "2", "--lr", "0.02", "--storage-path",
                                  str(tmp_path), "--name", "graphbolt"])
    summary = run(cfg)
    logged = _epochs_logged(tmp_path, "graphbolt")
    assert [m["epoch"] for m in logged] == [0, 1] and logged[1]["loss"] < logged[0]["loss"]
    assert summary.test_acc > 4 * (1 / 8), summary.line()


@pytest.mark.parametrize("args, message", [
    (["--dataset", "/nonexistent/graph"], "unknown dataset"),
    (["--fanouts", "10,0"], "--fanouts"),
    (["--batch-size", "0"], "--batch-size"),
])
def test_bad_input_is_a_clear_error(args, message, tmp_path, capsys):
    assert main(args + ["--storage-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gnnray: error:") and message in err and "Traceback" not in err


def test_featureless_graph_dir_needs_random_features(tmp_path, capsys):
    arxiv = shared_dataset("arxiv-structure")
    assert main(["--dataset", str(arxiv), "--storage-path", str(tmp_path)]) == 2
    assert "--random-features" in capsys.readouterr().err


def test_unwritable_storage_fails_before_training(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert main(SYNTHETIC + ["--storage-path", str(blocker / "runs")]) == 2
    assert "cannot write checkpoints" in capsys.readouterr().err


def test_job_script_end_to_end_learns_and_resumes(script_run):
    """The command users run, as a subprocess joined to the session's cluster, learns far above chance; the same
    name then resumes (here, in this process) at the next epoch, and once finished has nothing to do. Under an
    interval longer than the run only the last epoch is checkpointed; resumed under 0, every epoch is.

    The script's run (shared_runs.py) is also the one whose metrics tests/test_metrics.py reads.
    """
    out, args, storage, name = script_run.proc, script_run.args, script_run.storage, script_run.name
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    # A disk past Ray's threshold (CI's machine) is said once a node, not by the raylet every 10 s.
    _, free, total, threshold = spill_disk()  # the session's nodes share this one
    disk = [l for l in lines if l.startswith("warning: node ") and "the disk of" in l]
    assert bool(disk) == (1 - free / total >= threshold), lines
    lines = [l for l in lines if l not in disk]
    # The console holds the run's own lines only: its cluster, graph, CPU plan, one per epoch, the summary.
    # Ray's (constructor-argument E-lines, Ray Data's progress and finish lines) stay in the session's logs.
    assert [l.split()[0] for l in lines[:-1]] == ["ray:", "graph", "sampling", "cpu", "epoch=0", "epoch=1"], lines
    assert lines[-1].startswith("best_val_acc="), lines
    assert out.stderr == "", out.stderr[-3000:]
    assert lines[0].startswith(f"ray: cluster {script_run.address}, "), lines[0]
    assert any(l.startswith("epoch=1 ") and "data_wait=" in l and "seeds_per_s=" in l for l in lines)
    summary = [l for l in lines if l.startswith("best_val_acc=")]
    assert len(summary) == 1, lines
    test_acc = float(summary[0].split(" test_acc=")[1].split()[0])
    chance = 1 / 8
    assert test_acc > 4 * chance, summary[0]  # about 0.88 after 2 epochs at --lr 0.02
    first_checkpoint = summary[0].split(" checkpoint=")[1]
    assert [m["epoch"] for m in _epochs_logged(storage, name)] == [0, 1]
    assert _checkpointed(storage / name) == [1]  # --checkpoint-interval 3600: only the last epoch's

    second = run(parse_args(args + ["--epochs", "4", "--checkpoint-interval", "0", "--keep-checkpoints", "10"]))
    logged = _epochs_logged(storage, name)
    assert [m["epoch"] for m in logged] == [0, 1, 2, 3]  # continued at epoch 2, nothing repeated
    assert _checkpointed(storage / name) == [1, 2, 3]  # every epoch's from then on
    assert second.metrics["epoch"] == 3 and second.checkpoint != first_checkpoint
    assert second.test_acc > 4 * chance, second.line()
    # Resumed from the checkpoint, not from scratch: epoch 2 starts near where epoch 1 ended.
    assert logged[2]["loss"] < logged[0]["loss"]

    again = run(parse_args(args + ["--epochs", "4"]))  # already finished: nothing to do
    assert again.checkpoint == second.checkpoint and len(_epochs_logged(storage, name)) == 4
