"""``layerwise NAME``: layer-wise full-neighbor inference on the device against the CPU, on a random graph."""

from __future__ import annotations

import copy
import time

import numpy as np
import torch

from bench.gpu.batches import REL_TOL, build, sync


def layerwise_row(name: str, dev: torch.device, z: dict) -> dict:
    """Layer-wise inference of ``name`` (same weights) on ``dev`` and on the CPU, over a random graph."""
    from gnnray.data.csc import csc_from_edges
    from gnnray.data.graph import Graph
    from gnnray.train.layerwise import SliceRows, infer

    rng, n = np.random.default_rng(2), z["graph_nodes"]
    indptr, indices = csc_from_edges(rng.integers(0, n, z["graph_edges"]), rng.integers(0, n, z["graph_edges"]), n)
    ids = rng.permutation(n)
    graph = Graph(indptr, indices, rng.standard_normal((n, z["in_feats"]), dtype=np.float32),
                  rng.integers(0, z["classes"], n), np.sort(ids[:n // 2]), np.sort(ids[n // 2:3 * n // 4]),
                  np.sort(ids[3 * n // 4:]), z["classes"], "random")
    torch.manual_seed(0)
    on_cpu = build(name, z)
    runs = {}
    for where, model in (("cpu", on_cpu), ("device", copy.deepcopy(on_cpu).to(dev))):
        d = torch.device("cpu") if where == "cpu" else dev
        infer(model, graph, [SliceRows([(0, graph.feat)])], 10_000, d, keep_input=True)  # warm-up
        sync(d)
        t = time.perf_counter()
        runs[where] = infer(model, graph, [SliceRows([(0, graph.feat)])], 10_000, d, keep_input=True)
        runs[where].seconds = time.perf_counter() - t
    a, b = runs["cpu"], runs["device"]
    scale = float(np.abs(a.last_input).max()) or 1.0
    diff = float(np.abs(a.last_input - b.last_input).max())
    row = dict(nodes=n, edges=int(indptr[-1]), hidden_rel_diff=diff / scale, pred_agree=float(np.mean(a.pred == b.pred)), cpu_s=a.seconds, device_s=b.seconds)
    row["met"] = row["hidden_rel_diff"] <= REL_TOL and row["pred_agree"] >= 0.999
    return row
