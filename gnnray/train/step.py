"""Stage 7's step (train worker): one epoch of optimizer steps over prepared mini-batches.

Plain torch: no Ray and no DGL, so the step runs and is tested on any machine
with torch (``python -m bench.gpu`` runs it on a bare GPU machine).

Nothing in a step reads a value back to the host: the epoch's sums (loss
weighted by seeds, correct predictions, seeds) accumulate in one tensor on the
device, and are summed over the ranks and read once, at the epoch's end. A
read-back per step would make the CPU wait for the GPU every step, so the next
step could not be queued while this one computes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F

from gnnray.batch import MiniBatch

if TYPE_CHECKING:
    from gnnray.metrics import TrainMetrics
    from gnnray.train.captured import CapturedStep
    from gnnray.train.embedding import EmbeddingTable


def train_epoch(model, optimizer, batches: Iterator[MiniBatch], steps: int, num_classes: int, device,
                exported: Optional["TrainMetrics"] = None, embedding: Optional["EmbeddingTable"] = None,
                on_step: Optional[Callable[[int], None]] = None, captured: Optional["CapturedStep"] = None) -> dict:
    """Take ``steps`` optimizer steps over ``batches``; return the epoch's metrics, reduced over the ranks.

    A batch's ``x`` is the model's whole input: with ``embedding``, ``batches`` is a
    :class:`Prefetcher` given it, which appended the embedding's rows.
    ``num_classes`` is kept for the call sites (accuracy needs only the argmax).
    Returns ``loss`` (mean over all ranks' seeds), ``train_acc`` (over all ranks'
    seeds), ``seeds_per_s`` (all ranks' seeds over this rank's time), ``epoch_time``
    (this rank's) and ``data_wait`` (the ranks' mean share of time spent waiting for
    batches). With ``captured``, each batch it takes is replayed from its CUDA graph; the others step here.
    """
    device = torch.device(device)
    # loss x seeds, correct predictions, seeds: float64, exact for counts up to 2**53.
    sums = captured.sums.zero_() if captured else torch.zeros(3, dtype=torch.float64, device=device)
    model.train()
    start = time.perf_counter()
    wait, seeds = 0.0, 0
    for step in range(steps):
        t = time.perf_counter()
        mb = next(batches)
        waited = time.perf_counter() - t
        wait += waited
        if captured is None or not captured.step(mb):
            _eager_step(model, optimizer, mb, sums, embedding)
        seeds += mb.num_seeds
        if exported:
            exported.step(time.perf_counter() - t, waited, mb.num_seeds)
        if on_step:
            on_step(step + 1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the epoch's time includes its last kernels
    elapsed = time.perf_counter() - start
    totals = torch.cat([sums, torch.tensor([wait / max(elapsed, 1e-12), 1.0], dtype=torch.float64, device=device)])
    _all_reduce(totals)
    loss_sum, correct, all_seeds, wait_share, ranks = totals.tolist()  # the epoch's one read-back
    return dict(loss=loss_sum / all_seeds if all_seeds else 0.0, train_acc=correct / all_seeds if all_seeds else 0.0,
                epoch_time=elapsed, seeds_per_s=all_seeds / elapsed if elapsed else 0.0,
                data_wait=wait_share / ranks)


def _eager_step(model, optimizer, mb: MiniBatch, sums: torch.Tensor, embedding) -> None:
    logits = model(mb.layers, mb.x)
    labels = mb.labels.long()  # a no-op for batches from MiniBatch.to or the Prefetcher
    # An empty batch (a split smaller than the ranks) still steps, with a
    # zero loss, so every rank joins the same DDP all-reduces.
    loss = F.cross_entropy(logits, labels) if mb.num_seeds else logits.sum() * 0.0
    optimizer.zero_grad(set_to_none=True)
    if embedding:
        embedding.zero_grad()
    loss.backward()
    optimizer.step()
    if embedding:
        embedding.step()  # sparse all-reduce over the ranks, then DGL's SparseAdam on the rows' holders
    if mb.num_seeds:  # shapes are known on the host: no read-back
        sums[0] += loss.detach() * mb.num_seeds
        sums[1] += (logits.detach().argmax(1) == labels).sum()
        sums[2] += mb.num_seeds


def seed_dropout(seed: int, rank: int, epoch: int, step: int = 0) -> None:
    """Seed torch's generators (dropout's draws) for ``rank``'s ``epoch`` from ``step`` on: ranks draw different
    masks, each epoch its own, and a restart from a checkpoint draws afresh rather than replaying the first steps'
    masks. Called after the model is built, whose weights come from the run seed alone (the same on every rank)."""
    # Shifted as a Python int: numpy 1 (the dgl extra's) has no uint64 >> int.
    torch.manual_seed(int(np.random.SeedSequence([seed, rank, epoch, step]).generate_state(1, np.uint64)[0]) >> 1)


def _all_reduce(t: torch.Tensor) -> None:
    """Sum ``t`` over the ranks in place (nothing to do in one process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
