"""``jobs/predict.py``: predict every node from a checkpoint with layer-wise inference and write Parquet."""

from __future__ import annotations

from typing import Optional, Sequence

from gnnray.errors import ConfigError
from gnnray.inference.layerwise_task import InferenceResult, load_model, run


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``jobs/predict.py``: predict every node from a checkpoint and write Parquet; returns the exit code."""
    import argparse
    import dataclasses
    import sys

    from gnnray.errors import GnnrayError

    p = argparse.ArgumentParser(
        prog="predict.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Predict every node of a trained run's graph with layer-wise full-neighbor inference (one Ray "
        "task, on a GPU if the cluster has one) and write node id, predicted class and optionally the final "
        "embedding to Parquet.")
    p.add_argument("--checkpoint", required=True,
                   help="a checkpoint directory, or a run directory (STORAGE_PATH/NAME: its newest valid checkpoint); "
                   "a path or a URI such as s3://BUCKET/PREFIX/NAME")
    p.add_argument("--output", required=True,
                   help="Parquet file to write (columns id, pred[, embedding]); a path or a URI")
    p.add_argument("--embeddings", action="store_true",
                   help="also write each node's final embedding (the input of the output layer)")
    p.add_argument("--dataset", default=None, help="override the dataset stored in the checkpoint")
    p.add_argument("--data-dir", default=None, help="override the data directory stored in the checkpoint")
    p.add_argument("--batch-size", type=int, default=None, help="nodes per chunk (default: the run's)")
    a = p.parse_args(argv)
    try:
        if a.batch_size is not None and a.batch_size < 1:
            raise ConfigError(f"--batch-size {a.batch_size}: must be at least 1")
        _check_output(a.output)  # before the graph loads and inference runs: no work lost to a bad --output
        cfg, directory = _checkpoint_config(a.checkpoint)
        data = dataclasses.replace(cfg.data, **{k: v for k, v in (("dataset", a.dataset), ("data_dir", a.data_dir))
                                                 if v is not None})
        cfg = dataclasses.replace(cfg, data=data)
        result = _predict(cfg, directory, a.output, a.embeddings, a.batch_size or cfg.train.inference_batch_size)
    except GnnrayError as e:
        print(f"gnnray: error: {e}", file=sys.stderr)
        return 2
    acc = " ".join(f"{k}_acc={v:.4f}" for k, v in result.accuracy.items())
    print(f"predicted {result.num_nodes} nodes in {result.seconds:.1f}s: {acc} output={result.output}", flush=True)
    return 0


def _check_output(output: str) -> None:
    from gnnray import run_storage

    try:
        run_storage.check_writable(run_storage.parent(output))
        run_storage.clean_leftovers(run_storage.parent(output), recursive=False)  # of an earlier predict's killed write
    except (OSError, ValueError) as e:
        raise ConfigError(f"--output {output}: cannot write there ({' '.join(str(e).split())})") from None


def _checkpoint_config(path: str):
    """The configuration stored with the checkpoint at ``path`` (or the newest valid one of run directory ``path``)."""
    from gnnray.config import from_dict
    from gnnray.train import checkpoint

    try:
        info = checkpoint.read_info(path) or checkpoint.latest_valid(path)[0]
    except (OSError, ValueError) as e:  # a store that refuses, a URI pyarrow does not know
        raise ConfigError(f"--checkpoint {path}: cannot read it ({' '.join(str(e).split())})") from None
    if info is None:
        raise ConfigError(f"--checkpoint {path}: no valid checkpoint there (expected a directory with state.pt "
                          "and meta.json, or a run directory STORAGE_PATH/NAME holding checkpoint_* directories)")
    meta = checkpoint.read_meta(info.path)
    if "config" not in meta:
        raise ConfigError(f"--checkpoint {info.path}: it stores no job configuration (written by an older "
                          "gnnray); retrain, or call gnnray.inference.layerwise_task.run with the model yourself")
    if meta["config"].get("custom_model"):
        raise ConfigError(f"--checkpoint {info.path}: trained with a custom model factory that predict.py cannot "
                          "rebuild; call gnnray.inference.layerwise_task.load_model with it and "
                          "gnnray.inference.layerwise_task.run")
    return from_dict(meta["config"]), info.path


def _predict(cfg, directory: str, output: str, with_embeddings: bool, batch_size: int) -> InferenceResult:
    from gnnray.driver.launch import load_and_publish

    loaded = {}

    def check(feat_dim: int, num_classes: int) -> None:  # a mismatch fails before Ray starts
        loaded["model"], loaded["embedding"] = load_model(directory, cfg, feat_dim, num_classes)

    pub = load_and_publish(cfg, check)
    # With --embedding-dim, ``embedding`` is the checkpoint directory: the inference task memory-maps the rows
    # it needs from its shard files; the table is never loaded here nor put in the object store.
    model, embedding = loaded["model"], loaded["embedding"]
    return run(pub.graph, pub.handle, model, embedding=embedding, batch_size=batch_size, output=output,
               with_embeddings=with_embeddings, use_gpu=cfg.train.use_gpu)
