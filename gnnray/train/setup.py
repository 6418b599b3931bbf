"""What the driver hands every train worker (stage 7's input), in a module of its own.

Ray Train's controller and its state actor unpickle the training function's
config, and with it this module: they need none of the worker's stages
(sampling, prefetch, models, embeddings), which ``train/loop.py`` imports,
nor torch (the backend config they unpickle is ``train/process_group.py``'s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from gnnray.config import JobConfig
from gnnray.cpus import CpuPolicy
from gnnray.store.handle import GraphHandle

if TYPE_CHECKING:
    import torch

ModelFactory = Callable[[int, int, JobConfig], "torch.nn.Module"]


@dataclass(frozen=True)
class WorkerSetup:
    """What the driver hands every train worker.

    Attributes:
        cfg: The job configuration.
        graph: Handle of the node-shared graph.
        first_epoch: The epoch the seed stream starts at (a fixed run).
        resume_from: Checkpoint directory to restore, chosen by the driver (a fixed run).
        restarts: How many times the driver restarted the run so far.
        run_dir: The run's directory: rank 0 appends each epoch's metrics to
            its ``metrics.jsonl`` and records progress there; the driver
            prints both as they arrive.
        model_factory: ``(in_feats, num_classes, cfg) -> nn.Module`` whose
            ``forward(layers, x)`` returns logits; ``--model`` by default.
        embedding_owners: With ``--feature-shards`` and ``--embedding-dim``:
            the owners of the embedding table's shards (``train.embedding.create_owners``).
        cpu: The job's CPU plan (:mod:`gnnray.cpus`); ``None`` leaves Ray's defaults.
        first_step: The step of ``first_epoch`` the seed stream starts at (a fixed run).
        stack: The driver's software stack (:func:`gnnray.stack.versions`): each worker and sampler actor
            compares its own with it when it starts.
    """

    cfg: JobConfig
    graph: GraphHandle
    first_epoch: int
    resume_from: Optional[str] = None
    restarts: int = 0
    run_dir: Optional[str] = None
    model_factory: Optional[ModelFactory] = None
    embedding_owners: Optional[tuple] = None
    cpu: Optional[CpuPolicy] = None
    first_step: int = 0
    stack: Optional[dict] = None
