"""What the sharding section (``python -m bench --sharding``) uses: its figure's name and its settings."""

from __future__ import annotations

import dataclasses

FIGURE = "sharding"
DEFAULT_JSON_NAME = "sharding.json"
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class ShardSettings:
    """What the sharding section uses; ``--quick`` shrinks the amounts of work only."""

    quick: bool
    nodes: int = 100_000
    avg_degree: int = 10
    feat_dim: int = 128
    store_mib: int = 300  # object store of every simulated node
    worker_nodes: int = 3  # nodes besides the head
    head_cpus: int = 6  # logical: 1 train worker x 2 CPUs + 1 sampler actor + Ray Data's tasks
    shards: tuple = (1, 2, 3)
    cache: float = 0.1  # the default --feature-cache, used for the K rows
    caches: tuple = (0.0, 0.1, 0.3)
    fanouts: tuple = (10, 10, 10)
    batch_size: int = 1024
    batches: int = 12  # gathered per configuration and reader, after one warm-up
    # Training (fit.run): splits cut to these many batches, epochs, (K=1, K=3) pairs.
    train_batches: int = 16
    eval_batches: int = 2
    epochs: int = 2
    hidden: int = 256
    train_pairs: int = 2
    # Sampling only: (name, nodes, average in-degree) of the synthetic graphs; the arxiv structure when present.
    extrapolation: tuple = (("synthetic-250k", 250_000, 29), ("synthetic-1M", 1_000_000, 29))
    extrapolation_batches: int = 8
    small_reach: float = 0.02  # the small batch reaches at most this share of the graph's nodes
    small_reach_seeds: int = 4096  # seeds sampled in small batches per graph
    extrapolation_shards: tuple = (2, 4, 8)
    # CPU of the job's processes per steady epoch: epochs per run, (K=1, K=3) pairs.
    cpu_epochs: int = 4
    cpu_pairs: int = 1
    memory_dims: tuple = (128, 512)  # the driver's memory with feature tables of these widths
    # Layer-wise inference's hidden tables (layerwise.py): the model's layers and width, nodes per chunk, how
    # often each node's store is read while it runs.
    infer_layers: int = 4  # three hidden tables, of which a shard node holds two at most
    infer_hidden: int = 128
    infer_chunk: int = 2000
    poll_s: float = 0.01
    infer_store_mib: int = 100  # stores with room for K = 3's ranges of the tables, not for K = 1's whole ones
    # The store run (layerwise.py --stores): a table of 614 MB (N x hidden x 4 B) on stores that hold a node's
    # range of it, layer-wise against sampled evaluation; each node's metrics endpoint read every metrics_s.
    stores_nodes: int = 300_000
    stores_layers: int = 2
    stores_hidden: int = 512
    stores_store_mib: int = 900
    stores_chunk: int = 10_000  # --inference-batch-size's default
    metrics_s: float = 0.5
    limit_gb: float = 2.25  # RLIMIT_DATA of the driver publishing a table twice that (its VmData is ~1.9 GB)
    seed: int = 0


def settings(quick: bool) -> ShardSettings:
    s = ShardSettings(quick=quick)
    if quick:
        s = dataclasses.replace(s, batches=5, train_batches=8, train_pairs=1,
                                extrapolation=(("synthetic-250k", 250_000, 29),), extrapolation_batches=4,
                                small_reach_seeds=2048)
    return s
