"""Message passing in plain torch over CSC blocks (:class:`~gnnray.batch.Layer`): the train worker's ops.

Every aggregation is one sparse product: ``F.embedding_bag`` with the CSR
rows as bags and the edge weights as ``per_sample_weights``, which runs on CPU
(fbgemm) and CUDA alike; its backward is the same product over the
transposed pattern, built once per block when the first backward needs it,
and gradients of edge weights (GAT's attention) are one sampled product
(``torch.sparse.sampled_addmm``). Heads and relations become interleaved
copies of the pattern, so a layer is one product whatever their number.

The modules :class:`SAGEConv`, :class:`GraphConv` and :class:`GATConv` compute
what ``dgl.nn``'s modules of the same names compute on a block, with the same
parameter names and shapes (so their state dicts load unchanged); DGL's CPU
wheel from PyPI cannot run on a GPU, so DGL is their test oracle
(tests/models/test_conv.py), not their engine. Nothing here reads a value
back to the host: shapes come from tensor shapes, never from their values.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

from gnnray.models.dropout import Dropout

warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")  # torch >= 2.5


class Csr:
    """A sparsity pattern of ``num_rows x num_cols`` in CSR form: row ``i`` (a destination) holds the columns
    (sources) ``indices[indptr[i]:indptr[i + 1]]``. A :class:`Layer` is one: rows are its destination nodes.

    Derived arrays (each entry's row, the transpose) are built on first use and kept.
    """

    def __init__(self, indptr: torch.Tensor, indices: torch.Tensor, num_cols: int):
        self.indptr, self.indices, self.num_cols = indptr, indices, int(num_cols)
        self._rows: Optional[torch.Tensor] = None
        self._transposed: Optional[tuple[Csr, torch.Tensor]] = None
        self._interleaved: dict[int, Csr] = {}
        self._base: Optional[tuple[Csr, int, torch.Tensor]] = None  # (pattern, copies, slots) it interleaves
        self.order: Optional[torch.Tensor] = None  # interleaved: each entry's position among the base's (nnz, k)

    @classmethod
    def of(cls, layer) -> "Csr":
        """The pattern of a :class:`~gnnray.batch.Layer` (or a :class:`Csr`, returned as is)."""
        return layer if isinstance(layer, Csr) else cls(layer.indptr, layer.indices, layer.num_src)

    @property
    def num_rows(self) -> int:
        return int(self.indptr.shape[0]) - 1

    @property
    def nnz(self) -> int:
        return int(self.indices.shape[0])

    def degrees(self) -> torch.Tensor:
        """Entries per row (in-degrees of the destinations)."""
        return self.indptr[1:] - self.indptr[:-1]

    def rows(self) -> torch.Tensor:
        """Each entry's row, int64."""
        if self._rows is None:
            ids = torch.arange(self.num_rows, device=self.indptr.device)
            self._rows = torch.repeat_interleave(ids, self.degrees().long(), output_size=self.nnz)
        return self._rows

    def col_counts(self) -> torch.Tensor:
        """Entries per column (out-degrees of the sources)."""
        t, _ = self.transpose()
        return t.degrees()

    def transpose(self) -> tuple["Csr", torch.Tensor]:
        """The transposed pattern and, for each of its entries, the position of that entry in this one."""
        if self._transposed is None:
            if self._base is not None:  # interleaved copies: interleave the base's transpose
                base, k, slots = self._base
                t, perm = base.transpose()
                ti = t.interleave(k)
                self._transposed = (ti, slots.flatten()[perm[ti.order // k] * k + ti.order % k])
            else:
                idx = self.indices
                ordered, perm = torch.sort(idx, stable=True)
                bounds = torch.arange(self.num_cols + 1, dtype=idx.dtype, device=idx.device)
                indptr = torch.searchsorted(ordered, bounds, out_int32=idx.dtype == torch.int32)
                self._transposed = (Csr(indptr, self.rows()[perm].to(idx.dtype), self.num_rows), perm)
        return self._transposed

    def interleave(self, k: int) -> "Csr":
        """``k`` copies interleaved node by node: row ``i * k + c`` holds copy ``c`` of row ``i``, over columns
        ``j * k + c``, so node-major ``(node, k, ...)`` features need no copy. ``order`` maps its entries to
        the flattened ``(nnz, k)`` per-copy entry values (GAT's per-head weights)."""
        if k == 1:
            return self
        if k not in self._interleaved:
            rows, dev = self.rows(), self.indices.device
            start, deg = self.indptr[:-1].long(), self.degrees().long()
            copies = torch.arange(k, device=dev)
            first = start.index_select(0, rows)
            # Entry e of row i, copy c, lands at start[i] * k + c * deg[i] + (e - start[i]).
            slots = ((first * (k - 1) + torch.arange(self.nnz, device=dev)).unsqueeze(1)
                     + copies * deg.index_select(0, rows).unsqueeze(1))
            order = torch.empty(self.nnz * k, dtype=torch.int64, device=dev)
            order.scatter_(0, slots.flatten(), torch.arange(self.nnz * k, device=dev))
            indices = (self.indices.long().unsqueeze(1) * k + copies).flatten()[order]
            indptr = torch.cat([(start.unsqueeze(1) * k + copies * deg.unsqueeze(1)).flatten(),
                                self.indptr[-1:].long() * k])
            out = Csr(indptr.to(self.indptr.dtype), indices.to(self.indices.dtype), self.num_cols * k)
            out._base, out.order = (self, k, slots), order
            self._interleaved[k] = out
        return self._interleaved[k]

    def by_relation(self, etype: Optional[torch.Tensor], num_relations: int) -> tuple["Csr", "Csr"]:
        """Split the rows by relation: row ``r * num_rows + i`` holds row ``i``'s entries of relation ``r``.

        Returns the pattern twice: over the original columns, and over ``num_relations`` copies of each
        (entry of relation ``r``, column ``j`` -> ``j * num_relations + r``), for node-major features
        computed per relation. One stable sort keeps each row's entries in their order; no shape depends
        on the types.
        """
        if num_relations == 1 or etype is None:
            if num_relations == 1:
                return self, self
            etype = torch.zeros_like(self.indices)
        n = self.num_rows
        key = etype.long() * n + self.rows()
        ordered, perm = torch.sort(key, stable=True)
        bounds = torch.arange(num_relations * n + 1, device=key.device)
        indptr = torch.searchsorted(ordered, bounds).to(self.indptr.dtype)
        indices = self.indices[perm]
        spread = indices * num_relations + etype[perm].to(indices.dtype)
        return Csr(indptr, indices, self.num_cols), Csr(indptr, spread, num_relations * self.num_cols)


def _product(csr: Csr, values: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    if csr.nnz == 0 or csr.num_rows == 0:
        return h.new_zeros((csr.num_rows,) + h.shape[1:])
    # embedding_bag is a sparse product whose "bags" are CSR rows: 2-3x faster on CPU than torch's sparse CSR
    # product and DGL's (docs/performance.md#the-models), and a CUDA kernel too.
    out = F.embedding_bag(csr.indices, h.reshape(h.shape[0], -1), csr.indptr, mode="sum",
                          per_sample_weights=values.to(h.dtype), include_last_offset=True)
    return out.view((csr.num_rows,) + h.shape[1:])


def _sampled(csr: Csr, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``<left[row], right[col]>`` for each entry ``(row, col)`` of ``csr``, in its order."""
    if csr.nnz == 0:
        return left.new_zeros(0)
    left, right = left.reshape(left.shape[0], -1), right.reshape(right.shape[0], -1)
    pattern = torch.sparse_csr_tensor(csr.indptr, csr.indices, left.new_zeros(csr.nnz), (csr.num_rows, csr.num_cols))
    return torch.sparse.sampled_addmm(pattern, left.contiguous(), right.t(), beta=0.0).values()


class _SpMM(torch.autograd.Function):
    """``A @ h`` for the sparse ``A`` of pattern ``csr`` and entries ``values``, differentiable in both."""

    @staticmethod
    def forward(ctx, csr: Csr, values: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        ctx.csr = csr
        ctx.save_for_backward(values, h if ctx.needs_input_grad[1] else None)
        return _product(csr, values, h)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        values, h = ctx.saved_tensors
        grad_values = grad_h = None
        if ctx.needs_input_grad[2]:
            t, perm = ctx.csr.transpose()
            grad_h = _product(t, values[perm], grad)
        if ctx.needs_input_grad[1]:
            grad_values = _sampled(ctx.csr, grad, h).to(values.dtype)
        return None, grad_values, grad_h


def spmm(csr: Csr, values: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Row ``i`` of the result: ``sum_e values[e] * h[indices[e]]`` over row ``i``'s entries ``e``.

    ``h`` is ``(num_cols, ...)``; the result ``(num_rows, ...)``; rows without entries are zero.
    """
    return _SpMM.apply(csr, values, h)


def project_first(csr: Csr, num_src: int, in_feats: int, out_feats: int) -> bool:
    """Whether a layer's ``A @ h @ W`` costs fewer multiply-adds as ``A @ (h @ W)`` than as ``(A @ h) @ W``.

    DGL projects first whenever ``in_feats > out_feats``, right for a full graph; a sampled block has several
    sources per destination, so there projecting every source can cost more (arxiv's last layer, 256 -> 40
    over 6,400 sources for 1,024 destinations: 6x more). Shapes only: nothing is read back.
    """
    projected = num_src * in_feats * out_feats + csr.nnz * out_feats
    return projected < csr.nnz * in_feats + csr.num_rows * in_feats * out_feats


def _inverse(counts: torch.Tensor, dtype: torch.dtype, power: float = -1.0) -> torch.Tensor:
    return counts.to(dtype).clamp(min=1).pow(power)


def mean(csr: Csr, h: torch.Tensor) -> torch.Tensor:
    """The mean of each row's sources' ``h`` (zero for a row without entries), as ``fn.mean``."""
    values = _inverse(csr.degrees(), h.dtype).index_select(0, csr.rows())
    return spmm(csr, values, h)


def segment_softmax(csr: Csr, scores: torch.Tensor) -> torch.Tensor:
    """Softmax of ``scores`` (``(nnz, H)``) over each row's entries, as DGL's ``edge_softmax`` on a block."""
    rows = csr.rows()
    index = rows.unsqueeze(1).expand_as(scores)
    # Any per-row shift gives the same softmax; the row maximum keeps exp in range (no gradient needed).
    top = scores.new_full((csr.num_rows, scores.shape[1]), float("-inf"))
    top = top.scatter_reduce(0, index, scores.detach(), "amax", include_self=True)
    e = torch.exp(scores - top.index_select(0, rows))
    total = scores.new_zeros((csr.num_rows, scores.shape[1])).index_add(0, rows, e)
    return e / total.index_select(0, rows)


def attend(csr: Csr, feat: torch.Tensor, el: torch.Tensor, er: torch.Tensor, negative_slope: float,
           attn_drop: Optional[nn.Module] = None) -> torch.Tensor:
    """GAT's aggregation: ``(num_rows, H, D)`` from column features ``feat`` ``(num_cols, H, D)`` and the
    per-head attention terms of columns ``el`` ``(num_cols, H)`` and rows ``er`` ``(num_rows, H)``."""
    n, heads, d = feat.shape
    scores = F.leaky_relu(el.index_select(0, csr.indices) + er.index_select(0, csr.rows()), negative_slope)
    a = segment_softmax(csr, scores)
    if attn_drop is not None:
        a = attn_drop(a)
    # One product for all heads, over the features as they lie: row v * heads + c reads rows u * heads + c.
    many = csr.interleave(heads)
    values = a.reshape(-1) if heads == 1 else a.reshape(-1).index_select(0, many.order)
    return spmm(many, values, feat.reshape(n * heads, d)).view(csr.num_rows, heads, d)


class SAGEConv(nn.Module):
    """``dgl.nn.SAGEConv(in_feats, out_feats, "mean")`` on a block: ``fc_self(h_dst) + fc_neigh(mean h_src)``.

    Projects before averaging only where that costs less (:func:`project_first`), and adds ``fc_self``'s
    product into the neighbour term in place: one pass less over the output than a sum of two products.
    """

    def __init__(self, in_feats: int, out_feats: int):
        super().__init__()
        self.fc_self = nn.Linear(in_feats, out_feats)
        self.fc_neigh = nn.Linear(in_feats, out_feats, bias=False)
        gain = nn.init.calculate_gain("relu")
        nn.init.xavier_uniform_(self.fc_self.weight, gain=gain)
        nn.init.xavier_uniform_(self.fc_neigh.weight, gain=gain)

    def forward(self, layer, h: torch.Tensor) -> torch.Tensor:
        csr = Csr.of(layer)
        if project_first(csr, h.shape[0], *self.fc_self.weight.shape[::-1]):
            out = mean(csr, self.fc_neigh(h)) + self.fc_self.bias
        else:
            out = F.linear(mean(csr, h), self.fc_neigh.weight, self.fc_self.bias)
        return out.addmm_(h[:csr.num_rows], self.fc_self.weight.t())


class GraphConv(nn.Module):
    """``dgl.nn.GraphConv(in_feats, out_feats, norm=norm, allow_zero_in_degree=True)`` on a block.

    ``norm="right"`` averages over in-neighbors; ``"both"`` also scales each source by its out-degree in the
    block to the power -1/2 and each destination by its in-degree to the power -1/2 instead.
    """

    def __init__(self, in_feats: int, out_feats: int, norm: str = "right"):
        super().__init__()
        if norm not in ("right", "both"):
            raise ValueError(f"GraphConv norm must be 'right' or 'both', not {norm!r}")
        self.norm = norm
        self.weight = nn.Parameter(torch.empty(in_feats, out_feats))
        self.bias = nn.Parameter(torch.zeros(out_feats))
        nn.init.xavier_uniform_(self.weight)

    def forward(self, layer, h: torch.Tensor) -> torch.Tensor:
        csr = Csr.of(layer)
        rows = csr.rows()
        if self.norm == "right":
            values = _inverse(csr.degrees(), h.dtype).index_select(0, rows)
        else:
            values = (_inverse(csr.col_counts(), h.dtype, -0.5).index_select(0, csr.indices)
                      * _inverse(csr.degrees(), h.dtype, -0.5).index_select(0, rows))
        if project_first(csr, h.shape[0], *self.weight.shape):
            out = spmm(csr, values, h @ self.weight)
        else:
            out = spmm(csr, values, h) @ self.weight
        return out + self.bias


class GATConv(nn.Module):
    """``dgl.nn.GATConv(in_feats, out_feats, num_heads, attn_drop=attn_drop, allow_zero_in_degree=True)`` on a
    block: ``(num_dst, num_heads, out_feats)``; a destination without in-edges gets only the bias."""

    def __init__(self, in_feats: int, out_feats: int, num_heads: int, attn_drop: float = 0.0,
                 negative_slope: float = 0.2):
        super().__init__()
        self._num_heads, self._out_feats, self.negative_slope = num_heads, out_feats, negative_slope
        self.fc = nn.Linear(in_feats, out_feats * num_heads, bias=False)
        self.attn_l = nn.Parameter(torch.empty(1, num_heads, out_feats))
        self.attn_r = nn.Parameter(torch.empty(1, num_heads, out_feats))
        self.bias = nn.Parameter(torch.zeros(num_heads * out_feats))
        self.attn_drop = Dropout(attn_drop)
        gain = nn.init.calculate_gain("relu")
        for p in (self.fc.weight, self.attn_l, self.attn_r):
            nn.init.xavier_normal_(p, gain=gain)

    def forward(self, layer, h: torch.Tensor) -> torch.Tensor:
        csr = Csr.of(layer)
        feat = self.fc(h).view(h.shape[0], self._num_heads, self._out_feats)
        el = (feat * self.attn_l).sum(-1)
        er = (feat[:csr.num_rows] * self.attn_r).sum(-1)
        out = attend(csr, feat, el, er, self.negative_slope, self.attn_drop)
        return out + self.bias.view(self._num_heads, self._out_feats)
