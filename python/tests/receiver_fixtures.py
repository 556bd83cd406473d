"""Helpers of the receiver tests: a real `python -m wsync.worker_server` process, the
trainer CLI (`wsync push`), a checkpoint the test writes itself, and digests the test
computes itself with hashlib.

Every wait has a deadline; every process a test starts is killed in teardown.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import http_json, wsync_bin  # noqa: F401  (shared with the trainer's tests)


def tensor_bytes(tensor):
    """A torch tensor's raw bytes in row-major order."""
    import torch
    t = tensor.detach().cpu().contiguous()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def sha256_digests(pairs):
    """{name: sha256 hex} of each tensor's bytes, computed here with hashlib."""
    return {name: hashlib.sha256(tensor_bytes(t)).hexdigest() for name, t in pairs}


_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def write_checkpoint(directory, pairs):
    """Writes `pairs` [(name, torch tensor)] as <directory>/model.safetensors with this
    test's own writer (8-byte little-endian header size, JSON header, raw bytes)."""
    header, blobs, offset = {}, [], 0
    for name, t in pairs:
        blob = tensor_bytes(t)
        header[name] = {"dtype": _SAFETENSORS_DTYPES[str(t.dtype)[len("torch."):]], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    Path(directory).mkdir(parents=True, exist_ok=True)
    with open(Path(directory) / "model.safetensors", "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for blob in blobs:
            f.write(blob)
    return str(directory)


def random_model(model, seed):
    """[(name, tensor)] of every HF tensor of a registered model, random, in its order."""
    import torch
    import wsync
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, dtype, shape in wsync.model_metadata(model):
        out.append((name, (torch.randn(shape, generator=g) * 0.02).to(getattr(torch, dtype))))
    return out


class Process:
    """A child process with its output in files under the test's tmp_path."""

    def __init__(self, name, cmd, tmp_path, env=None):
        self.name, self.cmd, self.tmp_path = name, cmd, tmp_path
        self.out_path, self.err_path = tmp_path / f"{name}.stdout", tmp_path / f"{name}.stderr"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.process = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                            env=dict(os.environ, TMPDIR=str(tmp_path), **(env or {})))

    def logs(self):
        return (f"--- {self.name}: {' '.join(self.cmd)}\n--- stdout\n{self.out_path.read_text()[-4000:]}"
                f"\n--- stderr\n{self.err_path.read_text()[-4000:]}")

    def stop(self, grace=5.0):
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


class WorkerServerProcess(Process):
    """`python -m wsync.worker_server` on a free port."""

    url = None

    def checksums(self, algorithm="sha256"):
        status, body = http_json(self.url, "/weight_checker", {"action": "checksum", "algorithm": algorithm},
                                 timeout=60)
        assert status == 200, f"{self.name}: /weight_checker -> {status}: {body}"
        return body["checksums"]


@pytest.fixture
def worker_server(tmp_path):
    """Factory: worker_server(backend, *args, workers=1) -> a ready WorkerServerProcess."""
    started = []

    def start(backend, *args, workers=1, model="qwen3-tiny", ready_seconds=60.0):
        name = f"worker_server{len(started)}"
        ready = tmp_path / f"{name}.url"
        cmd = [sys.executable, "-m", "wsync.worker_server", "--backend", backend, "--model", model,
               "--workers", str(workers), "--port", "0", "--ready-file", str(ready), "--timeout", "60",
               *map(str, args)]
        server = WorkerServerProcess(name, cmd, tmp_path)
        started.append(server)
        deadline = time.monotonic() + ready_seconds
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                pytest.fail(f"{name} exited with {server.process.returncode}:\n{server.logs()}")
            if ready.exists():
                server.url = ready.read_text().strip()
                status, _ = http_json(server.url, "/health", timeout=5)
                if status == 200:
                    return server
            time.sleep(0.05)
        pytest.fail(f"{name} was not ready within {ready_seconds} s:\n{server.logs()}")

    yield start
    for server in started:
        server.stop()


def push(tmp_path, name, servers, *args, timeout=180.0):
    """Runs `wsync push --servers ...` to completion (bounded); returns the CompletedProcess."""
    cmd = [wsync_bin(), "push", "--servers", ",".join(s.url for s in servers), "--timeout", "60", *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                       env=dict(os.environ, TMPDIR=str(tmp_path)))
    r.description = f"{name}: {' '.join(cmd)} -> {r.returncode}\n--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-4000:]}"
    return r
