"""The train workers' process group: Ray Train's controller sets it up without importing torch, and each NCCL
rank names its own GPU (no guessed device, no barrier warning) except on torch 2.7.0."""

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


# Ranks in processes of their own, as Ray Train's workers: each joins at rank 0's rendezvous address through
# init_process_group, all-reduces and leaves.
_RANKS = """
import os, sys
import torch
import torch.distributed as dist
from gnnray.train import process_group

def rank(i, world, backend, addr, port):
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))
    device = torch.device("cuda", i) if backend == "nccl" else torch.device("cpu")
    process_group.worker_gpu = lambda: device  # Ray's choice, outside Ray
    if device.type == "cuda":
        torch.cuda.set_device(device)
    process_group.init_process_group(backend, i, world, 120)
    t = torch.full((3,), float(i + 1), device=device)
    dist.all_reduce(t)
    bound = dist.distributed_c10d._get_default_group().bound_device_id
    # One write per line: with PYTHONUNBUFFERED, print writes the text and its newline apart, and two ranks'
    # lines could interleave on the shared pipe.
    os.write(1, f"rank {i} sum {t.sum().item():g} bound {bound}\\n".encode())
    process_group.leave_process_group(destroy=True)

if __name__ == "__main__":
    backend, world = sys.argv[1], int(sys.argv[2])
    addr, port = process_group.rendezvous_address()
    torch.multiprocessing.spawn(rank, args=(world, backend, addr, port), nprocs=world)
"""


def _run_ranks(tmp_path, backend: str, world: int) -> list[str]:
    script = tmp_path / "ranks.py"
    script.write_text(_RANKS)
    out = subprocess.run([sys.executable, str(script), backend, str(world)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return sorted(line for line in out.stdout.splitlines() if line.startswith("rank "))


def test_gloo_ranks_meet_at_the_rendezvous_address(tmp_path):
    """rank 0's address and port (this node's IP as Ray sees it) are where the other ranks find it."""
    lines = _run_ranks(tmp_path, "gloo", 2)
    assert lines == ["rank 0 sum 9 bound None", "rank 1 sum 9 bound None"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a multi-rank NCCL group needs 2 GPUs on one machine; "
                                                          f"this one has {torch.cuda.device_count()}")
def test_nccl_ranks_each_bound_to_their_gpu_all_reduce(tmp_path):
    lines = _run_ranks(tmp_path, "nccl", 2)
    bound = [process_group.binds_device(torch.__version__)] * 2
    assert lines == [f"rank {i} sum 9 bound {'cuda:' + str(i) if b else None}" for i, b in enumerate(bound)]


def test_no_device_id_on_the_torch_whose_nccl_start_can_hang_with_it(group, monkeypatch):
    """torch 2.7.0 can hang NCCL's start when device_id is passed (pytorch/pytorch#153960, fixed in 2.7.1)."""
    seen = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: seen.append(kwargs))
    monkeypatch.setattr(process_group, "worker_gpu", lambda: torch.device("cuda", 1))
    for version, binds in (("2.7.0+cu126", False), ("2.7.0", False), ("2.7.1", True), ("2.14.1+cpu", True)):
        monkeypatch.setattr(torch, "__version__", version)
        process_group.init_process_group("nccl", 0, 1, 60, init_method=_address())
        assert ("device_id" in seen[-1]) == binds, version
        if binds:
            assert seen[-1]["device_id"] == torch.device("cuda", 1)


def test_shutdown_honours_torchs_timeout_variable_and_says_when_it_passed(ray_cluster, monkeypatch, caplog):
    """A rank stuck in a collective at the group's end: the wait ends at the variable's bound, in one line."""
    import logging
    import time

    import ray

    @ray.remote(num_cpus=0)
    def stuck():
        time.sleep(600)

    class Group:  # Ray Train's worker group as the backend sees it: one worker, stuck
        def __init__(self):
            self.refs = []

        def __len__(self):
            return 1

        def execute_async(self, fn, **kwargs):
            self.refs = [stuck.remote()]
            return self.refs

    monkeypatch.setenv(process_group.SHUTDOWN_TIMEOUT_ENV, "1.5")
    group = Group()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=process_group.__name__):
        process_group._Backend().on_shutdown(group, process_group.ProcessGroupConfig())
    took = time.monotonic() - start
    ray.cancel(group.refs[0], force=True)
    assert 1.5 <= took < 15
    lines = [r.getMessage() for r in caplog.records if r.name == process_group.__name__]
    assert lines == ["torch process group: the workers did not leave it within 1.5s "
                     "(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S); Ray Train ends them"]


@pytest.mark.parametrize("value", ["0", "-3", "soon"])
def test_a_bad_shutdown_timeout_is_one_clear_line(monkeypatch, value):
    monkeypatch.setenv(process_group.SHUTDOWN_TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match=f"TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S='{value}': expected a positive"):
        process_group.shutdown_timeout_s()


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
