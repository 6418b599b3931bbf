"""Sampled evaluation per 1k seeds against a training step's sampling plus forward half, side by side.

``python -m bench.evaluation [--dataset DIR] [--fanouts 10,10,10]``: on a local Ray cluster, in this process as
one train worker: the ``Evaluator`` over the validation split (its sampler actor samples, the worker gathers and
computes), against training batches of ``--batch-size`` sampled, gathered and run forward; medians of
``--repeats``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def main(argv=None) -> int:
    import ray

    from gnnray.config import DataConfig, JobConfig, ModelConfig, SamplerConfig, TrainConfig
    from gnnray.data.load import load_graph
    from gnnray.models.model import model_for
    from gnnray.sampler.sampler import Sampler
    from gnnray.store.handle import publish
    from gnnray.train.evaluate import Evaluator
    from gnnray.train.prefetch import HostSlot

    p = argparse.ArgumentParser(prog="python -m bench.evaluation", description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="../shared/datasets/arxiv-structure")
    p.add_argument("--fanouts", default="10,10,10")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--eval-batch-size", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="", help="also write the figures here")
    a = p.parse_args(argv)
    fanouts = [int(f) for f in a.fanouts.split(",")]
    graph = load_graph(DataConfig(dataset=a.dataset, reverse_edges=True, random_features=128))
    cfg = JobConfig(sampler=SamplerConfig(fanouts=fanouts), model=ModelConfig(hidden=a.hidden),
                    train=TrainConfig(eval_batch_size=a.eval_batch_size))
    torch.manual_seed(0)
    model = model_for(graph.feat_dim, graph.num_classes, cfg)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    handle = publish(graph)
    evaluator = Evaluator(handle.get(), cfg, 0, 1, "cpu", handle=handle)
    evaluator.accuracy(model, "valid")  # the actor's start and imports are not the figure
    seeds = len(graph.split("valid"))
    sampler, slot = Sampler(graph, fanouts), HostSlot(pin=False)
    rng = np.random.default_rng(0)
    evals, samples, forwards = [], [], []
    for _ in range(a.repeats):
        start = time.perf_counter()
        evaluator.accuracy(model, "valid")
        evals.append((time.perf_counter() - start) / seeds * 1000)
        s = f = 0.0
        steps = max(1, seeds // a.batch_size)
        for _ in range(steps):
            ids = rng.choice(graph.train_idx, a.batch_size, replace=False)
            t = time.perf_counter()
            mb = sampler.sample(ids)
            s += time.perf_counter() - t
            t = time.perf_counter()
            model.train()
            model(mb.layers, slot.gather(graph.feat, mb.input_nodes.numpy()))
            f += time.perf_counter() - t
        samples.append(s / (steps * a.batch_size) * 1000)
        forwards.append(f / (steps * a.batch_size) * 1000)
    from bench.harness import report, side_by_side

    train = [a_ + b_ for a_, b_ in zip(samples, forwards)]
    row = side_by_side("seconds per 1k seeds: evaluation vs training's sampling + forward", evals, train, "{:.3f}",
                       sample=samples, forward=forwards, peak_in_flight=evaluator.peak_in_flight)
    report([row], a.json, f"fanouts {fanouts}, batch {a.batch_size}, eval batch {a.eval_batch_size}, {seeds} "
           f"validation seeds, {torch.get_num_threads()} threads; medians of {a.repeats}",
           max_in_flight=evaluator.max_in_flight)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
