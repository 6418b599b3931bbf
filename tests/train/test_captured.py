"""Tests of gnnray.train.captured: padding that changes nothing real (any machine), and on a GPU a captured step
that trains as the eager one does."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from conftest import tiny_graph
from gnnray.models.model import build_model
from gnnray.sampler.sampler import Sampler
from gnnray.train.captured import MEASURED, CapturedStep, Padded, Shape, padded, padded_loss, refusal
from gnnray.train.step import train_epoch

FANOUTS = (4, 3)
NO_GPU = "a CUDA graph needs a CUDA GPU; this machine has none (CPU only)"


def _batches(n: int, seed: int = 0, sizes=(5, 9, 13)):
    graph = tiny_graph(num_nodes=120, num_edges=700, feat_dim=6, num_classes=4)
    rng = np.random.default_rng(seed)
    sampler = Sampler(graph, FANOUTS)
    out = []
    for i in range(n):
        mb = sampler.sample(rng.choice(graph.train_idx, sizes[i % len(sizes)], replace=False)).tensors()
        mb.x = torch.from_numpy(graph.feat[mb.input_nodes.numpy()]).float()
        mb.labels = mb.labels.long()
        out.append(mb)
    return graph, out


def test_padding_holds_every_measured_batch_with_room_for_padding():
    _, batches = _batches(30)
    shapes = [Shape.of(mb) for mb in batches]
    shape = padded(shapes, quantum=8)
    assert all(shape.holds(s) for s in shapes)
    assert all(shape.srcs[l] >= shape.dst(l) for l in range(len(FANOUTS)))  # destinations are sources' prefix
    assert not shape.holds(Shape(shape.seeds, shape.srcs, shape.edges))  # a padded row must remain


@pytest.mark.parametrize("name", ["sage", "gcn", "gat"])
def test_a_padded_batch_gives_the_loss_gradients_and_metrics_of_the_batch(name):
    """Padded destinations, edges, input rows and seeds change nothing real: loss, every gradient and the epoch's
    sums equal the unpadded batch's (dropout off: the padded rows would draw masks too)."""
    graph, batches = _batches(6)
    shape = padded([Shape.of(mb) for mb in batches], quantum=16)
    torch.manual_seed(0)
    model = build_model(graph.feat_dim, graph.num_classes, len(FANOUTS), 16, 0.0, name=name, heads=2)
    buffers = Padded(shape, batches[0])
    for mb in batches:
        model.zero_grad(set_to_none=True)
        logits = model(mb.layers, mb.x)
        loss = torch.nn.functional.cross_entropy(logits, mb.labels)
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        buffers.load(mb)
        assert buffers.x.shape[0] > mb.x.shape[0] and buffers.layers[-1].num_dst > mb.num_seeds
        sums = torch.zeros(3, dtype=torch.float64)
        padded_loss(model, buffers, sums).backward()
        assert float(sums[0] / sums[2]) == pytest.approx(float(loss.detach()), rel=1e-5)
        assert int(sums[1]) == int((logits.argmax(1) == mb.labels).sum()) and int(sums[2]) == mb.num_seeds
        for k, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[k], rtol=1e-4, atol=1e-6, msg=k)


def test_capture_is_refused_where_it_would_change_the_step():
    model = build_model(6, 4, 2, 8, 0.0, name="sage")
    assert refusal("cpu", 1, model, None) == "not on a GPU"
    assert "DDP" in refusal("cuda", 2, model, None)
    assert "--embedding-dim" in refusal("cuda", 1, model, object())
    rgat = build_model(6, 4, 2, 8, 0.0, name="rgat", heads=2, num_relations=2)
    assert "batch norm" in refusal("cuda", 1, rgat, None)
    assert refusal("cuda", 1, model, None) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
@pytest.mark.parametrize("name", ["sage", "gat"])
def test_a_captured_epoch_trains_as_the_eager_one(name):
    """Two epochs: the first MEASURED batches eager, the rest replayed (one larger than the padding eager again);
    loss, accuracy and every weight after them equal the eager run's within float tolerance."""
    graph, batches = _batches(MEASURED + 12, sizes=(5, 9, 13))
    big = _batches(1, seed=1, sizes=(60,))[1][0]  # past the padding: steps eagerly between replays
    batches.insert(MEASURED + 6, big)
    batches = [mb.to("cuda") for mb in batches]
    torch.manual_seed(0)
    base = build_model(graph.feat_dim, graph.num_classes, len(FANOUTS), 32, 0.0, name=name, heads=2).cuda()
    runs = {}
    for mode in ("eager", "captured"):
        model = copy.deepcopy(base)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01, capturable=True)
        step = CapturedStep(model, optimizer, "cuda") if mode == "captured" else None
        stats = [train_epoch(model, optimizer, iter(batches), len(batches), graph.num_classes, "cuda", captured=step)
                 for _ in range(2)]
        runs[mode] = stats, model.state_dict(), step
    (eager, w_eager, _), (capt, w_capt, step) = runs["eager"], runs["captured"]
    assert not step.failed and step.graph is not None and step.replays >= len(batches) - MEASURED
    assert step.eager == MEASURED - 1 + 2  # the measured batches before the one that sets the padding; the large one, twice
    for a, b in zip(eager, capt):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["train_acc"] == pytest.approx(a["train_acc"], abs=1e-9)
    for k in w_eager:
        torch.testing.assert_close(w_capt[k], w_eager[k], rtol=1e-4, atol=1e-5, msg=k)


def test_a_captured_runs_checkpoint_resumes_on_a_cpu():
    """A checkpoint's Adam groups say capturable when a captured GPU run wrote it; a CPU run must step anyway."""
    from gnnray.train.loop import capture_where

    graph, (mb, *_) = _batches(1)
    model = build_model(graph.feat_dim, graph.num_classes, len(FANOUTS), 8, 0.0, name="sage")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.nn.functional.cross_entropy(model(mb.layers, mb.x), mb.labels).backward()
    optimizer.step()
    saved = optimizer.state_dict()
    for group in saved["param_groups"]:
        group["capturable"] = True  # as a captured run's optimizer saves it
    resumed = torch.optim.Adam(model.parameters(), lr=0.01)
    resumed.load_state_dict(saved)
    assert all(g["capturable"] for g in resumed.param_groups)
    capture_where(resumed, False)
    resumed.step()  # with capturable groups on CPU parameters torch refuses to step
    assert not any(g["capturable"] for g in resumed.param_groups)
    assert all(float(s["step"]) == 2.0 for s in resumed.state.values())
