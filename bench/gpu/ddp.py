"""``ddp step``: ``train_epoch`` under DDP fed by the ``Prefetcher``: NCCL with one process per GPU, gloo on the CPU."""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from bench.gpu.batches import build, synthetic_rows


def _ddp_rank(rank: int, world: int, port: int, device_type: str, z: dict, out: str) -> None:
    """One DDP rank: ``train_epoch`` over Prefetcher batches; writes its step time and weights' checksum."""
    import torch.distributed as dist

    from gnnray.train.prefetch import Prefetcher
    from gnnray.train.step import train_epoch

    cuda = device_type == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=dev if cuda else None)
    try:
        torch.manual_seed(0)  # the same initial weights on every rank
        model = build("sage", z)
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
            dist.barrier(device_ids=[dev.index])
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
    import tempfile

    from bench.harness import free_port

    cuda = dev.type == "cuda"
    world, port = torch.cuda.device_count() if cuda else 1, free_port()
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
