"""The train workers' process group: Ray Train's, with each rank's GPU bound to it.

Ray Train's ``TorchConfig`` calls ``torch.distributed.init_process_group``
without ``device_id``. NCCL then guesses each rank's GPU from its global rank
(and says so, warning of hangs where ranks and GPUs do not map one to one), and
every ``barrier()`` warns that it uses the current device. :class:`BoundTorchConfig`
adds ``device_id``, the worker's own GPU, to that call on NCCL ranks; on the CPU
(gloo) it changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray.train.torch.config import TorchConfig

from gnnray.ray_internals import TorchBackend as _TorchBackend
from gnnray.ray_internals import plain_framework_versions


def bind_device() -> None:
    """In a train worker: make this process's ``init_process_group`` pass the worker's GPU as ``device_id`` when
    the backend is NCCL and none is given."""
    import torch
    import torch.distributed as dist

    if getattr(dist.init_process_group, "binds_device", False):
        return
    original = dist.init_process_group

    def init_process_group(*args, **kwargs):
        backend = str(kwargs.get("backend", args[0] if args else "") or "")
        if "nccl" in backend and "device_id" not in kwargs and torch.cuda.is_available():
            kwargs["device_id"] = worker_gpu()
        return original(*args, **kwargs)

    init_process_group.binds_device = True
    dist.init_process_group = init_process_group


def worker_gpu():
    """The GPU Ray gave this worker (Ray Train's own choice, as ``ray.train.torch.get_device`` makes it)."""
    from gnnray import ray_internals

    return ray_internals.worker_devices()[0]


class _BoundBackend(_TorchBackend):
    def on_start(self, worker_group, backend_config):  # in Ray Train's controller
        plain_framework_versions()  # before Train's state callback reads them (it runs after this one)
        worker_group.execute(bind_device)
        super().on_start(worker_group, backend_config)


@dataclass
class BoundTorchConfig(TorchConfig):
    """``TorchConfig`` whose NCCL process group knows each rank's GPU."""

    @property
    def backend_cls(self):
        return _BoundBackend
