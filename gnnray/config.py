"""Stage 0 (driver): the job's configuration, built once from the command line.

Every option is written once, as a field of a frozen dataclass made with
:func:`option`: its help, its flag (``--`` and the field name with dashes,
unless ``flag=`` says otherwise) and its check sit beside it, and
:func:`build_parser` and :func:`parse_args` are generated from the fields.
A configuration is checked when it is built (``__post_init__``), so an
invalid one cannot exist, whether it came from the command line, from code or
from a checkpoint.

Why a small helper and not tyro, simple-parsing or jsonargparse: the flags
users know (``--sampler-actors MIN,MAX``, ``--use-gpu auto|yes|no``,
``--fanouts 10,10,10``) would need custom parsers there too, the checks must
name the flag in gnnray's own error format, and the install stays small.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional, Sequence

from gnnray.errors import ConfigError, GnnrayError
from gnnray.fanouts import Fanouts, int_list

DEFAULT_DATA_DIR = os.path.join(os.path.expanduser("~"), ".gnnray", "data")
DEFAULT_STORAGE_PATH = os.path.join(os.path.expanduser("~"), ".gnnray", "runs")


def option(default: Any, help: str, *, flag: Optional[str] = None, check: Optional[Callable[[Any], bool]] = None,
           need: str = "", choices: Optional[Sequence[str]] = None, metavar: Optional[str] = None) -> Any:
    """A configuration field that is also a command-line option.

    Args:
        default: The default value.
        help: What ``--help`` says.
        flag: The flag, if not ``--field-name``.
        check: Predicate the value must pass.
        need: What ``check`` requires, said in the error (``"must be at least 1"``).
        choices: Allowed values of a string option.
        metavar: Placeholder in ``--help``.
    """
    meta = dict(help=help, flag=flag, check=check, need=need, choices=choices, metavar=metavar)
    return field(default=default, metadata=meta)


def at_least(n: float) -> dict:
    return dict(check=lambda v: v >= n, need=f"must be at least {n:g}")


POSITIVE = dict(check=lambda v: v > 0, need="must be > 0")


class _Options:
    """Base of the configuration sections: checks every field when an instance is built."""

    def __post_init__(self):
        for f in fields(self):
            value, check = getattr(self, f.name), f.metadata.get("check")
            if check is not None and value is not None and not check(value):
                raise ConfigError(f"{flag_of(f)} {_show(value)}: {f.metadata['need']}")
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise ConfigError(f"{flag_of(f)} {value!r}: choose {', '.join(choices)}")


@dataclass(frozen=True)
class DataConfig(_Options):
    """Which graph to train on and how to prepare it."""

    dataset: str = option("ogbn-arxiv", "ogbn-arxiv, ogbn-products, ogbn-papers100M, synthetic, the typed "
                          "ogbn-mag, mag240m and synthetic-hetero, or the path of a graph directory (edges.parquet, "
                          "nodes.parquet, meta.json; a column 'type' in both makes it typed)")
    data_dir: str = option(DEFAULT_DATA_DIR, "root directory of local datasets (OGB layout: DATA_DIR/ogbn_arxiv)")
    reverse_edges: Optional[bool] = option(None, "add the reverse of every edge (auto: the dataset's default, yes "
                                           "for ogbn-arxiv, papers100M, synthetic and typed graphs, no for untyped "
                                           "graph directories); on a typed graph each relation's reverse is a "
                                           "relation of its own, rev_<relation>")
    symmetric_relations: bool = option(False, "on a typed graph with reverse edges, a relation between nodes of one "
                                       "type (cites: paper to paper) and its reverse are one symmetric relation, "
                                       "as in DGL's MAG240M example, not r and rev_r")
    self_loops: bool = option(False, "add a self loop to every node")
    random_features: int = option(0, "random features of this dimension for a graph without features (load tests "
                                  "only: they carry no signal)", metavar="DIM", **at_least(0))
    normalize_features: bool = option(False, "scale each node's features to sum to 1 (bag-of-words graphs such "
                                      "as cora)")
    embedding_dim: int = option(0, "learnable node embedding of this size as (extra) input, updated sparsely; lets "
                                "a graph without features train; on a typed graph, nodes without features get it "
                                "instead of their neighbors' mean (0: off)", metavar="DIM", **at_least(0))
    feature_shards: int = option(1, "split the feature table into K shards held by K different nodes, each node's "
                                 "object store then holds one shard plus the cache (1: every node holds it all)",
                                 metavar="K", **at_least(1))
    feature_cache: float = option(0.1, "with --feature-shards: share of the nodes (highest in-degree first) whose "
                                  "features every node also holds, so they are never fetched remotely",
                                  metavar="FRACTION", check=lambda v: 0.0 <= v <= 1.0, need="must be in [0, 1]")
    feature_dtype: str = option("float32", "storage type of the features (the model computes in float32); "
                                "float16 halves their memory and network bytes", choices=("float32", "float16"))
    feature_placement: str = option("auto", "where a train worker gathers feature rows: device (the node's table, or "
                                    "its shards and the cache, copied once to the GPU), uva (read by the GPU from "
                                    "pinned host memory, the hottest rows cached on the GPU), host (gathered by the "
                                    "prefetch thread and copied per batch); auto: device where the table fits half "
                                    "the GPU's free memory, else uva, and host on CPU workers",
                                    choices=("auto", "device", "uva", "host"))
    feature_timeout: float = option(60.0, "seconds a remote feature fetch may take before the attempt fails "
                                    "(naming the shard's node)", metavar="SECONDS", **POSITIVE)
    synthetic_nodes: int = option(20_000, "nodes of the synthetic graph (papers of synthetic-hetero)", **at_least(10))
    synthetic_classes: int = option(8, "classes of the synthetic graph", **at_least(2))
    synthetic_feat_dim: int = option(64, "feature size of the synthetic graph", **at_least(1))
    synthetic_avg_degree: int = option(10, "average in-degree of the synthetic graph", **at_least(1))


# --sampler-actors auto, until the driver sizes the pool (gnnray.driver.plans.sampling), and where it does not (the
# workers sample their own batches, or a --sampler whose pace is not measured beside CPU workers).
AUTO_ACTORS = (1, 2)


@dataclass(frozen=True)
class SamplerConfig(_Options):
    """How seed batches become sampled mini-batches."""

    backend: str = option("native", "the neighbor sampler: native (gnnray's own, on any supported torch) or "
                          "graphbolt (DGL's GraphBolt: needs the dgl extra, pip install -e '.[dgl]', which pins "
                          "torch 2.2.1, numpy < 2 and Python <= 3.12)", flag="--sampler",
                          choices=("native", "graphbolt"))
    fanouts: Fanouts = option(Fanouts(), "neighbors sampled per layer, input layer first; the number of layers "
                              "is the number of fanouts; -1 takes all neighbors (write --fanouts=-1,-1). On a typed "
                              "graph each relation gets that many per layer; relation=list parts after ';' give a "
                              "relation its own, e.g. '10,10;cites=5,5;rev_writes=3,3'")
    batch_size: int = option(1024, "seed nodes per mini-batch per train worker", **at_least(1))
    actors: Optional[tuple[int, ...]] = option(None, "sampler actors, where actors sample: MAX start with the "
                                               "stream where the cluster has room and stay to its end; the run needs "
                                               "room for MIN (a single number: both); auto: the cores the CPU plan "
                                               "gives sampling on CPU workers (docs/cpu-plan.md); beside GPUs, per "
                                               "worker the actors that keep pace with its steps, as its node's cores "
                                               "per GPU allow",
                                               flag="--sampler-actors", metavar="MIN,MAX|auto",
                                     check=lambda a: len(a) in (1, 2) and 1 <= a[0] <= a[-1],
                                     need="expected MIN,MAX with 1 <= MIN <= MAX, or a single number")
    cpus_per_actor: float = option(1.0, "CPUs per sampler actor", flag="--cpus-per-sampler", **POSITIVE)
    eval_fanouts: Optional[Fanouts] = option(None, "neighbors per layer (and relation) for sampled validation "
                                             "and test, in --fanouts' form with as many layers (auto: --fanouts); "
                                             "more than training's lowers the draw's variance, as DGL's MAG240M "
                                             "example trains at 15,25 and evaluates at 160,160")
    max_ahead: Optional[int] = option(None, "mini-batches the sampler pool may run ahead of each train worker "
                                      "(bounds the object store memory that sampled batches take; auto: 16-row "
                                      "seed blocks, three per worker and three per actor, which keeps every actor "
                                      "busy; less than one per actor is refused)", **at_least(1))
    sample_on: str = option("auto", "where training batches are sampled: actors (sampler actors on the CPU, "
                            "batches streamed to the workers), device (each train worker samples its seed batches "
                            "on its own device, the graph's structure held there), or auto (device where a GPU "
                            "holds the structure and the node's cores per GPU could not keep pace; else actors)",
                            choices=("auto", "actors", "device"))

    def __post_init__(self):
        object.__setattr__(self, "fanouts", Fanouts.of_value(self.fanouts))  # code may give a list of ints
        if self.eval_fanouts is not None:
            object.__setattr__(self, "eval_fanouts", Fanouts.of_value(self.eval_fanouts))
            if len(self.eval_fanouts) != len(self.fanouts):
                raise ConfigError(f"--eval-fanouts {str(self.eval_fanouts)!r} has {len(self.eval_fanouts)} layers "
                                  f"but --fanouts {str(self.fanouts)!r} has {len(self.fanouts)} (the model's "
                                  f"layers); give one per layer")
        super().__post_init__()

    @property
    def evaluation_fanouts(self) -> Fanouts:
        """What sampled validation and test draw: ``--eval-fanouts``, else ``--fanouts``."""
        return self.eval_fanouts if self.eval_fanouts is not None else self.fanouts

    @property
    def num_layers(self) -> int:
        return len(self.fanouts.layers)

    @property
    def actors_min(self) -> int:
        return (self.actors or AUTO_ACTORS)[0]

    @property
    def actors_max(self) -> int:
        return (self.actors or AUTO_ACTORS)[-1]


@dataclass(frozen=True)
class ModelConfig(_Options):
    """The GNN."""

    name: str = option("sage", "GraphSAGE (SAGEConv mean), GAT (GATConv) or GCN (GraphConv); gat and gcn want "
                       "--self-loops; on typed graphs rgat (a GATConv per relation, the MAG240M example's RGAT) "
                       "and rsage (one self-projection and a neighbor projection per relation), the others ignoring types", flag="--model",
                       choices=("sage", "gat", "gcn", "rgat", "rsage"))
    hidden: int = option(256, "hidden feature size (per head for gat and rgat)", **at_least(1))
    heads: int = option(4, "attention heads of gat's hidden layers and of rgat's layers", **at_least(1))
    dropout: float = option(0.5, "dropout probability", check=lambda v: 0.0 <= v < 1.0, need="must be in [0, 1)")


@dataclass(frozen=True)
class TrainConfig(_Options):
    """The training loop on each Ray Train worker."""

    epochs: int = option(10, "number of epochs", **at_least(1))
    lr: float = option(0.003, "Adam learning rate", **POSITIVE)
    weight_decay: float = option(0.0, "Adam weight decay", **at_least(0))
    num_workers: tuple[int, ...] = option((2,), "Ray Train workers (DDP ranks); MIN,MAX makes the run elastic: it "
                                          "starts once MIN fit, grows to MAX as nodes join and shrinks when nodes "
                                          "leave, the global batch staying --batch-size x MAX (docs/elastic.md); "
                                          "auto: one per GPU, or on CPU nodes the CPU plan's (one per 16 cores of "
                                          "each node, docs/cpu-plan.md)",
                                          metavar="N|MIN,MAX|auto",
                                          check=lambda w: len(w) in (0, 1, 2) and (not w or 1 <= w[0] <= w[-1]),
                                          need="expected N, MIN,MAX with 1 <= MIN <= MAX, or auto")
    resize_interval: float = option(60.0, "with --num-workers MIN,MAX: seconds between Ray Train's looks for nodes "
                                    "that joined (each resize restarts the workers from the last checkpoint; lost "
                                    "nodes are noticed at once)", metavar="SECONDS", **at_least(0))
    use_gpu: Optional[bool] = option(None, "train on GPUs (auto: when the cluster has any)")
    cpus_per_worker: float = option(1.0, "CPUs per train worker", **POSITIVE)
    prefetch: int = option(2, "mini-batches each worker prepares ahead of the current step", **at_least(1))
    eval_batch_size: int = option(4096, "seeds per evaluation mini-batch, at most (--eval-rows bounds its rows)",
                                  **at_least(1))
    eval_rows: int = option(0, "feature rows an evaluation mini-batch gathers, at most: it takes as many seeds as "
                            "fit (0: from the feature table in the object store: the evaluation's prepared batches "
                            "together hold at most half as many rows, but each may hold 131,072)", **at_least(0))
    eval: str = option("layerwise", "final accuracies: layerwise (exact, all neighbors, on the train workers "
                       "after the last epoch) or sampled (with --eval-fanouts, on the train workers); per-epoch validation is "
                       "sampled either way", choices=("layerwise", "sampled"))
    eval_fallback: bool = option(False, "with --eval layerwise: where its hidden tables cannot fit the object stores "
                                 "that would hold them, evaluate sampled instead (said before training); without it "
                                 "the run stops before training, saying what each node needs")
    inference_batch_size: int = option(10_000, "nodes per chunk of layer-wise inference", **at_least(1))
    embedding_lr: Optional[float] = option(None, "SparseAdam learning rate of --embedding-dim embeddings "
                                           "(auto: --lr)", **POSITIVE)
    cpu_plan: str = option("on", "threads, cores and priority of the job's processes from each node's real "
                           "cores (gnnray/cpus.py; printed at start); off leaves Ray's defaults (threads from "
                           "--cpus-per-worker)", choices=("on", "off"))
    capture_step: str = option("auto", "auto: a lone GPU rank replays each training step as one CUDA graph, its "
                               "batches padded to sizes measured on the first 20 (not with --embedding-dim or a "
                               "model with batch norm); off: every step eager", choices=("auto", "off"))
    trainer_threads: int = option(0, "torch threads per train worker, overriding the CPU plan's (0: from "
                                  "the plan)", **at_least(0))

    def __post_init__(self):
        if isinstance(self.num_workers, int):  # code (and checkpoints of older versions) may give one number
            object.__setattr__(self, "num_workers", (self.num_workers,))
        super().__post_init__()

    @property
    def auto_workers(self) -> bool:
        """``--num-workers auto``, until the driver resolves it from the cluster (:func:`gnnray.driver.plans.workers`)."""
        return not self.num_workers

    @property
    def workers_min(self) -> int:
        return self._workers()[0]

    @property
    def workers_max(self) -> int:
        return self._workers()[-1]

    def _workers(self) -> tuple[int, ...]:
        if not self.num_workers:
            raise GnnrayError("--num-workers auto is resolved by the driver from the cluster; this code ran before it "
                              "(a bug)")
        return self.num_workers

    @property
    def elastic(self) -> bool:
        """``--num-workers MIN,MAX``: Ray Train's elastic worker group (a single number keeps the fixed one)."""
        return len(self.num_workers) == 2


@dataclass(frozen=True)
class RunConfig(_Options):
    """Where the run lives, how it survives failures, and what it prints."""

    name: str = option("gnnray", "run name; the same name and storage path resume the run",
                       check=lambda v: bool(v) and "/" not in v, need="must be a non-empty name without '/'")
    storage_path: str = option(DEFAULT_STORAGE_PATH, "where runs are kept (checkpoints, metrics): a directory "
                               "(shared storage on several nodes) or an object store, s3://BUCKET/PREFIX (gs://, "
                               "abfs://: any URI pyarrow.fs resolves)")
    max_failures: int = option(0, "restarts from the last checkpoint before giving up", **at_least(0))
    keep_checkpoints: int = option(2, "checkpoints kept per run", **at_least(1))
    checkpoint_interval: float = option(60.0, "write a checkpoint at an epoch's end only once this many seconds "
                                        "passed since the last one (or the attempt's start), and always after the "
                                        "last epoch: a restart loses at most this much work (0: every epoch)",
                                        metavar="SECONDS", **at_least(0))
    checkpoint_every: int = option(0, "also write a checkpoint within an epoch every STEPS optimizer steps, so a "
                                   "failure or resize trains at most that many again (0: at epoch ends only, as "
                                   "--checkpoint-interval says)", metavar="STEPS", **at_least(0))
    seed: int = option(0, "random seed (shuffling, initialisation, synthetic data, random features)")
    verbose: bool = option(False, "also print Ray's own INFO logs (otherwise in its session logs, see docs/running.md)")


@dataclass(frozen=True)
class JobConfig:
    """Everything one training job needs."""

    data: DataConfig = DataConfig()
    sampler: SamplerConfig = SamplerConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    run: RunConfig = RunConfig()


_SECTIONS = {"data": "data", "sampler": "sampling", "model": "model", "train": "training", "run": "run"}
# Fields renamed since checkpoints first stored configurations: (section, old name) -> new name.
_RENAMED = {("data", "add_reverse_edges"): "reverse_edges", ("data", "add_self_loops"): "self_loops"}


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return repr(value) if isinstance(value, str) else str(value)


def _parser_of(kind: Any, flag: str) -> Callable[[str], Any]:
    """Turn a flag's text into a value of the field's type ``kind``; raise :class:`ConfigError` naming ``flag``."""
    def fail(text: str, expected: str):
        raise ConfigError(f"{flag} {text!r}: expected {expected}")

    if kind == Optional[bool]:
        words = {"auto": None, "yes": True, "true": True, "1": True, "on": True,
                 "no": False, "false": False, "0": False, "off": False}
        return lambda t: words[t.strip().lower()] if t.strip().lower() in words else fail(t, "auto, yes or no")
    if kind in (Fanouts, Optional[Fanouts]):
        return lambda t: None if kind != Fanouts and t.strip().lower() == "auto" else Fanouts.parse(t, flag)
    if kind in (tuple[int, ...], Optional[tuple[int, ...]]):  # "auto": None, or () where the check allows it
        auto = None if kind != tuple[int, ...] else ()
        return lambda t: auto if t.strip().lower() == "auto" else (
            int_list(t) or fail(t, "comma-separated integers, e.g. 10,10,10"))
    base = typing.get_args(kind)[0] if typing.get_origin(kind) is typing.Union else kind
    if base in (int, float):
        def number(t: str):
            if kind != base and t.strip().lower() == "auto":
                return None
            try:
                return base(t)
            except ValueError:
                return fail(t, "an integer" if base is int else "a number")
        return number
    return str


def _sections() -> list[tuple[str, type]]:
    hints = typing.get_type_hints(JobConfig)
    return [(name, hints[name]) for name in _SECTIONS]


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of ``jobs/train_arxiv.py``, generated from the configuration's fields."""
    p = argparse.ArgumentParser(
        prog="train_arxiv.py",
        description="Train GNN node classification on a Ray cluster (Ray Train workers fed by Ray Data sampler "
        "actors over a graph held once per node in Ray's object store).")
    for section, cls in _sections():
        group = p.add_argument_group(_SECTIONS[section])
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            meta, flag = f.metadata, flag_of(f)
            if hints[f.name] is bool:
                group.add_argument(flag, action="store_true", dest=f"{section}.{f.name}", help=meta["help"])
                continue
            shown = "auto" if f.default is None else _show(f.default)
            group.add_argument(flag, dest=f"{section}.{f.name}", default=None, metavar=meta.get("metavar"),
                               choices=meta.get("choices"), help=f"{meta['help']} (default: {shown})")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> JobConfig:
    """Parse the command line into a checked :class:`JobConfig`.

    Raises:
        ConfigError: An option has an invalid value.
    """
    given = vars(build_parser().parse_args(argv))
    parts = {}
    for section, cls in _sections():
        hints, values = typing.get_type_hints(cls), {}
        for f in fields(cls):
            text = given[f"{section}.{f.name}"]
            if hints[f.name] is bool:
                values[f.name] = bool(text)
            elif text is not None:
                values[f.name] = _parser_of(hints[f.name], flag_of(f))(text)
        parts[section] = cls(**values)
    return JobConfig(**parts)


def from_dict(d: dict) -> JobConfig:
    """Rebuild a :class:`JobConfig` from ``dataclasses.asdict`` output (as checkpoints store it).

    Keys unknown to this version are ignored and missing ones take their
    defaults, so checkpoints of older or newer versions still load.
    """
    parts = {}
    for section, cls in _sections():
        names = {f.name for f in fields(cls)}
        values = {_RENAMED.get((section, k), k): v for k, v in (d.get(section) or {}).items()}
        if section == "sampler" and "actors_min" in values:  # before MIN,MAX became one field
            values["actors"] = (values["actors_min"], values.get("actors_max", values["actors_min"]))
        if section == "run" and "seed" not in values:  # before --seed became one field
            values["seed"] = (d.get("train") or {}).get("seed", 0)
        parts[section] = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in names})
    return JobConfig(**parts)
