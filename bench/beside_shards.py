"""Train workers beside their shards: remote rows per batch with and without, and what each node's store holds.

``python -m bench.beside_shards``: ``fit.run`` with ``--feature-shards 3`` and 2 train workers on a simulated
cluster, placed as the job places them (``plans.beside_shards``) against as Ray Train does. ``--host-memory``:
what placing features costs a train worker's host memory (:func:`host_memory`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
import uuid
from pathlib import Path

from bench.harness import write_json

MIB = 2**20


def _node(cl, handle, n: str) -> str:
    shards = {s.node_id: i for i, s in enumerate(handle.features.shards)}
    return "head" if n == cl.head else f"shard {shards[n]}" if n in shards else n[:8]


def _store_layout(cl, handle) -> dict:
    """Per node: bytes of the job's objects there, and the raylet's ``object_store_bytes_used``."""
    from bench.sharding.cluster import bytes_on

    used = cl.raylet_used()
    return {_node(cl, handle, n): dict(objects=parts, total=sum(parts.values()), raylet_used=used.get(n))
            for n, parts in bytes_on(cl, handle).items()}


def run_one(cl, data, cache: float, beside: bool, workdir: Path, hidden: int) -> dict:
    import gnnray.driver.fit as fit
    from bench.settings import Settings, job_config
    from gnnray.driver import launch, plans
    from gnnray.ray_internals import actor_table

    published = []
    original_publish, original_beside = launch.load_and_publish, plans.beside_shards
    launch.load_and_publish = lambda *a, **kw: published.append(original_publish(*a, **kw)) or published[-1]
    if not beside:
        plans.beside_shards = lambda *a, **kw: None
    before = set(actor_table())
    name = f"{'beside' if beside else 'ray'}-{cache}-{uuid.uuid4().hex[:6]}"
    s = Settings(quick=True, cores=2, fanouts=(10, 10, 10), batch_size=1024, hidden=hidden, epochs=1, workers=2)
    cfg = job_config(dataclasses.replace(data, feature_shards=3, feature_cache=cache), s, workdir, name)
    try:
        start = time.perf_counter()
        summary = fit.run(cfg)
        wall_s = time.perf_counter() - start
    finally:
        launch.load_and_publish, plans.beside_shards = original_publish, original_beside
    handle = published[-1].handle
    workers = [i["Address"]["NodeID"] for aid, i in actor_table().items()
               if aid not in before and "TrainWorker" in i["ActorClassName"]]
    m = summary.metrics
    result = dict(cache=cache, beside=beside, wall_s=wall_s, worker_nodes=[_node(cl, handle, w) for w in workers],
                  remote_row_share=m.get("remote_row_share"), cache_hit_rate=m.get("cache_hit_rate"),
                  remote_mib_per_batch=m.get("remote_bytes_per_batch", 0) / MIB,
                  store=_store_layout(cl, handle),
                  expected=dict(structure=handle.nbytes, shard=handle.features.shard_bytes,
                                cache=handle.features.cache_bytes))
    published.clear()
    return result


# One worker placing the node's table under uva with a cache budget of half of it, on torch's meta device (it
# holds no host memory, as a GPU's does not): the growth of its peak RSS, in bytes.
_PLACE = """
import resource, sys
import numpy as np, torch
from gnnray.store.shards import cache_ids
from gnnray.train import placement
from gnnray.train.feature_reader import LocalRows

table = np.load(sys.argv[1], mmap_mode="r")
table.sum(axis=0)  # the store's pages, mapped and read before the baseline
indptr = np.arange(table.shape[0] + 1, dtype=np.int64) * 3
n, budget = table.shape[0], table.nbytes // 2
placement.place("uva", LocalRows(table[:1000]), "meta", indptr[:1001], free_bytes=table[:1000].nbytes)  # torch's set-up
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if sys.argv[2] == "now":
    placement.place("uva", LocalRows(table), "meta", indptr, free_bytes=2 * budget)
else:  # as placement did before its pieces: the cache gathered whole on the host, then moved
    hot = cache_ids(indptr, budget // (table.shape[1] * 4) / n)
    slot = np.full(n, -1, dtype=np.int32)
    slot[hot] = np.arange(hot.size, dtype=np.int32)
    torch.from_numpy(np.ascontiguousarray(table[hot])).to("meta"), torch.from_numpy(slot).to("meta")
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def host_memory(table_mib: int = 1024, workers: int = 2) -> dict:
    """Peak host-memory growth of ``workers`` processes placing one float32 table (128 features a row, in
    /dev/shm as the store's pages are shared memory) at once, before and now."""
    import subprocess
    import sys

    import numpy as np

    from gnnray.train.placement import PIECE_BYTES

    out = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        path = os.path.join(tmp, "table.npy")
        rows = table_mib * MIB // (128 * 4)
        table = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, 128))
        for a in range(0, rows, 1 << 16):
            table[a:a + (1 << 16)] = np.random.default_rng(a).standard_normal((min(1 << 16, rows - a), 128))
        del table
        for how in ("before", "now"):
            procs = [subprocess.Popen([sys.executable, "-c", _PLACE, path, how], stdout=subprocess.PIPE, text=True)
                     for _ in range(workers)]
            out[how] = [int(p.communicate()[0]) for p in procs]
            print(f"{how}: {table_mib} MiB table, cache budget {table_mib // 2} MiB, {workers} workers at once: "
                  f"host memory +{', +'.join(f'{g / MIB:.0f}' for g in out[how])} MiB (piece "
                  f"{PIECE_BYTES / MIB:.0f} MiB)", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the results here too")
    p.add_argument("--host-memory", action="store_true", help="host memory of placing features, before and now")
    args = p.parse_args(argv)
    if args.host_memory:
        write_json(args.json, host_memory())
        return 0

    from bench.sharding.cluster import ShardSettings, SimulatedCluster, graph_dir

    ss = ShardSettings(quick=False, train_batches=8, head_cpus=4, node_cpus=2)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        cl = SimulatedCluster(ss, verbose=False)
        try:
            data, info = graph_dir(ss, workdir)
            print(f"graph: {info['nodes']:,} nodes, {info['edges']:,} edges ({info['index_dtype']}), "
                  f"{info['feature_mib']:.1f} MiB of features", flush=True)
            for cache in (0.0, 0.1):
                for beside in (True, False):
                    r = run_one(cl, data, cache, beside, workdir, hidden=64)
                    results.append(r)
                    print(f"cache {cache}, {'beside shards' if beside else 'Ray Train alone'}: workers on "
                          f"{r['worker_nodes']}, rank 0 remote share {r['remote_row_share']:.1%} "
                          f"({r['remote_mib_per_batch']:.1f} MiB/batch), cache hit {r['cache_hit_rate']:.1%}, "
                          f"{r['wall_s']:.0f} s", flush=True)
                    for node, held in sorted(r["store"].items()):
                        parts = " + ".join(f"{k} {v / MIB:.2f}" for k, v in held["objects"].items())
                        used = held["raylet_used"]
                        print(f"    {node}: {parts} = {held['total'] / MIB:.2f} MiB (raylet: "
                              f"{'?' if used is None else f'{used / MIB:.2f}'} MiB)", flush=True)
        finally:
            cl.close()
    write_json(args.json, dict(graph=info, load_avg=os.getloadavg(), results=results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
