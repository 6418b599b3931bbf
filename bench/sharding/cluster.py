"""The sharding section's settings, its simulated cluster (a head and nodes, each with its own object store) and
the graph it publishes."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from bench.harness import free_port

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
    node_cpus: int = 1
    shards: tuple = (1, 2, 3)
    cache: float = 0.1  # the default --feature-cache, used for the K rows
    caches: tuple = (0.0, 0.1, 0.3)
    fanouts: tuple = (10, 10, 10)
    batch_size: int = 1024
    batches: int = 12  # gathered per configuration and reader, after one warm-up
    train_batches: int = 16  # the graph's splits, cut to these many batches
    eval_batches: int = 2
    memory_dims: tuple = (128, 512)  # the driver's memory with feature tables of these widths
    # Layer-wise inference's hidden tables (hidden_tables.py): the model's layers and width, nodes per chunk, how
    # often each node's store is read while it runs.
    infer_layers: int = 4  # three hidden tables, of which a shard node holds two at most
    infer_hidden: int = 128
    infer_chunk: int = 2000
    poll_s: float = 0.01
    infer_store_mib: int = 100  # stores with room for K = 3's ranges of the tables, not for K = 1's whole ones
    # The store run (hidden_tables.py --stores): a table of 614 MB (N x hidden x 4 B) on stores that hold a node's
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
        s = dataclasses.replace(s, batches=5, train_batches=8)
    return s


class SimulatedCluster:
    """A head and ``worker_nodes`` nodes, each with its own object store, and this process connected to it.
    ``RAY_ADDRESS`` names it before it starts: Ray Train's placement-group cleaner looks its cluster up through it
    and could find another one on this machine (docs/performance.md#time-between-epochs)."""

    def __init__(self, ss: ShardSettings, verbose: bool):
        import ray
        import ray.data
        from ray.cluster_utils import Cluster

        import bench
        from gnnray.driver.console import quiet_ray

        self._env = os.environ.get("RAY_ADDRESS")
        port = free_port()
        os.environ["RAY_ADDRESS"] = f"{ray.util.get_node_ip_address()}:{port}"
        store = ss.store_mib * MIB
        self.cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=ss.head_cpus, gcs_server_port=port, object_store_memory=store))
        for _ in range(ss.worker_nodes):
            self.cluster.add_node(num_cpus=ss.node_cpus, object_store_memory=store)
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, log_to_driver=verbose,
                 logging_config=ray.LoggingConfig(log_level="INFO" if verbose else "WARNING"))
        os.environ["RAY_ADDRESS"] = self.cluster.address
        ray.cloudpickle.register_pickle_by_value(bench)  # the probes' class travels by value
        quiet_ray(verbose)
        ray.data.DataContext.get_current().enable_progress_bars = False
        self.head = ray.get_runtime_context().get_node_id()
        self.nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        self.nodes.sort(key=lambda n: (n != self.head, n))  # head first

    def name(self, node_id: str, handle=None) -> str:
        """``head`` or ``node i``, with the shard it holds."""
        label = "head" if node_id == self.head else f"node {self.nodes.index(node_id)}"
        held = [i for i, s in enumerate(handle.features.shards) if s.node_id == node_id] \
            if handle is not None and handle.features is not None else []
        return label + "".join(f" (shard {i})" for i in held)

    def raylet_used(self) -> dict:
        """Each node's ``object_store_bytes_used`` as its raylet reports it, or {}."""
        used = "object_store_bytes_used"
        return {n: stats[used] for n, stats in self.store_stats(used).items()}

    def store_stats(self, *fields: str) -> dict:
        """``{node_id: {field: value}}`` of each node's raylet store stats, or {} (``object_store_bytes_used``
        counts freed objects not yet deleted too; ``object_store_bytes_primary_copy`` the copies it must keep)."""
        import ray

        from gnnray.ray_internals import store_stats

        try:
            return {n["NodeID"]: store_stats(n, *fields) for n in ray.nodes() if n.get("Alive")}
        except Exception:  # noqa: BLE001 - a private API; the locations are the figure
            return {}

    def close(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
        if self._env is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = self._env


def graph_dir(ss: ShardSettings, workdir: Path):
    """The synthetic structure as a graph directory with short splits; its DataConfig and the graph's figures."""
    from bench.settings import Settings, quick_data_config
    from gnnray.config import DataConfig
    from gnnray.data.load import load_structure

    graph, _ = load_structure(DataConfig(dataset="synthetic", synthetic_nodes=ss.nodes, synthetic_feat_dim=1,
                                         synthetic_avg_degree=ss.avg_degree), ss.seed)
    s = Settings(quick=True, cores=1, batch_size=ss.batch_size, seed=ss.seed, quick_train_batches=ss.train_batches,
                 quick_eval_batches=ss.eval_batches)
    data = dataclasses.replace(quick_data_config(graph, s, workdir), random_features=ss.feat_dim)
    info = dict(nodes=graph.num_nodes, edges=graph.num_edges, index_dtype=str(graph.indices.dtype),
                structure_mib=graph.nbytes / MIB, feature_mib=graph.num_nodes * ss.feat_dim * 4 / MIB,
                train=ss.train_batches * ss.batch_size, data=dataclasses.asdict(data))
    return data, info


def publish(data, k: int, cache: float, seed: int):
    from gnnray.config import JobConfig, RunConfig
    from gnnray.driver import launch

    cfg = JobConfig(data=dataclasses.replace(data, feature_shards=k, feature_cache=cache), run=RunConfig(seed=seed))
    start = time.perf_counter()
    pub = launch.load_and_publish(cfg)
    return pub, time.perf_counter() - start


def bytes_on(cl: SimulatedCluster, handle) -> dict:
    """``{node_id: {object: bytes}}`` of the job's objects (``get_object_locations``): structure, shards, cache."""
    from ray.experimental import get_object_locations

    refs = {"structure" if handle.features is not None else "graph": handle._ref[0]}
    if handle.features is not None:
        refs.update({f"shard {i}": s.ref[0] for i, s in enumerate(handle.features.shards)})
        if handle.features.cache is not None:
            refs["cache"] = handle.features.cache[0]
    locs = get_object_locations(list(refs.values()))
    per = {n: {} for n in cl.nodes}
    for what, ref in refs.items():
        for n in locs[ref]["node_ids"]:
            per.setdefault(n, {})[what] = int(locs[ref]["object_size"])
    return per
