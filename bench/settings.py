"""What the figures of ``python -m bench`` share: the settings, the graph and its ``--quick`` cut, a job."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import numpy as np

from bench.harness import DEFAULT_DATASET
from gnnray.config import DataConfig, JobConfig, ModelConfig, RunConfig, SamplerConfig, TrainConfig
from gnnray.cpus import node_cores


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every measurement uses; ``--quick`` shrinks only the amounts of work."""

    quick: bool
    cores: int  # physical cores both sides of every comparison get
    fanouts: tuple = (15, 10, 5)
    batch_size: int = 1024
    hidden: int = 256
    dropout: float = 0.5
    lr: float = 0.003
    seed: int = 0
    epochs: int = 4  # a job's epochs (steady: all but the first and the last)
    workers: int = 1  # Ray Train workers; they share the cores (trainer_cpus)
    samplers: int = 1  # sampler actors in the pool
    ddp_workers: int = 2  # the whole runs' DDP configuration
    wall_epochs: tuple = (1, 4)  # whole runs: a short and a longer run; their difference is steady state
    wall_repeats: int = 3  # interleaved rounds; each figure is their median
    wall_only: tuple = ()  # wall.SHORT_NAMES of the configurations to run (empty: all)
    quick_train_batches: int = 20  # --quick: training/validation/test nodes kept, in batches
    quick_eval_batches: int = 2

    @property
    def trainer_cpus(self) -> int:
        """All the cores, split between workers: sampling a batch costs a small fraction of a step, so the
        trainers get every core, as the DGL loop does (Ray's logical CPUs are oversubscribed to allow it)."""
        return max(1, self.cores // self.workers)


def job_config(data: DataConfig, s: Settings, workdir: Path, name: str = "bench") -> JobConfig:
    """The job ``s`` describes (the DGL loops build theirs from it too); runs under one ``workdir`` need distinct
    ``name`` s. Sampled final accuracies, as the DGL loop computes them; threads from the job's CPU plan unless
    ``--cores`` leaves the comparison fewer cores than the node has."""
    import torch

    return JobConfig(
        data=data,
        sampler=SamplerConfig(fanouts=tuple(s.fanouts), batch_size=s.batch_size, actors=(s.samplers,),
                              cpus_per_actor=1.0),
        model=ModelConfig(hidden=s.hidden, dropout=s.dropout),
        train=TrainConfig(epochs=s.epochs, lr=s.lr, num_workers=s.workers, use_gpu=torch.cuda.is_available(),
                          eval="sampled", trainer_threads=s.trainer_cpus if s.cores < node_cores() else 0),
        run=RunConfig(name=name, storage_path=str(workdir / "runs"), max_failures=0, seed=s.seed),
    )


def metrics_log(cfg: JobConfig) -> Path:
    """The run's ``metrics.jsonl`` (one JSON line per epoch; runs under a local storage path)."""
    from gnnray.run_storage import METRICS_LOG

    return Path(cfg.run.storage_path) / cfg.run.name / METRICS_LOG


def epochs_of(cfg: JobConfig) -> list[dict]:
    return [json.loads(line) for line in metrics_log(cfg).read_text().splitlines() if line.strip()]


def base_data_config(dataset: Optional[str]) -> DataConfig:
    """The arxiv structure with 128 random features, else an arxiv-sized synthetic graph."""
    path = Path(dataset).expanduser() if dataset and dataset != "synthetic" else DEFAULT_DATASET
    if dataset != "synthetic" and path.is_dir():
        return DataConfig(dataset=str(path), reverse_edges=True, random_features=128)
    if dataset not in (None, "synthetic"):
        raise SystemExit(f"--dataset {dataset}: no such directory")
    if dataset is None:
        print(f"{DEFAULT_DATASET} not found: using the arxiv-sized synthetic graph", flush=True)
    return DataConfig(dataset="synthetic", synthetic_nodes=169_343, synthetic_feat_dim=128, synthetic_classes=40)


def quick_data_config(graph, s: Settings, workdir: Path) -> DataConfig:
    """``graph`` as a graph directory whose splits are cut to a few batches (``--quick``): the same nodes, edges
    and feature size, so a batch costs what it does on the full graph; only epochs get shorter."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = workdir / "quick-graph"
    out.mkdir(parents=True, exist_ok=True)
    rng, n = np.random.default_rng(s.seed), graph.num_nodes
    split = np.full(n, "none", dtype=object)
    keep = {"train": s.quick_train_batches, "valid": s.quick_eval_batches, "test": s.quick_eval_batches}
    for name, batches in keep.items():
        ids = graph.split(name)
        split[rng.choice(ids, min(len(ids), batches * s.batch_size), replace=False)] = name
    dst = np.repeat(np.arange(n, dtype=np.int64), np.diff(graph.indptr))
    pq.write_table(pa.table({"src": graph.indices, "dst": dst}), out / "edges.parquet")
    pq.write_table(pa.table({"id": np.arange(n, dtype=np.int64), "label": graph.label,
                             "split": pa.array(split, type=pa.string())}), out / "nodes.parquet")
    (out / "meta.json").write_text(json.dumps({"num_nodes": n, "num_classes": graph.num_classes,
                                               "name": f"{graph.name}-quick"}))
    return DataConfig(dataset=str(out), reverse_edges=False, random_features=graph.feat_dim)
