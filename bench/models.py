"""Forward + backward per arxiv-sized batch: the torch models (gnnray/models/conv.py) against DGL's modules.

``python -m bench.models [--repeats N] [--threads T] [--json PATH]``. One
batch's layers (3 layers, fanouts 10,10,10, 1024 seeds) are sampled from the
arxiv structure with the job's sampler when ../shared/datasets/arxiv-structure
exists, else drawn at random with the sizes of such a batch; input 128
features, hidden 256 (GAT: 4 heads of 64), 40 classes, dropout 0.5, train
mode. Each model and its DGL-module twin (bench/dgl_models.py, the former
models, same weights; DGL blocks built beforehand, as a DGL loader hands them
out) run in turn, repeat after repeat; each figure is the median. DGL's
modules run only in an environment with the dgl extra (torch 2.2.1); in the
default one (current torch) the torch models run alone, so running both and
comparing separates the models' cost from torch's version.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import REPO, Row, format_table, machine, threads, verdict


GOALS = {"sage": 1.0, "gcn": 1.0, "gat": 1.2, "rgat": None, "rsage": None}
FANOUTS, BATCH, IN_FEATS, HIDDEN, CLASSES, HEADS = (10, 10, 10), 1024, 128, 256, 40, 4
# --shape products: a batch of the products-sized graph with fanouts 15,10,5 (bench.products' run), random layers of
# its sizes (sources, destinations), 100 input features and 47 classes.
PRODUCTS = dict(layers=((631_000, 58_000), (58_000, 6_000), (6_000, BATCH)), fanouts=(15, 10, 5), in_feats=100,
                classes=47)


def sample_layers(shape: str = "arxiv") -> tuple[list, str]:
    """One batch's layers: sampled from the arxiv structure if it is there, else random of the same sizes; with
    ``shape`` products, random of a products-shaped batch's sizes."""
    from bench.graphs import DEFAULT_DATASET, base_data_config

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
    from bench.common import _dgl
    from gnnray.models.model import build_model

    with_dgl = _dgl() is not None  # DGL's modules only where the dgl extra is installed (torch 2.2.1)
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

    times = {name: {"ours": [], "dgl": []} for name in names}
    for rep in range(warmup + repeats):  # interleaved: each repeat runs every model, ours then DGL's
        for name, (ours, theirs) in pairs.items():
            t = step(ours, layers)
            if rep >= warmup:
                times[name]["ours"].append(t)
            if theirs is not None:
                t = step(theirs, dgl_blocks)
                if rep >= warmup:
                    times[name]["dgl"].append(t)
    sizes = [dict(num_src=l.num_src, num_dst=l.num_dst, nnz=int(l.indices.shape[0])) for l in layers]
    return dict(source=source, layers=sizes, times_s=times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="sage,gcn,gat,rgat,rsage")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shape", choices=("arxiv", "products"), default="arxiv",
                        help="the batch: arxiv's (sampled when the structure is there) or a products-shaped one")
    parser.add_argument("--huge-pages", choices=("env", "both"), default="env",
                        help="both: run the models once with torch's huge pages (THP_MEM_ALLOC_ENABLE=1, as the "
                             "job's processes) and once without, in fresh processes, and compare")
    parser.add_argument("--json", default=str(REPO / "bench-results" / "models.json"))
    args = parser.parse_args(argv)
    names = args.models.split(",")
    if args.huge_pages == "both":
        return compare_huge_pages(args)
    with threads(args.threads):
        result = measure(names, args.repeats, shape=args.shape)
    rows = []
    for name in names:
        t = result["times_s"][name]
        ours = statistics.median(t["ours"]) * 1e3
        if not t["dgl"]:
            rows.append(Row(f"{name} fwd+bwd ms", ours=f"{ours:.1f}", baseline="-", ratio="-", target="-", met="-"))
            continue
        base = statistics.median(t["dgl"]) * 1e3
        goal = GOALS[name]
        rows.append(Row(f"{name} fwd+bwd ms", ours=f"{ours:.1f}", baseline=f"{base:.1f}", ratio=f"{ours / base:.2f}x",
                        target=f"<= {goal}x" if goal else "-", met=verdict(ours / base <= goal) if goal else "-",
                        detail=dict(ratio=ours / base)))
    sizes = ", ".join(f"{s['num_src']}/{s['num_dst']}/{s['nnz']}" for s in result["layers"])
    print(f"{result['source']}: layers (src/dst/edges) {sizes}; {args.threads} threads; "
          f"median of {args.repeats} interleaved repeats; baseline: DGL's modules, same weights")
    print(format_table(rows))
    out = dict(result, threads=args.threads, repeats=args.repeats, machine=machine(), torch=torch.__version__,
               rows=[r.__dict__ for r in rows], date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))


def compare_huge_pages(args) -> None:
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
    rows = []
    for name in names:
        on, off = (statistics.median(times[side][name]) * 1e3 for side in ("on", "off"))
        rows.append(Row(f"{name} fwd+bwd ms", ours=f"{on:.1f}", baseline=f"{off:.1f}", ratio=f"{on / off:.2f}x",
                        target="-", met="-", detail=dict(ratio=on / off)))
    print(f"{args.shape} batch, {args.threads} threads; ours: torch's huge pages (the job's processes), baseline: "
          f"without; medians of 3 x {args.repeats} repeats")
    print(format_table(rows))
    out = dict(shape=args.shape, threads=args.threads, times_s=times, machine=machine(), torch=torch.__version__,
               rows=[r.__dict__ for r in rows], date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
