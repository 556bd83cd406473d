"""Helpers of the distributed-trainer tests: every rank a real process (gloo, CPU).

A transformers Qwen3 built from a tiny config is sharded with FSDP2 ``fully_shard``
(``wsync.DTensorSource``) or laid out Megatron-style (``wsync.MegatronSource``), trained
with AdamW and synced after every step into real `wsync serve` fleets. After every sync
rank 0 compares each server's /weight_checker sha256 digests with hashlib digests of the
full model (dist_worker.py). Failures (a rank killed, a server killed, a source raising on
one rank) end every rank's call within the engine timeout, with a named error, and the
next sync lands.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import shared  # noqa: F401  (re-exported)

WORKER = Path(__file__).with_name("dist_worker.py")
TIMEOUT = 20.0  # the engines' timeout
SLACK = 30.0    # what a rank may take beyond it on a loaded 2-core machine


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(directory, dtype="float32", moe=False, tied=True):
    from transformers import Qwen3Config, Qwen3MoeConfig
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=tied, dtype=dtype)
    if moe:
        config = Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], intermediate_size=128,
                                moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                decoder_sparse_step=1, mlp_only_layers=[], **common)
    else:
        config = Qwen3Config(architectures=["Qwen3ForCausalLM"], intermediate_size=128, **common)
    config.save_pretrained(directory)
    return str(directory)


def run_ranks(spec, tmp_path, world=2, timeout=300.0, tag="run"):
    """Starts `world` worker processes and returns each one's JSON lines (and the processes)."""
    spec = dict(spec, world=world, torch_port=free_port(), timeout=spec.get("timeout", TIMEOUT))
    procs, logs = [], []
    for r in range(world):
        log = tmp_path / f"{tag}.rank{r}.stderr"
        logs.append(log)
        with open(log, "w") as err:
            procs.append(subprocess.Popen([sys.executable, str(WORKER), str(r), json.dumps(spec)],
                                          stdout=subprocess.PIPE, stderr=err, text=True, env=dict(os.environ)))
    out = []
    deadline = time.monotonic() + timeout
    for r, p in enumerate(procs):
        try:
            stdout, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"rank {r} still running after {timeout} s\n" + stderr_of(logs))
        out.append([json.loads(line) for line in stdout.splitlines() if line.startswith("{")])
    return out, procs, logs


def stderr_of(logs):
    return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)


def assert_landed(results, logs, steps):
    for r, lines in enumerate(results):
        assert len(lines) == steps, f"rank {r}: {lines}\n" + stderr_of(logs)
        for line in lines:
            assert line["ok"], f"rank {r}: {line}\n" + stderr_of(logs)
    for line in results[0]:
        assert line["mismatch"] == {}, f"step {line['step']}: {line['mismatch']}"


def start_server(tmp_path, name, port, model_dir, tp):
    """A sharded `wsync serve` on a given port (so that a restart keeps its URL)."""
    ready = tmp_path / f"{name}.url"
    ready.unlink(missing_ok=True)
    cmd = [shared.wsync_bin(), "serve", "--host", "127.0.0.1", "--port", str(port), "--ready-file", str(ready),
           "--backend", "sharded", "--model", model_dir, "--tp", str(tp)]
    with open(tmp_path / f"{name}.log", "a") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                env=dict(os.environ, TMPDIR=str(tmp_path)))
    deadline = time.monotonic() + 60
    while not (ready.exists() and ready.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / f"{name}.log").read_text()
        time.sleep(0.05)
    return proc, ready.read_text().strip()


def assert_failed_everywhere(results, logs, step, words):
    """Every rank's sync `step` failed within the engine timeout, naming one of `words`."""
    for r, lines in enumerate(results):
        line = next((x for x in lines if x["step"] == step), None)
        assert line is not None and not line["ok"], f"rank {r}: {lines}\n" + stderr_of(logs)
        assert line["seconds"] < TIMEOUT + SLACK, f"rank {r} took {line['seconds']:.1f} s: {line}"
        assert any(w in line["message"] for w in words), f"rank {r}: {line}"
