"""Stage 6 (train worker): the GNN.

Input: DGL blocks and the input features of their first layer's source nodes.
Output: logits of the seed nodes. Any ``nn.Module`` with ``forward(blocks, x)``
plugs into the training loop the same way.

The built-in models (``--model sage|gat|gcn``) also expose
``layer(i, block, h)``: layer ``i`` with the activation and dropout that
follow it, exactly as ``forward`` applies it. Layer-wise inference
(:mod:`gnnray.inference.layerwise`) needs it to compute one layer for all nodes at a time.
"""

from __future__ import annotations

import torch
from torch import nn

MODELS = ("sage", "gat", "gcn")


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


def build_model(in_feats: int, num_classes: int, num_layers: int, hidden: int, dropout: float,
                name: str = "sage", heads: int = 4) -> nn.Module:
    """Return the model the job trains.

    Args:
        in_feats: Input feature size (features plus learnable embedding).
        num_classes: Output size.
        num_layers: Number of graph convolutions (one per block).
        hidden: Hidden feature size (per head for GAT).
        dropout: Dropout probability.
        name: ``sage``, ``gat`` or ``gcn``.
        heads: Attention heads of GAT's hidden layers.

    Raises:
        ValueError: ``name`` is not a known model.
    """
    if name == "sage":
        return GraphSAGE(in_feats, hidden, num_classes, num_layers, dropout)
    if name == "gat":
        return GAT(in_feats, hidden, num_classes, num_layers, dropout, heads)
    if name == "gcn":
        return GCN(in_feats, hidden, num_classes, num_layers, dropout)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")


def model_for(in_feats: int, num_classes: int, cfg) -> nn.Module:
    """The model ``--model`` names, sized by the job configuration (the default model factory)."""
    return build_model(in_feats, num_classes, cfg.sampler.num_layers, cfg.model.hidden, cfg.model.dropout,
                       name=cfg.model.name, heads=cfg.model.heads)
