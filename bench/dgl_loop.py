"""The whole runs' baseline (:mod:`bench.wall`): the DGL tutorials' training loop in one process, with the job's
model on DGL's modules, sampled validation each epoch and a sampled test at the end. ``python -m bench.dgl_loop
SPEC`` (JSON: the job's configuration, ``cores``, ``loader_workers``) runs one whole run and emits its figures.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import warnings
from typing import Iterator

import numpy as np

from gnnray.config import JobConfig
from gnnray.data.graph import Graph


class DglLoop:
    """Graph, model, optimizer and loaders of the DGL loop; :meth:`epoch` trains."""

    def __init__(self, graph: Graph, cfg: JobConfig, loader_workers: int):
        import torch

        from gnnray.sampler.graphbolt import to_dgl
        from gnnray.store.handle import readonly_tensor
        from bench.dgl_models import DGLModel
        from gnnray.models.model import model_for

        self._graph, self._cfg, self._workers = graph, cfg, loader_workers
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        # int64 structure, as DGL users load graphs (and DGL 2.1's fused sampler is wrong on int32 ones with
        # more than one thread).
        self._g = to_dgl(dataclasses.replace(graph, indptr=graph.indptr.astype(np.int64),
                                             indices=graph.indices.astype(np.int64)))
        self._feat, self._label = readonly_tensor(graph.feat), readonly_tensor(graph.label)
        torch.manual_seed(cfg.run.seed)
        # The tutorial's loop runs DGL's own modules on DGL's blocks (ours take Layers; same sizes and weights).
        self._model = DGLModel(model_for(graph.feat_dim, graph.num_classes, cfg)).to(self.device)
        self._opt = torch.optim.Adam(self._model.parameters(), lr=cfg.train.lr)
        self._train = self._loader(graph.train_idx, cfg.sampler.batch_size, shuffle=True)

    def _loader(self, ids, batch_size: int, shuffle: bool):
        import dgl

        from gnnray.store.handle import readonly_tensor

        return dgl.dataloading.DataLoader(self._g, readonly_tensor(ids),
                                          dgl.dataloading.NeighborSampler(list(self._cfg.sampler.fanouts)),
                                          batch_size=batch_size, shuffle=shuffle, drop_last=False,
                                          num_workers=self._workers)

    def _batches(self, loader) -> Iterator:
        with warnings.catch_warnings():  # DGL asks for CPU affinity (the tutorials do not set it): hidden
            warnings.filterwarnings("ignore", message=".*CPU affinity")
            for input_nodes, output_nodes, blocks in loader:
                yield (self._feat[input_nodes].to(self.device), self._label[output_nodes].to(self.device),
                       [b.to(self.device) for b in blocks])

    def epoch(self) -> dict:
        """One pass over the training nodes; the job's per-epoch numbers that apply."""
        import torch.nn.functional as F

        self._model.train()
        steps, seeds, loss, start, wait = len(self._train), 0, 0.0, time.perf_counter(), 0.0
        batches = self._batches(self._train)
        while True:  # the time spent getting each batch (sampling, gather) is the loop's data_wait, as ours logs
            asked = time.perf_counter()
            x, y, blocks = next(batches, (None, None, None))
            if x is None:
                break
            wait += time.perf_counter() - asked
            step_loss = F.cross_entropy(self._model(blocks, x), y)
            self._opt.zero_grad()
            step_loss.backward()
            self._opt.step()
            n = int(y.shape[0])
            seeds, loss = seeds + n, loss + n * float(step_loss)
        elapsed = time.perf_counter() - start
        return dict(loss=loss / seeds, epoch_time=elapsed, seeds_per_s=seeds / elapsed, steps=steps,
                    data_wait=wait / elapsed)

    def accuracy(self, split: str) -> float:
        """Sampled accuracy of ``split``, in ``eval_batch_size`` chunks."""
        import torch

        self._model.eval()
        right = total = 0
        with torch.no_grad():
            for x, y, blocks in self._batches(self._loader(self._graph.split(split),
                                                           self._cfg.train.eval_batch_size, shuffle=False)):
                right += int((self._model(blocks, x).argmax(1) == y).sum())
                total += int(y.shape[0])
        return right / max(total, 1)


def end_to_end(cfg: JobConfig, cores: int, loader_workers: int) -> dict:
    """A whole run of ``cfg.train.epochs`` epochs: load the graph, build, train, validate each epoch, test."""
    from bench.harness import threads
    from gnnray.data.load import load_graph

    start = time.perf_counter()
    with threads(cores):
        loop = DglLoop(load_graph(cfg.data, cfg.run.seed), cfg, loader_workers)
        ready, epochs, best = time.perf_counter() - start, [], 0.0
        for epoch in range(cfg.train.epochs):
            m = dict(epoch=epoch, **loop.epoch())
            started = time.perf_counter()
            m["val_acc"] = loop.accuracy("valid")
            best = max(best, m["val_acc"])
            m["best_val_acc"] = best
            if epoch == cfg.train.epochs - 1:
                m["test_acc"] = loop.accuracy("test")
            m["eval_time"] = time.perf_counter() - started  # as the job's: validation (and the test)
            print(" ".join(f"{k}={v:.4g}" for k, v in m.items()), flush=True)
            epochs.append(m)
    return dict(epochs=epochs, ready_s=ready, loader_workers=loader_workers, threads=cores)


def main(argv=None) -> int:
    from bench.harness import emit
    from gnnray.config import from_dict

    spec = json.loads((argv or sys.argv[1:])[0])
    emit(end_to_end(from_dict(spec["job"]), spec["cores"], spec["loader_workers"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
