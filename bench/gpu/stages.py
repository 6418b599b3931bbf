"""Where a GPU step's data time goes, stage by stage, at products shape: ``python -m bench.gpu.stages``.

Per batch, medians: sampling on one core and on the device; the features gathered on the host and copied,
gathered on the device and read over PCIe (``uva``); and the ceiling, model + loss + Adam over the batches already
on the device, eager and captured. ``--smoke`` runs tiny sizes on the CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from bench.harness import RESULTS, write_json

PRODUCTS = ["--dataset", "synthetic", "--synthetic-nodes", "1000000", "--synthetic-avg-degree", "50",
            "--synthetic-feat-dim", "100", "--synthetic-classes", "47", "--fanouts", "15,10,5",
            "--batch-size", "1024", "--hidden", "256"]
SMOKE = ["--dataset", "synthetic", "--synthetic-nodes", "3000", "--synthetic-feat-dim", "16", "--fanouts", "5,5",
         "--batch-size", "64", "--hidden", "16"]


def timed(fn, n: int, sync) -> float:
    """Median seconds of ``fn(i)`` over ``n`` calls after one warm-up call."""
    fn(0)
    sync()
    times = []
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def ceiling_s(cfg, graph, on_device: list, dev, passes: int = 3, captured: bool = False) -> float:
    """The ceiling: model + loss + Adam over ``on_device`` (batches and features on ``dev``), seconds a step, the
    median of the passes after the first (``captured``: after the second, which warms and captures)."""
    from gnnray.models.model import model_for
    from gnnray.train.captured import CapturedStep
    from gnnray.train.step import train_epoch

    torch.manual_seed(0)
    model = model_for(graph.feat_dim, graph.num_classes, cfg).to(dev)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.train.lr, capturable=captured)
    step = CapturedStep(model, optimizer, dev) if captured else None
    skip = 2 if captured else 1
    times = [train_epoch(model, optimizer, iter(on_device), len(on_device), graph.num_classes, dev,
                         captured=step)["epoch_time"] / len(on_device) for _ in range(passes + skip - 1)]
    if step:
        print(f"  captured: padded to {step.buffers.shape if step.buffers else None}; {step.replays} replays, "
              f"{step.eager} eager steps{'; failed: ' + step.failed if step.failed else ''}", flush=True)
    return statistics.median(times[skip:] or times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--json", default=str(RESULTS / "gpu-stages.json"))
    a = p.parse_args(argv)
    from gnnray.config import parse_args
    from gnnray.data.load import load_graph
    from gnnray.sampler.sampler import make_sampler
    from gnnray.train.device_sampler import DeviceSampler
    from gnnray.train.feature_reader import LocalRows
    from gnnray.train.placement import place
    from gnnray.train.prefetch import HostSlot

    cuda = torch.cuda.is_available() and not a.smoke
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = parse_args(SMOKE if a.smoke else PRODUCTS)
    started = time.monotonic()
    graph = load_graph(cfg.data, cfg.run.seed)
    print(f"device {torch.cuda.get_device_name(0) if cuda else 'cpu'}; graph {graph.num_nodes:,} nodes, "
          f"{graph.indices.shape[0]:,} edges, loaded in {time.monotonic() - started:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    seeds = [rng.choice(graph.train_idx, cfg.sampler.batch_size, replace=False) for _ in range(a.batches + 1)]
    sampler = make_sampler(graph, cfg.sampler.fanouts, seed=0)
    torch.set_num_threads(1)
    batches = []

    class Rows(dict):  # each stage printed as it is measured, so that a later failure keeps it
        def __setitem__(self, name, seconds):
            super().__setitem__(name, seconds)
            print(f"{name:<32}{seconds * 1e3:>10.2f} ms/batch{1 / seconds:>10.1f} batches/s", flush=True)

    rows = Rows()
    rows["sample actors (1 core)"] = timed(lambda i: batches.append(sampler.sample(seeds[i])), a.batches, sync)
    batches = batches[1:]
    inputs = statistics.mean(int(mb.input_nodes.shape[0]) for mb in batches)
    ids_host = [mb.input_nodes.numpy() for mb in batches]
    ids_dev = [torch.from_numpy(i).to(dev) for i in ids_host]
    dsampler = DeviceSampler(graph, cfg.sampler.fanouts, dev, seed=0)
    rows["sample device"] = timed(lambda i: dsampler.sample(torch.from_numpy(seeds[i]), epoch=0, batch=i),
                                  a.batches, sync)
    slot = HostSlot(pin=cuda)
    reader = LocalRows(graph.feat)
    rows["features host (gather + copy)"] = timed(
        lambda i: slot.gather(reader, ids_host[i], stored=cuda).to(dev, non_blocking=True).float(), a.batches, sync)
    checked = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        # The store's pages are read-only shared memory: a read-only map of a file in /dev/shm stands for them.
        path = os.path.join(tmp, "feat.npy")
        np.save(path, graph.feat)
        table = np.load(path, mmap_mode="r")
        free = torch.cuda.mem_get_info(dev)[0] if cuda else 4 * graph.feat.nbytes
        for name, mode, free_bytes in (("device", "device", free), ("uva, no cache", "uva", 0),
                                       ("uva, a quarter cached", "uva", graph.feat.nbytes // 2)):
            placed = place(mode, LocalRows(table), dev, graph.indptr, free_bytes=free_bytes)
            rows[f"features {name}"] = timed(lambda i: placed.gather(ids_dev[i]), a.batches, sync)
            got = placed.gather(ids_dev[0]).cpu().numpy()
            checked[name] = bool(np.array_equal(got, graph.feat[ids_host[0]]))
            print(f"  {name}: {placed.note or 'resident'}; rows equal the host gather's: {checked[name]}", flush=True)
    on_device = []
    for mb, ids in zip(batches, ids_host):
        mb.x = torch.from_numpy(graph.feat[ids])
        on_device.append(mb.to(dev))
    rows["compute (the ceiling)"] = ceiling_s(cfg, graph, on_device, dev)
    if cuda:  # the same steps replayed from one CUDA graph (gnnray.train.captured)
        rows["compute, captured"] = ceiling_s(cfg, graph, on_device, dev, captured=True)
    print(f"{inputs:,.0f} input nodes a batch, {inputs * graph.feat_dim * 4 / 2**20:.0f} MiB of float32 features")
    out = dict(device=torch.cuda.get_device_name(0) if cuda else "cpu", input_nodes=inputs,
               seconds=dict(rows), rows_equal=checked, cores=os.cpu_count())
    write_json(a.json, out)
    print(f"written: {a.json}")
    return 0 if all(checked.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
