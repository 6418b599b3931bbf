"""The train workers' process group binds each NCCL rank's GPU (no guessed device, no barrier warning)."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from gnnray.train import process_group

NO_CUDA = "no CUDA device here"


@pytest.fixture
def bound(monkeypatch):
    """``bind_device`` applied to this process, undone after the test."""
    monkeypatch.setattr(dist, "init_process_group", dist.init_process_group)
    process_group.bind_device()
    process_group.bind_device()  # twice: wrapped once
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_a_gloo_group_is_left_as_it_was(bound):
    assert dist.init_process_group.binds_device
    dist.init_process_group("gloo", init_method=_address(), rank=0, world_size=1)
    assert dist.distributed_c10d._get_default_group().bound_device_id is None
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.ones(3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_an_nccl_group_is_bound_to_the_workers_gpu(bound, monkeypatch, recwarn):
    monkeypatch.setattr(process_group, "worker_gpu", lambda: torch.device("cuda", 0))  # Ray's choice, outside Ray
    dist.init_process_group(backend="nccl", init_method=_address(), rank=0, world_size=1)
    assert dist.distributed_c10d._get_default_group().bound_device_id == torch.device("cuda", 0)
    dist.barrier()
    assert not [w for w in recwarn if "using the device under current context" in str(w.message)]
