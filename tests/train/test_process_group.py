"""The train workers' process group: Ray Train's controller sets it up without importing torch, and each NCCL
rank names its own GPU (no guessed device, no barrier warning)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from gnnray.train import process_group

NO_CUDA = "no CUDA device here"

# What Ray Train's controller does with the backend config: unpickle it, make its backend, read its framework.
_CONTROLLER = """
import pickle, sys
config = pickle.loads(bytes.fromhex(sys.argv[1]))
backend = config.backend_cls()
print(config.framework.value, config.train_func_context.__name__)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_ray_trains_controller_unpickles_the_config_without_torch():
    """torch in the controller cost it 0.27 GB of its own memory and 1.5-2 CPU-seconds of its start."""
    import ray.cloudpickle

    config = ray.cloudpickle.dumps(process_group.ProcessGroupConfig())
    out = subprocess.run([sys.executable, "-c", _CONTROLLER, config.hex()], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["torch OnWorkerGpu", "[]"]


@pytest.fixture
def group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_the_rendezvous_port_is_free_on_this_node():
    addr, port = process_group.rendezvous_address()
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        s.bind(("", port))


def test_a_gloo_group_is_bound_to_no_device(group):
    process_group.init_process_group("gloo", 0, 1, 60, init_method=_address())
    assert dist.distributed_c10d._get_default_group().bound_device_id is None
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.ones(3))
    process_group.leave_process_group(destroy=True)
    assert not dist.is_initialized()


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_an_nccl_group_is_bound_to_the_workers_gpu(group, monkeypatch, recwarn):
    monkeypatch.setattr(process_group, "worker_gpu", lambda: torch.device("cuda", 0))  # Ray's choice, outside Ray
    process_group.init_process_group("nccl", 0, 1, 60, init_method=_address())
    assert dist.distributed_c10d._get_default_group().bound_device_id == torch.device("cuda", 0)
    dist.barrier()
    assert not [w for w in recwarn if "using the device under current context" in str(w.message)]
