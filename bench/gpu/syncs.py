"""Host syncs of the step's collectives under a one-rank process group (the multi-rank path, moving nothing):
``syncs embedding`` (``--embedding-dim``: one read-back by design), ``syncs rgat`` (synchronised BatchNorms, and
one call of gnnray's against torch's ``nn.SyncBatchNorm``) and ``syncs placed`` (features on the device: none).
Counted with torch's sync debug mode on CUDA; on the CPU the rows check that the paths run.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from bench.gpu.batches import count_syncs, one_rank_group

EMBEDDING_DIM = 16
STEPS = 4  # syncs per step = (count over 2 x STEPS steps - count over STEPS) / STEPS: the epoch's end cancels out


def embedding_row(dev: torch.device, z: dict) -> dict:
    """Host syncs and time per ``train_epoch`` step with a learnable embedding, on the multi-rank path."""
    from bench.gpu import batches
    from gnnray.train.embedding import NodeEmbedding
    from gnnray.train.prefetch import Prefetcher

    # Batches drawn from the same ids: rows a step updates recur in the next batches (re-read when taken).
    rows, feat = batches.synthetic_rows(np.random.default_rng(3), 2 * STEPS, z["batch"], z["fanouts"], z["classes"],
                                        z["in_feats"])
    with one_rank_group(dev):
        torch.manual_seed(0)
        table = NodeEmbedding(feat.shape[0], EMBEDDING_DIM, 0.01)
        model = batches.build("sage", dict(z, in_feats=z["in_feats"] + EMBEDDING_DIM)).to(dev)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

        def epoch(steps: int) -> dict:
            with Prefetcher(rows[:steps], feat, dev, depth=2, embedding=table) as it:
                return batches.timed_epoch(model, optimizer, it, steps, z["classes"], dev, embedding=table)

        row = batches.per_step(epoch, STEPS)
    moved = int((table.store.step_count > 0).sum())
    return dict(row, rows_updated=moved, met=bool(np.isfinite(row["loss"]) and moved > 0 and (
        dev.type != "cuda" or row["host_syncs_per_step"] <= 1)))


def placed_row(dev: torch.device, z: dict) -> dict:
    """Host syncs and time per ``train_epoch`` step fed by the ``Prefetcher`` with features on the device
    (``--feature-placement device``, then ``uva`` with half the table cached): none may read back."""
    from bench.gpu import batches
    from gnnray.train.feature_reader import LocalRows
    from gnnray.train.placement import place
    from gnnray.train.prefetch import Prefetcher

    rows, feat = batches.synthetic_rows(np.random.default_rng(4), 2 * STEPS, z["batch"], z["fanouts"], z["classes"],
                                        z["in_feats"])
    indptr = np.arange(feat.shape[0] + 1)  # in-degree 1 everywhere: the cache takes the lowest ids
    out = {}
    for mode in ("device", "uva"):
        try:
            placed = place(mode, LocalRows(feat), dev, indptr, free_bytes=feat.nbytes)
        except RuntimeError as exc:  # uva without Triton
            out[mode] = dict(error=str(exc))
            continue
        torch.manual_seed(0)
        model = batches.build("sage", z).to(dev)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

        def epoch(steps: int) -> dict:
            with Prefetcher(rows[:steps], feat, dev, depth=2, placed=placed) as it:
                return batches.timed_epoch(model, optimizer, it, steps, z["classes"], dev)

        out[mode] = dict(batches.per_step(epoch, STEPS), rows_on_device=placed.resident_rows)
    ok = [r for r in out.values() if "error" not in r]
    return dict(out, met=bool(ok) and all(np.isfinite(r["loss"]) and (dev.type != "cuda" or r["host_syncs_per_step"]
                                                                      == 0) for r in ok))


def rgat_row(dev: torch.device, z: dict) -> dict:
    """rgat's steps with synchronised BatchNorms, and one BatchNorm call of gnnray's against torch's."""
    import torch.distributed as dist

    from bench.gpu import batches, models
    from gnnray.models.model import SyncBatchNorm

    rng = np.random.default_rng(4)
    mb = batches.synthetic_batch(rng, z["batch"], z["fanouts"], z["classes"], batches.RELATIONS)
    mb.x = torch.from_numpy(rng.standard_normal((mb.input_nodes.shape[0], z["in_feats"]), dtype=np.float32))
    mb = mb.to(dev)
    width = z["hidden"]
    x = (3 + 2 * torch.randn(z["batch"] * 4, width, device=dev)).requires_grad_()
    w = torch.randn(z["batch"] * 4, width, device=dev)  # the loss's weights: sum(y^2) would have no gradient
    with one_rank_group(dev):
        torch.manual_seed(0)
        model = batches.build("rgat", z).to(dev)
        with _synced_norms():
            step_syncs = models.syncs_per_step(model, mb, z) if dev.type == "cuda" else None
        ours, theirs = SyncBatchNorm(width).to(dev), torch.nn.BatchNorm1d(width).to(dev)

        def ours_call():
            x.grad = None
            (ours.synced(x) * w).sum().backward()

        def theirs_call():  # torch's nn.SyncBatchNorm's own function, as its forward calls it on 2+ ranks (CUDA
            from torch.nn.modules._functions import SyncBatchNorm as TorchSync  # only: plain BatchNorm on the CPU)

            x.grad = None
            y = TorchSync.apply(x, theirs.weight, theirs.bias, theirs.running_mean, theirs.running_var, theirs.eps,
                                theirs.momentum, dist.group.WORLD, 1) if dev.type == "cuda" else theirs(x)
            (y * w).sum().backward()

        ours_call()
        grad_ours = x.grad.clone()
        theirs_call()
        diff = float((grad_ours - x.grad).abs().max() / x.grad.abs().max())
        row = dict(step_host_syncs=step_syncs, bn_call_host_syncs=count_syncs(ours_call),
                   torch_bn_call_host_syncs=count_syncs(theirs_call), input_grad_rel_diff=diff,
                   bn_call_s=batches.median_s(ours_call, dev, z["reps"]),
                   torch_bn_call_s=batches.median_s(theirs_call, dev, z["reps"]))
    no_syncs = row["step_host_syncs"] == 0 and row["bn_call_host_syncs"] == 0
    row["met"] = diff <= 1e-4 and (dev.type != "cuda" or no_syncs)
    if dev.type != "cuda":
        row["bn_call_host_syncs"] = row["torch_bn_call_host_syncs"] = None
    return row


@contextlib.contextmanager
def _synced_norms():
    """gnnray's SyncBatchNorms take their synchronised path on one rank (as they would on two or more)."""
    from gnnray.models.model import SyncBatchNorm

    plain = SyncBatchNorm.forward
    SyncBatchNorm.forward = lambda self, x: SyncBatchNorm.synced(self, x) if self.training else plain(self, x)
    try:
        yield
    finally:
        SyncBatchNorm.forward = plain


def jobs(dev: torch.device, z: dict) -> list:
    """``bench.gpu``'s rows of this module: (name, function) pairs."""
    return [("syncs embedding", lambda: embedding_row(dev, z)), ("syncs rgat", lambda: rgat_row(dev, z)),
            ("syncs placed", lambda: placed_row(dev, z))]


def text(name: str, r: dict, device: str) -> str:
    """A row's figures in one line of ``bench.gpu``'s table."""
    def n(v) -> str:
        return "n/a (no CUDA)" if v is None else f"{v:g}"

    if name == "syncs placed":
        return "; ".join(f"features on the device ({mode}): " + (r["error"] if "error" in r else
                         f"{n(r['host_syncs_per_step'])} host syncs/step, {1000 * r['step_s']:.2f} ms/step")
                         for mode, r in r.items() if mode in ("device", "uva"))
    if name == "syncs embedding":
        return (f"--embedding-dim {EMBEDDING_DIM}: {n(r['host_syncs_per_step'])} host syncs/step (1 by design: the "
                f"reduced gradient to the host table), {1000 * r['step_s']:.2f} ms/step on {device}, "
                f"{r['rows_updated']:,} rows updated")
    return (f"synced BatchNorms: {n(r['step_host_syncs'])} host syncs/step; one BatchNorm call: gnnray "
            f"{n(r['bn_call_host_syncs'])} syncs {1000 * r['bn_call_s']:.2f} ms, torch "
            f"{'nn.SyncBatchNorm' if device.startswith('cuda') else 'BatchNorm1d (no CPU SyncBatchNorm)'} "
            f"{n(r['torch_bn_call_host_syncs'])} syncs {1000 * r['torch_bn_call_s']:.2f} ms; input grad rel diff "
            f"{r['input_grad_rel_diff']:.1e}")
