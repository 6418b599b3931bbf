"""Stage 5 (train worker): the GNN.

Input: DGL blocks and the input features of their first layer's source nodes.
Output: logits of the seed nodes. Any ``nn.Module`` with ``forward(blocks, x)``
plugs into the training loop the same way.
"""

from __future__ import annotations

import torch
from torch import nn


class GraphSAGE(nn.Module):
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

    def forward(self, blocks: list, x: torch.Tensor) -> torch.Tensor:
        h = x
        for i, (layer, block) in enumerate(zip(self.layers, blocks)):
            h = layer(block, h)
            if i < len(self.layers) - 1:
                h = self.dropout(torch.relu(h))
        return h


def build_model(in_feats: int, num_classes: int, num_layers: int, hidden: int, dropout: float) -> nn.Module:
    """Return the model the job trains."""
    return GraphSAGE(in_feats, hidden, num_classes, num_layers, dropout)
