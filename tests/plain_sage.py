"""A GraphSAGE-mean model in plain torch over ``Layer`` s, for tests that must not depend on the built-in models."""

from __future__ import annotations

import numpy as np
import torch

from gnnray.batch import Layer


def mean_sage(in_feats: int, hidden: int, num_classes: int, num_layers: int = 2) -> torch.nn.Module:
    """A GraphSAGE-mean model in plain torch over ``Layer`` s, with ``layer(i, layer, h)``.

    The class is made inside this function, so that cloudpickle ships it by
    value to train workers (tests/ is not on their path).
    """

    class MeanSAGE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            sizes = [in_feats] + [hidden] * (num_layers - 1) + [num_classes]
            self.own = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
            self.neigh = torch.nn.ModuleList(torch.nn.Linear(a, b, bias=False) for a, b in zip(sizes, sizes[1:]))

        @property
        def num_layers(self) -> int:
            return len(self.own)

        def forward(self, layers, x):
            for i, layer in enumerate(layers):
                x = self.layer(i, layer, x)
            return x

        def layer(self, i, layer, h):
            deg = (layer.indptr[1:] - layer.indptr[:-1]).long()
            dst = torch.repeat_interleave(torch.arange(layer.num_dst, device=h.device), deg)
            agg = torch.zeros(layer.num_dst, h.shape[1], device=h.device).index_add_(0, dst, h[layer.indices.long()])
            out = self.own[i](h[:layer.num_dst]) + self.neigh[i](agg / deg.clamp(min=1).unsqueeze(1))
            return torch.relu(out) if i < self.num_layers - 1 else out

    return MeanSAGE()


def whole_graph(graph) -> Layer:
    """The whole graph as one block: every node a destination, every in-edge."""
    return Layer(torch.from_numpy(graph.indptr.astype(np.int64)), torch.from_numpy(graph.indices.astype(np.int64)),
                 graph.num_nodes)
