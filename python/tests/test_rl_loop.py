"""A colocated-style RL loop against real `wsync serve` processes, one per backend that runs
on CPU (nccl over Gloo, ipc over shared memory, delta over a sync dir): generate, sleep
(level 1, then level 2 as SkyRL's colocated step does), train, wake the weights, sync,
wake the KV cache, generate again. Each step checks the server's memory as the kernel
reports it (/proc/PID/status, read here), what /health says of it, the weights against
the test's own sha256 digests, and that the tokens generated after the sync carry the new
weight version and come from the new weights."""

import pytest

import wsync
from wsync.toy_model import write_config
from conftest import DeltaSetup, assert_servers_hold, http_json, sha256_digests
from test_sources_numpy import random_arrays

PROMPT = "the weights of step"


def rss_bytes(pid):
    """Resident anonymous memory of process `pid`, from the kernel (the weights are
    anonymous memory; a delta server's mapped checkpoint files are not)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no RssAnon for pid {pid}")


def post(server, path, body=None, timeout=60.0):
    status, reply = http_json(server.url, path, {} if body is None else body, timeout=timeout)
    assert status == 200, f"{server.name}: POST {path} -> {status}: {reply}"
    return reply


def generate(server, max_tokens=8):
    reply = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": max_tokens})
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == max_tokens
    return choice["token_ids"], choice["weight_versions"]


def is_sleeping(server):
    status, reply = http_json(server.url, "/is_sleeping")
    assert status == 200, reply
    return reply["is_sleeping"]


@pytest.mark.parametrize("backend", ["nccl", "ipc", "delta"])
def test_sleep_sync_wake_generate(backend, wsync_server, tmp_path):
    # About 70 MB of bf16 weights: far above the RSS noise of a server process.
    model = write_config(tmp_path / "model", vocab_size=8192, hidden_size=1024, intermediate_size=2048,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                         dtype="bfloat16")
    metadata = wsync.model_metadata(model)
    weights_bytes = sum(2 * __import__("math").prod(shape) for _, _, shape in metadata)
    arrays = random_arrays(metadata, seed=10)
    server_args, options = [], {}
    if backend == "delta":
        delta = DeltaSetup(tmp_path, [(n, d, a) for n, a, d in arrays])
        server_args, options = delta.server_args(), delta.trainer_options()
    server = wsync_server(backend=backend, model=model, args=server_args, name=backend, ready_seconds=120)
    pid = server.process.pid
    with wsync.TrainerEngine(backend=backend, servers=[server.url], timeout=60, bucket_gb=0.01,
                             **options) as engine:
        engine.send_weights(wsync.TensorListSource(arrays), weight_version="step-0")
        assert_servers_hold([server], sha256_digests((n, a) for n, a, _ in arrays))
        tokens, versions = generate(server)
        assert versions == ["step-0"] * len(tokens)

        for step, level in enumerate([1, 2, 1], start=1):
            awake_rss = rss_bytes(pid)
            memory = server.health()["memory"]
            assert memory["weights_bytes"] == weights_bytes
            assert memory["weights_resident_bytes"] == weights_bytes

            # Generation is done: the engine sleeps while the trainer trains.
            post(server, f"/sleep?level={level}")
            assert is_sleeping(server)
            asleep_rss = rss_bytes(pid)
            assert awake_rss - asleep_rss >= 0.8 * weights_bytes, (level, awake_rss, asleep_rss)
            memory = server.health()["memory"]
            assert memory["weights_resident_bytes"] == 0
            assert memory["sleep"]["weights"] == ("offloaded" if level == 1 else "discarded")
            assert memory["sleep"]["kv_cache"] == "discarded"

            arrays = random_arrays(metadata, seed=10 + step)  # the training step

            # SkyRL's bracket: wake the weights, sync, then wake the KV cache.
            post(server, "/wake_up?tags=weights")
            assert is_sleeping(server)  # the KV cache still sleeps
            assert rss_bytes(pid) - asleep_rss >= 0.8 * weights_bytes
            health = server.health()
            assert health["memory"]["sleep"]["weights"] == "awake"
            # Level 1 kept the bytes; level 2 did not, and the server says so until a sync.
            assert health["weights_consistent"] is (level == 1)
            engine.send_weights(wsync.TensorListSource(arrays), weight_version=f"step-{step}")
            assert server.health()["weights_consistent"] is True
            assert_servers_hold([server], sha256_digests((n, a) for n, a, _ in arrays))
            post(server, "/wake_up?tags=kv_cache")
            assert not is_sleeping(server)

            new_tokens, versions = generate(server)
            assert versions == [f"step-{step}"] * len(new_tokens)
            assert new_tokens != tokens, "tokens after a sync must come from the new weights"
            tokens = new_tokens
