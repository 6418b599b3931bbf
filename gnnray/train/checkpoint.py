"""Checkpoints: written by rank 0 at epoch ends (:class:`Schedule`) and within epochs (``--checkpoint-every``,
a preemption notice), chosen by the driver on resume (an elastic run: by its stream, ``controller/split.py``).

A checkpoint's position is ``(epoch, step)``: ``epoch`` is the last completed
epoch (``-1``: none) and ``step`` the steps done of the next one (``0`` at an
epoch's end), so code that reads only ``epoch`` treats a checkpoint within an
epoch as the epoch before it, and a run is finished only by the checkpoint at
the end of its last epoch. Resume continues at :func:`gnnray.train.stream_start.next_position`.

A checkpoint directory holds ``state.pt`` (model, optimizer, epoch, best
validation accuracy), with ``--embedding-dim`` one directory per embedding
shard, ``embedding/rows-LO-HI/`` (``weight.npy``, ``exp_avg.npy``,
``exp_avg_sq.npy``, ``step.npy``: rows ``[LO, HI)`` and their SparseAdam state,
written by whoever holds those rows, an owner on its node with
``--feature-shards``), and ``meta.json`` (epoch, metrics, the size of every
other file, the embedding shards and the job configuration). No process holds
the whole embedding table to write or read it: a reader takes the rows it
needs from the shards that overlap them (:func:`read_rows`), so a checkpoint of
K=1 resumes with K=3 and back. Older checkpoints kept the whole table in
``state.pt`` (``embedding``); they still load, memory-mapped.
The directory is a path or an object store's URI (``gnnray.run_storage``: every
file is written whole or not at all). ``meta.json`` is written last, so a crash
mid-write leaves a directory without a valid ``meta.json``:
:func:`latest_valid` skips it and resume falls back to the previous one.
``meta.json`` records the files' sizes, so a torn copy is caught the same way.
A checkpoint whose files are complete but whose ``state.pt`` does not load or
lacks a key is *corrupt* (:func:`corrupt_reason`): it is skipped too, and the
driver stops rather than start over when no older good one is left.

The driver, not the worker, chooses the checkpoint because the seed stream it
builds must start at the step after the one the model resumes from.
"""

from __future__ import annotations

import io
import json
import pickle
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from gnnray import run_storage
from gnnray.errors import CheckpointError

STATE_FILE = "state.pt"
META_FILE = "meta.json"
EMBEDDING_DIR = "embedding"
# An embedding shard's files: its rows, then DGL SparseAdam's state of each row.
EMBEDDING_ARRAYS = ("weight", "exp_avg", "exp_avg_sq", "step")
# What a resume needs from state.pt (``embedding`` too when the run learns embeddings; ``step``, within an epoch,
# is 0 when missing, as in checkpoints of epoch ends and of older versions).
REQUIRED_KEYS = ("model", "optimizer", "epoch", "best_val_acc")


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint found in storage.

    Attributes:
        path: Its directory.
        epoch: The last completed epoch it holds.
        metrics: The metrics reported with it.
        step: Steps done of epoch ``epoch + 1`` (0: written at the end of ``epoch``).
    """

    path: str
    epoch: int
    metrics: dict
    step: int = 0


class Schedule:
    """When rank 0 writes a checkpoint (``--checkpoint-interval``).

    Once ``interval_s`` seconds have passed since the last checkpoint (or since
    the schedule was made, at the attempt's start), and always when ``final``:
    after the last epoch, and before any planned stop. A restart then loses at
    most ``interval_s`` of work, and short epochs do not pay for a checkpoint
    each. Ray Train still gets every epoch's metrics, without a checkpoint.
    The test is cheap: it may be asked at any point where a checkpoint can be
    taken, not only at epoch ends. ``clock`` is for tests.
    """

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self._interval_s, self._clock = interval_s, clock
        self._last = clock()

    def due(self, final: bool = False) -> bool:
        return final or self._clock() - self._last >= self._interval_s

    def saved(self) -> None:
        """Restart the interval: a checkpoint was just written."""
        self._last = self._clock()


def save(directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, metrics: dict[str, Any],
         extra: Optional[dict[str, Any]] = None, config: Optional[dict[str, Any]] = None,
         embedding: Optional[dict[str, Any]] = None) -> None:
    """Write a checkpoint of the epoch ``metrics["epoch"]`` into ``directory`` (crash-safe, see the module docstring).

    Args:
        directory: Where to write.
        model: Its ``state_dict`` is saved as ``model``.
        optimizer: Its ``state_dict`` is saved as ``optimizer``.
        metrics: The epoch's metrics (``epoch``, ``best_val_acc``, ...); within an epoch, ``epoch`` is the
            last completed one and ``step`` the steps done of the next.
        extra: More entries of ``state.pt`` (e.g. ``embedding``).
        config: JSON-able job configuration (``dataclasses.asdict(JobConfig)``)
            stored in ``meta.json`` so that ``jobs/predict.py`` can rebuild the
            model and the graph.
        embedding: ``{"num_nodes", "dim", "shards"}``, the shards being what
            :func:`write_rows` returned for each, already in ``directory``.
    """
    epoch, step = int(metrics["epoch"]), int(metrics.get("step", 0))
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch, "step": step,
             "best_val_acc": float(metrics["best_val_acc"]), **(extra or {})}
    size = run_storage.write(run_storage.join(directory, STATE_FILE), lambda f: torch.save(state, f))
    meta = {"epoch": epoch, "step": step, "state_bytes": size, "metrics": metrics}
    if embedding is not None:
        meta["embedding"] = embedding
    if config is not None:
        meta["config"] = config
    run_storage.write_bytes(run_storage.join(directory, META_FILE), json.dumps(meta).encode())


def read_meta(directory: str) -> dict:
    """Return ``meta.json`` of the checkpoint in ``directory`` (``epoch``, ``metrics``, ``config`` if saved)."""
    return json.loads(run_storage.read_bytes(run_storage.join(directory, META_FILE)))


def update_metrics(directory: str, metrics: dict[str, Any]) -> None:
    """Merge ``metrics`` into the checkpoint's ``meta.json`` (atomically), e.g. accuracies computed after training."""
    meta = read_meta(directory)
    meta["metrics"] = {**meta["metrics"], **metrics}
    run_storage.write_bytes(run_storage.join(directory, META_FILE), json.dumps(meta).encode())


def load_state(directory: str, mmap: bool = False) -> dict:
    """Return the state saved in ``directory``: ``model``, ``optimizer``, ``epoch``, ``best_val_acc``.

    ``mmap``: a file's tensors are memory-mapped, read when used (an older
    checkpoint's ``state.pt`` holds the embedding table); an object is read whole.
    Only tensors, containers and numbers are unpickled (``weights_only``): a
    checkpoint can come from a bucket others write to, and on torch < 2.6
    ``torch.load`` would otherwise run whatever code a pickle names.
    """
    location = run_storage.join(directory, STATE_FILE)
    try:
        if run_storage.is_uri(location):
            return torch.load(io.BytesIO(run_storage.read_bytes(location)), map_location="cpu", weights_only=True)
        return torch.load(run_storage.normalize(location), map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only" not in str(e).lower():
            raise
        raise CheckpointError(f"{location} holds objects other than tensors, dicts and numbers, so it was not "
                              f"written by gnnray and is not loaded (loading it could run code): resume from "
                              f"another checkpoint or delete this one") from None


def read_info(directory: str) -> Optional[CheckpointInfo]:
    """Return the checkpoint in ``directory``, or ``None`` if it is missing or incomplete."""
    try:
        meta = read_meta(directory)
        complete = run_storage.size(run_storage.join(directory, STATE_FILE)) == meta["state_bytes"]
        for shard in (meta.get("embedding") or {}).get("shards", ()):  # each owner's files, whole
            complete &= all(run_storage.size(run_storage.join(directory, shard["dir"], name)) == size
                            for name, size in shard["bytes"].items())
        info = CheckpointInfo(directory, int(meta["epoch"]), dict(meta["metrics"]), int(meta.get("step", 0)))
        return info if complete else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def corrupt_reason(directory: str, extra_keys: Sequence[str] = ()) -> Optional[str]:
    """Why a checkpoint whose files are complete cannot be resumed from, or ``None``.

    Loads ``state.pt`` and checks that it holds :data:`REQUIRED_KEYS` and
    ``extra_keys``. A checkpoint that is merely incomplete (see
    :func:`read_info`) also gives ``None``: only a complete one can be corrupt.
    """
    info = read_info(directory)
    if info is None:
        return None
    try:
        # Memory-mapped: the check reads the pickled structure, not every tensor's bytes; an older checkpoint's
        # state holds the embedding table.
        state = load_state(directory, mmap=True)
    except Exception as exc:  # torch.load raises many types on damaged files
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return f"{STATE_FILE} does not load ({type(exc).__name__}: {first})"
    if not isinstance(state, dict):
        return f"{STATE_FILE} holds a {type(state).__name__}, not a dict"
    meta = read_meta(directory)
    # The embedding is in its shard files (listed in meta.json) or, in older checkpoints, in state.pt.
    in_meta = {"embedding"} & set(meta)
    missing = [k for k in (*REQUIRED_KEYS, *extra_keys) if k not in state and k not in in_meta]
    if missing:
        return f"{STATE_FILE} lacks {', '.join(map(repr, missing))}"
    if (state["epoch"], state.get("step", 0)) != (info.epoch, info.step):
        return (f"{STATE_FILE} is of epoch {state['epoch']} step {state.get('step', 0)} but {META_FILE} says epoch "
                f"{info.epoch} step {info.step}")
    if "embedding" in meta:
        return _embedding_reason(directory, meta["embedding"])
    return None


def _embedding_reason(directory: str, emb: dict) -> Optional[str]:
    """Why the embedding shards listed in ``meta.json`` cannot be read back, or ``None``."""
    try:
        shards = sorted(emb["shards"], key=lambda s: s["lo"])
        ranges = [(s["lo"], s["hi"]) for s in shards]
        if [lo for lo, _ in ranges] != [0] + [hi for _, hi in ranges[:-1]] or ranges[-1][1] != emb["num_nodes"]:
            return f"its embedding shards {ranges} do not cover rows 0-{emb['num_nodes']}"
        for s in shards:
            for name in EMBEDDING_ARRAYS:
                shape = run_storage.npy_header(run_storage.join(directory, s["dir"], name + ".npy"))[0]
                if shape[0] != s["hi"] - s["lo"] or (len(shape) == 2 and shape[1] != emb["dim"]):
                    return f"{s['dir']}/{name}.npy has shape {shape} for rows {s['lo']}-{s['hi']}"
    except Exception as exc:  # np.load raises many types on damaged files
        return f"its embedding shards do not load ({type(exc).__name__}: {str(exc)[:200]})"
    return None


def write_rows(directory: str, lo: int, hi: int, arrays: dict[str, np.ndarray]) -> dict:
    """Write rows ``[lo, hi)`` of an embedding table and their optimizer state (:data:`EMBEDDING_ARRAYS`) into
    checkpoint ``directory``; return the shard's entry for ``meta.json`` (call where the rows are)."""
    sub = f"{EMBEDDING_DIR}/rows-{lo:012d}-{hi:012d}"
    sizes = {name + ".npy": run_storage.save_npy(run_storage.join(directory, sub, name + ".npy"), arrays[name])
             for name in EMBEDDING_ARRAYS}
    return {"lo": lo, "hi": hi, "dir": sub, "bytes": sizes}


def read_rows(directory: str, lo: int, hi: int, names: Sequence[str] = EMBEDDING_ARRAYS) -> dict[str, np.ndarray]:
    """Rows ``[lo, hi)`` of the embedding table and their optimizer state saved in checkpoint ``directory``.

    Read from whichever shard files overlap the range, and only these rows
    (memory-mapped files, ranged reads of objects), whatever the shards of
    the run that wrote it. An
    older checkpoint (the whole table in ``state.pt``, torch's ``SparseAdam``
    state) is read the same way; its rows get the old global step count where
    their moments are non-zero (torch's bias correction had no per-row count).
    """
    meta = read_meta(directory)
    if "embedding" not in meta:
        return _legacy_rows(directory, lo, hi, names)
    emb = meta["embedding"]
    out = {}
    for s in emb["shards"]:
        a, b = max(lo, s["lo"]), min(hi, s["hi"])
        if a >= b:
            continue
        for name in names:
            part = run_storage.npy_rows(run_storage.join(directory, s["dir"], name + ".npy"), a - s["lo"], b - s["lo"])
            if name not in out:
                out[name] = np.empty((hi - lo, *part.shape[1:]), dtype=part.dtype)
            out[name][a - lo:b - lo] = part
    return out


def _legacy_rows(directory: str, lo: int, hi: int, names: Sequence[str]) -> dict[str, np.ndarray]:
    state = load_state(directory, mmap=True)
    if "embedding" not in state:
        raise CheckpointError(f"checkpoint {directory} holds no node embeddings (neither embedding shards in "
                              f"{META_FILE} nor a table in {STATE_FILE}); was it written without --embedding-dim?")
    weight = state["embedding"]["weight"]
    opt = state["embedding"].get("optimizer", {}).get("state", {}).get(0)
    rows = {"weight": weight[lo:hi].numpy().copy()}
    if opt:
        rows["exp_avg"] = opt["exp_avg"].to_dense()[lo:hi].numpy().copy()
        rows["exp_avg_sq"] = opt["exp_avg_sq"].to_dense()[lo:hi].numpy().copy()
        touched = (rows["exp_avg_sq"] != 0).any(axis=1)
        rows["step"] = np.where(touched, int(opt["step"]), 0).astype(np.int32)
    else:
        rows["exp_avg"] = np.zeros_like(rows["weight"])
        rows["exp_avg_sq"] = np.zeros_like(rows["weight"])
        rows["step"] = np.zeros(hi - lo, dtype=np.int32)
    return {k: rows[k] for k in names}


def embedding_info(directory: str) -> Optional[dict]:
    """``{"num_nodes", "dim", "shards"}`` of the checkpoint's embedding (``shards`` empty in older checkpoints,
    whose table is in ``state.pt``), or ``None`` if it has none."""
    meta = read_meta(directory)
    if "embedding" in meta:
        return meta["embedding"]
    state = load_state(directory, mmap=True)
    if "embedding" not in state:
        return None
    n, dim = state["embedding"]["weight"].shape
    return {"num_nodes": int(n), "dim": int(dim), "shards": []}


def latest_valid(run_dir: str, extra_keys: Sequence[str] = ()) -> tuple[Optional[CheckpointInfo], list[str]]:
    """Find the newest valid checkpoint of a run.

    Complete checkpoints are tried newest first (furthest position, then
    name: Ray names them by time) until one passes :func:`corrupt_reason` (with
    ``extra_keys``), so a corrupt newest one falls back to the one before.

    Returns:
        The newest valid checkpoint (``None`` if none is) and the checkpoint
        directories that were skipped as incomplete or corrupt.
    """
    found, bad = [], []
    for name in run_storage.list_dirs(run_dir):
        if not name.startswith("checkpoint_"):
            continue
        path = run_storage.join(run_dir, name)
        info = read_info(path)
        (found.append(info) if info else bad.append(path))
    for info in sorted(found, key=lambda c: (c.epoch, c.step, c.path), reverse=True):
        if corrupt_reason(info.path, extra_keys) is None:
            return info, bad
        bad.append(info.path)
    return None, bad
