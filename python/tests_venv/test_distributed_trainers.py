"""Distributed PyTorch trainers on torch 2.x: every rank a real process (gloo, CPU).

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

from conftest import shared

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


@pytest.mark.parametrize("backend", ["sharded", "nccl", "delta"])
def test_fsdp2_two_ranks_into_tp1_and_tp2(backend, wsync_server, tmp_path):
    """FSDP2 fully_shard over 2 ranks, fp32 trained and sent as bf16, into a TP=1 and a TP=2 server."""
    model_dir = write_config(tmp_path / "model", dtype="bfloat16")
    options = {}
    args = []
    if backend == "sharded":
        options = {"model": model_dir}
    if backend == "delta":
        import torch
        from dist_worker import build_model
        base = [(n, "bfloat16", t.detach().to(torch.bfloat16))
                for n, t in build_model({"model_dir": model_dir}).state_dict().items() if n != "lm_head.weight"]
        delta = shared.DeltaSetup(tmp_path, base)
        options = delta.trainer_options()
        args = delta.server_args()
    servers = [wsync_server(backend=backend, model=model_dir, args=["--tp", "1", *args]),
               wsync_server(backend=backend, model=model_dir, args=["--tp", "2", *args])]
    spec = {"backend": backend, "servers": [s.url for s in servers], "model_dir": model_dir,
            "source": "dtensor", "steps": 2, "servers_dtype": "bfloat16", "backend_options": options,
            "dropped": ["lm_head.weight"]}
    results, _, logs = run_ranks(spec, tmp_path)
    assert_landed(results, logs, 2)


def test_megatron_tp2pp2_four_ranks_into_tp2(wsync_server, tmp_path):
    """A Megatron-style tp2pp2 layout of 4 ranks (tied embeddings: the last stage keeps its
    own copy) into a TP=2 server with sharded: each TP group assembles its stage's tensors."""
    model_dir = write_config(tmp_path / "model", dtype="float32")
    server = wsync_server(backend="sharded", model=model_dir, args=["--tp", "2"])
    spec = {"backend": "sharded", "servers": [server.url], "model_dir": model_dir, "source": "megatron",
            "layout": "tp2pp2ep1", "steps": 2, "backend_options": {"model": model_dir},
            "dropped": ["lm_head.weight"]}
    results, _, logs = run_ranks(spec, tmp_path, world=4)
    assert_landed(results, logs, 2)


@pytest.mark.parametrize("source,layout", [("dtensor", None), ("megatron", "tp1pp1ep2")])
def test_moe_two_ranks_into_tp2(source, layout, wsync_server, tmp_path):
    """A transformers Qwen3-MoE (experts fused, as transformers 5 holds them) from 2 ranks
    into a TP=2 server with sharded: FSDP2 shards, or an expert-parallel layout (ep2)."""
    model_dir = write_config(tmp_path / "model", dtype="float32", moe=True, tied=False)
    server = wsync_server(backend="sharded", model=model_dir, args=["--tp", "2"])
    spec = {"backend": "sharded", "servers": [server.url], "model_dir": model_dir, "source": source,
            "layout": layout, "steps": 2, "backend_options": {"model": model_dir}}
    results, _, logs = run_ranks(spec, tmp_path, world=2)
    assert_landed(results, logs, 2)


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


def test_failures_end_every_rank_and_the_next_sync_lands(tmp_path):
    """Sharded from 2 FSDP2 ranks into a TP=2 server. Step 1: rank 1's source raises after
    its pass: both ranks raise naming it; step 2 lands. Step 3: the server is killed: both
    ranks raise naming it; it restarts on its port and step 4 lands. Then rank 1 dies before
    a sync: rank 0's call ends with a named error, and a fresh pair of ranks lands."""
    model_dir = write_config(tmp_path / "model", dtype="float32")
    port = free_port()
    proc, url = start_server(tmp_path, "server", port, model_dir, 2)
    signals = tmp_path / "signals"
    signals.mkdir()
    try:
        spec = {"backend": "sharded", "servers": [url], "model_dir": model_dir, "source": "dtensor",
                "steps": 5, "backend_options": {"model": model_dir}, "dropped": ["lm_head.weight"],
                "signal_dir": str(signals),
                "faults": {"1": {"raise_rank": 1}, "3": {"wait_file": str(signals / "killed")},
                           "4": {"wait_file": str(signals / "restarted")}}}
        import threading

        def restart():
            deadline = time.monotonic() + 240
            while not (signals / "done2").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.kill()
            proc.wait()
            (signals / "killed").touch()
            while not (signals / "done3").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            restarted.append(start_server(tmp_path, "server", port, model_dir, 2)[0])
            (signals / "restarted").touch()

        restarted = []
        helper = threading.Thread(target=restart, daemon=True)
        helper.start()
        results, _, logs = run_ranks(spec, tmp_path, world=2, tag="faults")
        helper.join(timeout=60)
        assert_failed_everywhere(results, logs, 1, ["gradient norm check failed"])
        assert_failed_everywhere(results, logs, 3, [url])
        for step in (0, 2, 4):
            for r, lines in enumerate(results):
                line = lines[step]
                assert line["ok"], f"rank {r} step {step}: {line}\n" + stderr_of(logs)
            assert results[0][step]["mismatch"] == {}, results[0][step]

        spec = {"backend": "sharded", "servers": [url], "model_dir": model_dir, "source": "dtensor",
                "steps": 2, "backend_options": {"model": model_dir}, "dropped": ["lm_head.weight"],
                "exit_on_failure": True, "faults": {"1": {"kill_rank": 1}}}
        results, _, logs = run_ranks(spec, tmp_path, world=2, tag="killed")
        assert results[0][0]["ok"], results
        line = results[0][1]
        assert not line["ok"] and line["seconds"] < TIMEOUT + SLACK, line
        assert "rank 1" in line["message"] or "Connection closed" in line["message"], line
        spec = dict(spec, steps=1, faults={})
        results, _, logs = run_ranks(spec, tmp_path, world=2, tag="after")
        assert_landed(results, logs, 1)
    finally:
        for p in [proc] + restarted:
            if p.poll() is None:
                p.kill()
