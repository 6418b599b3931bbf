"""DGL's modules, from the same layers and weights: the torch models' test oracle and the DGL baselines' models."""

from __future__ import annotations

import dgl
import torch
from dgl.nn import GATConv, GraphConv, SAGEConv
from torch import nn

from gnnray.batch import Layer
from gnnray.models import model as ours


def block(layer: Layer):
    """``layer`` as a DGL block (edge ``k`` is CSC position ``k``; ``etype`` in ``edata``), on its device. Explicit
    edge ids: DGL 2.1's CPU kernel for edge-data messages (GAT) fails with "Check notnull: edges" without them."""
    eids = torch.arange(layer.indices.shape[0], dtype=layer.indices.dtype, device=layer.indices.device)
    b = dgl.create_block(("csc", (layer.indptr, layer.indices, eids)), num_src_nodes=layer.num_src,
                         num_dst_nodes=layer.num_dst, device=layer.indptr.device)
    if layer.etype is not None:
        b.edata["etype"] = layer.etype.long()
    return b


def blocks(layers) -> list:
    return [block(layer) for layer in layers]


def relation_blocks(b, num_relations: int) -> list:
    """Each relation's edges as a block over all of ``b``'s nodes (the MAG240M example's ``edge_subgraph``)."""
    if "etype" not in b.edata:
        return [b] + [b.edge_subgraph(torch.zeros(b.num_edges(), dtype=torch.bool), relabel_nodes=False)
                      for _ in range(num_relations - 1)]
    return [b.edge_subgraph(b.edata["etype"] == j, relabel_nodes=False) for j in range(num_relations)]


class DGLModel(nn.Module):
    """The DGL-module model of the same kind and sizes as ``new``, with the same state keys."""

    def __init__(self, new: nn.Module):
        super().__init__()
        self.new = [new]  # not a submodule: the state dict is the old model's alone
        if isinstance(new, ours.GraphSAGE):
            self.layers = nn.ModuleList(SAGEConv(c.fc_self.in_features, c.fc_self.out_features, "mean")
                                        for c in new.layers)
        elif isinstance(new, ours.GCN):
            self.layers = nn.ModuleList(GraphConv(*c.weight.shape, norm="right", allow_zero_in_degree=True)
                                        for c in new.layers)
        elif isinstance(new, ours.GAT):
            self.layers = nn.ModuleList(
                GATConv(c.fc.in_features, c._out_feats, c._num_heads, attn_drop=c.attn_drop.p,
                        allow_zero_in_degree=True) for c in new.layers)
        elif isinstance(new, ours.RGAT):
            self.convs = nn.ModuleList(
                nn.ModuleList(GATConv(c.fc.in_features, c._out_feats, c._num_heads, allow_zero_in_degree=True)
                              for c in convs) for convs in new.convs)
            self.skips, self.norms, self.mlp = new.skips, new.norms, new.mlp  # shared: not DGL modules
            self.register_buffer("num_relations", new.num_relations.clone())
        else:
            raise TypeError(f"no DGL model for {type(new).__name__}")
        self.dropout = new.dropout

    def forward(self, layers, x):
        """``layers``: :class:`Layer` s or DGL blocks (a DGL loader's)."""
        h = x
        for i, layer in enumerate(layers):
            h = self.layer(i, block(layer) if isinstance(layer, Layer) else layer, h)
        return h

    def layer(self, i, b, h):
        new = self.new[0]
        if isinstance(new, ours.RGAT):
            x_dst = h[:b.num_dst_nodes()]
            subs = relation_blocks(b, len(self.convs[i]))
            h = self.skips[i](x_dst) + sum(c(g, (h, x_dst)).flatten(1) for c, g in zip(self.convs[i], subs))
            h = self.dropout(nn.functional.elu(self.norms[i](h)))
            return self.mlp(h) if i == len(self.convs) - 1 else h
        h = self.layers[i](b, h)
        last = i == len(self.layers) - 1
        if isinstance(new, ours.GAT):
            return h.mean(1) if last else self.dropout(nn.functional.elu(h.flatten(1)))
        return h if last else self.dropout(torch.relu(h))
