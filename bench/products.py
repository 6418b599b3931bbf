"""The products-sized row: gnnray's whole 1-epoch run against the DGL tutorial script's, side by side.

``python -m bench.products`` writes an ogbn-products-shaped graph directory, then runs the job and
:func:`dgl_script`, each in its own process; per phase (load, training, evaluation) the time, and the peaks of
the machine's used memory over its value before and of the PSS summed over the run's process tree.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench.harness import REPO, RESULTS, Row, child_env, emit, report, write_json

# ogbn-products' shape: nodes, average degree, classes, train / valid / test; 100 random features.
NODES, AVG_DEGREE, CLASSES, SPLIT, FEAT = 2_449_029, 50, 47, (196_615, 39_323, 48_981), 100
MARK = "PHASE "
# What jobs/train_arxiv.py sets before pyarrow loads; both loaders get it, so the comparison is of the builds.
ARROW_ENV = {"ARROW_DEFAULT_MEMORY_POOL": "system"}


def write_graph(out: Path, seed: int = 0) -> None:
    """``--dataset synthetic``'s graph of products' shape as a graph directory, with products' split (no features)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gnnray.data.synthetic import synthetic_parts

    if (out / "meta.json").is_file():
        return
    out.mkdir(parents=True, exist_ok=True)
    p = synthetic_parts(NODES, CLASSES, 1, AVG_DEGREE, seed)
    pq.write_table(pa.table({"src": p.src.astype(np.int64), "dst": p.dst.astype(np.int64)}), out / "edges.parquet")
    perm = np.random.default_rng(seed).permutation(NODES)
    split = np.full(NODES, "none", dtype=object)
    for name, lo, hi in zip(("train", "valid", "test"), np.cumsum([0, *SPLIT[:-1]]), np.cumsum(SPLIT)):
        split[perm[lo:hi]] = name
    pq.write_table(pa.table({"id": np.arange(NODES, dtype=np.int64), "label": p.label.astype(np.int64),
                             "split": split.astype(str)}), out / "nodes.parquet")
    (out / "meta.json").write_text(json.dumps({"num_nodes": NODES, "num_classes": CLASSES, "name": "products-sized"}))


class Memory:
    """The machine's used memory over its start every 0.2 s, and once :attr:`pid` is set the PSS summed over
    that process tree, with its largest processes at the tree's peak."""

    def __init__(self):
        import psutil

        self._psutil, self.base, self.pid = psutil, psutil.virtual_memory().used, 0
        self.samples, self.tree, self.at_tree_peak, self._stop = [], [], {}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        top = 0
        while not self._stop.wait(0.2):
            now = time.perf_counter()
            self.samples.append((now, self._psutil.virtual_memory().used - self.base))
            procs = self._tree_pss() if self.pid else []
            total = sum(p for p, _ in procs)
            self.tree.append((now, total))
            if total > top:
                top, self.at_tree_peak = total, dict(pss_gb=total / 1e9, t=now,
                                                     top=[[round(p / 1e9, 3), c] for p, c in procs[:8]])

    def _tree_pss(self) -> list:
        """(PSS bytes, command) of :attr:`pid` and every descendant, largest first."""
        out = []
        with contextlib.suppress(self._psutil.Error):
            root = self._psutil.Process(self.pid)
            for p in [root] + root.children(recursive=True):
                with contextlib.suppress(self._psutil.Error, OSError):
                    out.append((p.memory_full_info().pss, " ".join(p.cmdline()[:3])[:80]))
        return sorted(out, reverse=True)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, a: float, b: float, tree: bool = False) -> float:
        """Peak GB over ``[a, b]`` (perf_counter times): the machine's used memory, or the tree's PSS."""
        return max((m for t, m in (self.tree if tree else self.samples) if a <= t <= b), default=0) / 1e9


def watched(cmd: list, env: dict, what: str) -> tuple:
    """Run ``cmd`` with :class:`Memory` following its tree: each output line with its time, start, end, the memory."""
    mem, start = Memory(), time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    mem.pid = proc.pid
    lines = [(time.perf_counter(), line.rstrip()) for line in proc.stdout]
    end, rc = time.perf_counter(), proc.wait()
    mem.stop()
    if rc:
        raise RuntimeError(f"{what} exited with {rc}: " + "\n".join(text for _, text in lines[-15:]))
    return lines, start, end, mem


def run_gnnray(graph_dir: Path, work: Path, extra: tuple = ()) -> dict:
    name = f"products-{int(time.time())}"
    argv = [sys.executable, str(REPO / "jobs" / "train_arxiv.py"), "--dataset", str(graph_dir),
            "--random-features", str(FEAT), "--reverse-edges", "yes", "--num-workers", "1", "--sampler-actors", "1",
            "--model", "sage", "--hidden", "256", "--fanouts", "15,10,5", "--batch-size", "1024", "--eval", "sampled",
            "--epochs", "1", "--storage-path", str(work), "--name", name, *extra]
    lines, start, end, mem = watched(argv, {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "gnnray")
    at = {}
    for i, (t, text) in enumerate(lines):
        if text.startswith("graph ") and "graph" not in at:
            at["graph"], at["published"] = t, lines[i + 1][0] if i + 1 < len(lines) else t
        if text.startswith("epoch=0"):
            at["epoch"] = t
    metrics = [json.loads(s) for s in (work / name / "metrics.jsonl").read_text().splitlines() if s.strip()]
    train_s = metrics[-1]["epoch_time"]
    after = at["epoch"] - at["published"]
    # When the run's PSS peaked: seconds before the epoch line, which follows the evaluation (eval_time long).
    mem.at_tree_peak["s_before_epoch_line"] = at["epoch"] - mem.at_tree_peak.pop("t", at["epoch"])
    return dict(argv=argv[2:], whole_s=end - start, load_s=at["graph"] - start, publish_s=at["published"] - at["graph"],
                train_s=train_s, eval_s=after - train_s, sampled_eval_s=metrics[-1].get("eval_time"),
                train_and_eval_s=after, metrics=metrics[-1],
                peak_gb=dict(load=mem.peak(start, at["graph"]), publish=mem.peak(at["graph"], at["published"]),
                             train_and_eval=mem.peak(at["published"], end), whole=mem.peak(start, end)),
                tree_peak_gb=dict(load=mem.peak(start, at["graph"], True), whole=mem.peak(start, end, True),
                                  train_and_eval=mem.peak(at["published"], end, True)),
                at_tree_peak=mem.at_tree_peak,
                output=[text for _, text in lines if not text.startswith("(")][-12:])


def run_dgl(graph_dir: Path, python: str = sys.executable) -> dict:
    spec = json.dumps(dict(graph=str(graph_dir), feat=FEAT))
    lines, start, end, mem = watched([python, "-m", "bench.products", "--dgl-script", spec], ENV, "the DGL script")
    marks = {text[len(MARK):]: t for t, text in lines if text.startswith(MARK)}
    result = json.loads([text for _, text in lines if text.startswith("RESULT ")][-1][len("RESULT "):])
    return dict(result, whole_s=end - start, load_s=marks["loaded"] - start,
                peak_gb=dict(load=mem.peak(start, marks["loaded"]), train=mem.peak(marks["loaded"], marks["trained"]),
                             eval=mem.peak(marks["trained"], end), whole=mem.peak(start, end)),
                tree_peak_gb=dict(load=mem.peak(start, marks["loaded"], True), whole=mem.peak(start, end, True)),
                at_tree_peak=mem.at_tree_peak)


ENV = child_env(**ARROW_ENV)  # the scripts' environment: Arrow's allocator as the job sets it


def dgl_script(spec: dict) -> None:
    """The DGL tutorial's script on the graph directory: pyarrow, ``dgl.graph`` with the reverse edges, CSC; three
    mean ``SAGEConv`` layers with torch's dropout; one epoch, sampled validation and test."""
    import dgl
    import pyarrow.parquet as pq
    import torch
    import torch.nn.functional as F

    from bench.dgl_models import DGLModel
    from gnnray.config import parse_args
    from gnnray.models.model import model_for

    path = Path(spec["graph"])
    meta = json.loads((path / "meta.json").read_text())
    edges = pq.read_table(path / "edges.parquet")
    src, dst = (torch.from_numpy(edges[c].to_numpy()) for c in ("src", "dst"))
    del edges
    g = dgl.graph((torch.cat([src, dst]), torch.cat([dst, src])), num_nodes=meta["num_nodes"])
    del src, dst
    g = g.formats("csc")
    g.create_formats_()
    nodes = pq.read_table(path / "nodes.parquet").to_pandas()
    label = torch.from_numpy(nodes["label"].to_numpy())
    feat = torch.randn(meta["num_nodes"], spec["feat"])
    ids = {s: torch.from_numpy(np.flatnonzero(nodes["split"].to_numpy() == s)) for s in ("train", "valid", "test")}
    print(MARK + "loaded", flush=True)
    cfg = parse_args(["--model", "sage", "--hidden", "256", "--fanouts", "15,10,5", "--batch-size", "1024"])
    model = DGLModel(model_for(spec["feat"], meta["num_classes"], cfg))
    model.dropout = torch.nn.Dropout(0.5)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.train.lr)
    sampler = dgl.dataloading.NeighborSampler([15, 10, 5])

    def loader(split, batch, shuffle):
        return dgl.dataloading.DataLoader(g, ids[split], sampler, batch_size=batch, shuffle=shuffle)

    start = time.perf_counter()
    model.train()
    for _, out, blocks in loader("train", 1024, True):
        loss = F.cross_entropy(model(blocks, feat[blocks[0].srcdata[dgl.NID]]), label[out])
        opt.zero_grad()
        loss.backward()
        opt.step()
    train_s = time.perf_counter() - start
    print(MARK + "trained", flush=True)
    model.eval()
    acc = {}
    with torch.no_grad():
        for split in ("valid", "test"):
            right = total = 0
            for _, out, blocks in loader(split, cfg.train.eval_batch_size, False):
                right += int((model(blocks, feat[blocks[0].srcdata[dgl.NID]]).argmax(1) == label[out]).sum())
                total += len(out)
            acc[split] = right / max(total, 1)
    emit(dict(train_s=train_s, eval_s=time.perf_counter() - start - train_s, val_acc=acc["valid"],
              test_acc=acc["test"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/gnnray-products")
    ap.add_argument("--json", default=str(RESULTS / "products.json"))
    ap.add_argument("--ours", default="", help="more options for gnnray's run, as one string (e.g. '--eval-rows "
                    "100000000': evaluation batches of --eval-batch-size seeds whatever their rows)")
    ap.add_argument("--ours-only", action="store_true", help="run gnnray's side alone (no DGL, no ratios)")
    ap.add_argument("--dgl-python", default=sys.executable,
                    help="the Python that runs the DGL script (one whose environment has DGL and its torch)")
    ap.add_argument("--dgl-script", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dgl_script:
        dgl_script(json.loads(args.dgl_script))
        return 0
    import psutil

    work = Path(args.workdir)
    graph_dir = work / f"graph-{NODES}-{AVG_DEGREE}-{CLASSES}"
    start = time.perf_counter()
    write_graph(graph_dir)
    print(f"graph directory {graph_dir} ({time.perf_counter() - start:.0f}s)", flush=True)
    load = os.getloadavg()
    ours = run_gnnray(graph_dir, work, tuple(args.ours.split()))
    if args.ours_only:
        write_json(args.json, dict(gnnray=ours, loadavg_before=load, loadavg_after=os.getloadavg()))
        print(json.dumps(dict(whole_s=ours["whole_s"], eval_time=ours["sampled_eval_s"],
                              tree_peak_gb=ours["tree_peak_gb"], at_tree_peak=ours["at_tree_peak"]), indent=1))
        return 0
    dgl = run_dgl(graph_dir, args.dgl_python)
    ratio = {k: ours[k] / dgl[k] for k in ("whole_s", "load_s", "train_s", "eval_s")}
    ratio["peak_whole"] = ours["peak_gb"]["whole"] / dgl["peak_gb"]["whole"]
    ratio["tree_peak_whole"] = ours["tree_peak_gb"]["whole"] / dgl["tree_peak_gb"]["whole"]
    out = dict(graph=dict(dir=str(graph_dir), nodes=NODES, avg_degree=AVG_DEGREE, classes=CLASSES, feat=FEAT,
                          split=SPLIT), gnnray=ours, dgl_script=dgl, ratio=ratio,
               machine=dict(cpus=os.cpu_count(), memory_gb=psutil.virtual_memory().total / 1e9),
               loadavg_before=load, loadavg_after=os.getloadavg())
    rows = [Row(k, ours=f"{ours[k]:.1f}", baseline=f"{dgl[k]:.1f}", ratio=f"{ratio[k]:.2f}x", target="-", met="-")
            for k in ("whole_s", "load_s", "train_s", "eval_s")]
    if ours["sampled_eval_s"] is not None:  # eval_s above also holds the workers' start; this is the evaluation
        ev = ours["sampled_eval_s"]
        rows.append(Row("eval_s (rank)", ours=f"{ev:.1f}", baseline=f"{dgl['eval_s']:.1f}",
                        ratio=f"{ev / dgl['eval_s']:.2f}x", target="-", met="-"))
    rows += [Row(name, ours=f"{ours[k]['whole']:.2f}", baseline=f"{dgl[k]['whole']:.2f}", ratio=f"{ratio[r]:.2f}x",
                 target="-", met="-") for name, k, r in (("peak GB (machine)", "peak_gb", "peak_whole"),
                                                         ("peak GB (run PSS)", "tree_peak_gb", "tree_peak_whole"))]
    report(rows, args.json, "gnnray against the DGL script, one run each", **out)
    print("gnnray phases (GB):", ours["peak_gb"], "DGL script phases (GB):", dgl["peak_gb"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
