"""Python inference workers on CUDA: `python -m wsync.worker_server --device cuda:N` receives
from `wsync push --device cuda:0` through CUDA IPC (same GPU, packed and zero-copy) and
NCCL (another GPU), lent device views landing in a torch model on the GPU, checked
against digests this test computes itself. Skips without CUDA (and NCCL without 2 GPUs)."""

import pytest
import torch

from receiver_fixtures import push, random_model, sha256_digests, worker_server, write_checkpoint  # noqa: F401

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def checkpoint(tmp_path):
    pairs = random_model("qwen3-tiny", seed=11)
    return write_checkpoint(tmp_path / "ckpt", pairs), pairs


@pytest.mark.parametrize("mode", ["packed", "zero_copy"])
def test_cuda_ipc_lands_device_views_in_the_model(tmp_path, worker_server, checkpoint, mode):
    ckpt, pairs = checkpoint
    server = worker_server("ipc", "--device", "cuda:0")
    r = push(tmp_path, "push0", [server], "--backend", "ipc", "--device", "cuda:0", "--ipc-mode", mode,
             "--checkpoint", ckpt)
    assert r.returncode == 0, r.description + "\n" + server.logs()
    assert server.checksums("sha256") == sha256_digests(pairs)
    r = push(tmp_path, "push2", [server], "--backend", "ipc", "--device", "cuda:0", "--ipc-mode", mode,
             "--checkpoint", ckpt, "--steps", 2, "--verify", "--verify-algorithm", "sha256")
    assert r.returncode == 0, r.description + "\n" + server.logs()
    assert r.stdout.count(" yes") == 3, r.stdout


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs the trainer and the worker on two GPUs")
def test_nccl_lands_device_views_in_the_model(tmp_path, worker_server, checkpoint):
    ckpt, pairs = checkpoint
    server = worker_server("nccl", "--device", "cuda:1")
    r = push(tmp_path, "push", [server], "--backend", "nccl", "--device", "cuda:0", "--checkpoint", ckpt,
             "--bucket-gb", 1 / 1024)
    assert r.returncode == 0, r.description + "\n" + server.logs()
    assert server.checksums("sha256") == sha256_digests(pairs)
    r = push(tmp_path, "push2", [server], "--backend", "nccl", "--device", "cuda:0", "--checkpoint", ckpt,
             "--steps", 2, "--verify", "--verify-algorithm", "sha256")
    assert r.returncode == 0, r.description + "\n" + server.logs()
    assert r.stdout.count(" yes") == 3, r.stdout
