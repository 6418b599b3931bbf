"""Layer-wise full-neighbor inference from a checkpoint, in one Ray task: ``jobs/predict.py`` and a finished run.

A training run's final evaluation runs on its train workers
(:mod:`gnnray.train.layerwise`). Here the same per-rank code runs with world
size 1 in one Ray task (on a GPU when the cluster has one): for
``jobs/predict.py``, and for a finished run resumed under ``--eval layerwise``
whose last checkpoint holds sampled accuracies only.

Layer 0's input is the graph's features (object store) and, with
``--embedding-dim``, the trained embedding table, which the task reads from
the checkpoint's shard files, memory-mapped (:class:`CheckpointRows`: only the
rows a chunk needs; the driver never holds the table). The hidden layers'
tables live in the task's memory (``N x width`` float32, two at a time), or
with ``--feature-shards`` on the shard servers, as on the train workers. The
task returns every node's prediction and, when asked, the output layer's
input (the final embedding) through the object store; the driver counts
nothing itself and writes them to Parquet in row groups.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from gnnray import run_storage
from gnnray.data.graph import Graph
from gnnray.errors import ConfigError
from gnnray.models.model import model_for
from gnnray.stack import check_node
from gnnray.store.handle import GraphHandle
from gnnray.train import checkpoint
from gnnray.train.feature_reader import LocalRows, reader_for
from gnnray.train.layerwise import SliceRows, infer, supports_layerwise

__all__ = ["InferenceResult", "CheckpointRows", "load_model", "run", "supports_layerwise"]


@dataclass(frozen=True)
class InferenceResult:
    """What a layer-wise inference run measured.

    Attributes:
        accuracy: Accuracy per split (``train``, ``valid``, ``test``), over
            every node of the split.
        num_nodes: Nodes predicted (all of the graph).
        seconds: Wall time, the task's start included.
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
        :func:`run`'s task reads the embedding rows (``None`` without).

    Raises:
        ConfigError: The checkpoint does not match the configuration.
    """
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


class CheckpointRows(SliceRows):
    """The embedding rows of a checkpoint, read from its shard files memory-mapped (any number of shards; from an
    object store, through a copy on this node's disk, ``run_storage.mapped_npy``), or from an older checkpoint's
    ``state.pt`` (the whole table, memory-mapped too)."""

    def __init__(self, directory: str):
        info = checkpoint.embedding_info(directory)
        shards = info["shards"]
        if shards:
            slices = [(s["lo"], run_storage.mapped_npy(run_storage.join(directory, s["dir"], "weight.npy")))
                      for s in shards]
        else:
            state = checkpoint.load_state(directory, mmap=True)
            slices = [(0, state["embedding"]["weight"].numpy())]
        super().__init__(slices)
        self.dim = int(info["dim"])


def run(graph: Graph, handle: GraphHandle, model: torch.nn.Module, *, embedding=None, batch_size: int = 10_000,
        output: Optional[str] = None, with_embeddings: bool = False,
        use_gpu: Optional[bool] = None) -> InferenceResult:
    """Predict every node with layer-wise full-neighbor inference in one Ray task (call on the driver).

    Args:
        graph: The graph; the driver reads nothing of it but its size.
        handle: The same graph in the object store, for the task.
        model: A model with ``num_layers`` and ``layer(i, layer, h)``.
        embedding: With ``--embedding-dim``, the checkpoint directory whose
            embedding the task reads (:func:`load_model` returns it), or a
            ``(num_nodes, dim)`` array.
        batch_size: Nodes per chunk.
        output: Parquet file to write: ``id``, ``pred`` and with
            ``with_embeddings`` ``embedding`` (the output layer's input).
        with_embeddings: Write the final embeddings too.
        use_gpu: Run the task on a GPU; ``None``: when the cluster has one.

    Returns:
        The accuracies per split.

    Raises:
        ValueError: ``model`` has no per-layer interface.
    """
    import ray

    if not supports_layerwise(model):
        raise ValueError(f"{type(model).__name__} has no layer(i, layer, h) and num_layers; layer-wise inference "
                         "needs them (the built-in models have them); use sampled evaluation instead")
    start = time.perf_counter()
    if use_gpu is None:
        use_gpu = ray.cluster_resources().get("GPU", 0) >= 1
    if embedding is not None and not isinstance(embedding, str):
        embedding = ray.put(np.ascontiguousarray(embedding, dtype=np.float32))
    task = ray.remote(_predict).options(num_cpus=1, num_gpus=1 if use_gpu else 0)
    keep = with_embeddings and output is not None
    acc, pred, last_input = ray.get(task.remote(handle, model.cpu().eval(), [embedding], batch_size, keep))
    if output is not None:
        _write(output, pred, last_input, batch_size)
    return InferenceResult(acc, graph.num_nodes, time.perf_counter() - start, output)


def _predict(handle: GraphHandle, model: torch.nn.Module, embedding: list, batch_size: int, keep_input: bool):
    """The task: :func:`~gnnray.train.layerwise.infer` with world size 1; accuracies, predictions, final inputs."""
    import ray

    check_node("the inference task")

    graph = handle.get()
    device = torch.device("cuda" if ray.get_gpu_ids() and torch.cuda.is_available() else "cpu")
    inputs = [reader_for(graph, handle.features)]
    if isinstance(embedding[0], str):
        inputs.append(CheckpointRows(embedding[0]))
    elif embedding[0] is not None:
        inputs.append(LocalRows(ray.get(embedding[0])))
    result = infer(model.to(device), graph, inputs, batch_size, device, keep_input=keep_input,
                   shards=handle.features)
    return result.accuracy, result.pred, result.last_input


def _write(output: str, pred: np.ndarray, embedding: Optional[np.ndarray], rows_per_group: int) -> None:
    """Write ``id``, ``pred`` (and ``embedding``) to ``output`` (a path or a URI) in row groups, atomically."""
    import pyarrow.parquet as pq

    def fill(f) -> None:
        with pq.ParquetWriter(f, _table(0, pred[:0], None if embedding is None else embedding[:0]).schema) as w:
            for a in range(0, len(pred), rows_per_group):
                b = a + rows_per_group
                w.write_table(_table(a, pred[a:b], None if embedding is None else embedding[a:b]))

    run_storage.write(output, fill)


def _table(first: int, pred: np.ndarray, embedding: Optional[np.ndarray]):
    import pyarrow as pa

    columns = {"id": pa.array(np.arange(first, first + len(pred), dtype=np.int64)),
               "pred": pa.array(pred.astype(np.int64))}
    if embedding is not None and embedding.shape[1] > 0:
        e = np.ascontiguousarray(embedding, dtype=np.float32)
        columns["embedding"] = pa.FixedSizeListArray.from_arrays(pa.array(e.reshape(-1)), e.shape[1])
    return pa.table(columns)
