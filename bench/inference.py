"""Layer-wise inference: gnnray's per-rank code against the DGL tutorial's ``inference`` loop, side by side.

``python -m bench.inference [--dataset DIR|synthetic] [--hidden 256] [--layers 3] [--batch-size 10000]``: both
compute SAGE (mean) layer by layer for every node with all in-neighbors, in chunks of ``--batch-size``, on the
CPU in this process with the same threads and weights, in alternating runs (medians): gnnray's
:func:`gnnray.train.layerwise.infer` (world size 1) and the tutorial's ``MultiLayerFullNeighborSampler(1)``
loop over ``dgl.nn.SAGEConv`` on an int64 DGL graph of the same CSC. Their predictions are compared.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def dgl_inference(g, feat: torch.Tensor, convs, batch_size: int) -> torch.Tensor:
    """The DGL tutorial's layer-wise ``inference`` (one layer per pass over all nodes)."""
    import dgl

    sampler = dgl.dataloading.MultiLayerFullNeighborSampler(1)
    loader = dgl.dataloading.DataLoader(g, torch.arange(g.num_nodes()), sampler, batch_size=batch_size,
                                        shuffle=False, drop_last=False, num_workers=0)
    x = feat
    for i, conv in enumerate(convs):
        y = torch.empty(g.num_nodes(), conv._out_feats)
        for input_nodes, output_nodes, blocks in loader:
            h = conv(blocks[0], x[input_nodes])
            if i < len(convs) - 1:
                h = torch.relu(h)
            y[output_nodes] = h
        x = y
    return x


def dgl_convs(model, sizes: list[int]):
    """``dgl.nn.SAGEConv`` layers with ``model``'s weights (state dict keys as DGL names them)."""
    from dgl.nn import SAGEConv

    convs = [SAGEConv(a, b, "mean") for a, b in zip(sizes, sizes[1:])]
    state = {k.removeprefix("layers."): v for k, v in model.state_dict().items() if k.startswith("layers.")}
    for i, conv in enumerate(convs):
        conv.load_state_dict({k.removeprefix(f"{i}."): v for k, v in state.items() if k.startswith(f"{i}.")})
    return convs


def main(argv=None) -> int:
    from gnnray.config import DataConfig
    from gnnray.data.load import load_graph
    from gnnray.models.model import build_model
    from gnnray.sampler.graphbolt import to_dgl
    from gnnray.train.feature_reader import LocalRows
    from gnnray.train.layerwise import infer

    p = argparse.ArgumentParser(prog="python -m bench.inference", description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="../shared/datasets/arxiv-structure")
    p.add_argument("--random-features", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=10_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--json", default="", help="also write the figures here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    import dgl.utils

    dgl.utils.set_num_threads(a.threads)
    data = (DataConfig(dataset="synthetic", synthetic_nodes=169_343, synthetic_feat_dim=128, synthetic_classes=40)
            if a.dataset == "synthetic" else DataConfig(dataset=a.dataset, reverse_edges=True,
                                                       random_features=a.random_features))
    graph = load_graph(data)
    torch.manual_seed(0)
    model = build_model(graph.feat_dim, graph.num_classes, a.layers, a.hidden, 0.0, name="sage").eval()
    sizes = [graph.feat_dim] + [a.hidden] * (a.layers - 1) + [graph.num_classes]
    convs = dgl_convs(model, sizes)
    wide = graph.indptr.astype(np.int64), graph.indices.astype(np.int64)
    g = to_dgl(type(graph)(**{**vars(graph), "indptr": wide[0], "indices": wide[1]}))
    feat = torch.from_numpy(np.ascontiguousarray(graph.feat, dtype=np.float32))

    from bench.harness import interleaved, report, side_by_side

    out = {}

    def timed(name: str, fn):
        def run(_):
            start = time.perf_counter()
            out[name] = fn()
            return time.perf_counter() - start
        return run

    with torch.no_grad():
        runs = interleaved({"gnnray": timed("gnnray", lambda: infer(model, graph, [LocalRows(graph.feat)],
                                                                     a.batch_size, "cpu").pred),
                            "dgl": timed("dgl", lambda: dgl_inference(g, feat, convs, a.batch_size).argmax(1).numpy())},
                           a.repeats)
    agree = float(np.mean(out["gnnray"] == out["dgl"]))
    row = side_by_side("layer-wise inference s", runs["gnnray"], runs["dgl"], predictions_agree=agree)
    return report([row], a.json, f"{graph.num_nodes:,} nodes, {a.layers} x {a.hidden}, {a.threads} threads; "
                  f"medians of {a.repeats}; predictions agree {agree:.2%}", nodes=graph.num_nodes, hidden=a.hidden,
                  layers=a.layers, batch_size=a.batch_size, threads=a.threads)


if __name__ == "__main__":
    raise SystemExit(main())
