"""Where a CPU train worker samples its batches: the job's idle-priority thread against the other two places.

``python -m bench.beside [--epochs 5]``: a train worker's own epoch (``train_epoch`` over ``device_batches``),
without Ray but in a job's environment, on arxiv structure (an arxiv-sized synthetic graph without it) with 128
random features, SAGE 3x256, fanouts 10,10,10, batch 1024, on the machine's threads. Its batches are prepared three ways in turn, epoch by epoch
in one process (the order reversed every other round, so that the machine's drift hits all alike): on a thread at
idle priority (the job's), on a thread at normal priority, and on the step's own thread between steps with the
sampler on all threads (what DGL's loop without loader workers does). Each epoch's seconds and cores busy; medians.
"""

from __future__ import annotations

import argparse
import os
import time

from bench.harness import DEFAULT_DATASET, interleaved, machine, report, side_by_side


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=5, help="epochs of each way (default: 5)")
    parser.add_argument("--json", help="where to write the figures")
    args = parser.parse_args(argv)
    # The environment of a job's processes (driver/connect.py run_env), read as torch loads or first allocates:
    # OpenMP's passive wait, and torch's huge pages for large blocks (without them steps here took 15-20% longer).
    from gnnray.cpus import JOB_ENV
    for name, value in {**JOB_ENV, "THP_MEM_ALLOC_ENABLE": "1"}.items():
        os.environ.setdefault(name, value)
    import torch

    from gnnray.config import parse_args
    from gnnray.data.load import load_graph
    from gnnray.models.model import model_for
    from gnnray.sampler.sampler import Sampler
    from gnnray.seeds import SeedPlan, SeedReader, rank_rows
    from gnnray.train.device_sampler import DeviceBatches
    from gnnray.train.prefetch import HostSlot
    from gnnray.train.step import seed_dropout, train_epoch

    data = str(DEFAULT_DATASET) if DEFAULT_DATASET.is_dir() else "synthetic"
    cfg = parse_args(["--dataset", data, "--reverse-edges", "yes", "--random-features", "128", "--fanouts", "10,10,10",
                      "--hidden", "256", "--batch-size", "1024", "--epochs", str(args.epochs)])
    graph = load_graph(cfg.data, cfg.run.seed)
    plan = SeedPlan.for_run(graph.train_idx, cfg.sampler.batch_size, 1, cfg.run.seed)
    steps = -(-len(graph.train_idx) // cfg.sampler.batch_size)
    torch.manual_seed(cfg.run.seed)
    model = model_for(graph.feat_dim, graph.num_classes, cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.train.lr)

    def on_the_step(rows):  # each batch when the step asks for it, the sampler and the gather on all threads
        sampler = Sampler(graph, cfg.sampler.fanouts, cfg.run.seed, torch.get_num_threads())
        seeds, slot = SeedReader(plan), HostSlot(pin=False)
        for row in rows:
            epoch, ids = seeds.seeds(row)
            mb = sampler.sample(ids, epoch=epoch, batch=row)
            mb.x, mb.labels = slot.gather(graph.feat, mb.input_nodes.numpy()), mb.labels.long()
            yield mb

    def epoch_of(batches):
        def run(i: int) -> dict:
            seed_dropout(cfg.run.seed, 0, i)
            wall, cpu = time.perf_counter(), sum(os.times()[:2])
            train_epoch(model, optimizer, batches, steps, graph.num_classes, "cpu")
            return dict(s=time.perf_counter() - wall, cpu=sum(os.times()[:2]) - cpu)
        return run

    rows_of = lambda: rank_rows(plan, 0, 0, args.epochs, 0)  # noqa: E731
    threads = {k: DeviceBatches(rows_of(), plan, Sampler(graph, cfg.sampler.fanouts, cfg.run.seed, threads=1),
                                graph.feat, torch.device("cpu"), cfg.train.prefetch, idle=k == "idle")
               for k in ("idle", "normal")}
    runs = interleaved({**{k: epoch_of(b) for k, b in threads.items()}, "step": epoch_of(on_the_step(rows_of()))},
                       args.epochs)
    col = {k: {"s": [r["s"] for r in v], "cores": [r["cpu"] / r["s"] for r in v]} for k, v in runs.items()}
    rows = [side_by_side(f"{m}, idle-priority thread vs {k}", col["idle"][m], col[k][m],
                         **(dict(target="< 1.0", meets=lambda r: r < 1.0) if m == "s" else {}))
            for m in ("s", "cores") for k in ("step", "normal")]
    return report(rows, args.json, f"{data}, {torch.get_num_threads()} threads, {steps} steps an epoch",
                  runs=runs, machine=machine())


if __name__ == "__main__":
    raise SystemExit(main())
