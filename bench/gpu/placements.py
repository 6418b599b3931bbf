"""The job's steady step against the ceiling, per ``--feature-placement``: ``python -m bench.gpu.placements``.

For each graph and ``--feature-placement``/``--sample-on`` row, a whole Ray job (``jobs/train_arxiv.py``, one
train worker): its steady step and ``data_wait`` from ``metrics.jsonl``, against the ceiling measured in the same
call (``stages.ceiling_s``). ``--smoke``: tiny sizes on the CPU, a check that it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.harness import DEFAULT_DATASET, REPO, RESULTS, write_json

ROWS = ("host/actors", "device/actors", "uva/actors", "device/device")
COMMON = ["--batch-size", "1024", "--hidden", "256", "--num-workers", "1", "--eval", "sampled"]


def graphs(arxiv: str, smoke: bool) -> dict:
    """name -> the job's graph options (the issue's sizes, or tiny ones with ``smoke``)."""
    if smoke:
        return {"synthetic-smoke": ["--dataset", "synthetic", "--synthetic-nodes", "3000", "--synthetic-feat-dim",
                                    "16", "--fanouts", "5,5", "--batch-size", "64", "--hidden", "16"]}
    return {
        "arxiv-structure": ["--dataset", arxiv, "--random-features", "128", "--fanouts", "10,10,10"],
        "products-shaped": ["--dataset", "synthetic", "--synthetic-nodes", "1000000", "--synthetic-avg-degree", "50",
                            "--synthetic-feat-dim", "100", "--synthetic-classes", "47", "--fanouts", "15,10,5",
                            # Evaluation is not part of the step: with the training fanouts it takes most of a run.
                            "--eval-fanouts", "5,5,5", "--eval-batch-size", "1024"],
    }


def job(options: list, row: str, use_gpu: bool, epochs: int, actors: int, steps: int, timeout_s: float,
        console: str = "") -> dict:
    """One job's steady step (s) and data_wait (``steps``: an epoch's; ``row``: ``placement/sample_on``; ``console``:
    a file for its whole output)."""
    placement, sample_on = row.split("/")
    with tempfile.TemporaryDirectory() as runs:
        cmd = [sys.executable, "jobs/train_arxiv.py", *COMMON, *options, "--feature-placement", placement,
               "--sample-on", sample_on, "--use-gpu", "yes" if use_gpu else "no", "--epochs", str(epochs),
               "--sampler-actors", f"{actors},{actors}", "--storage-path", runs, "--name", "bench"]
        try:
            done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            done = subprocess.CompletedProcess(cmd, -9, _text(exc.stdout), _text(exc.stderr) + "\n(timed out)")
        if console:
            Path(console).write_text(f"$ {' '.join(cmd)}\n--- stdout\n{done.stdout}--- stderr\n{done.stderr}")
        if done.returncode:
            raise RuntimeError(f"job failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
        rows = [json.loads(line) for line in open(os.path.join(runs, "bench", "metrics.jsonl"))]
        events = [json.loads(line) for line in open(os.path.join(runs, "bench", "workers.jsonl"))]
    steady = rows[1:] or rows
    placed = [e for e in events if e["event"] == "features"]
    stepped = [e for e in events if e["event"] == "step"]  # whether the step was captured (gnnray.train.captured)
    return dict(step_s=statistics.median(r["epoch_time"] for r in steady) / steps,
                data_wait=statistics.median(r["data_wait"] for r in steady),
                did=placed[-1] if placed else None, step=stepped[-1] if stepped else None,
                console=done.stdout.splitlines()[:6],
                console_lines=len(done.stdout.splitlines()) + len(done.stderr.splitlines()))


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def ceiling(options: list, dev: torch.device, batches: int, passes: int = 3) -> dict:
    """model + loss + Adam over ``batches`` sampled batches already on ``dev``: seconds a step."""
    from bench.gpu.stages import ceiling_s
    from gnnray.config import parse_args
    from gnnray.data.load import load_graph
    from gnnray.sampler.sampler import make_sampler
    from gnnray.seeds import steps_per_epoch

    cfg = parse_args([*COMMON, *options])
    graph = load_graph(cfg.data, cfg.run.seed)
    sampler = make_sampler(graph, cfg.sampler.fanouts, seed=0)
    rng = np.random.default_rng(0)
    on_device = []
    for _ in range(batches):
        seeds = rng.choice(graph.train_idx, min(cfg.sampler.batch_size, len(graph.train_idx)), replace=False)
        mb = sampler.sample(seeds)
        mb.x = torch.from_numpy(np.asarray(graph.feat[mb.input_nodes.numpy()], dtype=np.float32))
        on_device.append(mb.to(dev))
    inputs = statistics.mean(int(mb.input_nodes.shape[0]) for mb in on_device)
    return dict(step_s=ceiling_s(cfg, graph, on_device, dev, passes), input_nodes=inputs,
                steps=steps_per_epoch(len(graph.train_idx), cfg.sampler.batch_size, 1),
                feature_mb=inputs * graph.feat_dim * 4 / 2**20)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arxiv", default=str(DEFAULT_DATASET))
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: that it runs")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--actors", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 4)),
                   help="sampler actors of each job")
    p.add_argument("--ceiling-batches", type=int, default=40)
    p.add_argument("--only", nargs="*", help="graphs to run (default: all)")
    p.add_argument("--rows", nargs="*", default=list(ROWS), help="placement/sample_on rows (default: %(default)s)")
    p.add_argument("--job-timeout", type=float, default=1800, help="seconds a job may take")
    p.add_argument("--console", default="", help="a folder for each job's whole console (GRAPH-PLACEMENT-ON.txt)")
    p.add_argument("--json", default=str(RESULTS / "gpu-placements.json"))
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.smoke
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    epochs, batches, actors = (2, 4, 1) if a.smoke else (a.epochs, a.ceiling_batches, a.actors)
    print(f"device: {torch.cuda.get_device_name(0) if cuda else 'cpu'}; {actors} sampler actors; "
          f"medians over epochs 2..{epochs} (jobs) and passes 2..3 (ceiling)")
    out, failed = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "actors": actors}, False
    for name, options in graphs(a.arxiv, a.smoke).items():
        if a.only and name not in a.only:
            continue
        started = time.monotonic()
        top = ceiling(options, dev, batches)
        out[name] = {"ceiling": top}
        print(f"\n{name}: ceiling {top['step_s'] * 1e3:.2f} ms a step ({top['input_nodes']:.0f} input nodes, "
              f"{top['feature_mb']:.0f} MB of features a batch)")
        print(f"  {'placement/sample_on':<20}{'step ms':>9}{'ceiling ms':>12}{'ratio':>8}{'data_wait':>11}"
              f"{'lines':>7}  worker did", flush=True)
        for row in a.rows:
            if not row.startswith("host") and not cuda and not a.smoke:
                continue
            console = ""
            if a.console:
                Path(a.console).mkdir(parents=True, exist_ok=True)
                console = os.path.join(a.console, f"{name}-{row.replace('/', '-')}.txt")
            try:
                r = job(options, row, cuda, epochs, actors, top["steps"], a.job_timeout, console)
            except Exception as exc:  # the other rows still run
                failed = True
                out[name][row] = {"error": str(exc)}
                print(f"  {row:<20} failed: {str(exc)[-600:]}", flush=True)
                continue
            out[name][row] = r
            did, stepped = r["did"] or {}, r["step"] or {}
            step = "captured" if stepped.get("captured") else f"eager ({stepped.get('why_not', '?')})"
            print(f"  {row:<20}{r['step_s'] * 1e3:>9.2f}{top['step_s'] * 1e3:>12.2f}"
                  f"{r['step_s'] / top['step_s']:>8.2f}{r['data_wait']:>11.2f}{r['console_lines']:>7}  "
                  f"{did.get('placement', '?')} {did.get('note', '')}, {step} step", flush=True)
            for line in r["console"]:
                if line.startswith(("sampling plan", "features")):
                    print(f"    {line}", flush=True)
        out[name]["seconds"] = time.monotonic() - started
    write_json(a.json, out)
    print(f"\nwritten: {a.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
