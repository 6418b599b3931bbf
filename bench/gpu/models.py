"""``model NAME``: each built-in model's forward and backward on the device against the CPU, host syncs per step;
``layerwise NAME``: layer-wise full-neighbor inference on the device against the CPU, on a random graph."""

from __future__ import annotations

import copy
import time

import numpy as np
import torch

from bench.gpu.batches import REL_TOL, RELATIONS, build, median_s, per_step, sync, synthetic_batch, timed_epoch


def model_row(name: str, dev: torch.device, z: dict) -> dict:
    """``name``'s forward and backward on ``dev`` against the CPU (same weights, same batch), and step times."""
    import torch.nn.functional as F

    rng = np.random.default_rng(1)
    mb = synthetic_batch(rng, z["batch"], z["fanouts"], z["classes"], RELATIONS if name.startswith("r") else 1)
    mb.x = torch.from_numpy(rng.standard_normal((mb.input_nodes.shape[0], z["in_feats"]), dtype=np.float32))
    torch.manual_seed(0)
    on_cpu = build(name, z)
    on_dev = copy.deepcopy(on_cpu).to(dev)
    mb_dev = mb.to(dev)

    def step(model, b):
        model.zero_grad(set_to_none=True)
        out = model(b.layers, b.x)
        F.cross_entropy(out, b.labels).backward()
        return out

    out_cpu, out_dev = step(on_cpu, mb), step(on_dev, mb_dev).cpu()
    scale = float(out_cpu.detach().abs().max()) or 1.0
    out_diff = float((out_cpu - out_dev).detach().abs().max())
    grad_diff, grad_scale = 0.0, 0.0
    for (pname, p), q in zip(on_cpu.named_parameters(), on_dev.parameters()):
        if p.grad is None or q.grad is None:
            if (p.grad is None) != (q.grad is None):
                raise AssertionError(f"{pname}: a gradient on one device only")
            continue
        grad_diff = max(grad_diff, float((p.grad - q.grad.cpu()).abs().max()))
        grad_scale = max(grad_scale, float(p.grad.abs().max()))
    row = dict(out_max_abs_diff=out_diff, out_rel_diff=out_diff / scale, grad_max_abs_diff=grad_diff,
               grad_rel_diff=grad_diff / (grad_scale or 1.0),
               cpu_step_s=median_s(lambda: step(on_cpu, mb), torch.device("cpu"), z["reps"]),
               device_step_s=median_s(lambda: step(on_dev, mb_dev), dev, z["reps"]))
    row["met"] = row["out_rel_diff"] <= REL_TOL and row["grad_rel_diff"] <= REL_TOL
    if dev.type == "cuda":
        row["host_syncs_per_step"] = syncs_per_step(on_dev, mb_dev, z)
    return row


def syncs_per_step(model, mb, z: dict) -> float:
    """Host syncs per ``train_epoch`` step (model, loss, Adam, metrics), by torch's sync debug mode."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return per_step(lambda n: timed_epoch(model, optimizer, iter([mb] * n), n, z["classes"], mb.x.device))[
        "host_syncs_per_step"]


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
    row = dict(nodes=n, edges=int(indptr[-1]), hidden_rel_diff=diff / scale,
               pred_agree=float(np.mean(a.pred == b.pred)), cpu_s=a.seconds, device_s=b.seconds)
    row["met"] = row["hidden_rel_diff"] <= REL_TOL and row["pred_agree"] >= 0.999
    return row
