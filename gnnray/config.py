"""Stage 0 (driver): the job's configuration, built once from the command line.

Every stage receives the frozen dataclass it needs; nothing reads options from
anywhere else.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Optional, Sequence

from gnnray.errors import ConfigError

DEFAULT_DATA_DIR = os.path.join(os.path.expanduser("~"), ".gnnray", "data")
DEFAULT_STORAGE_PATH = os.path.join(os.path.expanduser("~"), ".gnnray", "runs")


@dataclass(frozen=True)
class DataConfig:
    """Which graph to train on and how to prepare it.

    Attributes:
        dataset: ``ogbn-arxiv``, ``synthetic`` or the path of a graph directory.
        data_dir: Root directory of downloaded or local datasets (OGB layout).
        add_reverse_edges: Add the reverse of every edge; ``None`` means the
            dataset's default (on for directed citation graphs such as arxiv).
        add_self_loops: Add one self loop per node.
        random_features: If > 0, use random features of this dimension for a
            graph without features (load tests only: they carry no signal).
        normalize_features: Scale each node's features to sum to 1 (as the
            GCN preprocessing of bag-of-words graphs such as cora).
        synthetic_nodes: Number of nodes of the synthetic graph.
        synthetic_classes: Number of classes of the synthetic graph.
        synthetic_feat_dim: Feature dimension of the synthetic graph.
        synthetic_avg_degree: Average in-degree of the synthetic graph.
        seed: Seed of the synthetic generator and of random features.
        embedding_dim: If > 0, every node also gets a learnable embedding of
            this size as input (appended to its features; a graph without
            features is then accepted).
    """

    dataset: str = "ogbn-arxiv"
    data_dir: str = DEFAULT_DATA_DIR
    add_reverse_edges: Optional[bool] = None
    add_self_loops: bool = False
    random_features: int = 0
    normalize_features: bool = False
    synthetic_nodes: int = 20_000
    synthetic_classes: int = 8
    synthetic_feat_dim: int = 64
    synthetic_avg_degree: int = 10
    seed: int = 0
    embedding_dim: int = 0


@dataclass(frozen=True)
class SamplerConfig:
    """How seed batches become sampled mini-batches.

    Attributes:
        fanouts: Neighbors sampled per layer, input layer first (as DGL's
            ``NeighborSampler``); ``-1`` takes all neighbors.
        batch_size: Seed nodes per mini-batch, i.e. per train worker and step.
        actors_min: Smallest size of the sampler actor pool.
        actors_max: Largest size of the sampler actor pool.
        cpus_per_actor: CPUs reserved by each sampler actor (Ray sets its
            ``OMP_NUM_THREADS`` from this).
    """

    fanouts: tuple[int, ...] = (10, 10, 10)
    batch_size: int = 1024
    actors_min: int = 1
    actors_max: int = 2
    cpus_per_actor: float = 1.0

    @property
    def num_layers(self) -> int:
        return len(self.fanouts)


@dataclass(frozen=True)
class ModelConfig:
    """The GNN.

    Attributes:
        hidden: Hidden feature size (per attention head for GAT).
        dropout: Dropout probability between layers.
        name: ``sage`` (GraphSAGE), ``gat`` or ``gcn`` (see ``gnnray.model``).
        heads: Attention heads of GAT's hidden layers.
    """

    hidden: int = 256
    dropout: float = 0.5
    name: str = "sage"
    heads: int = 4


@dataclass(frozen=True)
class TrainConfig:
    """The training loop on each Ray Train worker.

    Attributes:
        epochs: Number of epochs.
        lr: Adam learning rate.
        weight_decay: Adam weight decay (L2 penalty).
        num_workers: Number of Ray Train workers (DDP ranks).
        use_gpu: ``True``/``False``, or ``None`` to use GPUs when the cluster
            has any.
        cpus_per_worker: CPUs reserved by each train worker.
        prefetch: Mini-batches each worker prepares ahead of the current step.
        eval_batch_size: Seeds per evaluation mini-batch.
        seed: Seed of shuffling, model initialisation and dropout.
        eval: How the final accuracies are computed: ``layerwise`` (exact,
            all neighbors, ``gnnray.inference``, after training) or
            ``sampled`` (with ``fanouts``, on the train workers). Per-epoch
            validation is always sampled.
        inference_batch_size: Nodes per chunk of layer-wise inference.
        embedding_lr: SparseAdam learning rate of the node embeddings
            (``None``: ``lr``).
    """

    epochs: int = 10
    lr: float = 0.003
    weight_decay: float = 0.0
    num_workers: int = 2
    use_gpu: Optional[bool] = None
    cpus_per_worker: float = 1.0
    prefetch: int = 2
    eval_batch_size: int = 4096
    seed: int = 0
    eval: str = "layerwise"
    inference_batch_size: int = 10_000
    embedding_lr: Optional[float] = None


@dataclass(frozen=True)
class RunConfig:
    """Where the run lives and how it survives failures.

    Attributes:
        name: Run name; the same name and storage path resume a run.
        storage_path: Directory (or URI) holding checkpoints of all runs.
        max_failures: Restarts from the last checkpoint before giving up.
        keep_checkpoints: Checkpoints kept per run (older ones are deleted).
    """

    name: str = "gnnray"
    storage_path: str = DEFAULT_STORAGE_PATH
    max_failures: int = 0
    keep_checkpoints: int = 2


@dataclass(frozen=True)
class JobConfig:
    """Everything one training job needs."""

    data: DataConfig = DataConfig()
    sampler: SamplerConfig = SamplerConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    run: RunConfig = RunConfig()


def from_dict(d: dict) -> JobConfig:
    """Rebuild a :class:`JobConfig` from ``dataclasses.asdict`` output (as checkpoints store it).

    Keys unknown to this version are ignored and missing ones take their
    defaults, so checkpoints of older or newer versions still load.
    """
    from dataclasses import fields

    def part(cls, values: dict):
        names = {f.name for f in fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in (values or {}).items() if k in names})

    return JobConfig(data=part(DataConfig, d.get("data")), sampler=part(SamplerConfig, d.get("sampler")),
                     model=part(ModelConfig, d.get("model")), train=part(TrainConfig, d.get("train")),
                     run=part(RunConfig, d.get("run")))


def _int_list(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip() != "")
    except ValueError:
        raise ConfigError(f"{option} {text!r}: expected comma-separated integers, e.g. 10,10,10") from None
    if not values:
        raise ConfigError(f"{option} {text!r}: give at least one value, e.g. 10,10,10")
    return values


def _bool_or_auto(text: str) -> Optional[bool]:
    value = text.strip().lower()
    if value == "auto":
        return None
    if value in ("1", "yes", "true", "on"):
        return True
    if value in ("0", "no", "false", "off"):
        return False
    raise ConfigError(f"--use-gpu {text!r}: expected auto, yes or no")


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of ``jobs/train_arxiv.py``; ``--help`` documents every option."""
    d = JobConfig()
    p = argparse.ArgumentParser(
        prog="train_arxiv.py",
        description="Train GraphSAGE node classification on a Ray cluster (Ray Train workers fed by "
        "Ray Data sampler actors over a graph held once per node in Ray's object store).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=d.data.dataset,
                   help="ogbn-arxiv, synthetic, or the path of a graph directory (edges.parquet, nodes.parquet, meta.json)")
    g.add_argument("--data-dir", default=d.data.data_dir, help="root directory of local datasets (OGB layout: DATA_DIR/ogbn_arxiv)")
    g.add_argument("--reverse-edges", default="auto", choices=["auto", "yes", "no"],
                   help="add reverse edges (auto: yes for ogbn-arxiv, no for graph directories)")
    g.add_argument("--self-loops", action="store_true", help="add a self loop to every node")
    g.add_argument("--random-features", type=int, default=0, metavar="DIM",
                   help="random features of this dimension for a graph without features (load tests only)")
    g.add_argument("--normalize-features", action="store_true",
                   help="scale each node's features to sum to 1 (bag-of-words graphs such as cora)")
    g.add_argument("--embedding-dim", type=int, default=d.data.embedding_dim, metavar="DIM",
                   help="learnable node embedding of this size as (extra) input, updated sparsely; "
                   "lets a graph without features train (0: off)")
    g.add_argument("--synthetic-nodes", type=int, default=d.data.synthetic_nodes, help="nodes of the synthetic graph")
    g.add_argument("--synthetic-classes", type=int, default=d.data.synthetic_classes, help="classes of the synthetic graph")
    g.add_argument("--synthetic-feat-dim", type=int, default=d.data.synthetic_feat_dim, help="feature size of the synthetic graph")
    g.add_argument("--synthetic-avg-degree", type=int, default=d.data.synthetic_avg_degree, help="average in-degree of the synthetic graph")

    g = p.add_argument_group("sampling")
    g.add_argument("--fanouts", default=",".join(map(str, d.sampler.fanouts)),
                   help="neighbors sampled per layer, input layer first; the number of layers is the number of fanouts; -1 takes all neighbors (write --fanouts=-1,-1)")
    g.add_argument("--batch-size", type=int, default=d.sampler.batch_size, help="seed nodes per mini-batch per train worker")
    g.add_argument("--sampler-actors", default=f"{d.sampler.actors_min},{d.sampler.actors_max}", metavar="MIN,MAX",
                   help="size of the sampler actor pool (a single number fixes it)")
    g.add_argument("--cpus-per-sampler", type=float, default=d.sampler.cpus_per_actor, help="CPUs per sampler actor")

    g = p.add_argument_group("model")
    g.add_argument("--model", default=d.model.name, choices=["sage", "gat", "gcn"],
                   help="GraphSAGE (SAGEConv mean), GAT (GATConv) or GCN (GraphConv); gat and gcn want --self-loops")
    g.add_argument("--hidden", type=int, default=d.model.hidden, help="hidden feature size (per head for gat)")
    g.add_argument("--heads", type=int, default=d.model.heads, help="attention heads of gat's hidden layers")
    g.add_argument("--dropout", type=float, default=d.model.dropout, help="dropout probability")

    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=d.train.epochs, help="number of epochs")
    g.add_argument("--lr", type=float, default=d.train.lr, help="Adam learning rate")
    g.add_argument("--weight-decay", type=float, default=d.train.weight_decay, help="Adam weight decay")
    g.add_argument("--num-workers", type=int, default=d.train.num_workers, help="Ray Train workers (DDP ranks)")
    g.add_argument("--use-gpu", default="auto", metavar="{auto,yes,no}", help="train on GPUs (auto: when the cluster has any)")
    g.add_argument("--cpus-per-worker", type=float, default=d.train.cpus_per_worker, help="CPUs per train worker")
    g.add_argument("--prefetch", type=int, default=d.train.prefetch, help="mini-batches prepared ahead per worker")
    g.add_argument("--eval-batch-size", type=int, default=d.train.eval_batch_size, help="seeds per evaluation mini-batch")
    g.add_argument("--eval", default=d.train.eval, choices=["layerwise", "sampled"],
                   help="final accuracies: layerwise (exact, all neighbors, a Ray Data job after training) or sampled "
                   "(with --fanouts, on the train workers); per-epoch validation is sampled either way")
    g.add_argument("--inference-batch-size", type=int, default=d.train.inference_batch_size,
                   help="nodes per chunk of layer-wise inference")
    g.add_argument("--embedding-lr", type=float, default=None,
                   help="SparseAdam learning rate of --embedding-dim embeddings (default: --lr)")
    g.add_argument("--seed", type=int, default=d.train.seed, help="random seed (shuffling, initialisation, synthetic data)")

    g = p.add_argument_group("run")
    g.add_argument("--name", default=d.run.name, help="run name; the same name and storage path resume the run")
    g.add_argument("--storage-path", default=d.run.storage_path, help="where checkpoints are kept (directory or URI)")
    g.add_argument("--max-failures", type=int, default=d.run.max_failures, help="restarts from the last checkpoint before giving up")
    g.add_argument("--keep-checkpoints", type=int, default=d.run.keep_checkpoints, help="checkpoints kept per run")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> JobConfig:
    """Parse the command line into a validated :class:`JobConfig`.

    Raises:
        ConfigError: An option has an invalid value.
    """
    a = build_parser().parse_args(argv)
    lo_hi = _int_list(a.sampler_actors, "--sampler-actors")
    if len(lo_hi) > 2:
        raise ConfigError(f"--sampler-actors {a.sampler_actors!r}: expected MIN,MAX or a single number")
    reverse = {"auto": None, "yes": True, "no": False}[a.reverse_edges]
    cfg = JobConfig(
        data=DataConfig(
            dataset=a.dataset, data_dir=a.data_dir, add_reverse_edges=reverse, add_self_loops=a.self_loops,
            random_features=a.random_features, normalize_features=a.normalize_features, synthetic_nodes=a.synthetic_nodes,
            synthetic_classes=a.synthetic_classes, synthetic_feat_dim=a.synthetic_feat_dim,
            synthetic_avg_degree=a.synthetic_avg_degree, seed=a.seed, embedding_dim=a.embedding_dim,
        ),
        sampler=SamplerConfig(
            fanouts=_int_list(a.fanouts, "--fanouts"), batch_size=a.batch_size,
            actors_min=lo_hi[0], actors_max=lo_hi[-1], cpus_per_actor=a.cpus_per_sampler,
        ),
        model=ModelConfig(hidden=a.hidden, dropout=a.dropout, name=a.model, heads=a.heads),
        train=TrainConfig(
            epochs=a.epochs, lr=a.lr, weight_decay=a.weight_decay, num_workers=a.num_workers, use_gpu=_bool_or_auto(a.use_gpu),
            cpus_per_worker=a.cpus_per_worker, prefetch=a.prefetch, eval_batch_size=a.eval_batch_size, seed=a.seed,
            eval=a.eval, inference_batch_size=a.inference_batch_size, embedding_lr=a.embedding_lr,
        ),
        run=RunConfig(name=a.name, storage_path=a.storage_path, max_failures=a.max_failures,
                      keep_checkpoints=a.keep_checkpoints),
    )
    validate(cfg)
    return cfg


def validate(cfg: JobConfig) -> None:
    """Check values that argparse cannot; raise :class:`ConfigError` naming the option."""
    checks = [
        (all(f > 0 or f == -1 for f in cfg.sampler.fanouts), f"--fanouts {cfg.sampler.fanouts}: each fanout must be a positive integer (or -1 for all neighbors)"),
        (cfg.sampler.batch_size > 0, f"--batch-size {cfg.sampler.batch_size}: must be at least 1"),
        (1 <= cfg.sampler.actors_min <= cfg.sampler.actors_max, f"--sampler-actors {cfg.sampler.actors_min},{cfg.sampler.actors_max}: need 1 <= MIN <= MAX"),
        (cfg.sampler.cpus_per_actor > 0, "--cpus-per-sampler: must be > 0"),
        (cfg.model.hidden > 0, f"--hidden {cfg.model.hidden}: must be at least 1"),
        (0.0 <= cfg.model.dropout < 1.0, f"--dropout {cfg.model.dropout}: must be in [0, 1)"),
        (cfg.train.epochs > 0, f"--epochs {cfg.train.epochs}: must be at least 1"),
        (cfg.train.lr > 0, f"--lr {cfg.train.lr}: must be > 0"),
        (cfg.train.weight_decay >= 0, f"--weight-decay {cfg.train.weight_decay}: must be >= 0"),
        (cfg.train.num_workers > 0, f"--num-workers {cfg.train.num_workers}: must be at least 1"),
        (cfg.train.cpus_per_worker > 0, "--cpus-per-worker: must be > 0"),
        (cfg.train.prefetch >= 1, f"--prefetch {cfg.train.prefetch}: must be at least 1"),
        (cfg.train.eval_batch_size > 0, f"--eval-batch-size {cfg.train.eval_batch_size}: must be at least 1"),
        (cfg.data.random_features >= 0, f"--random-features {cfg.data.random_features}: must be >= 0"),
        (cfg.data.embedding_dim >= 0, f"--embedding-dim {cfg.data.embedding_dim}: must be >= 0 (0: no embedding)"),
        (cfg.model.name in ("sage", "gat", "gcn"), f"--model {cfg.model.name!r}: choose sage, gat or gcn"),
        (cfg.model.heads >= 1, f"--heads {cfg.model.heads}: must be at least 1"),
        (cfg.train.eval in ("layerwise", "sampled"), f"--eval {cfg.train.eval!r}: choose layerwise or sampled"),
        (cfg.train.inference_batch_size > 0, f"--inference-batch-size {cfg.train.inference_batch_size}: must be at least 1"),
        (cfg.train.embedding_lr is None or cfg.train.embedding_lr > 0, f"--embedding-lr {cfg.train.embedding_lr}: must be > 0"),
        (cfg.run.max_failures >= 0, f"--max-failures {cfg.run.max_failures}: must be >= 0"),
        (cfg.run.keep_checkpoints >= 1, f"--keep-checkpoints {cfg.run.keep_checkpoints}: must be at least 1"),
        (bool(cfg.run.name) and "/" not in cfg.run.name, f"--name {cfg.run.name!r}: must be a non-empty name without '/'"),
    ]
    if cfg.data.dataset == "synthetic":
        checks += [
            (cfg.data.synthetic_nodes >= 10, "--synthetic-nodes: must be at least 10"),
            (cfg.data.synthetic_classes >= 2, "--synthetic-classes: must be at least 2"),
            (cfg.data.synthetic_feat_dim >= 1, "--synthetic-feat-dim: must be at least 1"),
            (cfg.data.synthetic_avg_degree >= 1, "--synthetic-avg-degree: must be at least 1"),
        ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
