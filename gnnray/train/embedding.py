"""Learnable node embeddings (``--embedding-dim``), for graphs without (enough) features.

As DGL's ``NodeEmbedding`` / ``DistEmbedding`` with its ``SparseAdam``: each node
has a trainable vector that is the model's input (appended to its features, if
any). Only the rows a mini-batch touched get a gradient and an update.

The update is DGL's (``dgl.optim.SparseAdam``, ``dgl.distributed.optim.SparseAdam``;
:class:`RowStore`): each row keeps its own step count for Adam's bias
correction (a row first touched late moves by about ``lr``, as its first step
would), and a row's gradient is the *mean over the contributions it got* in the
step (one per rank that looked it up), not a sum divided by the world size.
Each step the ranks exchange the ids they looked up (on the host, where the
lookups read them, over a gloo group: the default one, or one made beside
NCCL's), scatter their gradient with a count column into the rows of the ids'
union, and one dense ``all_reduce`` sums those rows where the gradient is: on
GPUs over the default (NCCL) group, so the gradient does not cross to the host
before it is reduced.

Where the rows live:

- one shard (:class:`NodeEmbedding`): every rank holds a :class:`RowStore` of
  the whole table (``num_nodes x dim x 4`` bytes, twice that for the moments, 4
  bytes per row of step counts), initialised from the same seed; every rank
  applies the same update, so the replicas stay identical;
- ``--feature-shards K`` (:class:`ShardedEmbedding`): an :class:`EmbeddingOwner`
  actor on each shard node holds its rows and applies their update, as DGL's
  servers do; a rank holds only its batches' rows.

Lookups run ahead, on the prefetch thread (:meth:`EmbeddingTable.prefetch`),
and wait there; on a GPU that thread also copies the rows to the device, on its
side stream from pinned memory (``Lookup.device_rows``). Rows that a step
updated after they were read are read again when the batch is taken
(:meth:`EmbeddingTable.complete`, counted in ``data_wait``), and only those are
copied again: every rank knows which rows each step touched (the all-reduced
gradient's ids), so a batch gets exactly the rows a lookup at its step would.
The table and its update stay on the host: a node table is far larger than a
GPU. So on a GPU the reduced gradient comes back to the host once per step
(``step``), the step's one read-back (docs/models.md#learnable-embeddings).

Checkpoints by shard: whoever holds rows writes them and their optimizer state
into the checkpoint directory (``train.checkpoint.write_rows``: an owner on its
node) and reads back the rows it owns from whichever saved shards overlap them
(``train.checkpoint.read_rows``), so K=1 and K=3 checkpoints interchange and no
process holds the whole table for it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from gnnray.data.feature_source import chunked_random
from gnnray.errors import FeatureShardError
from gnnray.stack import check_node
from gnnray.store.shards import route
from gnnray.train import checkpoint


class RowStore:
    """Rows ``[lo, hi)`` of an embedding table and their sparse Adam state, updated as DGL's ``SparseAdam``.

    Args:
        lo, hi: The rows held.
        dim: Embedding size.
        lr: Learning rate.
        seed: Initialisation seed (:func:`init_rows`: the same rows whatever the range).
        betas, eps: Adam's, DGL's defaults.
    """

    def __init__(self, lo: int, hi: int, dim: int, lr: float, seed: int, betas=(0.9, 0.999), eps: float = 1e-8):
        self._lo, self._hi, self._dim, self._lr, self._seed = lo, hi, dim, lr, seed
        self._betas, self._eps = betas, eps
        self.reset()

    def reset(self) -> None:
        """Back to the initial rows and a fresh optimizer (a run that restarts without a checkpoint)."""
        n = self._hi - self._lo
        self.weight = torch.from_numpy(init_rows(self._seed, self._lo, self._hi, self._dim))
        self.exp_avg, self.exp_avg_sq = torch.zeros(n, self._dim), torch.zeros(n, self._dim)
        self.step_count = torch.zeros(n, dtype=torch.int32)  # DGL's per-row ``state_step``

    @property
    def nbytes(self) -> int:
        """Bytes of the rows (the optimizer holds twice as much again, and 4 bytes per row)."""
        return self.weight.numel() * 4

    def gather(self, local_ids: np.ndarray) -> np.ndarray:
        return self.weight.numpy()[local_ids]

    def update(self, local_ids: np.ndarray, grad_sum: np.ndarray, count: np.ndarray) -> bool:
        """One step of rows ``local_ids`` (unique): their gradient summed over ``count`` contributions each.

        DGL's ``SparseAdam.update``: the mean gradient, per-row step counts.
        """
        if not len(local_ids):
            return True
        b1, b2 = self._betas
        # Copies: arrays that came through Ray are read-only.
        idx = torch.tensor(local_ids, dtype=torch.int64)
        g = torch.tensor(grad_sum, dtype=torch.float32) / torch.tensor(count, dtype=torch.float32).unsqueeze(1)
        self.step_count[idx] += 1
        step = self.step_count[idx].to(torch.float32)
        m = b1 * self.exp_avg[idx] + (1.0 - b1) * g
        v = b2 * self.exp_avg_sq[idx] + (1.0 - b2) * (g * g)
        self.exp_avg[idx], self.exp_avg_sq[idx] = m, v
        m_hat = m / (1.0 - torch.pow(torch.tensor(b1), step)).unsqueeze(1)
        v_hat = v / (1.0 - torch.pow(torch.tensor(b2), step)).unsqueeze(1)
        self.weight[idx] -= self._lr * m_hat / (torch.sqrt(v_hat) + self._eps)
        return True

    def save(self, directory: str) -> dict:
        """Write these rows and their state into checkpoint ``directory``; return their ``meta.json`` entry."""
        return checkpoint.write_rows(directory, self._lo, self._hi, self._arrays())

    def load(self, directory: Optional[str]) -> bool:
        """Take these rows and their state from checkpoint ``directory`` (any shards), or reset (``None``)."""
        if directory is None:
            self.reset()
            return True
        self.weight = self.exp_avg = self.exp_avg_sq = self.step_count = None  # the old state goes first
        rows = checkpoint.read_rows(directory, self._lo, self._hi)
        self.weight, self.exp_avg, self.exp_avg_sq = (torch.from_numpy(np.require(rows[k], np.float32, "CW"))
                                                      for k in ("weight", "exp_avg", "exp_avg_sq"))
        self.step_count = torch.from_numpy(np.require(rows["step"], np.int32, "CW"))
        return True

    def _arrays(self) -> dict[str, np.ndarray]:
        return {"weight": self.weight.numpy(), "exp_avg": self.exp_avg.numpy(),
                "exp_avg_sq": self.exp_avg_sq.numpy(), "step": self.step_count.numpy()}


class EmbeddingOwner(RowStore):
    """A :class:`RowStore` as a Ray actor on a shard's node (``--feature-shards K`` with ``--embedding-dim``)."""

    def __init__(self, *args, **kwargs):
        check_node("an embedding owner")
        super().__init__(*args, **kwargs)

    def ping(self) -> bool:
        return True


def init_rows(seed: int, lo: int, hi: int, dim: int) -> np.ndarray:
    """Initial rows ``[lo, hi)``: uniform in [-1, 1] (as DGL's examples), the same for any range (chunked seeds)."""
    return chunked_random(seed, lo, hi, dim, uniform=True)


class Lookup:
    """Rows read ahead of their step (:meth:`EmbeddingTable.prefetch`): ``ids``, ``rows``, and ``version``, the
    steps whose updates had all landed before they were read; ``device_rows``: their copy on the GPU, if the
    prefetcher made one."""

    def __init__(self, ids: np.ndarray, rows: np.ndarray, version: int):
        self.ids, self.rows, self.version = ids, rows, version
        self.device_rows: Optional[torch.Tensor] = None


class EmbeddingTable:
    """A train worker's view of the embedding table: lookups (ahead of time or not) and the step after backward.

    Subclasses say where rows are read (:meth:`_read`), where updates go
    (:meth:`_apply`) and who writes and reads checkpoints.
    """

    def __init__(self, num_nodes: int, dim: int):
        import collections
        import threading

        self._n, self.dim = num_nodes, dim
        self._group = _gloo_group()
        # The prefetch thread reads these while the training thread steps: one lock for the three.
        self._lock = threading.Lock()
        self._version = 0  # steps whose updates have all landed
        self._pending: collections.deque = collections.deque()  # versions of prefetched lookups not completed
        self._touched: list[tuple[int, np.ndarray]] = []  # (step, the rows it updated), while a lookup may need it
        self._ids: Optional[np.ndarray] = None
        self._rows: Optional[torch.Tensor] = None

    def prefetch(self, ids: np.ndarray, pending: bool = True) -> Lookup:
        """Read rows ``ids`` now (the prefetch thread calls it); :meth:`complete` makes them current, in order."""
        with self._lock:  # the version before the rows are read: a step landing meanwhile is re-read by complete
            version = self._version
            if pending:
                self._pending.append(version)
        ids = np.array(ids, dtype=np.int64)  # a copy: the caller's buffer is reused
        return Lookup(ids, self._read(ids), version)

    def complete(self, lookup: Lookup, pending: bool = True) -> torch.Tensor:
        """The lookup's rows as of now (a leaf tensor, on the device of ``device_rows`` if set, else the CPU; its
        gradient is :meth:`step`'s): rows updated since they were read are read again. Call on the training
        thread, in the order of :meth:`prefetch`."""
        with self._lock:
            if pending:
                self._pending.popleft()
            oldest = min([lookup.version, self._version] + ([self._pending[0]] if self._pending else []))
            self._touched = [(v, t) for v, t in self._touched if v >= oldest]
            since = [t for v, t in self._touched if v >= lookup.version]
        rows, on_device = lookup.rows, lookup.device_rows
        if since and len(lookup.ids):
            stale = np.flatnonzero(np.isin(lookup.ids, np.concatenate(since)))
            if len(stale) and on_device is not None:  # only the stale rows cross again, queued (no host wait)
                fresh = torch.from_numpy(self._read(lookup.ids[stale])).pin_memory()
                at = torch.from_numpy(stale).pin_memory().to(on_device.device, non_blocking=True)
                on_device.index_copy_(0, at, fresh.to(on_device.device, non_blocking=True))
            elif len(stale):
                rows[stale] = self._read(lookup.ids[stale])
        self._ids = lookup.ids
        self._rows = (torch.from_numpy(rows) if on_device is None else on_device).requires_grad_(
            torch.is_grad_enabled())
        return self._rows

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (global node ids, any device), read now; the result is on the CPU."""
        return self.complete(self.prefetch(ids.cpu().numpy(), pending=False), pending=False)

    def zero_grad(self) -> None:
        """Nothing to clear: each lookup makes fresh rows, whose gradient :meth:`step` reads."""

    def step(self) -> None:
        """Sum the batch rows' gradient and counts over the ranks, apply the mean (call on every rank, every step)."""
        import torch.distributed as dist

        grad = self._rows.grad if self._rows is not None and self._ids is not None and len(self._ids) else None
        ids = self._ids if grad is not None else np.empty(0, dtype=np.int64)
        # One rank (a single worker's group) has nothing to exchange or reduce: no collective on its hot path.
        group = dist.is_available() and dist.is_initialized() and dist.get_world_size(self._group) > 1
        nccl = group and dist.get_backend() == "nccl"
        if group:  # every rank's ids (host arrays), over gloo: the union's rows are then reduced in one piece
            every = [None] * dist.get_world_size(self._group)
            dist.all_gather_object(every, ids, group=self._group)
            ids = np.concatenate([ids, *every])  # this rank's first: their positions are found below
        union, where = np.unique(ids, return_inverse=True)
        # Reduced where the gradient is: on a GPU (NCCL) without a copy to the host first.
        device = grad.device if grad is not None else torch.device("cuda", torch.cuda.current_device()) if nccl \
            else torch.device("cpu")
        total = torch.zeros(len(union), self.dim + 1, device=device)
        if grad is not None:
            n = len(self._ids)
            at = torch.from_numpy(where[:n])
            at = at.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else at
            total.index_add_(0, at, torch.cat([grad, grad.new_ones(n, 1)], dim=1))
        if group:
            dist.all_reduce(total, group=None if nccl else self._group)
        values = total.cpu().numpy()  # on a GPU the step's one read-back: the table and its update are here
        self._apply(union, np.ascontiguousarray(values[:, :-1]), np.ascontiguousarray(values[:, -1]))
        self._rows = None
        with self._lock:
            self._touched.append((self._version, union))
            self._version += 1

    def _ranks(self) -> tuple[int, int]:
        import torch.distributed as dist

        return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)

    def _barrier(self) -> None:
        import torch.distributed as dist

        if self._ranks()[1] > 1:
            dist.barrier(group=self._group)

    def _read(self, ids: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _apply(self, ids: np.ndarray, grad_sum: np.ndarray, count: np.ndarray) -> None:
        raise NotImplementedError

    def save(self, directory: str) -> dict:
        """Have the rows written into checkpoint ``directory`` (rank 0 calls it); return ``meta.json``'s entry."""
        raise NotImplementedError

    def load(self, directory: Optional[str]) -> None:
        """Take the rows from checkpoint ``directory`` (``None``: the initial ones); call on every rank."""
        raise NotImplementedError

    def _entry(self, shards: list) -> dict:
        return {"num_nodes": self._n, "dim": self.dim, "shards": shards}


class NodeEmbedding(EmbeddingTable):
    """A replicated table: every rank holds all rows and applies every update (K=1).

    Args:
        num_nodes: Rows of the table.
        dim: Embedding size.
        lr: SparseAdam learning rate.
        seed: Initialisation seed; the same on every rank.
    """

    def __init__(self, num_nodes: int, dim: int, lr: float, seed: int = 0):
        super().__init__(num_nodes, dim)
        self.store = RowStore(0, num_nodes, dim, lr, seed)

    @property
    def nbytes(self) -> int:
        """Bytes of the table on this rank (the optimizer holds twice as much again)."""
        return self.store.nbytes

    def _read(self, ids):
        return self.store.gather(ids)

    def _apply(self, ids, grad_sum, count):
        self.store.update(ids, grad_sum, count)

    def save(self, directory: str) -> dict:
        return self._entry([self.store.save(directory)])

    def load(self, directory: Optional[str]) -> None:
        self.store.load(directory)


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


class ShardedEmbedding(EmbeddingTable):
    """A table whose rows are on their owners (``--feature-shards K``); a rank holds only its batches' rows.

    A lookup sends one call per owner it needs and waits for all at once; after
    backward, :meth:`step` sums the gradient over the ranks (as
    :class:`NodeEmbedding`) and rank ``r`` sends each owner ``k`` with
    ``k % world == r`` its rows' part, so each owner applies it exactly once; a
    barrier then keeps any rank from reading rows before every update landed.

    Args:
        owners: ``(lo, hi, where, actor)`` per shard (:func:`create_owners`).
        num_nodes, dim: The table's shape.
        lr: Unused (the owners hold it); kept for the call sites.
        timeout_s: Seconds the owners together may take to answer one call.
    """

    def __init__(self, owners: tuple, num_nodes: int, dim: int, lr: float, timeout_s: float):
        super().__init__(num_nodes, dim)
        self._owners, self._timeout = owners, timeout_s
        self._starts = np.array([o[0] for o in owners], dtype=np.int64)

    @property
    def nbytes(self) -> int:
        """Bytes of the table on this rank: only the current batch's rows."""
        return 0 if self._rows is None else self._rows.numel() * 4

    def _route(self, ids: np.ndarray):
        """``(order, bounds)``: ``ids[order[bounds[k]:bounds[k + 1]]]`` are owner ``k``'s (as feature shards route)."""
        return route(self._starts, ids)

    def _read(self, ids: np.ndarray) -> np.ndarray:
        rows = np.empty((len(ids), self.dim), dtype=np.float32)
        order, bounds = self._route(ids)
        parts = [(order[bounds[k]:bounds[k + 1]], o) for k, o in enumerate(self._owners) if bounds[k + 1] > bounds[k]]
        results = self._get_all([(o, o[3].gather.remote(ids[p] - o[0])) for p, o in parts])
        for (p, _), r in zip(parts, results):
            rows[p] = r
        return rows

    def _apply(self, ids, grad_sum, count) -> None:
        rank, world = self._ranks()
        order, bounds = self._route(ids)
        calls = []
        for k, o in enumerate(self._owners):
            p = order[bounds[k]:bounds[k + 1]]
            if k % world == rank and len(p):  # per-row step counts: an owner without rows has nothing to do
                calls.append((o, o[3].update.remote(ids[p] - o[0], grad_sum[p], count[p])))
        self._get_all(calls)
        self._barrier()

    # Checkpoints: no timeout, as a shard's files take as long as its disk needs; a lost owner still fails at once.
    def save(self, directory: str) -> dict:
        """Each owner writes its rows, on its node (rank 0 calls it; ``directory`` is a bucket's URI or shared
        storage)."""
        return self._entry(self._get_all([(o, o[3].save.remote(directory)) for o in self._owners], None))

    def load(self, directory: Optional[str]) -> None:
        rank, world = self._ranks()
        self._get_all([(o, o[3].load.remote(directory)) for k, o in enumerate(self._owners) if k % world == rank],
                      None)
        self._barrier()

    def _get_all(self, calls: list, timeout: Optional[float] = -1.0) -> list:
        """The results of ``(owner, ref)`` calls, waited for together within one timeout (``--feature-timeout``
        unless given; ``None``: none). The first failure ends the wait: it names the owner's shard and node,
        and the calls still running are cancelled."""
        import time

        import ray
        import ray.exceptions

        timeout = self._timeout if timeout == -1.0 else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        owner_of = {ref: o for o, ref in calls}
        results, pending, failure = {}, [ref for _, ref in calls], None
        while pending and failure is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                late = ", ".join(f"{owner_of[r][0]}:{owner_of[r][1]} on {owner_of[r][2]}" for r in pending)
                failure = FeatureShardError(f"embedding shard {late} did not answer within {timeout:g}s "
                                            "(--feature-timeout)")
            for ref in ready:
                o = owner_of[ref]
                try:
                    results[ref] = ray.get(ref)
                except ray.exceptions.RayActorError:
                    failure = FeatureShardError(f"embedding shard {o[0]}:{o[1]} on {o[2]} was lost (node lost?)")
                except ray.exceptions.RayError as exc:
                    first = (str(exc).strip().splitlines() or [""])[0][:200]
                    failure = FeatureShardError(f"embedding shard {o[0]}:{o[1]} on {o[2]} failed: "
                                                f"{type(exc).__name__}: {first}")
        if failure is not None:
            for ref in pending:
                try:
                    ray.cancel(ref)
                except Exception:  # already finished or its actor gone: nothing left to stop
                    pass
            raise failure
        return [results[ref] for _, ref in calls]


def _gloo_group() -> Optional[object]:
    """A process group for host arrays (the ranks' ids; the gradient too on CPU ranks): the default one if it
    is gloo."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")
