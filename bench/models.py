"""Forward + backward of a batch: the torch models (gnnray/models/conv.py) against DGL's modules, same weights.

``python -m bench.models [--models sage,gcn,...] [--shape arxiv|products] [--huge-pages both]``: each model and its
DGL twin (``dgl_models.py``, in the dgl extra's environment) in turn on one batch's layers; medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.harness import RESULTS, REPO, Row, dgl_or_none, interleaved, machine, report, side_by_side, threads


GOALS = {"sage": 1.0, "gcn": 1.0, "gat": 1.2, "rgat": None, "rsage": None}
FANOUTS, BATCH, IN_FEATS, HIDDEN, CLASSES, HEADS = (10, 10, 10), 1024, 128, 256, 40, 4
# --shape products: a batch of the products-sized graph with fanouts 15,10,5 (bench.products' run), random layers of
# its sizes (sources, destinations), 100 input features and 47 classes.
PRODUCTS = dict(layers=((631_000, 58_000), (58_000, 6_000), (6_000, BATCH)), fanouts=(15, 10, 5), in_feats=100,
                classes=47)


def sample_layers(shape: str = "arxiv") -> tuple[list, str]:
    """One batch's layers: sampled from the arxiv structure if it is there, else random of the same sizes; with
    ``shape`` products, random of a products-shaped batch's sizes."""
    from bench.harness import DEFAULT_DATASET
    from bench.settings import base_data_config

    if shape == "products":
        return random_layers(PRODUCTS["layers"], PRODUCTS["fanouts"], full=True), "synthetic, products-shaped"
    if DEFAULT_DATASET.is_dir():
        from gnnray.data.load import load_graph
        from gnnray.sampler.sampler import Sampler

        graph = load_graph(base_data_config(None), 0)
        seeds = np.random.default_rng(0).permutation(graph.train_idx)[:BATCH]
        return Sampler(graph, FANOUTS).sample(seeds).layers, "arxiv-structure sample"
    return random_layers(((120_000, 60_000), (60_000, 9_000), (9_000, BATCH)), FANOUTS), "synthetic"  # the probe note's


def random_layers(sizes, fanouts, full: bool = False) -> list:
    """Layers of the given (sources, destinations), input layer first, each destination with up to its fanout of
    random sources (with ``full``, all of it: products' nodes have 50 in-edges on average)."""
    from gnnray.batch import Layer

    g, layers = torch.Generator().manual_seed(0), []
    for (num_src, num_dst), fanout in zip(sizes, fanouts):
        deg = torch.full((num_dst,), fanout) if full else torch.randint(0, fanout + 1, (num_dst,), generator=g)
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), deg.cumsum(0)])
        layers.append(Layer(indptr.int(), torch.randint(0, num_src, (int(indptr[-1]),), generator=g).int(), num_src))
    return layers


def measure(names, repeats: int, warmup: int = 2, shape: str = "arxiv") -> dict:
    from gnnray.models.model import build_model

    with_dgl = dgl_or_none() is not None  # DGL's modules only where the dgl extra is installed (torch 2.2.1)
    if with_dgl:
        from bench.dgl_models import DGLModel, blocks
    layers, source = sample_layers(shape)
    in_feats, classes = (PRODUCTS["in_feats"], PRODUCTS["classes"]) if shape == "products" else (IN_FEATS, CLASSES)
    dgl_blocks = blocks(layers) if with_dgl else None
    x = torch.randn(layers[0].num_src, in_feats)
    y = torch.randint(0, classes, (layers[-1].num_dst,))
    pairs = {}
    for name in names:
        torch.manual_seed(0)
        hidden = HIDDEN // HEADS if name in ("gat", "rgat") else HIDDEN
        ours = build_model(in_feats, classes, len(layers), hidden, 0.5, name=name, heads=HEADS).train()
        pairs[name] = (ours, None if name == "rsage" or not with_dgl else DGLModel(ours).train())
        if pairs[name][1] is not None:
            pairs[name][1].load_state_dict(ours.state_dict())

    def step(model, inputs):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        torch.nn.functional.cross_entropy(model(inputs, x), y).backward()
        return time.perf_counter() - start

    fns = {(name, side): (lambda _, m=m, inputs=inputs: step(m, inputs))
           for name, (ours, theirs) in pairs.items()
           for side, m, inputs in (("ours", ours, layers), ("dgl", theirs, dgl_blocks)) if m is not None}
    runs = interleaved(fns, repeats, warmup)
    times = {name: {side: runs.get((name, side), []) for side in ("ours", "dgl")} for name in names}
    sizes = [dict(num_src=l.num_src, num_dst=l.num_dst, nnz=int(l.indices.shape[0])) for l in layers]
    return dict(source=source, layers=sizes, times_s=times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="sage,gcn,gat,rgat,rsage")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shape", choices=("arxiv", "products"), default="arxiv",
                        help="the batch: arxiv's (sampled when the structure is there) or a products-shaped one")
    parser.add_argument("--huge-pages", choices=("env", "both"), default="env",
                        help="both: run the models once with torch's huge pages (THP_MEM_ALLOC_ENABLE=1, as the "
                             "job's processes) and once without, in fresh processes, and compare")
    parser.add_argument("--json", default=str(RESULTS / "models.json"))
    args = parser.parse_args(argv)
    names = args.models.split(",")
    if args.huge_pages == "both":
        return compare_huge_pages(args)
    with threads(args.threads):
        result = measure(names, args.repeats, shape=args.shape)
    rows = []
    for name in names:
        t = {k: [1e3 * v for v in vs] for k, vs in result["times_s"][name].items()}
        if not t["dgl"]:  # no DGL here: ours alone
            rows.append(Row(f"{name} fwd+bwd ms", f"{statistics.median(t['ours']):.1f}", "-", "-", "-", "-"))
            continue
        goal = GOALS[name]
        rows.append(side_by_side(f"{name} fwd+bwd ms", t["ours"], t["dgl"], "{:.1f}", f"<= {goal}x" if goal else "-",
                                 (lambda r, g=goal: r <= g) if goal else None))
    sizes = ", ".join(f"{s['num_src']}/{s['num_dst']}/{s['nnz']}" for s in result["layers"])
    return report(rows, args.json, f"{result['source']}: layers (src/dst/edges) {sizes}; {args.threads} threads; "
                  f"median of {args.repeats} interleaved repeats; baseline: DGL's modules, same weights",
                  **result, threads=args.threads, repeats=args.repeats, machine=machine(), torch=torch.__version__)


def compare_huge_pages(args) -> int:
    """The models' medians with torch's huge pages against without, each side in fresh processes (torch reads
    ``THP_MEM_ALLOC_ENABLE`` once), alternating for three rounds; medians over all their repeats."""
    import os
    import subprocess
    import sys
    import tempfile

    names, times = args.models.split(","), {"on": {}, "off": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(3):
            for side in ("off", "on"):
                env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
                if side == "on":
                    env["THP_MEM_ALLOC_ENABLE"] = "1"
                out = f"{tmp}/{side}-{rnd}.json"
                subprocess.run([sys.executable, "-m", "bench.models", "--models", args.models, "--shape", args.shape,
                                "--repeats", str(args.repeats), "--threads", str(args.threads), "--json", out],
                               env=env, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
                for name, t in json.loads(Path(out).read_text())["times_s"].items():
                    times[side].setdefault(name, []).extend(t["ours"])
    rows = [side_by_side(f"{name} fwd+bwd ms", [1e3 * t for t in times["on"][name]],
                         [1e3 * t for t in times["off"][name]], "{:.1f}") for name in names]
    return report(rows, args.json, f"{args.shape} batch, {args.threads} threads; ours: torch's huge pages (the "
                  f"job's processes), baseline: without; medians of 3 x {args.repeats} repeats", shape=args.shape,
                  threads=args.threads, times_s=times, machine=machine(), torch=torch.__version__)


if __name__ == "__main__":
    raise SystemExit(main())
