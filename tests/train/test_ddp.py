"""DDP gradient sync through the real job: ranks see different data, yet end with the same, averaged weights.

The job runs with a linear model on the seed rows that records, on each rank,
every step's seed inputs and the LOCAL gradient of the loss w.r.t. its logits
(a tensor hook: the logits are not all-reduced, only parameter gradients are),
and its weights when evaluation runs after the last epoch. The test then
replays Adam from the same initial weights: on the average of the two ranks'
local gradients it must reproduce the ranks' final weights (what DDP's
all-reduce does), while rank 0's gradients alone must not (what training
without sync would give). Without ``ray.train.torch.prepare_model`` in
``gnnray/train/loop.py`` each rank steps on its own gradients and the ranks'
weights differ.
"""

from __future__ import annotations

import torch

from gnnray.config import parse_args
from gnnray.driver.fit import run


def _grads_of_linear(step: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``fc.weight`` and ``fc.bias`` of one step, from its inputs and logit gradients."""
    g, x = step["grad"], step["x"]
    return g.t().mm(x), g.sum(0)


def _replay_adam(initial: torch.nn.Module, grads: list[tuple[torch.Tensor, torch.Tensor]], lr: float,
                 weight_decay: float) -> dict:
    """Adam (as the loop builds it) over ``grads``, one (weight, bias) pair per step; the resulting state dict."""
    params = [initial.weight, initial.bias]
    opt = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    for gw, gb in grads:
        opt.zero_grad(set_to_none=True)
        params[0].grad, params[1].grad = gw.clone(), gb.clone()
        opt.step()
    return {k: v.detach().clone() for k, v in initial.state_dict().items()}


def test_ranks_step_on_averaged_gradients(ray_cluster, tmp_path):
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    record = str(record_dir)

    # Defined here so that cloudpickle ships it by value (tests/ is not on the workers' path).
    class RecordingLinear(torch.nn.Module):
        """A linear layer on the seed rows that records inputs, local logit gradients and final weights per rank."""

        def __init__(self, in_feats: int, num_classes: int):
            super().__init__()
            self.fc = torch.nn.Linear(in_feats, num_classes)  # the first draw after torch.manual_seed(seed)
            self.steps = 0

        def forward(self, blocks, x):
            import os

            import ray.train

            rank = ray.train.get_context().get_world_rank()
            seeds = x[: blocks[-1].num_dst]
            if not self.training:  # evaluation, after the epoch's last step
                torch.save({k: v.detach().cpu().clone() for k, v in self.state_dict().items()},
                           os.path.join(record, f"weights_rank{rank}.pt"))
                return self.fc(seeds)
            logits = self.fc(seeds)
            step, inputs = self.steps, seeds.detach().cpu().clone()  # x is a reused buffer: copy it
            self.steps += 1

            def save(grad):  # runs in backward, before DDP all-reduces the parameters' gradients
                torch.save({"x": inputs, "grad": grad.detach().cpu().clone()},
                           os.path.join(record, f"step_rank{rank}_{step:04d}.pt"))

            logits.register_hook(save)
            return logits

    cfg = parse_args(["--dataset", "synthetic", "--synthetic-nodes", "2000", "--synthetic-feat-dim", "8",
                      "--fanouts", "3", "--batch-size", "64", "--num-workers", "2", "--sampler-actors", "1",
                      "--epochs", "1", "--eval", "sampled", "--lr", "0.01", "--storage-path", str(tmp_path),
                      "--name", "ddp-sync"])
    run(cfg, model_factory=lambda in_feats, num_classes, _cfg: RecordingLinear(in_feats, num_classes))

    steps = {r: [torch.load(p) for p in sorted(record_dir.glob(f"step_rank{r}_*.pt"))] for r in (0, 1)}
    final = {r: torch.load(record_dir / f"weights_rank{r}.pt") for r in (0, 1)}
    assert len(steps[0]) == len(steps[1]) >= 5, {r: len(s) for r, s in steps.items()}
    # The ranks trained on different data.
    assert not torch.equal(torch.cat([s["x"] for s in steps[0]]), torch.cat([s["x"] for s in steps[1]]))

    # 1. DDP: both ranks end with the same weights.
    for k in final[0]:
        assert torch.equal(final[0][k], final[1][k]), f"ranks' {k} differ: gradients were not synchronised"

    # 2. Those weights are Adam's over the average of the ranks' local gradients, from the same initial weights.
    in_feats, num_classes = final[0]["fc.weight"].shape[1], final[0]["fc.weight"].shape[0]

    def initial() -> torch.nn.Linear:
        torch.manual_seed(cfg.run.seed)  # as train_loop does before it calls the factory
        return torch.nn.Linear(in_feats, num_classes)

    local = {r: [_grads_of_linear(s) for s in steps[r]] for r in (0, 1)}
    averaged = [((w0 + w1) / 2, (b0 + b1) / 2) for (w0, b0), (w1, b1) in zip(local[0], local[1])]
    synced = _replay_adam(initial(), averaged, cfg.train.lr, cfg.train.weight_decay)
    alone = _replay_adam(initial(), local[0], cfg.train.lr, cfg.train.weight_decay)
    got = {"weight": final[0]["fc.weight"], "bias": final[0]["fc.bias"]}

    for k in ("weight", "bias"):
        diff = (got[k] - synced[k]).abs().max().item()
        assert diff < 1e-5, f"{k}: {diff:.2e} from Adam over the averaged gradients"
    # 3. ...and not rank 0's weights without sync (the check above would not tell the two apart otherwise).
    apart = max((got[k] - alone[k]).abs().max().item() for k in ("weight", "bias"))
    assert apart > 1e-2, f"rank 0's gradients alone give nearly the same weights ({apart:.2e}): the test cannot tell"
