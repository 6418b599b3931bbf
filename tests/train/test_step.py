"""Tests of gnnray.train.step: the epoch's metrics, labels of any packed dtype, and no host sync per step (CUDA)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gnnray.batch import Layer, MiniBatch
from gnnray.train.step import train_epoch

NUM_CLASSES, FEAT_DIM = 3, 4
NO_GPU = "needs a CUDA GPU; this machine has none (CPU only)"


class MeanConv(torch.nn.Module):
    """A one-layer model over :class:`Layer`: a linear map of each destination's mean in-neighbor, plus itself.

    Written without host syncs (the edge count is known from the shape), as a model must be to keep the step's.
    """

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2 * FEAT_DIM, NUM_CLASSES)
        self.logits: list[torch.Tensor] = []

    def forward(self, layers, x):
        (layer,) = layers
        deg = layer.indptr.diff()
        dst = torch.repeat_interleave(torch.arange(layer.num_dst, device=x.device), deg,
                                      output_size=layer.indices.shape[0])
        agg = torch.zeros(layer.num_dst, x.shape[1], device=x.device).index_add_(0, dst, x[layer.indices.long()])
        h = torch.cat([x[:layer.num_dst], agg / deg.clamp(min=1).unsqueeze(1)], dim=1)
        out = self.lin(h)
        self.logits.append(out.detach().clone())
        return out


def make_batch(rng: np.random.Generator, num_seeds: int, dtype=np.int64) -> MiniBatch:
    """A one-layer batch of ``num_seeds`` seeds, unpacked from ``dtype`` as a train worker gets it (labels in the
    packed dtype), with features."""
    num_src = num_seeds + 5
    indptr = np.zeros(num_seeds + 1, dtype=np.int64)
    np.cumsum(rng.integers(0, 4, num_seeds), out=indptr[1:])
    nodes = torch.from_numpy(rng.permutation(100)[:num_src])
    layer = Layer(torch.from_numpy(indptr), torch.from_numpy(rng.integers(0, num_src, int(indptr[-1]))), num_src)
    mb = MiniBatch(nodes[:num_seeds], torch.from_numpy(rng.integers(0, NUM_CLASSES, num_seeds)), nodes, [layer])
    out = MiniBatch.unpack(torch.from_numpy(mb.pack(dtype)))
    out.x = torch.from_numpy(rng.standard_normal((num_src, FEAT_DIM), dtype=np.float32))
    return out


def test_metrics_are_those_of_the_steps_taken():
    """Loss weighted by each step's seeds, accuracy over all seeds, as recomputed from the recorded logits; an
    empty batch steps and counts nothing."""
    rng = np.random.default_rng(0)
    batches = [make_batch(rng, n) for n in (7, 1, 0, 12, 5)]
    torch.manual_seed(0)
    model = MeanConv()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    seen = []
    stats = train_epoch(model, optimizer, iter(batches), len(batches), NUM_CLASSES, "cpu",
                        on_step=lambda step: seen.append(step))
    assert seen == [1, 2, 3, 4, 5]
    assert len(model.logits) == len(batches)
    labeled = [(l, b.labels.long()) for l, b in zip(model.logits, batches) if b.num_seeds]
    total = sum(len(y) for _, y in labeled)
    loss = sum(float(F.cross_entropy(l, y)) * len(y) for l, y in labeled) / total
    acc = sum(int((l.argmax(1) == y).sum()) for l, y in labeled) / total
    assert stats["loss"] == pytest.approx(loss, rel=1e-6)
    assert stats["train_acc"] == pytest.approx(acc, abs=1e-12)
    assert 0 < acc < 1  # the check above tells right from wrong predictions
    assert stats["seeds_per_s"] == pytest.approx(total / stats["epoch_time"], rel=1e-9)
    assert 0.0 <= stats["data_wait"] <= 1.0


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_labels_in_the_packed_dtype_train_as_int64(dtype):
    """Unpacked batches keep labels in the packed dtype (cast on the device): the step takes either, the same."""
    results = []
    for d in (dtype, np.int64):
        rng = np.random.default_rng(1)
        batches = [make_batch(rng, n, d) for n in (6, 9)]
        assert batches[0].labels.dtype == torch.from_numpy(np.empty(0, d)).dtype
        torch.manual_seed(0)
        model = MeanConv()
        results.append(train_epoch(model, torch.optim.SGD(model.parameters(), lr=0.1), iter(batches), 2,
                                   NUM_CLASSES, "cpu"))
    assert results[0]["loss"] == results[1]["loss"] and results[0]["train_acc"] == results[1]["train_acc"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_no_host_sync_per_step_on_cuda():
    """torch's sync debug mode counts the host syncs of an epoch: ``2k`` steps sync as often as ``k`` (the epoch's
    one read-back at its end), so a step syncs never."""
    rng = np.random.default_rng(2)
    batches = [make_batch(rng, 8).to("cuda") for _ in range(8)]
    for mb in batches:
        mb.x = mb.x.cuda()
    model = MeanConv().cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    def syncs(steps: int) -> int:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train_epoch(model, optimizer, iter(batches), steps, NUM_CLASSES, "cuda")
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in seen)

    syncs(2)  # warm-up: Adam's state, the allocator
    assert syncs(8) == syncs(4)


def _masks(seed: int, rank: int, epoch: int, step: int = 0) -> torch.Tensor:
    """The model's initial weights (from the run seed, as the loop builds them) and a dropout mask drawn after
    ``seed_dropout``."""
    from gnnray.models.dropout import Dropout
    from gnnray.train.step import seed_dropout

    torch.manual_seed(seed)
    weights = torch.nn.Linear(8, 8).weight.detach().clone()
    seed_dropout(seed, rank, epoch, step)
    return weights, Dropout(0.5).train()(torch.ones(4096)) > 0


def test_ranks_draw_their_own_dropout_masks_each_epoch():
    w0, rank0 = _masks(7, 0, 0)
    w1, rank1 = _masks(7, 1, 0)
    assert torch.equal(w0, w1)  # identical initial weights on every rank
    assert not torch.equal(rank0, rank1)
    assert not torch.equal(rank0, _masks(7, 0, 1)[1])  # folded with the epoch
    assert not torch.equal(rank0, _masks(7, 0, 0, step=5)[1])  # a restart mid-epoch does not replay the start
    assert not torch.equal(rank0, _masks(8, 0, 0)[1])
    assert torch.equal(rank0, _masks(7, 0, 0)[1])  # and reproducible
    from gnnray.models.dropout import Dropout

    torch.manual_seed(7)  # what every rank drew from before: the run seed's stream
    torch.nn.Linear(8, 8)
    assert not torch.equal(rank0, Dropout(0.5).train()(torch.ones(4096)) > 0)
