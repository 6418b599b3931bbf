"""RGAT's BatchNorm across DDP ranks: two gloo ranks (spawned CPU processes) normalise with the statistics of
their joint batch, exactly as one BatchNorm over the concatenated batch, gradients included."""

from __future__ import annotations

import torch

from conftest import run_gloo_ranks
from gnnray.models.model import RGAT, SyncBatchNorm

C = 6
ROWS = {0: slice(0, 5), 1: slice(5, 12)}  # uneven: the count is reduced too
STEPS = 2


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The joint batch of ``step`` and the weights of its loss; a mean far from 0 checks the variance's precision."""
    g = torch.Generator().manual_seed(step)
    return 3 + 2 * torch.randn(12, C, generator=g), torch.randn(12, C, generator=g)


def _norm(cls) -> torch.nn.Module:
    bn = cls(C)
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():  # affine parameters away from their (1, 0) initial values
        bn.weight.copy_(torch.rand(C, generator=g) + 0.5)
        bn.bias.copy_(torch.randn(C, generator=g))
    return bn


def _steps(bn: torch.nn.Module, rows: slice) -> dict:
    """Two training steps on ``rows`` of each step's batch; outputs, input and parameter gradients, statistics."""
    out = {"y": [], "x_grad": [], "w_grad": [], "b_grad": []}
    for step in range(STEPS):
        x, w = _data(step)
        x = x[rows].clone().requires_grad_()
        bn.zero_grad()
        y = bn(x)
        (y * w[rows]).sum().backward()
        for k, v in (("y", y), ("x_grad", x.grad), ("w_grad", bn.weight.grad), ("b_grad", bn.bias.grad)):
            out[k].append(v.detach().clone())
    out.update(running_mean=bn.running_mean.clone(), running_var=bn.running_var.clone(),
               tracked=int(bn.num_batches_tracked))
    bn.eval()
    out["eval"] = bn(_data(5)[0]).detach()
    return out


def _rank_main(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.save(_steps(_norm(SyncBatchNorm), ROWS[rank]), f"{out}/rank{rank}.pt")
    # DDP wraps a CPU RGAT (it refuses CPU modules that hold torch's nn.SyncBatchNorm).
    torch.nn.parallel.DistributedDataParallel(RGAT(5, 4, 3, 2, 0.0, 2, 3))
    dist.destroy_process_group()


def test_two_cpu_ranks_normalise_as_one_batchnorm_over_their_joint_batch(tmp_path):
    run_gloo_ranks(_rank_main, tmp_path, timeout=180)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    ref = _steps(_norm(torch.nn.BatchNorm1d), slice(None))
    for step in range(STEPS):
        for k in ("y", "x_grad"):  # row-wise: each rank holds its rows of the joint result
            torch.testing.assert_close(torch.cat([r[k][step] for r in ranks]), ref[k][step], rtol=1e-5, atol=1e-5)
        for k in ("w_grad", "b_grad"):  # local gradients; DDP's all-reduce adds them up
            torch.testing.assert_close(ranks[0][k][step] + ranks[1][k][step], ref[k][step], rtol=1e-5, atol=1e-5)
    for r in ranks:
        for k in ("running_mean", "running_var", "eval"):
            torch.testing.assert_close(r[k], ref[k], rtol=1e-5, atol=1e-5)
        assert r["tracked"] == STEPS
    # Without the sync a rank would normalise by its own rows' statistics: a different output.
    local = _steps(_norm(torch.nn.BatchNorm1d), ROWS[0])
    assert not torch.allclose(local["y"][0], ranks[0]["y"][0], atol=1e-3)


def _single_rank_main(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=1)
    torch.save(_steps(_norm(SyncBatchNorm), slice(None)), f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_one_cpu_rank_under_a_process_group_is_plain_batchnorm(tmp_path):
    """Ray Train forms a process group for a single worker too: torch's SyncBatchNorm would raise on CPU there."""
    run_gloo_ranks(_single_rank_main, tmp_path, world=1, timeout=180)
    ours, ref = torch.load(tmp_path / "rank0.pt"), _steps(_norm(torch.nn.BatchNorm1d), slice(None))
    for k in ("y", "x_grad", "w_grad", "running_var", "eval"):
        torch.testing.assert_close(ours[k], ref[k])


def test_without_a_process_group_it_is_plain_batchnorm_and_shares_its_state():
    ours, ref = _steps(_norm(SyncBatchNorm), slice(None)), _steps(_norm(torch.nn.BatchNorm1d), slice(None))
    for k in ("y", "x_grad", "w_grad"):
        torch.testing.assert_close(ours[k], ref[k])
    torch.testing.assert_close(ours["running_var"], ref["running_var"])
    # An RGAT checkpoint written with plain BatchNorm1d loads, and the other way round.
    torch.manual_seed(0)
    model = RGAT(5, 4, 3, 2, 0.0, 2, 3)
    assert sum(isinstance(m, SyncBatchNorm) for m in model.modules()) == 3  # two layers' norms and the MLP's
    plain = _norm(torch.nn.BatchNorm1d)
    _norm(SyncBatchNorm).load_state_dict(plain.state_dict())
    torch.nn.BatchNorm1d(8).load_state_dict(model.norms[0].state_dict())
