"""The products-sized row: gnnray's whole 1-epoch run against the DGL tutorial script's, side by side.

``python -m bench.products`` writes a graph directory shaped like
ogbn-products (``--dataset synthetic``'s generator: 2,449,029 nodes, average
degree 50, 47 classes; edges stored once, the reverse added at load; a
products-like split of 196,615 / 39,323 / 48,981 nodes; 100 random
features), then runs, one after the other, each in its own process:

- gnnray: ``jobs/train_arxiv.py --dataset DIR --random-features 100
  --reverse-edges yes`` (a graph directory's edges are taken as given otherwise) with 1
  worker, 1 sampler actor, SAGE 3x256, fanouts 15,10,5, batch 1024,
  ``--eval sampled``, 1 epoch;
- the DGL script (``python -m bench.products --dgl-script SPEC``): the
  Parquet edges read with pyarrow, ``dgl.graph`` of them plus their reverse,
  ``formats("csc")``, random features, ``dgl.dataloading.DataLoader``, the
  tutorial's model (3 mean ``SAGEConv`` layers of 256) and the same fanouts,
  one epoch, then sampled validation and test.

For each: the whole run, loading (command to graph in memory; gnnray's
includes Ray's start, which overlaps it), the training epoch, evaluation,
and two peaks of memory per phase: the whole machine's used memory (every
process, Ray's included; ``psutil.virtual_memory().used`` every 0.2 s, less
its value before the run), and the run's own, the proportional set size (PSS)
summed over the run's process tree (its local Ray cluster's processes are its
descendants; pages shared between them, the object store's included, count
once), which other work on a shared machine does not move. ``--dgl-python``
runs the DGL script with another interpreter (DGL's last wheel needs torch
2.2.1: an environment of its own). gnnray's phases come from its output lines: load
(to the graph line), publish (to the next line), and training plus
evaluation (to the epoch line, workers' start included); its evaluation is
that span less ``epoch_time``. Writes ``--json`` (default
``bench-results/products.json``). ``--load-only``: only the structure's
loading, gnnray's (``read_graph_dir(...).build(reverse=True)``) against the
DGL script's, time and peak RSS of each process (the largest-graph row).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SPLIT = (196_615, 39_323, 48_981)  # ogbn-products' train / valid / test, of 2,449,029 nodes
MARK = "PHASE "
RESULT = "RESULT "
# What jobs/train_arxiv.py sets before pyarrow loads; both loaders get it, so the comparison is of the builds.
ARROW_ENV = {"ARROW_DEFAULT_MEMORY_POOL": "system"}


def write_graph(out: Path, n: int, avg_degree: int, classes: int, seed: int = 0) -> None:
    """``--dataset synthetic``'s graph as a graph directory, with a products-like split (no features)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gnnray.data.synthetic import synthetic_parts

    if (out / "meta.json").is_file():
        return
    out.mkdir(parents=True, exist_ok=True)
    p = synthetic_parts(n, classes, 1, avg_degree, seed)
    pq.write_table(pa.table({"src": p.src.astype(np.int64), "dst": p.dst.astype(np.int64)}), out / "edges.parquet")
    scale = n / 2_449_029
    sizes = [int(round(k * scale)) for k in SPLIT]
    perm = np.random.default_rng(seed).permutation(n)
    split = np.full(n, "none", dtype=object)
    for name, lo, hi in zip(("train", "valid", "test"), np.cumsum([0, *sizes[:-1]]), np.cumsum(sizes)):
        split[perm[lo:hi]] = name
    pq.write_table(pa.table({"id": np.arange(n, dtype=np.int64), "label": p.label.astype(np.int64),
                             "split": split.astype(str)}), out / "nodes.parquet")
    (out / "meta.json").write_text(json.dumps({"num_nodes": n, "num_classes": classes, "name": "products-sized"}))


class Memory:
    """The machine's used memory every 0.2 s, in bytes over its value at the start, with the time of each; and,
    once :attr:`pid` is set, the PSS summed over that process and its descendants."""

    def __init__(self):
        import psutil

        self._psutil, self.base = psutil, psutil.virtual_memory().used
        self.samples, self.tree, self._stop = [], [], threading.Event()
        self.pid: int = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

        self.at_peak: dict = {}  # what held the memory near the peak (:meth:`_holders`)
        self.at_tree_peak: dict = {}  # the run's processes at the peak of their PSS

    def _run(self) -> None:
        top, last, tree_top = 0, 0.0, 0
        while not self._stop.wait(0.2):
            now, used = time.perf_counter(), self._psutil.virtual_memory().used - self.base
            self.samples.append((now, used))
            if self.pid:
                procs = self._tree_pss()
                total = sum(p for p, _ in procs)
                self.tree.append((now, total))
                if total > tree_top:
                    tree_top = total
                    self.at_tree_peak = dict(pss_gb=total / 1e9, t=now,
                                             top=[[round(p / 1e9, 3), c] for p, c in procs[:8]])
            if used > top * 1.02 and now - last > 2.0:  # a new peak: who holds it (reading smaps takes time)
                top, last = used, now
                self.at_peak = dict(used_gb=used / 1e9, **self._holders())

    def _tree_pss(self) -> list:
        """(PSS bytes, command) of :attr:`pid` and every descendant, largest first."""
        try:
            root = self._psutil.Process(self.pid)
            procs = [root] + root.children(recursive=True)
        except self._psutil.Error:
            return []
        out = []
        for p in procs:
            try:
                out.append((p.memory_full_info().pss, " ".join(p.cmdline()[:3])[:80]))
            except (self._psutil.Error, OSError):
                continue
        return sorted(out, reverse=True)

    def _holders(self) -> dict:
        """Private memory (USS) of the largest processes, GB, and the machine's shared memory (the object
        store's /dev/shm pages are shared, not "used")."""
        procs = []
        for p in self._psutil.process_iter(["name", "cmdline"]):
            try:
                uss = p.memory_full_info().uss
            except (self._psutil.Error, OSError):
                continue
            cmd = " ".join((p.info["cmdline"] or [p.info["name"] or "?"])[:3])[:80]
            procs.append((uss / 1e9, cmd))
        procs.sort(reverse=True)
        return dict(uss_gb=[[round(u, 3), c] for u, c in procs[:10]], uss_total_gb=sum(u for u, _ in procs),
                    shared_gb=self._psutil.virtual_memory().shared / 1e9)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def peak(self, a: float, b: float, tree: bool = False) -> float:
        """Peak over ``[a, b]`` (perf_counter times), GB: of the machine's used memory, or with ``tree`` of the
        run's processes' PSS."""
        inside = [m for t, m in (self.tree if tree else self.samples) if a <= t <= b]
        return max(inside, default=0) / 1e9


def timed_lines(cmd: list, env: dict, mem: "Memory | None" = None) -> tuple[list, float, float, int]:
    """Run ``cmd`` (``mem`` follows its process tree); each output line with its perf_counter time; start, end,
    exit code."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if mem is not None:
        mem.pid = proc.pid
    lines = [(time.perf_counter(), line.rstrip()) for line in proc.stdout]
    return lines, start, time.perf_counter(), proc.wait()


def run_gnnray(graph_dir: Path, work: Path, feat: int, extra: tuple = ()) -> dict:
    name = f"products-{int(time.time())}"
    argv = [sys.executable, str(REPO / "jobs" / "train_arxiv.py"), "--dataset", str(graph_dir),
            "--random-features", str(feat), "--reverse-edges", "yes", "--num-workers", "1", "--sampler-actors", "1",
            "--model", "sage",
            "--hidden", "256", "--fanouts", "15,10,5", "--batch-size", "1024", "--eval", "sampled",
            "--epochs", "1", "--storage-path", str(work), "--name", name, *extra]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    mem = Memory()
    lines, start, end, rc = timed_lines(argv, env, mem)
    mem.stop()
    if rc:
        raise RuntimeError(f"gnnray exited with {rc}: " + "\n".join(text for _, text in lines[-15:]))
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
                at_peak=mem.at_peak, at_tree_peak=mem.at_tree_peak,
                output=[text for _, text in lines if not text.startswith("(")][-12:])


def run_dgl(graph_dir: Path, feat: int, python: str = sys.executable) -> dict:
    spec = json.dumps(dict(graph=str(graph_dir), feat=feat))
    mem = Memory()
    lines, start, end, rc = timed_lines([python, "-m", "bench.products", "--dgl-script", spec], _env(), mem)
    mem.stop()
    if rc:
        raise RuntimeError(f"the DGL script exited with {rc}: " + "\n".join(text for _, text in lines[-15:]))
    marks = {text[len(MARK):]: t for t, text in lines if text.startswith(MARK)}
    result = json.loads([text for _, text in lines if text.startswith(RESULT)][-1][len(RESULT):])
    return dict(result, whole_s=end - start, load_s=marks["loaded"] - start,
                peak_gb=dict(load=mem.peak(start, marks["loaded"]), train=mem.peak(marks["loaded"], marks["trained"]),
                             eval=mem.peak(marks["trained"], end), whole=mem.peak(start, end)),
                tree_peak_gb=dict(load=mem.peak(start, marks["loaded"], True), whole=mem.peak(start, end, True)),
                at_peak=mem.at_peak, at_tree_peak=mem.at_tree_peak)


def _env() -> dict:
    """The scripts' environment: Arrow's allocator as the job sets it, and this checkout first on the path (another
    interpreter, ``--dgl-python``, imports this bench and gnnray from here)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, **ARROW_ENV, PYTHONPATH=path)


def dgl_script(spec: dict) -> None:
    """The DGL tutorial's script on the graph directory: load, one epoch, sampled validation and test."""
    import pyarrow.parquet as pq
    import torch

    os.environ.setdefault("DGLBACKEND", "pytorch")
    import dgl
    import torch.nn.functional as F

    from gnnray.config import parse_args

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
    model = Sage(spec["feat"], 256, meta["num_classes"], dgl.nn.SAGEConv)
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
    eval_s = time.perf_counter() - start - train_s
    print(RESULT + json.dumps(dict(train_s=train_s, eval_s=eval_s, val_acc=acc["valid"], test_acc=acc["test"])),
          flush=True)


def Sage(in_feats: int, hidden: int, classes: int, conv):
    """The DGL tutorial's GraphSAGE: three mean ``SAGEConv`` layers, ReLU and dropout 0.5 between them."""
    import torch

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            sizes = [in_feats, hidden, hidden, classes]
            self.layers = torch.nn.ModuleList(conv(a, b, "mean") for a, b in zip(sizes, sizes[1:]))
            self.dropout = torch.nn.Dropout(0.5)

        def forward(self, blocks, h):
            for i, (layer, block) in enumerate(zip(self.layers, blocks)):
                h = layer(block, h)
                if i < len(self.layers) - 1:
                    h = self.dropout(torch.relu(h))
            return h

    return Model()


def load_script(which: str, path: Path) -> None:
    """Load the graph directory's structure as gnnray or as the DGL script does; print its time and peak RSS."""
    start = time.perf_counter()
    if which == "gnnray":
        from gnnray.data.graph_dir import read_graph_dir

        g = read_graph_dir(path).build(reverse=True)
        edges = g.num_edges
    else:
        import pyarrow.parquet as pq
        import torch

        os.environ.setdefault("DGLBACKEND", "pytorch")
        import dgl

        n = json.loads((path / "meta.json").read_text())["num_nodes"]
        t = pq.read_table(path / "edges.parquet")
        src, dst = (torch.from_numpy(t[c].to_numpy()) for c in ("src", "dst"))
        del t
        g = dgl.graph((torch.cat([src, dst]), torch.cat([dst, src])), num_nodes=n)
        del src, dst
        g = g.formats("csc")
        g.create_formats_()
        edges = g.num_edges()
    seconds = time.perf_counter() - start
    peak = [int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith("VmHWM")][0]
    print(RESULT + json.dumps(dict(load_s=seconds, peak_rss_gb=peak / 1e9, edges=edges)), flush=True)


def load_only(graph_dir: Path, repeat: int = 1, dgl_python: str = sys.executable) -> dict:
    """gnnray's and the DGL script's loading of the structure, each in a process of its own, interleaved
    ``repeat`` times; the medians and their ratios."""
    runs = {"gnnray": [], "dgl": []}
    for _ in range(repeat):
        for which in runs:
            python = dgl_python if which == "dgl" else sys.executable
            lines, start, end, rc = timed_lines([python, "-m", "bench.products", "--load-script", which,
                                                 str(graph_dir)], _env())
            if rc:
                raise RuntimeError(f"{which} load exited with {rc}: " + "\n".join(t for _, t in lines[-10:]))
            runs[which].append(dict(json.loads([t for _, t in lines if t.startswith(RESULT)][-1][len(RESULT):]),
                                    process_s=end - start))
    keys = ("load_s", "peak_rss_gb", "process_s")
    out = {which: dict({k: float(np.median([r[k] for r in rs])) for k in keys}, edges=rs[0]["edges"], runs=rs)
           for which, rs in runs.items()}
    out["ratio"] = {k: out["gnnray"][k] / out["dgl"][k] for k in keys}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2_449_029)
    ap.add_argument("--avg-degree", type=int, default=50)
    ap.add_argument("--classes", type=int, default=47)
    ap.add_argument("--feat", type=int, default=100)
    ap.add_argument("--workdir", default="/tmp/gnnray-products")
    ap.add_argument("--json", default=str(REPO / "bench-results" / "products.json"))
    ap.add_argument("--load-only", action="store_true", help="only load the structure, gnnray's way and DGL's")
    ap.add_argument("--repeat", type=int, default=1, help="--load-only: runs of each, interleaved (medians)")
    ap.add_argument("--ours", default="", help="more options for gnnray's run, as one string (e.g. '--eval-rows "
                    "100000000': evaluation batches of --eval-batch-size seeds whatever their rows)")
    ap.add_argument("--ours-only", action="store_true", help="run gnnray's side alone (no DGL, no ratios)")
    ap.add_argument("--dgl-python", default=sys.executable,
                    help="the Python that runs the DGL script (one whose environment has DGL and its torch)")
    ap.add_argument("--dgl-script", help=argparse.SUPPRESS)
    ap.add_argument("--load-script", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dgl_script:
        dgl_script(json.loads(args.dgl_script))
        return 0
    if args.load_script:
        load_script(args.load_script[0], Path(args.load_script[1]))
        return 0
    import psutil

    work = Path(args.workdir)
    graph_dir = work / f"graph-{args.nodes}-{args.avg_degree}-{args.classes}"
    start = time.perf_counter()
    write_graph(graph_dir, args.nodes, args.avg_degree, args.classes)
    print(f"graph directory {graph_dir} ({time.perf_counter() - start:.0f}s)", flush=True)
    load = os.getloadavg()
    if args.load_only:
        out = dict(graph=dict(dir=str(graph_dir), nodes=args.nodes, avg_degree=args.avg_degree),
                   **load_only(graph_dir, args.repeat, args.dgl_python), loadavg_before=load,
                   loadavg_after=os.getloadavg())
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(json.dumps(out, indent=1))
        return 0
    ours = run_gnnray(graph_dir, work, args.feat, tuple(args.ours.split()))
    if args.ours_only:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(gnnray=ours, loadavg_before=load, loadavg_after=os.getloadavg()),
                                              indent=1))
        print(json.dumps(dict(whole_s=ours["whole_s"], eval_time=ours["sampled_eval_s"],
                              tree_peak_gb=ours["tree_peak_gb"], at_tree_peak=ours["at_tree_peak"]), indent=1))
        return 0
    dgl = run_dgl(graph_dir, args.feat, args.dgl_python)
    ratio = {k: ours[k] / dgl[k] for k in ("whole_s", "load_s", "train_s", "eval_s")}
    ratio["peak_whole"] = ours["peak_gb"]["whole"] / dgl["peak_gb"]["whole"]
    ratio["tree_peak_whole"] = ours["tree_peak_gb"]["whole"] / dgl["tree_peak_gb"]["whole"]
    out = dict(graph=dict(dir=str(graph_dir), nodes=args.nodes, avg_degree=args.avg_degree, classes=args.classes,
                          feat=args.feat, split=SPLIT), gnnray=ours, dgl_script=dgl, ratio=ratio,
               machine=dict(cpus=os.cpu_count(), memory_gb=psutil.virtual_memory().total / 1e9),
               loadavg_before=load, loadavg_after=os.getloadavg())
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"{'':12}{'gnnray':>10}{'DGL script':>12}{'ratio':>8}")
    for k in ("whole_s", "load_s", "train_s", "eval_s"):
        print(f"{k:12}{ours[k]:10.1f}{dgl[k]:12.1f}{ratio[k]:8.2f}")
    if ours["sampled_eval_s"] is not None:  # eval_s above also holds the workers' start; this is the evaluation
        ev = ours["sampled_eval_s"]
        print(f"{'eval (rank)':12}{ev:10.1f}{dgl['eval_s']:12.1f}{ev / dgl['eval_s']:8.2f}")
    print(f"{'peak GB':12}{ours['peak_gb']['whole']:10.2f}{dgl['peak_gb']['whole']:12.2f}{ratio['peak_whole']:8.2f}")
    print(f"{'run PSS GB':12}{ours['tree_peak_gb']['whole']:10.2f}{dgl['tree_peak_gb']['whole']:12.2f}"
          f"{ratio['tree_peak_whole']:8.2f}")
    print("gnnray phases (GB):", ours["peak_gb"], "DGL script phases (GB):", dgl["peak_gb"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
