"""Stage 6 (train worker): the GNN.

Input: DGL blocks and the input features of their first layer's source nodes.
Output: logits of the seed nodes. Any ``nn.Module`` with ``forward(blocks, x)``
plugs into the training loop the same way.

Typed graphs: blocks carry each edge's relation as ``block.edata["etype"]``
(:meth:`gnnray.pipeline.batch.MiniBatch.blocks`). The relational models
(``--model rgat|rsage``) run one convolution per relation and sum them;
sage, gat and gcn ignore the types. RGAT's BatchNorms are :class:`SyncBatchNorm`:
their training statistics span all DDP ranks, as in the MAG240M example.

The built-in models (``--model sage|gat|gcn|rgat|rsage``) also expose
``layer(i, block, h)``: layer ``i`` with the activation and dropout that
follow it, exactly as ``forward`` applies it. Layer-wise inference
(:mod:`gnnray.inference.layerwise`) needs it to compute one layer for all nodes at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from gnnray.errors import CheckpointError

MODELS = ("sage", "gat", "gcn", "rgat", "rsage")


class _LayeredGNN(nn.Module):
    """A stack of graph convolutions, one per block, applied by :meth:`layer`."""

    layers: nn.ModuleList

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(self, blocks: list, x: torch.Tensor) -> torch.Tensor:
        h = x
        for i, block in enumerate(blocks):
            h = self.layer(i, block, h)
        return h

    def layer(self, i: int, block, h: torch.Tensor) -> torch.Tensor:
        """Apply layer ``i`` to ``block`` (source features ``h``); hidden layers include activation and dropout.

        The default is ReLU then ``self.dropout`` after every hidden layer
        (GraphSAGE, GCN); GAT overrides it.
        """
        h = self.layers[i](block, h)
        if i < self.num_layers - 1:
            h = self.dropout(torch.relu(h))
        return h


class GraphSAGE(_LayeredGNN):
    """GraphSAGE on message-flow graphs: ``dgl.nn.SAGEConv`` (mean), ReLU, dropout.

    Args:
        in_feats: Input feature size.
        hidden: Hidden feature size.
        num_classes: Output size.
        num_layers: Number of SAGEConv layers (one per block).
        dropout: Dropout probability after every hidden layer.
    """

    def __init__(self, in_feats: int, hidden: int, num_classes: int, num_layers: int, dropout: float):
        super().__init__()
        from dgl.nn import SAGEConv

        sizes = [in_feats] + [hidden] * (num_layers - 1) + [num_classes]
        self.layers = nn.ModuleList(SAGEConv(a, b, "mean") for a, b in zip(sizes[:-1], sizes[1:]))
        self.dropout = nn.Dropout(dropout)


class GAT(_LayeredGNN):
    """GAT (``dgl.nn.GATConv``): hidden layers concatenate ``heads`` heads, then ELU and dropout.

    The output layer has one head, as the GAT paper's transductive models.
    Attention dropout is ``dropout`` too. Nodes without in-edges get only the
    bias; add self loops (``--self-loops``) so that every node attends to itself.

    Args:
        in_feats: Input feature size.
        hidden: Feature size per head of the hidden layers.
        num_classes: Output size.
        num_layers: Number of GATConv layers (one per block).
        dropout: Dropout after every hidden layer and on the attention weights.
        heads: Attention heads of every hidden layer.
    """

    def __init__(self, in_feats: int, hidden: int, num_classes: int, num_layers: int, dropout: float, heads: int):
        super().__init__()
        from dgl.nn import GATConv

        sizes = [in_feats] + [hidden * heads] * (num_layers - 1)
        outs = [(hidden, heads)] * (num_layers - 1) + [(num_classes, 1)]
        self.layers = nn.ModuleList(GATConv(a, out, h, attn_drop=dropout, allow_zero_in_degree=True)
                                    for a, (out, h) in zip(sizes, outs))
        self.dropout = nn.Dropout(dropout)

    def layer(self, i: int, block, h: torch.Tensor) -> torch.Tensor:
        h = self.layers[i](_with_edge_ids(block), h)  # (dst nodes, heads, out)
        if i < self.num_layers - 1:
            return self.dropout(nn.functional.elu(h.flatten(1)))
        return h.mean(1)


def _with_edge_ids(block):
    """``block`` with explicit edge ids if it was built from CSC arrays without them.

    DGL 2.1's libxsmm CPU kernel for messages that read edge data (GAT's
    attention weights) fails with "Check notnull: edges" on such blocks, as
    ``MiniBatch.blocks`` builds them; edge ids ``0..nnz-1`` are what the
    missing ids stand for.
    """
    import dgl

    if not block.is_block or block.num_edges() == 0:
        return block
    indptr, indices, eids = block.adj_tensors("csc")
    if eids.numel() == indices.numel():
        return block
    eids = torch.arange(indices.numel(), dtype=indices.dtype, device=indices.device)
    return dgl.create_block(("csc", (indptr, indices, eids)),
                            num_src_nodes=block.num_src_nodes(), num_dst_nodes=block.num_dst_nodes(),
                            device=indices.device)


class GCN(_LayeredGNN):
    """GCN (``dgl.nn.GraphConv``) on blocks, ReLU, dropout.

    Messages are averaged over a node's in-neighbors (``norm="right"``). The
    symmetric normalisation of the GCN paper divides by the source nodes'
    out-degrees too, which in a block are the sampled ones, not the graph's: it
    would differ between training, sampled evaluation and layer-wise inference.
    With self loops (``--self-loops``) this is the GCN aggregator of the
    GraphSAGE paper. Nodes without in-edges get only the bias.

    Args:
        in_feats: Input feature size.
        hidden: Hidden feature size.
        num_classes: Output size.
        num_layers: Number of GraphConv layers (one per block).
        dropout: Dropout probability after every hidden layer.
    """

    def __init__(self, in_feats: int, hidden: int, num_classes: int, num_layers: int, dropout: float):
        super().__init__()
        from dgl.nn import GraphConv

        sizes = [in_feats] + [hidden] * (num_layers - 1) + [num_classes]
        self.layers = nn.ModuleList(GraphConv(a, b, norm="right", allow_zero_in_degree=True)
                                    for a, b in zip(sizes[:-1], sizes[1:]))
        self.dropout = nn.Dropout(dropout)


def relation_subgraphs(block, num_relations: int) -> list:
    """``block``'s edges of each relation as blocks over all its nodes (relation 0: all, if it has no ``etype``).

    What the MAG240M example gets from ``edge_subgraph(etype == j,
    relabel_nodes=False)``, built straight from the block's CSC: selecting a
    relation's edges keeps their CSC order, so each is one mask, one cumsum
    and a new block, several times cheaper than ``edge_subgraph`` on CPU.
    """
    import dgl

    indptr, indices, eids = block.adj_tensors("csc")
    if "etype" in block.edata:
        etype = block.edata["etype"]
        etype = etype[eids.long()] if eids.numel() else etype
    else:
        etype = torch.zeros_like(indices)
    out = []
    for j in range(num_relations):
        keep = etype == j
        kept_before = torch.cat([keep.new_zeros(1, dtype=indptr.dtype), torch.cumsum(keep, 0).to(indptr.dtype)])
        picked = indices[keep]
        # Explicit edge ids: see _with_edge_ids (GATConv's CPU kernel needs them).
        ids = torch.arange(picked.numel(), dtype=indices.dtype, device=indices.device)
        out.append(dgl.create_block(("csc", (kept_before[indptr.long()], picked, ids)),
                                    num_src_nodes=block.num_src_nodes(), num_dst_nodes=block.num_dst_nodes(),
                                    device=indices.device))
    return out


class SyncBatchNorm(nn.BatchNorm1d):
    """BatchNorm1d whose training statistics span all DDP ranks, on CPUs and GPUs alike.

    torch 2.2's ``nn.SyncBatchNorm`` cannot serve CPU ranks: its forward
    refuses CPU tensors and DDP refuses to wrap a CPU module that holds one.
    So the batch's sum and sum of squares (float64) are all-reduced here with
    the autograd-aware ``torch.distributed.nn.functional.all_reduce`` (its
    backward sums the gradients of all ranks, as torch's own does).
    ``nn.SyncBatchNorm.convert_sync_batchnorm`` converts it like any
    BatchNorm, for GPU ranks that prefer torch's fused kernels. Without a
    process group, with one rank, or in eval mode it is plain BatchNorm; its
    state is ``nn.BatchNorm1d``'s, so checkpoints load either way.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if not self.training or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return super().forward(x)
        from torch.distributed.nn.functional import all_reduce

        group = dist.group.WORLD
        # One reduction of sum, sum of squares and count; in float64, so that E[x^2] - E[x]^2 keeps its
        # precision where |mean| >> std (each collective waits for every rank: one, not two, per pass).
        c, xd = x.shape[1], x.double()
        sums = all_reduce(torch.cat([xd.sum(0), (xd * xd).sum(0), xd.new_full((1,), x.shape[0])]), group=group)
        count = sums[-1]
        mean = sums[:c] / count
        var = (sums[c:2 * c] / count - mean * mean).clamp(min=0)
        mean, var = mean.to(x.dtype), var.to(x.dtype)
        centered = x - mean
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                self.running_mean.lerp_(mean, momentum)
                unbiased = var * float(count / (count - 1).clamp(min=1))  # as torch's running variance
                self.running_var.lerp_(unbiased, momentum)
        out = centered * torch.rsqrt(var + self.eps)
        return out * self.weight + self.bias if self.affine else out


class _Relational(_LayeredGNN):
    """One convolution (rsage: a neighbor projection) per relation and layer, ``self.convs[i][j]``; the count is
    saved as a buffer.

    The buffer lets a checkpoint rebuild the model without the graph
    (:func:`gnnray.inference.layerwise.load_model`).
    """

    convs: nn.ModuleList

    def __init__(self, num_relations: int):
        super().__init__()
        self.register_buffer("num_relations", torch.tensor(num_relations))

    @property
    def num_layers(self) -> int:
        return len(self.convs)


class RGAT(_Relational):
    """RGAT as in DGL's MAG240M example: per layer, a ``GATConv`` per relation, summed, plus a linear skip.

    Each layer adds a linear projection of the destination nodes' own
    features to the sum over relations, then BatchNorm, ELU and dropout; an
    MLP (linear, BatchNorm, ReLU, dropout, linear) after the last layer gives
    the logits. The BatchNorms are synchronised across DDP ranks
    (:class:`SyncBatchNorm`), as the example converts them.

    Args:
        in_feats: Input feature size.
        hidden: Feature size per head (``heads`` heads are concatenated).
        num_classes: Output size.
        num_layers: Number of relational layers (one per block).
        dropout: Dropout probability.
        heads: Attention heads.
        num_relations: Relations of the graph (1 for an untyped graph).
    """

    def __init__(self, in_feats: int, hidden: int, num_classes: int, num_layers: int, dropout: float, heads: int,
                 num_relations: int):
        super().__init__(num_relations)
        from dgl.nn import GATConv

        width = hidden * heads
        sizes = [in_feats] + [width] * (num_layers - 1)
        self.convs = nn.ModuleList(
            nn.ModuleList(GATConv(a, hidden, heads, allow_zero_in_degree=True) for _ in range(num_relations))
            for a in sizes)
        self.skips = nn.ModuleList(nn.Linear(a, width) for a in sizes)
        self.norms = nn.ModuleList(SyncBatchNorm(width) for _ in sizes)
        self.mlp = nn.Sequential(nn.Linear(width, width), SyncBatchNorm(width), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(width, num_classes))
        self.dropout = nn.Dropout(dropout)

    def layer(self, i: int, block, h: torch.Tensor) -> torch.Tensor:
        x_dst = h[:block.num_dst_nodes()]
        subgraphs = relation_subgraphs(block, len(self.convs[i]))
        h = self.skips[i](x_dst) + sum(conv(g, (h, x_dst)).flatten(1) for conv, g in zip(self.convs[i], subgraphs))
        h = self.dropout(nn.functional.elu(self.norms[i](h)))
        return self.mlp(h) if i == self.num_layers - 1 else h


class RSAGE(_Relational):
    """Relational GraphSAGE: per layer one self-projection and a neighbor projection per relation.

    ``h_v' = W_self h_v + b + sum_r W_r mean_{u in N_r(v)} h_u`` (the mean is 0
    where ``v`` has no in-edge of relation ``r``): what R summed ``SAGEConv`` layers
    compute, without their R - 1 redundant self-projections and biases. ReLU
    and dropout between layers.

    Args:
        in_feats: Input feature size.
        hidden: Hidden feature size.
        num_classes: Output size.
        num_layers: Number of layers (one per block).
        dropout: Dropout probability after every hidden layer.
        num_relations: Relations of the graph (1 for an untyped graph).
    """

    def __init__(self, in_feats: int, hidden: int, num_classes: int, num_layers: int, dropout: float,
                 num_relations: int):
        super().__init__(num_relations)
        sizes = [in_feats] + [hidden] * (num_layers - 1) + [num_classes]
        self.selfs = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.convs = nn.ModuleList(nn.ModuleList(nn.Linear(a, b, bias=False) for _ in range(num_relations))
                                   for a, b in zip(sizes[:-1], sizes[1:]))
        self.dropout = nn.Dropout(dropout)

    def layer(self, i: int, block, h: torch.Tensor) -> torch.Tensor:
        import dgl.function as fn

        out = self.selfs[i](h[:block.num_dst_nodes()])
        # Project before averaging when that narrows the rows to move, as SAGEConv does.
        narrow = self.selfs[i].in_features > self.selfs[i].out_features
        for linear, g in zip(self.convs[i], relation_subgraphs(block, len(self.convs[i]))):
            with g.local_scope():
                g.srcdata["h"] = linear(h) if narrow else h
                g.update_all(fn.copy_u("h", "m"), fn.mean("m", "h"))
                out = out + (g.dstdata["h"] if narrow else linear(g.dstdata["h"]))
        if i < self.num_layers - 1:
            out = self.dropout(torch.relu(out))
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if any(k.startswith(prefix + "convs.") and k.endswith(".fc_neigh.weight") for k in state_dict):
            raise CheckpointError(
                "the checkpoint holds an rsage of the former layout (a SAGEConv per relation, keys "
                "convs.I.J.fc_self/fc_neigh); rsage now has one self-projection per layer and a neighbor "
                "projection per relation, so it cannot be loaded: train it again (a new --name), or predict "
                "with the gnnray version that wrote it")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def build_model(in_feats: int, num_classes: int, num_layers: int, hidden: int, dropout: float,
                name: str = "sage", heads: int = 4, num_relations: int = 1) -> nn.Module:
    """Return the model the job trains.

    Args:
        in_feats: Input feature size (features plus learnable embedding).
        num_classes: Output size.
        num_layers: Number of graph convolutions (one per block).
        hidden: Hidden feature size (per head for GAT).
        dropout: Dropout probability.
        name: ``sage``, ``gat``, ``gcn``, ``rgat`` or ``rsage``.
        heads: Attention heads of GAT's hidden layers and of RGAT's layers.
        num_relations: Relations of the graph, for rgat and rsage (1: untyped).

    Raises:
        ValueError: ``name`` is not a known model.
    """
    if name == "sage":
        return GraphSAGE(in_feats, hidden, num_classes, num_layers, dropout)
    if name == "gat":
        return GAT(in_feats, hidden, num_classes, num_layers, dropout, heads)
    if name == "gcn":
        return GCN(in_feats, hidden, num_classes, num_layers, dropout)
    if name == "rgat":
        return RGAT(in_feats, hidden, num_classes, num_layers, dropout, heads, num_relations)
    if name == "rsage":
        return RSAGE(in_feats, hidden, num_classes, num_layers, dropout, num_relations)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")


def model_for(in_feats: int, num_classes: int, cfg, num_relations: int = 1) -> nn.Module:
    """The model ``--model`` names, sized by the job configuration (the default model factory)."""
    return build_model(in_feats, num_classes, cfg.sampler.num_layers, cfg.model.hidden, cfg.model.dropout,
                       name=cfg.model.name, heads=cfg.model.heads, num_relations=max(1, num_relations))
