"""What rank 0 hands the driver: the epoch's metrics line, a checkpoint when due, and progress within the epoch.

The metrics line goes to ``STORAGE_PATH/NAME/metrics.jsonl`` (the driver
prints it, tools read it) and through ``ray.train.report`` every epoch, with a
checkpoint when ``checkpoint.Schedule`` says one is due; a checkpoint within an
epoch (:func:`report_position`) is reported on its own. The run's directory is
a path or an object store's URI (``gnnray.run_storage``). The checkpoint is written
in place there and reported to Ray Train without an upload: with
``--feature-shards`` each embedding owner writes its own rows from its node, so
no process gathers the table (``train.checkpoint``), and ``meta.json``, written
last, must follow every other file, which Ray Train's upload of a local
directory would not ensure.

An elastic run also keeps ``workers.jsonl`` (:func:`log_event`): a line for
each worker-group start (its world size and where its stream starts) and for
each preemption notice, from which the driver prints its resize lines.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from typing import Optional

import torch

from gnnray import run_storage
from gnnray.heap import trim_heap
from gnnray.run_storage import METRICS_LOG, PROGRESS_FILE, WORKERS_LOG
from gnnray.train import checkpoint
from gnnray.train.embedding import EmbeddingTable

# How often rank 0 rewrites the progress file: each rewrite of an object is a request on the training thread.
PROGRESS_EVERY_S = {False: 0.5, True: 5.0}  # a file, an object


def log_event(run_dir: str, event: str, **fields) -> dict:
    """Append ``{"event", "time", **fields}`` to the run's :data:`WORKERS_LOG`; return it.

    One writer at a time: the driver before ``fit``, then each worker group's
    stream as the group starts, then that group's rank 0.
    """
    line = {"event": event, "time": time.time(), **fields}
    run_storage.append(run_storage.join(run_dir, WORKERS_LOG), (json.dumps(line) + "\n").encode())
    return line


def events(run_dir: str) -> list[dict]:
    """The complete lines of the run's :data:`WORKERS_LOG` (none if it has none)."""
    try:
        text = run_storage.read_bytes(run_storage.join(run_dir, WORKERS_LOG)).decode()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def saved_config(cfg, custom_model: bool) -> dict:
    """The configuration a checkpoint stores, so that ``jobs/predict.py`` can rebuild model and graph."""
    return {**dataclasses.asdict(cfg), "custom_model": custom_model}


class Progress:
    """Rank 0's progress within an epoch, written at most every ``every_s`` seconds for the driver's progress bar
    (default :data:`PROGRESS_EVERY_S`)."""

    def __init__(self, run_dir: Optional[str], every_s: Optional[float] = None):
        self._path = run_storage.join(run_dir, PROGRESS_FILE) if run_dir else None
        self._every_s = PROGRESS_EVERY_S[run_storage.is_uri(run_dir or "")] if every_s is None else every_s
        self._last = 0.0

    def update(self, epoch: int, step: int, steps: int) -> None:
        now = time.monotonic()
        if self._path is None or (now - self._last < self._every_s and step < steps):
            return
        self._last = now
        try:
            run_storage.write_bytes(self._path, f"{epoch} {step} {steps}".encode(), sync=False)
        except OSError:  # only the progress bar misses it: a store's failed request must not end the attempt
            pass


class PrivateMemory:
    """The largest private memory (USS, MiB) of the ranks' processes; flat over epochs in a healthy run.

    USS leaves out the node-shared graph, so it shows what each process holds
    by itself (``worker_uss_mb`` in the metrics). Free memory the C allocator
    keeps is handed back first (glibc ``malloc_trim``): it is not growth.
    Reading USS walks the process's page tables, a cost that grows with the
    process: a rank reads it again only once ``share`` of the time since its
    last reading pays for it, and passes on its last reading in between, so
    that short epochs do not spend their time on it.
    """

    def __init__(self, share: float = 0.01):
        self._share, self._uss_mb, self._next = share, 0.0, 0.0

    def max_mb(self, device, fresh: bool = False) -> float:
        """Every rank calls it at the same point (an all-reduce); ``fresh`` reads USS now, whatever its cost."""
        import psutil
        import torch.distributed as dist

        now = time.monotonic()
        if fresh or now >= self._next:
            trim_heap()
            self._uss_mb = psutil.Process().memory_full_info().uss / 2**20
            self._next = now + (time.monotonic() - now) / self._share
        uss = torch.tensor(self._uss_mb, dtype=torch.float64, device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(uss, op=dist.ReduceOp.MAX)
        return float(uss)


def report(metrics: dict, model, optimizer, rank: int, run_dir: Optional[str],
           embedding: Optional[EmbeddingTable] = None, config: Optional[dict] = None, save: bool = True) -> None:
    """Report an epoch's ``metrics`` to Ray Train (every rank, every epoch); rank 0 first appends them to
    ``run_dir``'s :data:`METRICS_LOG` and, with ``save``, attaches a checkpoint written there (``config`` stored
    in it). Without ``run_dir`` (where Ray Train's storage is a local directory): no log, and the checkpoint goes
    to Ray Train's run directory."""
    import ray.train

    if rank != 0:
        ray.train.report(metrics)
        return
    # The log line goes first: a crash between the two then repeats the
    # epoch's line after the restart, rather than losing it while its
    # checkpoint exists.
    if run_dir:
        run_storage.append(run_storage.join(run_dir, METRICS_LOG), (json.dumps(metrics) + "\n").encode())
    if not save:
        ray.train.report(metrics)
        return
    _report_with_checkpoint(metrics, model, optimizer, run_dir, embedding, config)


def report_position(position: dict, model, optimizer, rank: int, run_dir: Optional[str],
                    embedding: Optional[EmbeddingTable] = None, config: Optional[dict] = None) -> None:
    """A checkpoint within an epoch: every rank calls it at the same step (``ray.train.report`` waits for all);
    rank 0 writes it. ``position`` holds ``epoch`` (the last completed), ``step`` (done of the next one) and
    ``best_val_acc``; no metrics line is written."""
    import ray.train

    if rank != 0:
        ray.train.report(position)
        return
    _report_with_checkpoint(position, model, optimizer, run_dir, embedding, config)


def _report_with_checkpoint(metrics: dict, model, optimizer, run_dir: Optional[str],
                            embedding: Optional[EmbeddingTable], config: Optional[dict]) -> None:
    import posixpath

    import ray.train

    ray_storage = ray.train.get_context().get_storage()  # the same directory as run_dir, resolved by Ray Train
    name = f"checkpoint_{datetime.datetime.now():%Y-%m-%d_%H-%M-%S.%f}"  # Ray's own naming
    fs_path = posixpath.join(ray_storage.experiment_fs_path, name)
    path = run_storage.join(run_dir, name) if run_dir else fs_path
    run_storage.make_dirs(path)
    # The embedding's files first (written where its rows are), then state.pt, then meta.json listing them all.
    entry = embedding.save(path) if embedding else None
    checkpoint.save(path, getattr(model, "module", model), optimizer, metrics, config=config, embedding=entry)
    ray.train.report(metrics, checkpoint=ray.train.Checkpoint(fs_path, filesystem=ray_storage.storage_filesystem),
                     checkpoint_dir_name=name, checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD)
