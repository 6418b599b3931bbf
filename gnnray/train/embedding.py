"""Learnable node embeddings (``--embedding-dim``), for graphs without (enough) features.

As DGL's ``DistEmbedding`` with a sparse optimizer: each node has a trainable
vector that is the model's input (appended to its features, if any). Only the
rows a mini-batch touched get a gradient and an update.

Consistency across DDP ranks: every rank holds the whole table (replicated,
``num_nodes x dim x 4`` bytes, plus SparseAdam's two moment tables of the same
size), initialised from the same seed. The table stays outside DDP: after each
backward pass its sparse gradient is summed over the ranks with one
``all_reduce`` over a gloo process group (gloo reduces sparse tensors; NCCL
cannot, so on GPUs a gloo group is created beside the default one) and divided
by the world size, as DDP averages dense gradients. Every rank then applies
the same SparseAdam step to the same rows, so the replicas stay identical.
The table lives in host memory on every device.
"""

from __future__ import annotations

from typing import Optional

import torch


class NodeEmbedding:
    """A replicated, sparsely updated embedding table and its SparseAdam optimizer.

    Args:
        num_nodes: Rows of the table.
        dim: Embedding size.
        lr: SparseAdam learning rate.
        seed: Initialisation seed; the same on every rank.
    """

    def __init__(self, num_nodes: int, dim: int, lr: float, seed: int = 0):
        self.table = torch.nn.Embedding(num_nodes, dim, sparse=True)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            # Uniform in [-1, 1], as DGL's examples initialise NodeEmbedding.
            self.table.weight.uniform_(-1.0, 1.0, generator=generator)
        self.optimizer = torch.optim.SparseAdam(self.table.parameters(), lr=lr)
        self._group = _gloo_group()

    @property
    def dim(self) -> int:
        return self.table.embedding_dim

    @property
    def nbytes(self) -> int:
        """Bytes of the table on this rank (the optimizer holds twice as much again)."""
        return self.table.weight.numel() * self.table.weight.element_size()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (global node ids, any device); the result is on the table's device (CPU)."""
        return self.table(ids.cpu().long())

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        """Average the sparse gradient over the ranks, then update the rows it touches (call on every rank)."""
        weight = self.table.weight
        if weight.grad is None:  # no rows looked up: still join the all-reduce
            weight.grad = torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.int64),
                                                  torch.empty(0, self.dim), weight.shape)
        allreduce_sparse_grad(weight, self._group)
        self.optimizer.step()

    def state_dict(self) -> dict:
        return {"weight": self.table.weight.detach().clone(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            self.table.weight.copy_(state["weight"])
        self.optimizer.load_state_dict(state["optimizer"])


def allreduce_sparse_grad(param: torch.Tensor, group=None) -> None:
    """Replace ``param.grad`` (sparse) by its mean over the ranks of ``group``; a no-op without a process group."""
    import torch.distributed as dist

    grad = param.grad.coalesce()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(grad, group=group)
        grad = grad.coalesce() / dist.get_world_size(group)
    param.grad = grad


def _gloo_group() -> Optional[object]:
    """A process group that can all-reduce sparse CPU tensors: the default one if it is gloo."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")
