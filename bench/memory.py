"""The ``memory`` stage: private memory per added process, the node-shared graph against a copy per process.

Four probe actors start (imports done); 1, 2 and 4 of them then hold the graph, shared or copied as
``torch.multiprocessing.spawn`` examples do, sample and gather, and free the batch: the growth of their summed
USS (PSS) over idle, per process, in MiB and as a share of the graph. The object store's one copy is shared
memory, in no process's USS.
"""

from __future__ import annotations

import dataclasses
import gc

import numpy as np

from bench.harness import Row, verdict
from bench.settings import Settings
from gnnray.data.graph import Graph

FIGURE, TARGET = "memory per added process (USS)", "< 5% of graph"


class MemoryProbe:
    """A Ray actor that uses the graph as a sampler actor or train worker does; its imports and kernels load in
    ``__init__`` (a tiny graph), so :meth:`usage` before and after :meth:`hold` differ by the big graph's cost."""

    def __init__(self):
        from gnnray.data.synthetic import make_synthetic
        from gnnray.sampler.sampler import Sampler
        from gnnray.train.prefetch import HostSlot

        tiny = make_synthetic(50, 2, 4, 8, seed=0)
        mb = Sampler(tiny, (3, 3)).sample(tiny.train_idx[:8])
        HostSlot(pin=False).gather(tiny.feat, mb.input_nodes.numpy())
        self._held = None

    def usage(self) -> tuple[int, int]:
        """(USS, PSS) in bytes, after handing freed heap back to the OS."""
        import psutil

        from gnnray.heap import trim_heap

        gc.collect()
        trim_heap()
        info = psutil.Process().memory_full_info()
        return int(info.uss), int(info.pss)

    def hold(self, handle, copy: bool, fanouts: tuple, batch_size: int, batches: int, seed: int) -> float:
        """Attach the graph (shared views, or private copies), sample and gather; keep graph and sampler, free
        the last batch and its feature buffer (MiB, returned)."""
        from gnnray.sampler.sampler import Sampler
        from gnnray.train.prefetch import HostSlot

        graph = handle.get()
        if copy:
            graph = dataclasses.replace(graph, **{f.name: np.array(getattr(graph, f.name))
                                                  for f in dataclasses.fields(graph)
                                                  if isinstance(getattr(graph, f.name), np.ndarray)})
        sampler, slot = Sampler(graph, fanouts), HostSlot(pin=False)
        rng = np.random.default_rng(seed)
        for _ in range(batches):
            mb = sampler.sample(rng.choice(graph.train_idx, min(batch_size, len(graph.train_idx)), replace=False))
            x = slot.gather(graph.feat, mb.input_nodes.numpy())
        self._held = (graph, sampler)
        return x.numel() * x.element_size() / 2**20

    def drop(self) -> None:
        self._held = None


def bench_memory(graph: Graph, handle, s: Settings) -> list[Row]:
    import ray

    probe_cls = ray.remote(num_cpus=1)(MemoryProbe)
    probes = [probe_cls.remote() for _ in range(max(s.memory_processes))]
    try:
        results = {variant: grow(probes, handle, copy, s) for variant, copy in (("shared", False), ("copy", True))}
    finally:
        for p in probes:
            ray.kill(p)
    graph_mib = graph.nbytes / 2**20
    ours, base = results["shared"]["per_process_mib"], results["copy"]["per_process_mib"]
    pct = 100 * ours / graph_mib
    return [Row(FIGURE, ours=f"{ours:.1f} MiB ({pct:.1f}%)", baseline=f"{base:.1f} MiB ({100 * base / graph_mib:.0f}%)",
                ratio=f"{ours / base:.2f}x" if base > 0 else "-", target=TARGET, met=verdict(pct < 5),
                detail=dict(graph_mib=graph_mib, batches_sampled=s.memory_batches, **results))]


def grow(probes: list, handle, copy: bool, s: Settings) -> dict:
    """Let 1, 2, 4 ... of ``probes`` hold the graph; the summed USS/PSS growth at each count."""
    import ray

    variant = "copy" if copy else "shared"
    idle = ray.get([p.usage.remote() for p in probes])
    points, held, buffers = [], 0, []
    for n in s.memory_processes:
        buffers += ray.get([p.hold.remote(handle, copy, s.fanouts, s.batch_size, s.memory_batches, s.seed + i)
                            for i, p in enumerate(probes[held:n], start=held)])
        held = n
        now = ray.get([p.usage.remote() for p in probes[:n]])
        uss = sum(a[0] - b[0] for a, b in zip(now, idle)) / 2**20
        pss = sum(a[1] - b[1] for a, b in zip(now, idle)) / 2**20
        points.append(dict(processes=n, uss_growth_mib=uss, pss_growth_mib=pss))
        print(f"[4] {variant}: {n} processes: USS +{uss:.0f} MiB, PSS +{pss:.0f} MiB", flush=True)
    ray.get([p.drop.remote() for p in probes])
    return dict(points=points, per_process_mib=points[-1]["uss_growth_mib"] / points[-1]["processes"],
                batch_feature_buffer_mib=float(np.mean(buffers)))
