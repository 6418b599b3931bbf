"""The train worker's GPU path, checked on a bare GPU machine: ``python -m bench.gpu [--smoke] [--json PATH]``.

Needs torch and numpy only (no Ray, no DGL: what a lent GPU machine with torch
2.11 and Python 3.12 has), and runs on synthetic :class:`~gnnray.pipeline.batch.Layer`
batches (:func:`synthetic_batch`):

- ``model NAME``: each built-in model's forward and backward on the device
  against the same model (same weights, same batch) on the CPU: the largest
  difference of the outputs and of the gradients, relative to the largest CPU
  value, and the time per step on each; on CUDA also the host syncs of a
  training step (``train_epoch``: model, loss, Adam), counted with torch's sync
  debug mode;
- ``prefetch float32|float16`` (median of 3 runs): per batch with the ``Prefetcher`` against
  the larger of its copy (gather + host-to-device) and the compute, and the
  serial time (gather, pageable copy, compute in turn);
- ``layerwise NAME``: layer-wise full-neighbor inference (``train.layerwise.infer``, what the workers run
  after the last epoch) on the device against the CPU, on a random arxiv-sized graph: the last hidden
  layer's rows and the predictions compared, and the time of each;
- ``ddp step``: ``train_epoch`` under DDP fed by the ``Prefetcher``, with NCCL
  (one process per GPU; one process on a single GPU), or gloo on the CPU: time
  per step, and the ranks' weights equal afterwards;
- ``syncs embedding``, ``syncs rgat``: host syncs of ``--embedding-dim``'s gradient
  exchange and of rgat's synchronised BatchNorm (``bench/gpu_syncs.py``).

It prints a table and writes every number to ``bench-results/gpu.json``; a failed row shows its error, the
others still run, and the exit status is 1. Without CUDA every row runs on the CPU at small sizes, as a
smoke test (tests/test_gpu_bench.py), and says so. ``python -m bench`` runs the prefetch row as figure 5.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import torch

FIGURE, TARGET = "GPU prefetch s/batch (overlap)", "<= 1.1 x max(copy, compute)"
DEFAULT_JSON = Path(__file__).resolve().parents[1] / "bench-results" / "gpu.json"
REL_TOL = 1e-4  # device against CPU, relative to the largest CPU value (float32, summation orders differ)
RELATIONS = 3  # of the typed batches the relational models get

# Sizes: an arxiv-like batch (1024 seeds, fanouts 15,10,5, 128 features, 3 x 256), and the smoke test's.
FULL = dict(batch=1024, fanouts=(15, 10, 5), in_feats=128, hidden=256, classes=40, heads=4, reps=10,
            prefetch_batches=30, prefetch_inputs=100_000, ddp_steps=10, graph_nodes=169_343, graph_edges=2_330_000)
SMOKE = dict(batch=32, fanouts=(4, 3), in_feats=16, hidden=16, classes=5, heads=2, reps=2,
             prefetch_batches=6, prefetch_inputs=2_000, ddp_steps=3, graph_nodes=500, graph_edges=3_000)


def synthetic_batch(rng: np.random.Generator, batch: int, fanouts, num_classes: int, num_relations: int = 1,
                    epoch: int = 0):
    """A sampled-looking :class:`MiniBatch` on the CPU (no features): for each layer, from the output down,
    every destination gets 0 to ``fanout`` in-edges (some none) from sources numbered after the destinations;
    int64 ids, labels in ``[0, num_classes)``, each edge a relation with ``num_relations > 1``."""
    from gnnray.pipeline.batch import Layer, MiniBatch

    sizes, layers = [batch], []
    for fanout in reversed(tuple(fanouts)):
        n_dst = sizes[-1]
        indptr = np.zeros(n_dst + 1, dtype=np.int64)
        np.cumsum(rng.integers(0, fanout + 1, n_dst), out=indptr[1:])
        nnz = int(indptr[-1])
        num_src = n_dst + max(1, nnz * 2 // 3)  # sampled neighbors repeat across destinations
        etype = torch.from_numpy(rng.integers(0, num_relations, nnz)) if num_relations > 1 else None
        layers.append(Layer(torch.from_numpy(indptr), torch.from_numpy(rng.integers(0, num_src, nnz)), num_src,
                            etype))
        sizes.append(num_src)
    layers.reverse()
    input_nodes = torch.from_numpy(rng.permutation(2 * sizes[-1])[:sizes[-1]])  # distinct global ids
    labels = torch.from_numpy(rng.integers(0, num_classes, batch))
    return MiniBatch(input_nodes[:batch].clone(), labels, input_nodes, layers, epoch=epoch)


def synthetic_rows(rng: np.random.Generator, n: int, batch: int, fanouts, num_classes: int, feat_dim: int,
                   feat_dtype=np.float32) -> tuple[list, np.ndarray]:
    """``n`` packed :func:`synthetic_batch` es and a feature table that covers their input nodes."""
    mbs = [synthetic_batch(rng, batch, fanouts, num_classes) for _ in range(n)]
    num_nodes = max(int(mb.input_nodes.max()) + 1 for mb in mbs)
    feat = rng.standard_normal((num_nodes, feat_dim), dtype=np.float32).astype(feat_dtype)
    return [mb.pack() for mb in mbs], feat


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _median_s(fn: Callable[[], object], dev: torch.device, reps: int) -> float:
    """Median seconds of ``fn`` (after one warm-up call), the device's queued work included."""
    fn()
    times = []
    for _ in range(reps):
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _model(name: str, z: dict):
    from gnnray.train.model import build_model

    return build_model(z["in_feats"], z["classes"], len(z["fanouts"]), z["hidden"], 0.0, name=name,
                       heads=z["heads"], num_relations=RELATIONS if name.startswith("r") else 1)


def model_row(name: str, dev: torch.device, z: dict) -> dict:
    """``name``'s forward and backward on ``dev`` against the CPU (same weights, same batch), and step times."""
    import torch.nn.functional as F

    rng = np.random.default_rng(1)
    mb = synthetic_batch(rng, z["batch"], z["fanouts"], z["classes"], RELATIONS if name.startswith("r") else 1)
    mb.x = torch.from_numpy(rng.standard_normal((mb.input_nodes.shape[0], z["in_feats"]), dtype=np.float32))
    torch.manual_seed(0)
    on_cpu = _model(name, z)
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
               cpu_step_s=_median_s(lambda: step(on_cpu, mb), torch.device("cpu"), z["reps"]),
               device_step_s=_median_s(lambda: step(on_dev, mb_dev), dev, z["reps"]))
    row["met"] = row["out_rel_diff"] <= REL_TOL and row["grad_rel_diff"] <= REL_TOL
    if dev.type == "cuda":
        row["host_syncs_per_step"] = _syncs_per_step(on_dev, mb_dev, z)
    return row


def _syncs_per_step(model, mb, z: dict) -> float:
    """Host syncs per ``train_epoch`` step (model, loss, Adam, metrics), by torch's sync debug mode: the
    difference between epochs of ``2k`` and ``k`` steps, so the epoch's own read-back at its end cancels out."""
    from gnnray.train.step import train_epoch

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    dev = mb.x.device

    def count(steps: int) -> int:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                train_epoch(model, optimizer, iter([mb] * steps), steps, z["classes"], dev)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in seen)

    k = 4
    count(k)  # warm-up: the allocator's first blocks, Adam's state
    return (count(2 * k) - count(k)) / k


def prefetch_overlap(device: str, batches: int = 20, input_nodes: int = 100_000, feat_dim: int = 128,
                     feat_dtype=np.float32) -> dict:
    """Per-batch times of the host side (gather + copy), of compute, and of both with and without the Prefetcher.

    The compute step (matmuls on the batch's features) is sized to take about
    as long as the copy, so full overlap would halve the serial time.
    """
    from gnnray.pipeline.batch import MiniBatch
    from gnnray.pipeline.prefetch import HostSlot, Prefetcher

    dev = torch.device(device)
    # One layer: about input_nodes sources for min(1024, input_nodes / 4) seeds.
    seeds = min(1024, input_nodes // 4)
    packed, feat = synthetic_rows(np.random.default_rng(0), batches, seeds, (3 * input_nodes // seeds,), 10,
                                  feat_dim, feat_dtype)
    w = torch.randn(feat_dim, feat_dim, device=dev)

    def compute(mb, reps):
        h = mb.x
        for _ in range(reps):
            h = torch.tanh(h @ w)
        return h

    def per_batch(fn) -> float:
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        return (time.perf_counter() - t) / batches

    def host_only():
        with Prefetcher(packed, feat, dev, depth=2) as it:
            for _ in it:
                _sync(dev)

    per_batch(host_only)  # warm-up: pinned buffers, the allocator
    copy_s = per_batch(host_only)
    with Prefetcher(packed[:1], feat, dev, depth=1) as it:
        resident = next(it)
        resident.x = resident.x.clone()
    unit = per_batch(lambda: [compute(resident, 1) for _ in range(batches)])
    reps = max(1, round(copy_s / max(unit, 1e-6)))
    compute_s = per_batch(lambda: [compute(resident, reps) for _ in range(batches)])

    def serial():
        slot = HostSlot(pin=False)
        for p in packed:
            mb = MiniBatch.unpack(torch.from_numpy(p.copy()))
            mb.x = slot.gather(feat, mb.input_nodes.numpy())  # widened on the host, as before the Prefetcher
            compute(mb.to(dev), reps)
            _sync(dev)

    def overlapped():
        with Prefetcher(packed, feat, dev, depth=2) as it:
            for mb in it:
                assert mb.x.dtype == torch.float32 and mb.labels.dtype == torch.int64
                compute(mb, reps)

    serial_s, prefetch_s = per_batch(serial), per_batch(overlapped)
    return dict(device=str(dev), feat_dtype=np.dtype(feat_dtype).name, copy_s=copy_s, compute_s=compute_s,
                reps=reps, serial_s=serial_s, prefetch_s=prefetch_s,
                prefetch_over_bound=prefetch_s / max(copy_s, compute_s),
                # On a CPU the thread and the compute share the cores: no target there.
                met=prefetch_s <= 1.1 * max(copy_s, compute_s) if dev.type == "cuda" else None)


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
    on_cpu = _model(name, z)
    runs = {}
    for where, model in (("cpu", on_cpu), ("device", copy.deepcopy(on_cpu).to(dev))):
        d = torch.device("cpu") if where == "cpu" else dev
        infer(model, graph, [SliceRows([(0, graph.feat)])], 10_000, d, keep_input=True)  # warm-up
        _sync(d)
        t = time.perf_counter()
        runs[where] = infer(model, graph, [SliceRows([(0, graph.feat)])], 10_000, d, keep_input=True)
        runs[where].seconds = time.perf_counter() - t
    a, b = runs["cpu"], runs["device"]
    scale = float(np.abs(a.last_input).max()) or 1.0
    diff = float(np.abs(a.last_input - b.last_input).max())
    row = dict(nodes=n, edges=int(indptr[-1]), hidden_rel_diff=diff / scale, pred_agree=float(np.mean(a.pred == b.pred)), cpu_s=a.seconds, device_s=b.seconds)
    row["met"] = row["hidden_rel_diff"] <= REL_TOL and row["pred_agree"] >= 0.999
    return row


def _median_run(runs: list) -> dict:
    """The run whose ratio is the median of ``runs`` (one run's timings are noisy), with every ratio kept."""
    runs = sorted(runs, key=lambda r: r["prefetch_over_bound"])
    return dict(runs[len(runs) // 2], ratios=[r["prefetch_over_bound"] for r in runs])


def _ddp_rank(rank: int, world: int, port: int, device_type: str, z: dict, out: str) -> None:
    """One DDP rank: ``train_epoch`` over Prefetcher batches; writes its step time and weights' checksum."""
    import torch.distributed as dist

    from gnnray.pipeline.prefetch import Prefetcher
    from gnnray.train.step import train_epoch

    cuda = device_type == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        torch.manual_seed(0)  # the same initial weights on every rank
        model = _model("sage", z)
        if cuda and world > 1:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = torch.nn.parallel.DistributedDataParallel(model.to(dev), device_ids=[rank] if cuda else None)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        steps = z["ddp_steps"]
        rows, feat = synthetic_rows(np.random.default_rng(100 + rank), 2 * steps, z["batch"], z["fanouts"],
                                    z["classes"], z["in_feats"])  # each rank its own batches
        with Prefetcher(rows, feat, dev, depth=2) as batches:
            train_epoch(model, optimizer, batches, steps, z["classes"], dev)  # warm-up epoch
            stats = train_epoch(model, optimizer, batches, steps, z["classes"], dev)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        spread = max(float((g - flat).abs().max()) for g in gathered)
        result = dict(rank=rank, step_s=stats["epoch_time"] / steps, loss=stats["loss"],
                      weights_max_diff_across_ranks=spread, pid=os.getpid())
        if cuda and world > 1:  # every rank still alive: which GPUs each has a context on
            pids = [None] * world
            dist.all_gather_object(pids, os.getpid())
            if rank == 0:
                result["gpus_of_rank"] = _gpus_of(pids)
            dist.barrier()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _gpus_of(pids: list) -> dict:
    """GPU indices each of ``pids`` has a context on, by ``nvidia-smi`` (``{}`` where it cannot tell: no
    nvidia-smi, or it sees other process ids, as in some containers)."""
    import subprocess

    def query(what: str) -> list:
        out = subprocess.run(["nvidia-smi", f"--query-{what}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout
        return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]

    try:
        index = {uuid: int(i) for i, uuid in query("gpu=index,uuid")}
        apps = query("compute-apps=pid,gpu_uuid")
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}
    found = {r: sorted(index[u] for p, u in apps if p == str(pid) and u in index) for r, pid in enumerate(pids)}
    return found if any(found.values()) else {}


def ddp_row(dev: torch.device, z: dict) -> dict:
    """One DDP epoch per rank: NCCL with one process per GPU (in this process on a single GPU), gloo on the CPU."""
    import socket
    import tempfile

    cuda = dev.type == "cuda"
    world = torch.cuda.device_count() if cuda else 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        if world == 1:
            _ddp_rank(0, 1, port, dev.type, z, out)
        else:
            torch.multiprocessing.spawn(_ddp_rank, args=(world, port, dev.type, z, out), nprocs=world)
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    row = dict(backend="nccl" if cuda else "gloo", world=world, step_s=max(r["step_s"] for r in ranks),
               loss=ranks[0]["loss"], weights_max_diff_across_ranks=max(r["weights_max_diff_across_ranks"]
                                                                       for r in ranks))
    row["met"] = bool(row["weights_max_diff_across_ranks"] == 0.0 and np.isfinite(row["loss"]))
    if world > 1:  # rank r on GPU r alone: no context of any rank (its prefetch thread included) on GPU 0
        gpus = ranks[0].get("gpus_of_rank", {})
        row["gpus_of_rank"] = gpus or "unknown (nvidia-smi)"
        row["met"] = row["met"] and all(g == [int(r)] for r, g in gpus.items())
    return row


def run(smoke: bool) -> dict:
    """Every row (a failed one carries its error), with the machine and the sizes."""
    from bench import gpu_syncs
    from gnnray.train.model import MODELS

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    z = SMOKE if smoke or not cuda else FULL
    if cuda:  # the comparison is of float32 arithmetic: no TF32 in matmuls
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    jobs: list[tuple[str, Callable[[], dict]]] = [(f"model {m}", lambda m=m: model_row(m, dev, z)) for m in MODELS]
    jobs += [(f"layerwise {m}", lambda m=m: layerwise_row(m, dev, z)) for m in MODELS if not m.startswith("r")]
    for dtype in (np.float32, np.float16):
        jobs.append((f"prefetch {np.dtype(dtype).name}", lambda dtype=dtype: _median_run([prefetch_overlap(
            str(dev), z["prefetch_batches"], z["prefetch_inputs"], z["in_feats"], dtype) for _ in range(3)])))
    jobs.append(("ddp step", lambda: ddp_row(dev, z)))
    jobs += gpu_syncs.jobs(dev, z)  # host syncs of the embedding's and rgat's collectives
    rows = {}
    for name, fn in jobs:
        try:
            rows[name] = dict(fn(), status="ok")
        except Exception as exc:  # noqa: BLE001 - shown in its row; the others still run
            rows[name] = dict(status="error", error=f"{type(exc).__name__}: {exc}"[:300],
                              traceback=traceback.format_exc())
    return dict(device=str(dev), gpu=torch.cuda.get_device_name(0) if cuda else None, smoke=not cuda or smoke,
                cpu_only=not cuda, sizes=z, python=platform.python_version(), torch=torch.__version__,
                numpy=np.__version__, cuda=torch.version.cuda, gpus=torch.cuda.device_count() if cuda else 0,
                rows=rows)


def table(result: dict) -> str:
    """The rows as text, one line each."""
    lines = [f"{'row':<18} {'status':<6} figures"]
    for name, r in result["rows"].items():
        if r["status"] != "ok":
            lines.append(f"{name:<18} ERROR  {r['error']}")
            continue
        if name.startswith("model"):
            text = (f"out rel diff {r['out_rel_diff']:.1e}, grad rel diff {r['grad_rel_diff']:.1e}; step "
                    f"{1000 * r['device_step_s']:.2f} ms on {result['device']} vs {1000 * r['cpu_step_s']:.2f} ms on "
                    f"cpu" + (f"; {r['host_syncs_per_step']:g} host syncs/step" if "host_syncs_per_step" in r else ""))
        elif name.startswith("layerwise"):
            text = (f"{r['nodes']:,} nodes: hidden rel diff {r['hidden_rel_diff']:.1e}, predictions agree "
                    f"{100 * r['pred_agree']:.2f}%; {r['device_s']:.2f} s on {result['device']} vs {r['cpu_s']:.2f} s on cpu")
        elif name.startswith("syncs"):
            from bench.gpu_syncs import text as syncs_text

            text = syncs_text(name, r, result["device"])
        elif name.startswith("prefetch"):
            text = (f"{1000 * r['prefetch_s']:.2f} ms/batch with the Prefetcher vs max(copy {1000 * r['copy_s']:.2f}, "
                    f"compute {1000 * r['compute_s']:.2f}) = {r['prefetch_over_bound']:.2f}x; serial "
                    f"{1000 * r['serial_s']:.2f} ms")
        else:
            text = (f"{r['backend']} x{r['world']}: {1000 * r['step_s']:.2f} ms/step, loss {r['loss']:.3f}, "
                    f"ranks' weights differ by {r['weights_max_diff_across_ranks']:g}")
        lines.append(f"{name:<18} {'-' if r['met'] is None else 'ok' if r['met'] else 'NO':<6} {text}")
    return "\n".join(lines)


def bench_gpu(s) -> list:
    """Figure 5 of ``python -m bench``: the prefetch row on CUDA; n/a without a GPU."""
    from bench.common import Row, verdict

    if not torch.cuda.is_available():
        return [Row(FIGURE, ours="n/a (no GPU)", baseline="n/a", ratio="-", target=TARGET, met="n/a")]
    r = prefetch_overlap("cuda", batches=10 if s.quick else 30)
    return [Row(FIGURE, ours=f"{1000 * r['prefetch_s']:.1f} ms", baseline=f"{1000 * r['serial_s']:.1f} ms serial",
                ratio=f"{r['serial_s'] / r['prefetch_s']:.2f}x faster", target=TARGET, met=verdict(r["met"]),
                detail=r)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="small sizes (always so without CUDA)")
    parser.add_argument("--json", default=str(DEFAULT_JSON), help="where to write the results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: every row runs on the CPU at small sizes, as a smoke test (no GPU figures)")
    result = run(args.smoke)
    print(table(result))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1, default=float))
    print(f"wrote {args.json}")
    return 1 if any(r["status"] != "ok" for r in result["rows"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
