"""Cross-rank metrics: every rank reports the metric over all ranks' seeds, not its own.

Two gloo ranks (spawned processes, no Ray) train the built-in GraphSAGE under
DDP with the real ``train_epoch`` on different mini-batches of different sizes,
recording each step's logits and labels, then run the real ``Evaluator`` on the
validation split. The parent checks that both ranks report the same numbers and
that these are the metrics over the union of the ranks' predictions: accuracy
over all seeds, loss weighted by each step's seeds, validation accuracy over
every validation node (recomputed here in one batch with the final weights).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

from conftest import run_gloo_ranks
from gnnray.config import JobConfig, ModelConfig, SamplerConfig, TrainConfig
from gnnray.data.synthetic import make_synthetic
from gnnray.models.model import model_for
from gnnray.sampler.sampler import Sampler

# An odd number of validation nodes (int(0.2 * 615) = 123): the ranks evaluate 62 and 61 of them, so
# averaging the two ranks' accuracies would not give the accuracy over all of them.
GRAPH_ARGS = dict(num_nodes=615, num_classes=4, feat_dim=8, avg_degree=6, seed=3)
BATCH = {0: 24, 1: 15}  # seeds per training step on each rank: a plain mean of the ranks' losses would be off
STEPS = 4
TOL = 1e-5


def _cfg() -> JobConfig:
    # fanouts -1 (all neighbors): evaluation is deterministic, so the parent can recompute it exactly.
    return JobConfig(sampler=SamplerConfig(fanouts=(-1, -1)), model=ModelConfig(hidden=16, dropout=0.0),
                     train=TrainConfig(eval_batch_size=20, prefetch=2))


def _graph():
    return make_synthetic(**GRAPH_ARGS)


def _train_seeds(graph, rank: int) -> list[np.ndarray]:
    """Rank ``rank``'s seed batches: disjoint halves of the train split, ``BATCH[rank]`` seeds a step."""
    own = graph.train_idx[rank::2]
    return [own[i * BATCH[rank]:(i + 1) * BATCH[rank]] for i in range(STEPS)]


class _Recording(torch.nn.Module):
    """Wraps a model; in training mode records each step's logits."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.logits: list[torch.Tensor] = []

    def forward(self, blocks, x):
        out = self.inner(blocks, x)
        if self.training:
            self.logits.append(out.detach().clone())
        return out


def _rank_main(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from gnnray.train.evaluate import Evaluator
    from gnnray.train.loop import train_epoch
    from gnnray.train.prefetch import Prefetcher

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cfg, graph = _cfg(), _graph()
    torch.manual_seed(0)  # the same initial weights on both ranks, as train_loop does
    model = torch.nn.parallel.DistributedDataParallel(
        _Recording(model_for(graph.feat_dim, graph.num_classes, cfg)))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    sampler = Sampler(graph, cfg.sampler.fanouts)
    packed = (sampler.sample(seeds).pack(sampler.id_dtype) for seeds in _train_seeds(graph, rank))
    labels, seeds = [], []

    def recorded(batches):
        for mb in batches:
            labels.append(mb.labels.clone())
            seeds.append(mb.seeds.clone())
            yield mb

    with Prefetcher(packed, graph.feat, "cpu", depth=2) as batches:
        stats = train_epoch(model, optimizer, recorded(batches), STEPS, graph.num_classes, "cpu")
    val_acc = Evaluator(graph, cfg, rank, 2, "cpu").accuracy(model, "valid")
    torch.save(dict(stats=stats, val_acc=val_acc, logits=model.module.logits, labels=labels, seeds=seeds,
                    weights=model.module.inner.state_dict()), f"{out}/rank{rank}.pt")
    # Every collective is done and the result is on disk: leave without gloo's teardown, which once kept
    # rank 0 (the host of the rendezvous store) from exiting after rank 1 had gone.
    os._exit(0)


def _run_ranks(tmp_path) -> dict:
    run_gloo_ranks(_rank_main, tmp_path)
    return {r: torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)}


def test_train_and_eval_metrics_are_over_all_ranks(tmp_path):
    res = _run_ranks(tmp_path)
    graph, cfg = _graph(), _cfg()

    # The ranks trained on different seeds, in batches of different sizes.
    for r in (0, 1):
        assert len(res[r]["logits"]) == len(res[r]["labels"]) == STEPS
        assert [len(s) for s in res[r]["seeds"]] == [BATCH[r]] * STEPS
    assert not set(torch.cat(res[0]["seeds"]).tolist()) & set(torch.cat(res[1]["seeds"]).tolist())

    # Training: the same loss and accuracy on both ranks...
    m0, m1 = res[0]["stats"], res[1]["stats"]
    assert m0["loss"] == m1["loss"] and m0["train_acc"] == m1["train_acc"], (m0, m1)
    # ...which are those over both ranks' recorded predictions.
    logits = [l for r in (0, 1) for l in res[r]["logits"]]
    labels = [y for r in (0, 1) for y in res[r]["labels"]]
    correct = sum(int((l.argmax(1) == y).sum()) for l, y in zip(logits, labels))
    total = sum(len(y) for y in labels)
    assert abs(m0["train_acc"] - correct / total) < TOL, (m0["train_acc"], correct / total)
    weighted = sum(float(F.cross_entropy(l, y)) * len(y) for l, y in zip(logits, labels)) / total
    assert abs(m0["loss"] - weighted) < TOL, (m0["loss"], weighted)
    # Not what either rank saw alone (else the checks above could not tell a missing sync).
    local_acc = [sum(int((l.argmax(1) == y).sum()) for l, y in zip(res[r]["logits"], res[r]["labels"]))
                 / sum(len(y) for y in res[r]["labels"]) for r in (0, 1)]
    assert local_acc[0] != local_acc[1], local_acc

    # Evaluation: the same validation accuracy on both ranks, the one over every validation node.
    assert res[0]["val_acc"] == res[1]["val_acc"], (res[0]["val_acc"], res[1]["val_acc"])
    for k in res[0]["weights"]:
        assert torch.equal(res[0]["weights"][k], res[1]["weights"][k])  # DDP kept the ranks in step
    model = model_for(graph.feat_dim, graph.num_classes, cfg)
    model.load_state_dict(res[0]["weights"])
    model.eval()
    valid = graph.valid_idx
    mb = Sampler(graph, cfg.sampler.fanouts).sample(valid)  # all of them in one batch
    x = torch.from_numpy(graph.feat[mb.input_nodes.numpy()])
    with torch.no_grad():
        hit = (model(mb.layers, x).argmax(1) == mb.labels).numpy()
    assert torch.equal(mb.seeds, torch.from_numpy(valid))
    assert abs(res[0]["val_acc"] - hit.mean()) < TOL, (res[0]["val_acc"], hit.mean())
    # Each rank's own share (every other node) scores differently from the whole.
    assert hit[0::2].mean() != hit[1::2].mean(), (hit[0::2].mean(), hit[1::2].mean())
