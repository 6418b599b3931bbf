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

from typing import Optional, Sequence

import numpy as np
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
        with torch.no_grad():  # the rows a sharded table starts from too (init_rows)
            self.table.weight.copy_(torch.from_numpy(init_rows(seed, 0, num_nodes, dim)))
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
    param.grad = mean_over_ranks(param.grad, group)


def mean_over_ranks(grad: torch.Tensor, group=None) -> torch.Tensor:
    """The mean of the sparse ``grad`` over the ranks of ``group`` (coalesced); itself without a process group."""
    import torch.distributed as dist

    grad = grad.coalesce()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(grad, group=group)
        grad = grad.coalesce() / dist.get_world_size(group)
    return grad


def _gloo_group() -> Optional[object]:
    """A process group that can all-reduce sparse CPU tensors: the default one if it is gloo."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


def init_rows(seed: int, lo: int, hi: int, dim: int) -> np.ndarray:
    """Initial rows ``[lo, hi)``: uniform in [-1, 1] (as DGL's examples), the same for any range (chunked seeds)."""
    from gnnray.data.features import chunked_random

    return chunked_random(seed, lo, hi, dim, uniform=True)


class EmbeddingOwner:
    """Rows ``[lo, hi)`` of a sharded embedding table and their SparseAdam state, on the shard's node.

    Ray actor (``--feature-shards K`` with ``--embedding-dim``): it applies the
    optimizer's update to its own rows, as the servers of DGL's ``DistEmbedding``
    do; train workers hold only the rows of their current mini-batch.
    """

    def __init__(self, lo: int, hi: int, dim: int, lr: float, seed: int):
        self._lo, self._hi, self._dim, self._lr, self._seed = lo, hi, dim, lr, seed
        self.reset()

    def reset(self) -> None:
        """Back to the initial rows and a fresh optimizer (a run that restarts without a checkpoint)."""
        import torch

        self._param = torch.nn.Parameter(torch.from_numpy(init_rows(self._seed, self._lo, self._hi, self._dim)))
        self._opt = torch.optim.SparseAdam([self._param], lr=self._lr)

    def gather(self, local_ids: np.ndarray) -> np.ndarray:
        return self._param.data.numpy()[local_ids]

    def ping(self) -> bool:
        return True

    def update(self, local_ids: np.ndarray, grad: np.ndarray) -> bool:
        """One SparseAdam step with the (averaged) gradient of rows ``local_ids``; called every step, even empty,
        so the optimizer's step count (its bias correction) is the replicated table's."""
        import torch

        self._param.grad = torch.sparse_coo_tensor(torch.from_numpy(local_ids).view(1, -1), torch.from_numpy(grad),
                                                   tuple(self._param.shape))
        self._opt.step()
        self._param.grad = None
        return True

    def state(self) -> dict:
        s = self._opt.state.get(self._param, {})
        return {"weight": self._param.data.numpy(), "step": float(s["step"]) if s else 0.0,
                "exp_avg": s["exp_avg"].numpy() if s else None, "exp_avg_sq": s["exp_avg_sq"].numpy() if s else None}

    def load(self, state: dict) -> bool:
        import torch

        self.reset()
        with torch.no_grad():
            self._param.copy_(torch.from_numpy(state["weight"]))
        if state["exp_avg"] is not None:
            self._opt.state[self._param] = {"step": torch.tensor(state["step"]),
                                            "exp_avg": torch.from_numpy(state["exp_avg"]).clone(),
                                            "exp_avg_sq": torch.from_numpy(state["exp_avg_sq"]).clone()}
        return True


def create_owners(bounds: Sequence[tuple[int, int, str, str]], dim: int, lr: float, seed: int) -> tuple:
    """One :class:`EmbeddingOwner` per ``(lo, hi, node_id, address)``, pinned to that node (call on the driver)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    owners = []
    for lo, hi, node_id, address in bounds:
        actor = ray.remote(EmbeddingOwner).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), num_cpus=0,
            max_restarts=0).remote(lo, hi, dim, lr, seed)
        owners.append((lo, hi, f"node {address} ({node_id[:8]})", actor))
    return tuple(owners)


class ShardedEmbedding:
    """A train worker's view of a sharded embedding table: :class:`NodeEmbedding`'s interface, rows on their owners.

    A lookup fetches the batch's rows (one call per owner); after backward,
    :meth:`step` averages the sparse gradient over the ranks (as
    :class:`NodeEmbedding`) and rank ``r`` sends each owner ``k`` with
    ``k % world == r`` its rows' part, so each owner applies it exactly once;
    a barrier then keeps any rank from reading rows before every update landed.

    Args:
        owners: ``(lo, hi, where, actor)`` per shard (:func:`create_owners`).
        num_nodes, dim: The table's shape.
        lr: SparseAdam's learning rate (for the checkpoint's optimizer state).
        timeout_s: Seconds an owner may take to answer.
    """

    def __init__(self, owners: tuple, num_nodes: int, dim: int, lr: float, timeout_s: float):
        self._owners, self._n, self.dim, self._lr, self._timeout = owners, num_nodes, dim, lr, timeout_s
        self._starts = np.array([o[0] for o in owners], dtype=np.int64)
        self._group = _gloo_group()
        self._ids: Optional[np.ndarray] = None
        self._rows = None

    @property
    def nbytes(self) -> int:
        """Bytes of the table on this rank: only the current batch's rows."""
        return 0 if self._rows is None else self._rows.numel() * 4

    def __call__(self, ids):
        import torch

        self._ids = ids.cpu().numpy().astype(np.int64)
        rows = np.empty((len(self._ids), self.dim), dtype=np.float32)
        owner = np.searchsorted(self._starts, self._ids, side="right") - 1
        calls = [(owner == k, o) for k, o in enumerate(self._owners) if (owner == k).any()]
        refs = [o[3].gather.remote(self._ids[m] - o[0]) for m, o in calls]
        for (m, o), ref in zip(calls, refs):
            rows[m] = self._get(ref, o)
        self._rows = torch.from_numpy(rows).requires_grad_(torch.is_grad_enabled())
        return self._rows

    def zero_grad(self) -> None:
        """Nothing to clear: each lookup makes fresh rows, whose gradient :meth:`step` reads."""

    def step(self) -> None:
        """Average the batch rows' gradient over the ranks; owners apply it (call on every rank, every step)."""
        import torch
        import torch.distributed as dist

        if self._rows is not None and self._rows.grad is not None and self._ids.size:
            grad = torch.sparse_coo_tensor(torch.from_numpy(self._ids).view(1, -1), self._rows.grad,
                                           (self._n, self.dim))
        else:  # no rows looked up: still join the all-reduce
            grad = torch.sparse_coo_tensor(torch.empty(1, 0, dtype=torch.int64), torch.empty(0, self.dim),
                                           (self._n, self.dim))
        grad = mean_over_ranks(grad, self._group)
        ids, values = grad.indices()[0].numpy(), grad.values().numpy()
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        owner = np.searchsorted(self._starts, ids, side="right") - 1
        pushes = [(o, o[3].update.remote(ids[owner == k] - o[0], np.ascontiguousarray(values[owner == k])))
                  for k, o in enumerate(self._owners) if k % world == rank]
        for o, ref in pushes:
            self._get(ref, o)
        if world > 1:
            dist.barrier(group=self._group)
        self._rows = None

    def state_dict(self) -> dict:
        """The whole table and optimizer state, :class:`NodeEmbedding`'s format (rank 0 writes checkpoints)."""
        import torch

        states = [self._get(o[3].state.remote(), o) for o in self._owners]
        weight = torch.from_numpy(np.concatenate([s["weight"] for s in states]))
        param = torch.nn.Parameter(weight)
        opt = torch.optim.SparseAdam([param], lr=self._lr)
        if states[0]["exp_avg"] is not None:
            opt.state[param] = {"step": torch.tensor(states[0]["step"]),
                                "exp_avg": torch.from_numpy(np.concatenate([s["exp_avg"] for s in states])),
                                "exp_avg_sq": torch.from_numpy(np.concatenate([s["exp_avg_sq"] for s in states]))}
        return {"weight": weight, "optimizer": opt.state_dict()}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Put a checkpoint's table (``None``: the initial one) back on the owners; call on every rank."""
        import torch.distributed as dist

        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        opt = (state or {}).get("optimizer", {}).get("state", {}).get(0)
        calls = []
        for k, o in enumerate(self._owners):
            if k % world != rank:
                continue
            lo, hi = o[0], o[1]
            if state is None:
                calls.append((o, o[3].reset.remote()))
                continue
            part = {"weight": state["weight"][lo:hi].numpy(), "step": float(opt["step"]) if opt else 0.0,
                    "exp_avg": opt["exp_avg"][lo:hi].numpy() if opt else None,
                    "exp_avg_sq": opt["exp_avg_sq"][lo:hi].numpy() if opt else None}
            calls.append((o, o[3].load.remote(part)))
        for o, ref in calls:
            self._get(ref, o)
        if world > 1:
            dist.barrier(group=self._group)

    def _get(self, ref, owner):
        import ray
        import ray.exceptions

        from gnnray.errors import FeatureShardError

        try:
            return ray.get(ref, timeout=self._timeout)
        except ray.exceptions.GetTimeoutError:
            raise FeatureShardError(f"embedding shard {owner[0]}:{owner[1]} on {owner[2]} did not answer within "
                                    f"{self._timeout:g}s (--feature-timeout)") from None
        except ray.exceptions.RayActorError:
            raise FeatureShardError(f"embedding shard {owner[0]}:{owner[1]} on {owner[2]} was lost (node lost?)") \
                from None
