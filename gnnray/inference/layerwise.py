"""Layer-wise full-neighbor inference: exact predictions for every node, as a Ray Data job.

Sampled evaluation recomputes each node's neighborhood with ``--eval-fanouts`` (``--fanouts``);
layer-wise inference (as DGL's ``inference`` and PyG's multi-GPU example) is
exact and cheaper: layer ``i`` is computed once for *all* nodes, each with
*all* its in-neighbors, from layer ``i - 1``'s output for all nodes.

One Ray Data job per layer maps chunks of node ids (``map_batches`` over
``ray.data.range(num_nodes)``, an actor pool): each actor attaches the
node-shared graph (:meth:`GraphHandle.get`) and the previous layer's output,
builds the full-neighbor block of its chunk with :class:`~gnnray.pipeline.sampler.Sampler`
(fanout ``-1``) and applies ``model.layer(i, block, h)``.

Where the layers live: layer 0's input is the graph's features (object store)
and, with ``--embedding-dim``, the trained embedding table, which each actor
reads from the checkpoint's shard files, memory-mapped (:class:`CheckpointRows`:
only the rows its chunks need; the driver never holds or publishes the table).
Each hidden layer's output is a ``.npy`` file in
a work directory (``num_nodes x width`` float32) that the actors write their
rows into and the next layer's actors memory-map; no process ever holds it
whole, and a layer's file is deleted once the next layer is done. The work
directory must be visible to every node (a shared file system on several
nodes, like the checkpoint storage). The last layer's rows (node id,
predicted class and, optionally, its input, the final embedding) stream back
to the driver, which counts accuracies and may write them to Parquet.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from gnnray.errors import ConfigError
from gnnray.data.graph import Graph
from gnnray.data.store import GraphHandle
from gnnray.pipeline.features import FeatureReader

_SPLIT_CODES = {"train": 1, "valid": 2, "test": 3}


@dataclass(frozen=True)
class InferenceResult:
    """What a layer-wise inference run measured.

    Attributes:
        accuracy: Accuracy per split (``train``, ``valid``, ``test``), over
            every node of the split.
        num_nodes: Nodes predicted (all of the graph).
        seconds: Wall time of all layers.
        output: The Parquet file written, if any.
    """

    accuracy: dict
    num_nodes: int
    seconds: float
    output: Optional[str] = None


def load_model(directory: str, cfg, feat_dim: int, num_classes: int,
               model_factory=None) -> tuple[torch.nn.Module, Optional[str]]:
    """Rebuild the trained model (eval mode, CPU) from a checkpoint, and check its embedding table.

    Args:
        directory: The checkpoint directory.
        cfg: The run's :class:`~gnnray.config.JobConfig`.
        feat_dim: The graph's feature size.
        num_classes: The graph's number of classes.
        model_factory: The user model factory the run trained with, if any.

    Returns:
        The model and, with ``--embedding-dim``, ``directory`` again: where
        :func:`run`'s actors read the embedding rows (``None`` without).

    Raises:
        ConfigError: The checkpoint does not match the configuration.
    """
    from gnnray.train import checkpoint
    from gnnray.train.model import model_for

    state = checkpoint.load_state(directory)
    if model_factory:
        model = model_factory(feat_dim + cfg.data.embedding_dim, num_classes, cfg)
    else:  # relational models keep their number of relations in their state
        relations = int(state["model"].get("num_relations", 1))
        model = model_for(feat_dim + cfg.data.embedding_dim, num_classes, cfg, relations)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        raise ConfigError(f"checkpoint {directory} does not fit the {cfg.model.name} model of its configuration "
                          f"({str(exc).splitlines()[0]}); was it written by a different model or dataset?") from None
    embedding = None
    if cfg.data.embedding_dim:
        info = checkpoint.embedding_info(directory)
        if info is None or info["dim"] != cfg.data.embedding_dim:
            has = "no node embeddings" if info is None else f"node embeddings of dim {info['dim']}"
            raise ConfigError(f"checkpoint {directory} has {has} but its configuration has embedding_dim "
                              f"{cfg.data.embedding_dim}")
        embedding = directory
    return model.eval(), embedding


def supports_layerwise(model: torch.nn.Module) -> bool:
    """Whether ``model`` exposes ``num_layers`` and ``layer(i, block, h)`` (the built-in models do)."""
    return callable(getattr(model, "layer", None)) and isinstance(getattr(model, "num_layers", None), int)


class CheckpointRows(FeatureReader):
    """The embedding rows of a checkpoint, read from its shard files memory-mapped (any number of shards),
    or from an older checkpoint's ``state.pt`` (the whole table, memory-mapped too)."""

    def __init__(self, directory: str):
        from gnnray.train import checkpoint

        super().__init__()
        info = checkpoint.embedding_info(directory)
        shards = sorted(info["shards"], key=lambda s: s["lo"])
        self.dim = int(info["dim"])
        self._starts = np.array([s["lo"] for s in shards] or [0], dtype=np.int64)
        if shards:
            self._parts = [np.load(os.path.join(directory, s["dir"], "weight.npy"), mmap_mode="r") for s in shards]
        else:
            state = torch.load(os.path.join(directory, checkpoint.STATE_FILE), map_location="cpu", mmap=True)
            self._parts = [state["embedding"]["weight"].numpy()]

    def gather(self, ids, out):
        ids = np.asarray(ids, dtype=np.int64)
        part = np.searchsorted(self._starts, ids, side="right") - 1
        order = np.argsort(part, kind="stable")
        bounds = np.searchsorted(part[order], np.arange(len(self._parts) + 1))
        for k, rows in enumerate(self._parts):
            p = order[bounds[k]:bounds[k + 1]]
            if len(p):
                out[p] = rows[ids[p] - self._starts[k]]
        s = self._stats
        s.batches, s.rows, s.local_rows = s.batches + 1, s.rows + len(ids), s.local_rows + len(ids)


class LayerRunner:
    """Computes one layer for chunks of nodes, with all their in-neighbors.

    The work of one inference actor, usable in-process too.

    Args:
        graph: The graph (structure; features are passed in ``inputs``).
        model: A model with ``layer(i, block, h)``, in eval mode.
        layer: Which layer to apply.
        inputs: Arrays whose rows, concatenated, are the layer's input per
            node: ``[features, embedding table]`` for layer 0, the previous
            layer's output after it.
    """

    def __init__(self, graph: Graph, model: torch.nn.Module, layer: int, inputs: Sequence):
        from gnnray.pipeline.features import FeatureReader, LocalRows
        from gnnray.pipeline.sampler import Sampler

        self._sampler = Sampler(graph, (-1,))
        self._model, self._layer = model, layer
        # Readers: layer 0's features are read as training reads them (sharded or not).
        self._inputs = [a if isinstance(a, FeatureReader) else LocalRows(a) for a in inputs]
        self._inputs = [r for r in self._inputs if r.dim > 0]

    def __call__(self, ids: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """Return the layer's output for nodes ``ids`` and their own input rows."""
        mb = self._sampler.sample(ids)
        nodes = mb.input_nodes.numpy()
        # float32 whatever the stored precision (MAG240M's features are float16).
        x = np.empty((len(nodes), sum(r.dim for r in self._inputs)), dtype=np.float32)
        col = 0
        for r in self._inputs:
            part = np.empty((len(nodes), r.dim), dtype=np.float32)
            r.gather(nodes, part)
            x[:, col:col + r.dim] = part
            col += r.dim
        with torch.no_grad():
            h = self._model.layer(self._layer, mb.blocks()[0], torch.from_numpy(x))
        return h, x[: len(ids)]  # the chunk's nodes come first among the block's source nodes


class _LayerActor:
    """The callable class of an inference layer's actor pool (one instance per actor)."""

    def __init__(self, graph: GraphHandle, model: list, layer: int, input_path: Optional[str],
                 embedding: Optional[list], output_path: Optional[str], with_embeddings: bool):
        import ray

        self._graph, self._model, self._layer = graph.get(), ray.get(model[0]), layer
        self._in, self._out, self._offset = input_path, output_path, 0
        self._with_embeddings = with_embeddings
        self._runner = None
        if input_path is None:  # layer 0: features from the store, plus the embedding table if any
            from gnnray.pipeline.features import reader_for

            inputs = [reader_for(self._graph, graph.features)] + ([_embedding_reader(embedding[0])] if embedding
                                                                   else [])
            self._runner = LayerRunner(self._graph, self._model, layer, inputs)

    def __call__(self, batch: dict) -> dict:
        if self._runner is None:
            # The files are opened at the first batch, not at start-up: an actor
            # the pool starts as the layer finishes never gets a batch, and the
            # driver may already have removed the files by then.
            self._runner = LayerRunner(self._graph, self._model, self._layer, [np.load(self._in, mmap_mode="r")])
        if self._out is not None and not self._offset:  # where row 0 starts: after the .npy header
            self._offset = np.load(self._out, mmap_mode="r").offset
        ids = np.asarray(batch["id"], dtype=np.int64)
        h, x = self._runner(ids)
        if self._out is not None:
            self._write(ids, np.ascontiguousarray(h.numpy(), dtype=np.float32))
            return {"rows": np.array([len(ids)], dtype=np.int64)}
        out = {"id": ids, "pred": h.argmax(1).numpy().astype(np.int64)}
        if self._with_embeddings:
            out["embedding"] = np.ascontiguousarray(x, dtype=np.float32)
        return out

    def _write(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Write ``rows`` at rows ``ids`` of the output file, one ``pwrite`` per run of consecutive ids.

        Plain writes and a close, not a writable memory map: on a shared file
        system the data is on the server once ``close`` returns, before the
        next layer's actors open the file.
        """
        starts = np.flatnonzero(np.r_[True, np.diff(ids) != 1])
        ends = np.r_[starts[1:], len(ids)]
        with open(self._out, "r+b") as f:
            for a, b in zip(starts.tolist(), ends.tolist()):
                os.pwrite(f.fileno(), memoryview(rows[a:b]).cast("B"), self._offset + int(ids[a]) * rows[0].nbytes)


def _embedding_reader(source):
    """Layer 0's embedding rows: a checkpoint directory's shard files, or an array put in the store by a caller."""
    import ray

    return CheckpointRows(source) if isinstance(source, str) else ray.get(source)


def _embedding_dim(embedding) -> int:
    if embedding is None:
        return 0
    if isinstance(embedding, str):
        from gnnray.train import checkpoint

        return int(checkpoint.embedding_info(embedding)["dim"])
    return int(embedding.shape[1])


def run(graph: Graph, handle: GraphHandle, model: torch.nn.Module, *, embedding=None,
        work_dir: Optional[str] = None, batch_size: int = 10_000, actors: tuple[int, int] = (1, 2),
        cpus_per_actor: float = 1.0, output: Optional[str] = None, with_embeddings: bool = False) -> InferenceResult:
    """Predict every node with layer-wise full-neighbor inference (call on the driver, Ray connected).

    Args:
        graph: The graph; the driver reads only labels and splits from it.
        handle: The same graph in the object store, for the actors.
        model: A model with ``num_layers`` and ``layer(i, block, h)``.
        embedding: With ``--embedding-dim``, the checkpoint directory whose
            embedding the actors read (:func:`load_model` returns it), or a
            ``(num_nodes, dim)`` array that is then put in the object store.
        work_dir: Where the hidden layers' outputs are written (a fresh
            subdirectory, removed at the end); a temporary directory if
            ``None``. Needs ``num_nodes x width x 4`` bytes for two layers.
        batch_size: Nodes per chunk.
        actors: Smallest and largest size of each layer's actor pool.
        cpus_per_actor: CPUs reserved by each actor.
        output: Parquet file to write: ``id``, ``pred`` and with
            ``with_embeddings`` ``embedding`` (the last layer's input).
        with_embeddings: Write the final embeddings too.

    Returns:
        The accuracies per split.

    Raises:
        ValueError: ``model`` has no per-layer interface.
    """
    import ray

    if not supports_layerwise(model):
        raise ValueError(f"{type(model).__name__} has no layer(i, block, h) and num_layers; layer-wise inference "
                         "needs them (the built-in models have them); use sampled evaluation instead")
    model = model.cpu().eval()
    start = time.perf_counter()
    n = graph.num_nodes
    widths = _layer_widths(model, handle.feat_dim + _embedding_dim(embedding))
    model_ref = [ray.put(model)]
    embedding_ref = None
    if isinstance(embedding, str):  # read by the actors from the checkpoint's files
        embedding_ref = [embedding]
    elif embedding is not None:
        embedding_ref = [ray.put(np.ascontiguousarray(embedding, dtype=np.float32))]
    if work_dir:
        os.makedirs(work_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="gnnray-inference-", dir=work_dir)
    try:
        previous = None
        for i in range(model.num_layers - 1):
            path = os.path.join(tmp, f"layer{i}.npy")
            np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, widths[i])).flush()
            rows = sum(int(b["rows"].sum()) for b in _layer_dataset(
                handle, model_ref, i, previous, embedding_ref, path, False, n, batch_size, actors,
                cpus_per_actor).iter_batches(batch_size=None, batch_format="numpy"))
            if rows != n:
                raise RuntimeError(f"layer {i} computed {rows} rows for {n} nodes")
            if previous:
                os.remove(previous)
            previous = path
        ds = _layer_dataset(handle, model_ref, model.num_layers - 1, previous, embedding_ref, None,
                            with_embeddings and output is not None, n, batch_size, actors, cpus_per_actor)
        accuracy, rows = _consume_predictions(ds, graph, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if rows != n:
        raise RuntimeError(f"the last layer predicted {rows} rows for {n} nodes")
    return InferenceResult(accuracy, n, time.perf_counter() - start, output)


def _layer_widths(model: torch.nn.Module, in_dim: int) -> list[int]:
    """Output width of every layer, found by applying each to one node without in-edges."""
    import dgl

    widths, h = [], torch.zeros(1, in_dim)
    with torch.no_grad():
        for i in range(model.num_layers):
            block = dgl.create_block(([], []), num_src_nodes=1, num_dst_nodes=1)
            h = model.layer(i, block, h)
            widths.append(int(h.shape[1]))
    return widths


def _layer_dataset(handle, model_ref, layer, input_path, embedding_ref, output_path, with_embeddings, n,
                   batch_size, actors, cpus_per_actor):
    import ray.data

    return ray.data.range(n, override_num_blocks=max(1, -(-n // batch_size))).map_batches(
        _LayerActor,
        fn_constructor_kwargs=dict(graph=handle, model=model_ref, layer=layer, input_path=input_path,
                                   embedding=embedding_ref if input_path is None else None,
                                   output_path=output_path, with_embeddings=with_embeddings),
        batch_size=batch_size,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(min_size=actors[0], max_size=actors[1]),
        num_cpus=cpus_per_actor,
    )


def _consume_predictions(ds, graph: Graph, output: Optional[str]) -> tuple[dict, int]:
    """Stream the last layer's rows: count correct predictions per split, write them to ``output``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    code = np.zeros(graph.num_nodes, dtype=np.int8)
    for name, value in _SPLIT_CODES.items():
        code[graph.split(name)] = value
    correct, total = np.zeros(4, dtype=np.int64), np.zeros(4, dtype=np.int64)
    writer, tmp_out, rows = None, None, 0
    ds.context.execution_options.preserve_order = True  # rows in node id order (this dataset only)
    with contextlib.ExitStack() as stack:
        for b in ds.iter_batches(batch_size=None, batch_format="numpy"):
            ids, pred = b["id"], b["pred"]
            c = code[ids]
            np.add.at(total, c, 1)
            np.add.at(correct, c, (pred == graph.label[ids]).astype(np.int64))
            rows += len(ids)
            if output is not None:
                table = _table(b)
                if writer is None:
                    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
                    tmp_out = output + ".tmp"
                    writer = stack.enter_context(pq.ParquetWriter(tmp_out, table.schema))
                writer.write_table(table)
    if output is not None:
        if writer is None:  # no rows (an empty graph cannot pass validation, but stay well-formed)
            pq.write_table(pa.table({"id": pa.array([], pa.int64()), "pred": pa.array([], pa.int64())}), output)
        else:
            os.replace(tmp_out, output)
    accuracy = {name: float(correct[v] / total[v]) if total[v] else float("nan") for name, v in _SPLIT_CODES.items()}
    return accuracy, rows


def _table(batch: dict):
    import pyarrow as pa

    columns = {"id": pa.array(batch["id"]), "pred": pa.array(batch["pred"])}
    if "embedding" in batch and batch["embedding"].shape[1] > 0:
        e = np.ascontiguousarray(batch["embedding"], dtype=np.float32)
        columns["embedding"] = pa.FixedSizeListArray.from_arrays(pa.array(e.reshape(-1)), e.shape[1])
    return pa.table(columns)

