"""What happens between two epochs: sampled validation, the workers' memory reading, the checkpoint interval's
default (checkpoints by interval, end to end: tests/test_job.py)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import psutil

from gnnray.config import JobConfig, ModelConfig, RunConfig, SamplerConfig, TrainConfig, parse_args
from gnnray.train import evaluate
from gnnray.train.evaluate import Evaluator
from plain_sage import mean_sage
from gnnray.train.report import PrivateMemory


def test_evaluation_in_one_batch_on_this_thread_equals_several(ray_cluster, graph, monkeypatch):
    import torch

    from gnnray.store.handle import publish

    # All neighbors: sampling is deterministic, so both ways must agree exactly.
    one = JobConfig(sampler=SamplerConfig(fanouts=(-1, -1)), model=ModelConfig(hidden=8, dropout=0.0),
                    train=TrainConfig(eval_batch_size=4096))
    several = replace(one, train=TrainConfig(eval_batch_size=3))
    handle = publish(graph)
    torch.manual_seed(0)
    model = mean_sage(graph.feat_dim, 8, graph.num_classes)
    want = Evaluator(graph, several, 0, 1, "cpu", handle=handle).accuracy(model, "valid")

    def no_thread(*args, **kwargs):
        raise AssertionError("a single evaluation batch started a prefetch thread")

    monkeypatch.setattr(evaluate, "Prefetcher", no_thread)
    evaluator = Evaluator(graph, one, 0, 1, "cpu", handle=handle)
    assert [evaluator.accuracy(model, "valid") for _ in range(2)] == [want, want]  # its reused buffer too


def test_eval_fanouts_are_what_evaluation_draws(ray_cluster, graph):
    """Trained at 1 neighbor per layer, evaluated with all: the same accuracy as with --fanouts=-1,-1 itself.

    Evaluation with the training draw of one neighbor differs (a 1-neighbor draw of the tiny graph's
    nodes is not all of them), so the check can fail if --eval-fanouts were ignored. An evaluation draw is
    fixed by the run's seed and the batch's seeds, so the 1-neighbor draws differ by run seed.
    """
    import torch

    from gnnray.store.handle import publish

    handle = publish(graph)

    def accuracy(cfg, actor=True):
        torch.manual_seed(0)
        model = mean_sage(graph.feat_dim, 8, graph.num_classes)
        return Evaluator(graph, cfg, 0, 1, "cpu", handle=handle if actor else None).accuracy(model, "valid")

    model = ModelConfig(hidden=8, dropout=0.0)
    exact = accuracy(JobConfig(sampler=SamplerConfig(fanouts=(-1, -1)), model=model))
    evaluated_whole = JobConfig(sampler=SamplerConfig(fanouts=(1, 1), eval_fanouts=(-1, -1)), model=model)
    assert [accuracy(evaluated_whole) for _ in range(3)] == [exact] * 3
    one_draw = [JobConfig(sampler=SamplerConfig(fanouts=(1, 1)), model=model, run=RunConfig(seed=s))
                for s in range(5)]
    assert any(accuracy(cfg, actor=False) != exact for cfg in one_draw)


def test_private_memory_passes_on_its_last_reading_until_a_new_one_pays(monkeypatch):
    readings = iter([100, 200, 300])
    monkeypatch.setattr(psutil, "Process", lambda: SimpleNamespace(
        memory_full_info=lambda: SimpleNamespace(uss=next(readings) * 2**20)))
    memory = PrivateMemory(share=1e-12)  # a new reading would pay only after ages
    assert memory.max_mb("cpu") == 100  # the first call reads
    assert memory.max_mb("cpu") == 100
    assert memory.max_mb("cpu", fresh=True) == 200  # the last epoch's is read whatever it costs
    assert memory.max_mb("cpu") == 200


def test_default_checkpoint_interval():
    assert parse_args([]).run.checkpoint_interval == 60.0
