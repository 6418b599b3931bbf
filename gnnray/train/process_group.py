"""The train workers' process group: gloo on CPUs, NCCL on GPUs, set up by Ray Train with a backend of our own.

Why not Ray Train's ``TorchConfig``: its module imports torch, and Ray Train's
controller, which computes nothing, unpickles it: 0.27 GB of the controller's
own memory and 1.5-2 CPU-seconds of its start. :class:`ProcessGroupConfig`
does what that backend does for gloo and NCCL (rank 0's address for the
``env://`` rendezvous, ``RANK``, ``LOCAL_RANK`` and the rest, then
``init_process_group``) from functions that import torch only in the
workers. It also passes each NCCL rank's own GPU as ``device_id``, which
``TorchConfig`` leaves out: NCCL then guesses the GPU from the global rank
(warning of hangs where ranks and GPUs do not map one to one) and every
``barrier()`` warns that it uses the current device. Not on torch 2.7.0, where
``device_id`` can hang NCCL's start at random (fixed in 2.7.1).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

from ray.train.backend import Backend, BackendConfig

from gnnray import ray_internals

logger = logging.getLogger(__name__)

# Ray Train's own variable and default for how long the workers may take to leave the group at its end.
SHUTDOWN_TIMEOUT_ENV, _SHUTDOWN_TIMEOUT_S = "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S", 30.0
# torch versions on which device_id can hang NCCL's start (pytorch/pytorch#153960).
_DEVICE_ID_HANGS = ("2.7.0",)


def shutdown_timeout_s() -> float:
    """Seconds the workers may take to leave the group: ``TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S``, else 30."""
    text = os.environ.get(SHUTDOWN_TIMEOUT_ENV, "").strip()
    try:
        value = float(text) if text else _SHUTDOWN_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{SHUTDOWN_TIMEOUT_ENV}={text!r}: expected a positive number of seconds")
    return value


def binds_device(torch_version: str) -> bool:
    """Whether an NCCL rank passes its GPU as ``device_id``: on every torch but those where that can hang."""
    return torch_version.split("+")[0] not in _DEVICE_ID_HANGS


def worker_gpu():
    """The GPU Ray gave this worker (Ray Train's own choice, as ``ray.train.torch.get_device`` makes it)."""
    return ray_internals.worker_devices()[0]


def rendezvous_address() -> tuple[str, int]:
    """This node's address and a free port on it: rank 0's, where the other ranks meet."""
    import socket

    import ray

    addr = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        s.bind(("", 0))
        return addr, int(s.getsockname()[1])


def set_rank_env(addr: str, port: int) -> None:
    """In a train worker: the variables torch's ``env://`` rendezvous and torchrun's conventions read."""
    import ray.train

    ctx = ray.train.get_context()
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(ctx.get_world_rank()),
                      WORLD_SIZE=str(ctx.get_world_size()), LOCAL_RANK=str(ctx.get_local_rank()),
                      LOCAL_WORLD_SIZE=str(ctx.get_local_world_size()), NODE_RANK=str(ctx.get_node_rank()))


def init_process_group(backend: str, world_rank: int, world_size: int, timeout_s: float,
                       init_method: str = "env://") -> None:
    """In a train worker: join the group; an NCCL rank names its own GPU (:func:`binds_device`), and a timed-out
    collective fails rather than hangs (as Ray Train sets it, unless the user chose)."""
    import torch
    import torch.distributed as dist

    kwargs = {}
    if backend == "nccl":
        if "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ:
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
        if binds_device(torch.__version__):
            kwargs["device_id"] = worker_gpu()
    dist.init_process_group(backend=backend, init_method=init_method, rank=world_rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), **kwargs)


def leave_process_group(destroy: bool) -> None:
    """In a train worker, at the group's end: leave the group (with several ranks) and free the GPU's cache."""
    import torch
    import torch.distributed as dist

    if destroy and dist.is_initialized():
        dist.destroy_process_group()
    if torch.cuda.is_available():
        for device in ray_internals.worker_devices():
            if device.type == "cuda":
                with torch.cuda.device(device):
                    torch.cuda.empty_cache()


class OnWorkerGpu:
    """The training function's context in each worker: its GPU, if it has one, is the current device."""

    def __enter__(self):
        import torch

        if torch.cuda.is_available():
            device = worker_gpu()
            if device.type == "cuda":
                torch.cuda.set_device(device)

    def __exit__(self, *exc) -> bool:
        return False


class _Backend(Backend):
    share_cuda_visible_devices = True  # as TorchConfig's: NCCL needs every GPU of the node visible to each rank

    def on_start(self, worker_group, backend_config: "ProcessGroupConfig"):  # in Ray Train's controller
        import ray

        shutdown_timeout_s()  # a bad value fails the start, not the end
        ray_internals.plain_framework_versions()  # before Train's state callback reads them (it runs after this)
        gpus = worker_group.get_resources_per_worker().get("GPU", 0)
        backend = backend_config.backend or ("nccl" if gpus > 0 else "gloo")
        addr, port = worker_group.execute_single(0, rendezvous_address)
        worker_group.execute(set_rank_env, addr=addr, port=port)
        ray.get([worker_group.execute_single_async(i, init_process_group, backend=backend, world_rank=i,
                                                   world_size=len(worker_group), timeout_s=backend_config.timeout_s)
                 for i in range(len(worker_group))])

    def on_shutdown(self, worker_group, backend_config: "ProcessGroupConfig"):
        import ray
        from ray.exceptions import GetTimeoutError

        timeout_s = shutdown_timeout_s()
        try:
            ray.get(worker_group.execute_async(leave_process_group, destroy=len(worker_group) > 1),
                    timeout=timeout_s)
        except GetTimeoutError:  # a rank stuck in a collective: Ray Train kills the workers next
            logger.warning(f"torch process group: the workers did not leave it within {timeout_s:g}s "
                           f"({SHUTDOWN_TIMEOUT_ENV}); Ray Train ends them")


@dataclass
class ProcessGroupConfig(BackendConfig):
    """Ray Train's backend config for the workers' torch process group.

    Attributes:
        backend: ``gloo``, ``nccl``, or ``None``: NCCL where the workers have GPUs, else gloo.
        timeout_s: Seconds a collective may wait for the other ranks.
    """

    backend: Optional[str] = None
    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return _Backend

    @property
    def train_func_context(self):
        return OnWorkerGpu

    @property
    def framework(self):
        return ray_internals.TrainingFramework.TORCH  # the Train view lists the workers' torch version

    def to_dict(self) -> dict:
        return {"backend": self.backend, "timeout_s": self.timeout_s}
