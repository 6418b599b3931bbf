"""Elastic runs (``--num-workers MIN,MAX``) on simulated nodes: grow when nodes join, shrink when one is drained
or lost, every epoch's seeds trained once apart from the replay after a resize.

The drills run the real job in a thread of the test process (drills.JobThread) with a model that records, on
every rank, the seed features of each training step (mapped back to node ids here) with its world size, so the
tests see exactly which steps of which epoch each worker group trained. Train workers ask for 4 CPUs: the
session's head (6 CPUs) fits one, with room left for the sampler actor and Ray Data; each added node (5 CPUs)
fits one more.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from ray import cloudpickle

from drills import (EVERY, JOB_TIMEOUT_S, JobThread, RecordingModel, alive_actors, attempts, events,  # noqa: F401
                    killed_fixed_run, logged, recorded_steps, recorded_steps_fast, replays,
                    steps_per_epoch, wait_until)
from gnnray.config import parse_args
from gnnray.seeds import SeedPlan

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the recording model reaches the workers by value

EPOCHS = 12  # at most about 7 go by before the last resize (the drain's 15 s at 3 workers: 3 at most)
ELASTIC = ["--dataset", "synthetic", "--synthetic-nodes", "3000", "--synthetic-feat-dim", "16", "--fanouts", "5,5",
           "--batch-size", "32", "--hidden", "16", "--sample-on", "actors", "--sampler-actors", "1,1", "--eval", "sampled",
           "--checkpoint-interval", "0", "--cpus-per-worker", "4", "--num-workers", "1,3", "--resize-interval", "1",
           "--checkpoint-every", str(EVERY)]
NODE_CPUS = 5  # one 4-CPU train worker and one CPU to spare
DRAIN_S = 15  # the spot notice's deadline: room for the notice (1 s polls), a checkpoint and a few steps
# The worker groups' sizes, in order: the two nodes that join are seen together (1 -> 3) or, when Ray Data's
# autoscaling coordinator refreshes its view of the nodes (every 20 s) between the two, one at a time.
GROUPS = ([1, 3, 2, 1], [1, 2, 3, 2, 1])
# Ray Train's knobs, read from the driver's environment: look for drained nodes every second, and give up a
# worker group that does not fit within 15 s (its count can lag a lost node by the autoscaling coordinator's
# 20 s refresh) rather than 60.
RAY_ENV = {"RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "1", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "15"}



def drain(node_id: str, deadline_s: float) -> None:
    """Drain a node as the autoscaler does for a spot instance's notice (Ray's own test utilities do the same)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    accepted, why = gcs.drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                   "test_elastic: a spot notice", int(deadline_s * 1000))
    assert accepted, why


@dataclass
class Scenario:
    """The run of :func:`scenario` and what the test did to it."""

    args: list
    storage: str  # a bucket's prefix (s3://...): the run keeps its checkpoints and logs there
    name: str
    run_dir: str
    records: Path
    job: JobThread
    out: str
    drained: str
    lost: str
    seconds: dict


_RUNS: dict = {}


@pytest.fixture(scope="module")
def scenario(cluster, ray_cluster, s3_server, tmp_path_factory) -> Scenario:
    """One elastic run, 1 to 3 workers, through every resize, keeping its run in a bucket (a real S3 server: each
    group resumes from the checkpoint found and read there): it starts on the head alone (1 worker); after
    epoch 1 two nodes join (it grows to 3); after an epoch at 3 one is drained with a 15 s deadline and removed
    at the deadline (2); during its first epoch at 2 the other is removed without notice (1); it then finishes.
    Steps at 3 and 2 workers are slowed to 0.25 s, so that the run is still going at each of these points."""
    if "run" not in _RUNS:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in RAY_ENV.items():
                mp.setenv(k, v)
            _RUNS["run"] = _scenario(cluster, s3_server.fresh_prefix("elastic"), tmp_path_factory)
    return _RUNS["run"]


def _scenario(cluster, storage: str, tmp_path_factory) -> Scenario:
    import io
    from contextlib import redirect_stdout

    from gnnray import run_storage as stores

    name = "elastic"
    records = tmp_path_factory.mktemp("elastic-records")
    args = ELASTIC + ["--epochs", str(EPOCHS), "--max-failures", "2", "--storage-path", str(storage), "--name", name]
    out = io.StringIO()
    added, seconds = [], {}
    try:
        with redirect_stdout(out):
            job = JobThread(args, model_factory=lambda f, c, cfg: RecordingModel(f, c, cfg, str(records)))
            run_dir = stores.join(storage, name)
            epochs_at = lambda w: [m for m in logged(storage, name) if m["world_size"] == w]  # noqa: E731

            # 1 worker; after epoch 1 it waits in its next step (pause-1) while two nodes join.
            wait_until(lambda: len(epochs_at(1)) >= 2, JOB_TIMEOUT_S, "two epochs at 1 worker", job)
            (records / "pause-1").touch()
            joined = time.time()
            added = [cluster.add_node(num_cpus=NODE_CPUS) for _ in range(2)]
            cluster.wait_for_nodes()
            wait_until(lambda: any(s.world == 3 for s in recorded_steps_fast(records)), JOB_TIMEOUT_S,
                       "a step at 3 workers", job)
            seconds["join"] = _resize_seconds(run_dir, records, joined, 3)
            (records / "pause-1").unlink()
            for w in (3, 2):
                (records / f"slow-{w}").write_text("0.25")

            # 3 workers; after an epoch, a spot notice for one added node, removed at its deadline.
            wait_until(lambda: len(epochs_at(3)) >= 1, JOB_TIMEOUT_S, "an epoch at 3 workers", job)
            drained = added[0]
            deadline = time.time() + DRAIN_S
            drain(drained.node_id, deadline)
            wait_until(lambda: time.time() >= deadline, 60, "the drain deadline", job)
            cluster.remove_node(drained)
            # After the deadline: a group of 2 may also have come and gone while the two nodes joined.
            wait_until(lambda: any(e["event"] == "start" and e["world_size"] == 2 and e["time"] > deadline
                                   for e in events(run_dir)), JOB_TIMEOUT_S, "the group of 2", job)
            wait_until(lambda: any(s.world == 2 and s.time > deadline for s in recorded_steps_fast(records)),
                       JOB_TIMEOUT_S, "a step at 2 workers", job)
            seconds["drain deadline"] = _resize_seconds(run_dir, records, deadline, 2)

            # 2 workers; during the group's first epoch, the other added node goes without notice.
            time.sleep(2)
            lost = added[1]
            cluster.remove_node(lost)
            gone = time.time()
            wait_until(lambda: [e["world_size"] for e in events(run_dir) if e["event"] == "start"][-1] == 1,
                       JOB_TIMEOUT_S, "the group of 1 again", job)
            wait_until(lambda: any(s.world == 1 and s.time > gone for s in recorded_steps_fast(records)),
                       JOB_TIMEOUT_S, "a step at 1 worker again", job)
            seconds["node lost"] = _resize_seconds(run_dir, records, gone, 1)
            job.join()
    finally:
        for n in added:
            if n in cluster.worker_nodes:
                cluster.remove_node(n)
        cluster.wait_for_nodes()
    print(out.getvalue())  # shown with -s or when a test fails
    return Scenario(args, storage, name, run_dir, records, job, out.getvalue(), drained.node_id, lost.node_id,
                    seconds)


def _resize_seconds(run_dir: str, records: Path, since: float, world: int) -> dict:
    """Seconds from ``since`` (nodes joined, a drain deadline, a node lost) to the start of the next group of
    ``world`` workers (its stream made) and to its first step."""
    start = min(e["time"] for e in events(run_dir) if e["event"] == "start" and e["world_size"] == world
                and e["time"] > since)
    first = min(s.time for s in recorded_steps_fast(records) if s.world == world and s.time > start)
    return {"to group start": round(start - since, 1), "to first step": round(first - since, 1)}


@pytest.mark.slow
def test_run_grows_and_shrinks_and_finishes(scenario):
    job = scenario.job
    assert job.error is None, repr(job.error)
    starts = [e for e in events(scenario.run_dir) if e["event"] == "start"]
    assert [e["world_size"] for e in starts] in GROUPS, starts
    # Every group after the first resumed from a checkpoint in the bucket, and the run ends with one there.
    assert all(e["checkpoint"].startswith(scenario.run_dir + "/checkpoint_") for e in starts[1:]), starts
    assert job.summary.checkpoint.startswith(scenario.run_dir + "/checkpoint_")
    lines = logged(scenario.storage, scenario.name)
    assert sorted({m["epoch"] for m in lines}) == list(range(EPOCHS))
    assert {1, 3} <= {m["world_size"] for m in lines} <= {1, 2, 3}  # the group of 2 may end within its epoch
    assert job.summary.metrics["epoch"] == EPOCHS - 1 and job.summary.restarts == len(starts) - 1
    # Ray Train restarted each group within the run's one fit (the driver restarted nothing), and the
    # dashboard's Train view (Ray Train's state actor) lists one run, a group an attempt.
    assert "training failed" not in scenario.out
    import ray
    from ray.train.v2._internal.state.state_actor import get_state_actor

    actor = get_state_actor()
    runs = [r for r in ray.get(actor.get_train_runs.remote()).values() if r.name == scenario.name]
    assert len(runs) == 1
    assert len(ray.get(actor.get_train_run_attempts.remote())[runs[0].id]) == len(starts)
    print("resize timings (s):", scenario.seconds)


@pytest.mark.slow
def test_every_epoch_trains_each_seed_once_apart_from_replays(scenario):
    """Each step of every epoch is trained, each rank on exactly its piece; a step is trained twice only where a
    group was cut short, at most --checkpoint-every steps, and never at the drain."""
    steps = recorded_steps(scenario.records, scenario.args)
    per_epoch = steps_per_epoch(scenario.args)
    groups = attempts(steps, per_epoch)
    assert [w for w, _ in groups] in GROUPS
    trained = Counter(g for _, gs in groups for g in gs)
    assert sorted(trained) == list(range(EPOCHS * per_epoch))  # every step of every epoch, all ranks of its group
    *grew, drained, lost = replays(groups)
    assert drained == 0, f"the drained node's group trained {drained} step(s) the next group trained again"
    assert all(g <= EVERY for g in grew) and lost <= EVERY, (grew, lost)
    assert sum(trained.values()) - len(trained) == sum(grew) + lost  # no other step twice


@pytest.mark.slow
def test_console_and_metrics_say_each_resize(scenario):
    out = scenario.out
    assert "workers: started 1, at epoch 0 step 0" in out
    assert "workers: 1 -> 3 (grew: nodes joined), resuming at epoch" in out or (
        "workers: 1 -> 2 (grew: nodes joined), resuming at epoch" in out
        and "workers: 2 -> 3 (grew: nodes joined), resuming at epoch" in out)
    assert f"preemption: node {scenario.drained[:8]} drains in" in out
    assert f"workers: 3 -> 2 (shrank: node {scenario.drained[:8]} drained), resuming at epoch" in out
    assert "workers: 2 -> 1 (shrank: a node or a worker was lost), resuming at epoch" in out
    assert "workers=1" in out and "workers=3" in out
    # The groups' streams ended with them: no sampler actor or split coordinator is left.
    wait_until(lambda: not alive_actors("SamplerActor") and not alive_actors("SplitCoordinator"), 60,
               "the streams' actors to exit")


# ----------------------------------------------------------------------------- quicker drills, run by CI


def test_fixed_run_trains_its_plan_and_resumes_within_the_epoch(killed_fixed_run):
    """A fixed run (--num-workers 2) trains the seeds of the plan it always had, each rank its piece of every
    step; with --checkpoint-every a killed worker costs at most that many steps: the driver resumes mid-epoch.
    (The run is drills.killed_fixed_run, which drill 1 of test_faults.py also reads.)"""
    run = killed_fixed_run
    job, groups, out = run.job, run.groups, run.out
    per_epoch = steps_per_epoch(run.args)
    assert [w for w, _ in groups] == [2, 2] and job.summary.restarts == 1
    first, second = (g for _, g in groups)
    assert per_epoch < second[0] < 2 * per_epoch  # resumed within epoch 1, at a checkpoint's step
    assert (second[0] - per_epoch) % EVERY == 0 and replays(groups) == [first[-1] - second[0] + 1]
    assert 0 <= replays(groups)[0] <= EVERY
    assert sorted(set(first) | set(second)) == list(range(3 * per_epoch))
    lines = logged(run.storage, run.name)
    resumed = [m for m in lines if m["restarts"] == 1][0]
    assert resumed["epoch"] == 1 and resumed["first_step"] == second[0] - per_epoch
    assert f"from epoch 1 step {second[0] - per_epoch}" in out


def test_elastic_split_makes_the_stream_of_each_group_from_the_newest_checkpoint(ray_cluster, tmp_path):
    """What Ray Train calls at each worker-group start: the stream for that world size, from the checkpoint's
    step, each rank its piece of every step; logged for the ranks, who restore the same checkpoint."""
    import threading

    from gnnray.batch import MiniBatch, from_arrow
    from gnnray.controller.split import ElasticSplit
    from gnnray.data.load import load_graph
    from gnnray.models.model import model_for
    from gnnray.seeds import plan_key
    from gnnray.store.handle import publish
    from gnnray.train import checkpoint

    args = ELASTIC + ["--epochs", "2", "--storage-path", str(tmp_path), "--name", "split"]
    cfg = parse_args(args)
    graph = load_graph(cfg.data, cfg.run.seed)
    run_dir = tmp_path / "split"
    run_dir.mkdir()

    def write(name: str, epoch: int, step: int, plan=plan_key(1800, 32, (1, 3))) -> str:  # as rank 0 writes it
        model = model_for(graph.feat_dim, graph.num_classes, cfg)
        d = run_dir / name
        d.mkdir()
        checkpoint.save(str(d), model, torch.optim.Adam(model.parameters()),
                        dict(epoch=epoch, step=step, best_val_acc=0.5, plan=plan))
        return str(d)

    write("checkpoint_2026-01-01_00-00-01.000000", 0, 0)
    newest = write("checkpoint_2026-01-01_00-00-00.000000", 0, 5)  # step 5 of epoch 1: furthest, older name
    split = ElasticSplit(cfg, publish(graph), graph.train_idx, str(run_dir))
    per_epoch = steps_per_epoch(args)
    for world, attempt in ((2, 0), (3, 1)):
        shards = [s["train"] for s in split.configure({"train": None}, world, None, None)]
        start = events(run_dir)[-1]
        assert {k: start[k] for k in ("event", "world_size", "epoch", "step", "attempt", "checkpoint")} == dict(
            event="start", world_size=world, epoch=1, step=5, attempt=attempt, checkpoint=newest)
        got: dict = {}

        def read(rank, it):
            got[rank] = [MiniBatch.unpack(torch.from_numpy(p.copy()))
                         for b in it.iter_batches(batch_size=None, batch_format="pyarrow") for p in from_arrow(b)]

        threads = [threading.Thread(target=read, args=(r, it), daemon=True) for r, it in enumerate(shards)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        plan = SeedPlan.elastic(graph.train_idx, cfg.sampler.batch_size, 3, world, cfg.run.seed)
        for rank in range(world):
            assert [mb.seeds.tolist() for mb in got[rank]] == [plan.batches(1)[k * world + rank].tolist()
                                                               for k in range(5, per_epoch)], (world, rank)
    # Written under another plan (--num-workers 3 fixed): its step 9 means other seeds, so epoch 1 starts over.
    other = write("checkpoint_2026-01-01_00-00-03.000000", 0, 9, plan_key(1800, 32, (3,)))
    split.configure({"train": None}, 2, None, None)
    assert {k: events(run_dir)[-1][k] for k in ("epoch", "step", "checkpoint")} == dict(epoch=1, step=0,
                                                                                       checkpoint=other)
    write("checkpoint_2026-01-01_00-00-02.000000", 1, 0)  # the last epoch's end: nothing left to stream
    assert split.configure({"train": None}, 2, None, None) == [{"train": None}] * 2
    assert events(run_dir)[-1]["epoch"] == 2


def test_elastic_group_must_leave_room_for_the_sampler_actors():
    """Ray Train sizes an elastic group by what its workers fit, as if nothing else ran: on CPU nodes a group that
    would take the CPUs the sampler actors need is refused, saying how large a MAX fits."""
    from gnnray.driver import preflight
    from gnnray.errors import ClusterError

    nodes = [preflight.Node(f"{i:056x}", "10.0.0.1", 4, 0, 2**30) for i in range(2)]  # 8 CPUs
    preflight.check_resources(parse_args(["--num-workers", "1,6", "--sampler-actors", "1,2"]), False, nodes)
    with pytest.raises(ClusterError, match="here 8, which leaves 0 CPUs .* need 3; lower MAX to 5"):
        preflight.check_resources(parse_args(["--num-workers", "1,8", "--sampler-actors", "2,2"]), False, nodes)
    with pytest.raises(ClusterError, match="--num-workers 9,9: each train worker needs 1 CPU on one node"):
        preflight.check_resources(parse_args(["--num-workers", "9,9"]), False, nodes)
    # GPU workers: the group is bounded by the GPUs, the CPUs stay for the actors.
    gpus = [preflight.Node(f"{i:056x}", "10.0.0.1", 4, 1, 2**30) for i in range(2)]
    preflight.check_resources(parse_args(["--num-workers", "1,8", "--sampler-actors", "2,2"]), True, gpus)


def test_elastic_runs_refuse_feature_shards(tmp_path, capsys):
    from gnnray.driver.cli import main

    assert main(["--num-workers", "1,2", "--feature-shards", "2", "--storage-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--num-workers 1,2 with --feature-shards 2: an elastic run cannot rebuild a feature shard" in err


def test_resize_lines():
    from gnnray.driver.console import preemption_line, worker_line

    start = dict(event="start", world_size=3, epoch=2, step=8)
    assert worker_line(start, None, []) == "workers: started 3, at epoch 2 step 8"
    assert worker_line(start, 1, []) == "workers: 1 -> 3 (grew: nodes joined), resuming at epoch 2 step 8"
    assert worker_line({**start, "world_size": 2}, 3, ["ab" * 28]) == (
        "workers: 3 -> 2 (shrank: node abababab drained), resuming at epoch 2 step 8")
    assert worker_line({**start, "world_size": 2}, 3, []).startswith("workers: 3 -> 2 (shrank: a node or a worker")
    assert worker_line(start, 3, []).startswith("workers: 3 -> 3 (restarted: a worker failed)")
    notice = dict(event="preempted", time=100.0, nodes=["cd" * 28], deadline_ms=125_000, epoch=4, step=3)
    assert preemption_line(notice) == ("preemption: node cdcdcdcd drains in 25s; checkpoint at epoch 4 step 3, "
                                       "then the group restarts without it")
