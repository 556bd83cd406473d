"""Shared fixtures: real `wsync serve` processes on loopback, and the tests' own digests.

``wsync_server`` is a factory: ``wsync_server(backend="nccl", model="qwen3-tiny",
device="cpu", args=(), name=None, env=None, ready_seconds=60)`` starts
``$WSYNC_BIN serve --host 127.0.0.1 --port 0 --ready-file ...`` with those flags, waits
(with a deadline) for the ready file and for GET /health to answer 200, and returns a
``Server``. Every server a test started is stopped in teardown (SIGTERM, then SIGKILL).
Its logs are under the test's tmp_path and printed when it fails to start.

Expected digests never come from wsync: ``sha256_digests`` hashes each tensor's bytes with
hashlib, and ``assert_servers_hold`` compares them with every server's
POST /weight_checker {"action": "checksum", "algorithm": "sha256"}.
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

SOURCE_DIR = Path(os.environ.get("WSYNC_SOURCE_DIR", Path(__file__).resolve().parents[2]))


def wsync_bin():
    """The `wsync` binary: $WSYNC_BIN, else <source>/build/tools/wsync."""
    return os.environ.get("WSYNC_BIN") or str(SOURCE_DIR / "build" / "tools" / "wsync")


def http_json(url, path, body=None, timeout=30.0, api_key=None):
    """(status, parsed JSON or text) of GET (body None) or POST ``body`` (a dict) to url+path."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST")
    req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


class Server:
    """One `wsync serve` process a test started."""

    def __init__(self, name, url, process, log_dir, args):
        self.name, self.url, self.process, self.log_dir, self.args = name, url, process, log_dir, args

    def health(self, timeout=10.0):
        status, body = http_json(self.url, "/health", timeout=timeout)
        assert status == 200, f"{self.name}: /health -> {status}: {body}"
        return body

    def checksums(self, algorithm="sha256", timeout=60.0):
        """The server's {name: hex digest} from POST /weight_checker."""
        status, body = http_json(self.url, "/weight_checker",
                                 {"action": "checksum", "algorithm": algorithm}, timeout=timeout)
        assert status == 200, f"{self.name}: /weight_checker -> {status}: {body}"
        return body["checksums"]

    def kill(self):
        """SIGKILL, and wait for it to be gone."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def logs(self):
        out = []
        for suffix in ("stdout", "stderr"):
            path = self.log_dir / f"{self.name}.{suffix}"
            if path.exists():
                out.append(f"--- {self.name} {suffix} ---\n" + path.read_text()[-4000:])
        return "\n".join(out)

    def __repr__(self):
        return f"Server({self.name}, {self.url})"


def stop_process(process, grace=5.0):
    """SIGTERM, then SIGKILL after `grace` seconds."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


@pytest.fixture
def wsync_server(tmp_path):
    started = []

    def start(backend="nccl", model="qwen3-tiny", device="cpu", args=(), name=None, env=None,
              ready_seconds=60.0):
        name = name or f"server{len(started)}"
        ready = tmp_path / f"{name}.url"
        cmd = [wsync_bin(), "serve", "--host", "127.0.0.1", "--port", "0", "--ready-file", str(ready),
               "--backend", backend, "--model", str(model), "--device", device, *map(str, args)]
        child_env = dict(os.environ, TMPDIR=str(tmp_path), **(env or {}))
        with open(tmp_path / f"{name}.stdout", "w") as out, open(tmp_path / f"{name}.stderr", "w") as err:
            process = subprocess.Popen(cmd, stdout=out, stderr=err, env=child_env,
                                       stdin=subprocess.DEVNULL)
        server = Server(name, None, process, tmp_path, cmd)
        started.append(server)
        deadline = time.monotonic() + ready_seconds
        while time.monotonic() < deadline:
            if process.poll() is not None:
                pytest.fail(f"{name} exited with {process.returncode} before it was ready: "
                            f"{' '.join(cmd)}\n{server.logs()}")
            if ready.exists() and ready.read_text().strip():
                server.url = ready.read_text().strip()
                try:
                    status, _ = http_json(server.url, "/health", timeout=2.0)
                    if status == 200:
                        return server
                except OSError:
                    pass
            time.sleep(0.05)
        pytest.fail(f"{name} was not ready within {ready_seconds} s: {' '.join(cmd)}\n{server.logs()}")

    yield start
    for server in started:
        stop_process(server.process)


@pytest.fixture
def toy_model_dir(tmp_path):
    """A config.json directory for a tiny float32 Qwen3 (servers and ToyQwen3 both read it)."""
    from wsync.toy_model import write_config
    return write_config(tmp_path / "toy-qwen3")


def tensor_bytes(tensor):
    """The raw bytes of a torch tensor or numpy array, in row-major order."""
    if hasattr(tensor, "detach"):
        import torch
        t = tensor.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        return t.numpy().tobytes()
    import numpy
    return numpy.ascontiguousarray(tensor).tobytes()


def sha256_digests(pairs):
    """{name: sha256 hex} over each tensor's bytes, computed here with hashlib."""
    return {name: hashlib.sha256(tensor_bytes(t)).hexdigest() for name, t in pairs}


def assert_servers_hold(servers, expected):
    """Every server's /weight_checker sha256 digests equal `expected`, tensor by tensor."""
    for server in servers:
        got = server.checksums("sha256")
        missing = sorted(set(expected) - set(got))[:3]
        extra = sorted(set(got) - set(expected))[:3]
        differ = sorted(n for n in expected if n in got and got[n] != expected[n])[:3]
        assert not (missing or extra or differ), (
            f"{server.name} ({server.url}) holds other weights: missing {missing}, extra {extra}, "
            f"differing {differ}")


def run_python(code, timeout=60.0, **kwargs):
    """Runs `code` in a fresh interpreter (this one) with this environment; returns the result."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, **kwargs)


_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64",
                       "int8": "I8", "uint8": "U8", "int16": "I16", "int32": "I32", "int64": "I64"}


def write_safetensors(path, entries):
    """Writes a safetensors file of `entries`: [(name, dtype_name, tensor)] (the test's own
    writer: an 8-byte little-endian header size, a JSON header, the raw bytes)."""
    header, blobs, offset = {}, [], 0
    for name, dtype, tensor in entries:
        blob = tensor_bytes(tensor)
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for blob in blobs:
            f.write(blob)
    return str(path)


class DeltaSetup:
    """A delta deployment's directories: the servers' base checkpoint (written from
    `entries`), their --sync-root and the trainer's sync_dir below it."""

    def __init__(self, tmp_path, entries):
        self.base = tmp_path / "delta-base"
        self.root = tmp_path / "delta-shared"
        self.sync_dir = self.root / "sync"
        self.root.mkdir(parents=True, exist_ok=True)
        write_safetensors(self.base / "model.safetensors", entries)

    def server_args(self):
        return ["--base-checkpoint", str(self.base), "--sync-root", str(self.root)]

    def trainer_options(self):
        return {"sync_dir": str(self.sync_dir), "base_checkpoint": str(self.base)}
