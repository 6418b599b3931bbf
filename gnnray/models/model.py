"""Stage 6 (train worker): the GNN.

Input: a mini-batch's layers (:class:`~gnnray.batch.Layer`, CSC blocks
in local ids) and the input features of their first layer's source nodes.
Output: logits of the seed nodes. Any ``nn.Module`` with ``forward(layers, x)``
plugs into the training loop the same way.

The convolutions are plain torch (:mod:`gnnray.models.conv`), on CPU and CUDA
alike; they compute what DGL's ``SAGEConv``, ``GraphConv`` and ``GATConv``
compute, under the same parameter names, so checkpoints of the former
DGL-module models load unchanged. DGL is their test oracle only: its PyPI
wheel cannot run on a GPU.

Typed graphs: layers carry each edge's relation (``Layer.etype``). The relational models
(``--model rgat|rsage``) run one convolution per relation and sum them;
sage, gat and gcn ignore the types. RGAT's BatchNorms are :class:`SyncBatchNorm`:
their training statistics span all DDP ranks, as in the MAG240M example, on CPU
and CUDA ranks alike.

The built-in models (``--model sage|gat|gcn|rgat|rsage``) also expose
``layer(i, layer, h)``: layer ``i`` with the activation and dropout that
follow it, exactly as ``forward`` applies it. Layer-wise inference
(:mod:`gnnray.train.layerwise`) needs it to compute one layer for all nodes at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from gnnray.errors import CheckpointError
from gnnray.models.conv import Csr, GATConv, GraphConv, SAGEConv, attend, mean
from gnnray.models.dropout import Dropout, relu_dropout

MODELS = ("sage", "gat", "gcn", "rgat", "rsage")


class _LayeredGNN(nn.Module):
    """A stack of graph convolutions, one per layer (block), applied by :meth:`layer`."""

    layers: nn.ModuleList

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(self, layers: list, x: torch.Tensor) -> torch.Tensor:
        h = x
        for i, layer in enumerate(layers):
            h = self.layer(i, layer, h)
        return h

    def layer(self, i: int, layer, h: torch.Tensor) -> torch.Tensor:
        """Apply layer ``i`` to ``layer`` (a ``Layer``; source features ``h``); hidden layers include activation
        and dropout.

        The default is ReLU then ``self.dropout`` after every hidden layer
        (GraphSAGE, GCN); GAT overrides it.
        """
        h = self.layers[i](layer, h)
        if i < self.num_layers - 1:
            h = relu_dropout(self.dropout, h)
        return h


class GraphSAGE(_LayeredGNN):
    """GraphSAGE on message-flow graphs: ``SAGEConv`` (DGL's, mean), ReLU, dropout.

    Args:
        in_feats: Input feature size.
        hidden: Hidden feature size.
        num_classes: Output size.
        num_layers: Number of SAGEConv layers (one per block).
        dropout: Dropout probability after every hidden layer.
    """

    def __init__(self, in_feats: int, hidden: int, num_classes: int, num_layers: int, dropout: float):
        super().__init__()
        sizes = [in_feats] + [hidden] * (num_layers - 1) + [num_classes]
        self.layers = nn.ModuleList(SAGEConv(a, b) for a, b in zip(sizes[:-1], sizes[1:]))
        self.dropout = Dropout(dropout)


class GAT(_LayeredGNN):
    """GAT (``GATConv``, DGL's): hidden layers concatenate ``heads`` heads, then ELU and dropout.

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
        sizes = [in_feats] + [hidden * heads] * (num_layers - 1)
        outs = [(hidden, heads)] * (num_layers - 1) + [(num_classes, 1)]
        self.layers = nn.ModuleList(GATConv(a, out, h, attn_drop=dropout) for a, (out, h) in zip(sizes, outs))
        self.dropout = Dropout(dropout)

    def layer(self, i: int, layer, h: torch.Tensor) -> torch.Tensor:
        h = self.layers[i](layer, h)  # (dst nodes, heads, out)
        if i < self.num_layers - 1:
            return self.dropout(nn.functional.elu(h.flatten(1)))
        return h.mean(1)


class GCN(_LayeredGNN):
    """GCN (``GraphConv``, DGL's) on blocks, ReLU, dropout.

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
        sizes = [in_feats] + [hidden] * (num_layers - 1) + [num_classes]
        self.layers = nn.ModuleList(GraphConv(a, b, norm="right") for a, b in zip(sizes[:-1], sizes[1:]))
        self.dropout = Dropout(dropout)


def relation_patterns(layer, num_relations: int) -> tuple[Csr, Csr]:
    """``layer``'s edges split by relation (relation 0: all, if it has no ``etype``), see :meth:`Csr.by_relation`.

    Row ``r * num_dst + v`` holds ``v``'s in-edges of relation ``r``: what the
    MAG240M example gets from one ``edge_subgraph(etype == r)`` per relation,
    as one pattern, so each layer aggregates all relations in one product.
    """
    return Csr.of(layer).by_relation(layer.etype, num_relations)


class SyncBatchNorm(nn.BatchNorm1d):
    """BatchNorm1d whose training statistics span all DDP ranks, on CPUs and GPUs alike, with no host sync.

    The batch's sum and sum of squares (float64, from each rank's fused
    mean and variance) and its row count are all-reduced with the autograd-aware
    ``torch.distributed.nn.functional.all_reduce`` (its backward sums the
    gradients of all ranks, as torch's own does). An empty rank adds zeros,
    so nothing depends on which ranks had rows. torch's ``nn.SyncBatchNorm``
    instead drops empty ranks' statistics with a boolean mask, which reads the
    counts back to the host on every call (a GPU step then waits for its queue
    to drain), and it refuses CPU tensors. Without a process group, with one
    rank, or in eval mode it is plain BatchNorm; its state is
    ``nn.BatchNorm1d``'s, so checkpoints load either way.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if not self.training or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return super().forward(x)
        return self.synced(x)

    def synced(self, x: torch.Tensor) -> torch.Tensor:
        """The synchronised training path that :meth:`forward` takes on 2+ ranks (``bench.gpu.syncs`` forces it on
        one rank, to count its host syncs)."""
        import torch.distributed as dist
        from torch.distributed.nn.functional import all_reduce

        group = dist.group.WORLD
        # One reduction of sum, sum of squares and count (each collective waits for every rank: one, not two,
        # per pass). Each rank's rows in one fused pass of its own precision, centred on its own mean; only the
        # per-channel sums are float64, so that E[x^2] - E[x]^2 keeps its precision where |mean| >> std.
        c, n = x.shape[1], x.shape[0]
        var, mean = torch.var_mean(x, 0, unbiased=False) if n else (x.new_zeros(c), x.new_zeros(c))
        mean, var = mean.double(), var.double()
        sums = all_reduce(torch.cat([n * mean, n * (var + mean * mean), mean.new_full((1,), n)]), group=group)
        count = sums[-1]
        mean = sums[:c] / count
        var = (sums[c:2 * c] / count - mean * mean).clamp(min=0)
        mean, var = mean.to(x.dtype), var.to(x.dtype)
        centered = x - mean
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                # Tensors, not floats: reading them back would stall the step on a GPU.
                momentum = (1.0 / self.num_batches_tracked).to(mean.dtype) if self.momentum is None else self.momentum
                self.running_mean.lerp_(mean, momentum)
                unbiased = var * (count / (count - 1).clamp(min=1)).to(var.dtype)  # as torch's running variance
                self.running_var.lerp_(unbiased, momentum)
        out = centered * torch.rsqrt(var + self.eps)
        return out * self.weight + self.bias if self.affine else out


class _Relational(_LayeredGNN):
    """One convolution (rsage: a neighbor projection) per relation and layer, ``self.convs[i][j]``; the count is
    saved as a buffer.

    The buffer lets a checkpoint rebuild the model without the graph
    (:func:`gnnray.inference.layerwise_task.load_model`).
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
        width = hidden * heads
        sizes = [in_feats] + [width] * (num_layers - 1)
        self.convs = nn.ModuleList(nn.ModuleList(GATConv(a, hidden, heads) for _ in range(num_relations))
                                   for a in sizes)
        self.skips = nn.ModuleList(nn.Linear(a, width) for a in sizes)
        self.norms = nn.ModuleList(SyncBatchNorm(width) for _ in sizes)
        self.mlp = nn.Sequential(nn.Linear(width, width), SyncBatchNorm(width), nn.ReLU(), Dropout(dropout),
                                 nn.Linear(width, num_classes))
        self.dropout = Dropout(dropout)

    def layer(self, i: int, layer, h: torch.Tensor) -> torch.Tensor:
        convs = self.convs[i]
        r, heads, d = len(convs), convs[0]._num_heads, convs[0]._out_feats
        n, m = h.shape[0], layer.num_dst
        _, spread = relation_patterns(layer, r)
        # All relations' GATConvs at once: features (n, r, heads, d) from their weights side by side; each
        # relation's edges read its own copy of the sources (spread's columns u * r + relation).
        feat = nn.functional.linear(h, torch.cat([c.fc.weight for c in convs])).view(n, r, heads, d)
        el = (feat * torch.stack([c.attn_l[0] for c in convs])).sum(-1)
        er = (feat[:m] * torch.stack([c.attn_r[0] for c in convs])).sum(-1)
        out = attend(spread, feat.view(n * r, heads, d), el.view(n * r, heads),
                     er.transpose(0, 1).reshape(r * m, heads), convs[0].negative_slope)
        out = out.reshape(r, m, heads * d).sum(0) + sum(c.bias for c in convs)
        h = self.dropout(nn.functional.elu(self.norms[i](self.skips[i](h[:m]) + out)))
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
        self.dropout = Dropout(dropout)

    def layer(self, i: int, layer, h: torch.Tensor) -> torch.Tensor:
        selfs, convs = self.selfs[i], self.convs[i]
        r, n, m = len(convs), h.shape[0], layer.num_dst
        plain, spread = relation_patterns(layer, r)
        weight = torch.stack([lin.weight for lin in convs])  # (r, out, in)
        out = selfs(h[:m])
        # Project before averaging when that narrows the rows to move (DGL's rule; SAGEConv compares costs instead).
        if selfs.in_features > selfs.out_features:
            proj = nn.functional.linear(h, weight.flatten(0, 1)).view(n * r, selfs.out_features)  # row u * r + j
            out = out + mean(spread, proj).view(r, m, selfs.out_features).sum(0)
        else:
            out = out + torch.einsum("rmi,roi->mo", mean(plain, h).view(r, m, selfs.in_features), weight)
        if i < self.num_layers - 1:
            out = relu_dropout(self.dropout, out)
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
