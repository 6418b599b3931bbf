"""Sampled evaluation per seed against a training step's forward half plus its sampling, side by side.

    python -m bench.evaluation [--dataset DIR] [--fanouts 10,10,10] [--batch-size 1024] [--eval-batch-size 4096]

On a local Ray cluster, in this process as one train worker would: the
:class:`~gnnray.train.evaluate.Evaluator` over the validation split (its
sampler actor samples, the worker gathers and computes), and, for the same
model, training batches of ``--batch-size`` seeds: GraphBolt sampling
(:class:`~gnnray.sampler.sampler.Sampler`), the feature gather and the
training-mode forward. Prints one JSON line: seconds per 1,000 seeds of each,
medians of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import statistics
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
    row = dict(eval_s_per_1k_seeds=statistics.median(evals), train_sample_s_per_1k=statistics.median(samples),
               train_forward_s_per_1k=statistics.median(forwards),
               ratio=statistics.median(evals) / (statistics.median(samples) + statistics.median(forwards)),
               peak_in_flight=evaluator.peak_in_flight, max_in_flight=evaluator.max_in_flight,
               fanouts=fanouts, batch_size=a.batch_size, eval_batch_size=a.eval_batch_size, valid_seeds=seeds,
               torch_threads=torch.get_num_threads())
    print(json.dumps(row), flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
