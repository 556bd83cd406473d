"""vLLM's sleep and wake against a real `wsync serve --backend ipc` process, with memory
measured from outside: the server's resident set (VmRSS of /proc/PID/status, read here)
drops by about the weights' size when they sleep and comes back when they wake, and
/health's "memory" says the same. Level 1 keeps the bytes (the digests after wake are the
ones before); level 2 discards them, and the colocated bracket SkyRL runs (discard, wake
the weights, sync from a torch trainer, wake the KV cache) refills and verifies them
against the test's own hashlib digests.

The model is a float32 Qwen3 of about 320 MB, so that the memory a sleep releases stands
far above the process's other allocations."""

import urllib.error
import urllib.request

import torch

import wsync
from wsync.toy_model import ToyQwen3, write_config
from conftest import assert_servers_hold, http_json, sha256_digests

# A safe fraction of the weights' bytes that a sleep must release, and a wake bring back.
SHARE = 0.8


def post(url, path, timeout=60.0):
    """(status, body text) of a POST without a body, as `curl -X POST` sends it."""
    req = urllib.request.Request(url + path, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def rss_bytes(pid):
    """VmRSS of process `pid`, from the kernel."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/{pid}/status has no VmRSS")


def memory(server):
    return server.health()["memory"]


def is_sleeping(server):
    status, body = http_json(server.url, "/is_sleeping")
    assert status == 200, body
    return body["is_sleeping"]


def is_paused(server):
    status, body = http_json(server.url, "/is_paused")
    assert status == 200, body
    return body["is_paused"]


def model_dir(tmp_path):
    return write_config(tmp_path / "qwen3-320mb", vocab_size=16384, hidden_size=1024, intermediate_size=2816,
                        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                        dtype="float32")


def test_level_one_offloads_the_weights_and_wake_brings_back_the_same_bytes(wsync_server, tmp_path):
    directory = model_dir(tmp_path)
    server = wsync_server(backend="ipc", model=directory, args=("--timeout", "120"))
    pid = server.process.pid
    mem = memory(server)
    weights = mem["weights_bytes"]
    assert weights > 300e6, mem
    assert mem["weights_resident_bytes"] == weights and mem["weights_offloaded_bytes"] == 0, mem
    assert mem["sleep"] == {"weights": "awake", "kv_cache": "awake", "scheduling": "awake"}
    assert "device_used_bytes" not in mem  # a CPU server
    before = server.checksums("sha256")
    # Resident from start-up: synthetic weights, not zeros.
    zeros = sha256_digests((name, torch.zeros(shape)) for name, _, shape in wsync.model_metadata(directory))
    assert set(zeros) == set(before) and not [n for n in before if before[n] == zeros[n]]
    rss_awake = rss_bytes(pid)
    assert rss_awake > weights

    assert post(server.url, "/sleep?level=1") == (200, '{"level":1,"status":"sleeping"}')
    assert is_sleeping(server) and is_paused(server)
    rss_asleep = rss_bytes(pid)
    assert rss_awake - rss_asleep >= SHARE * weights, (rss_awake, rss_asleep, weights)
    mem = memory(server)
    assert mem["weights_offloaded_bytes"] == weights, mem
    assert mem["weights_resident_bytes"] <= (1 - SHARE) * weights, mem
    assert mem["sleep"] == {"weights": "offloaded", "kv_cache": "discarded", "scheduling": "asleep"}
    assert abs(mem["host_rss_bytes"] - rss_asleep) < 0.1 * weights, (mem, rss_asleep)
    status, body = http_json(server.url, "/server_info")
    assert status == 200 and body["memory"]["sleep"] == mem["sleep"], body
    assert body["capabilities"]["sleep_mode"] is True and body["config"]["offload_dir"] == str(tmp_path)
    # Nothing reads or writes sleeping weights; each refusal names the fix.
    for path, payload in (("/weight_checker", {"action": "checksum", "algorithm": "sha256"}),
                          ("/start_weight_update", {})):
        status, body = http_json(server.url, path, payload)
        assert status == 409 and "POST /wake_up?tags=weights first" in body["error"]["message"], (path, status, body)

    assert post(server.url, "/wake_up?tags=weights") == (200, '{"status":"sleeping","tags":["weights"]}')
    assert is_sleeping(server) and is_paused(server)  # the KV cache still sleeps
    rss_woken = rss_bytes(pid)
    assert rss_woken - rss_asleep >= SHARE * weights, (rss_asleep, rss_woken, weights)
    mem = memory(server)
    assert mem["weights_resident_bytes"] == weights and mem["weights_offloaded_bytes"] == 0, mem
    assert server.checksums("sha256") == before
    assert server.health()["weights_consistent"] is True

    assert post(server.url, "/wake_up?tags=kv_cache") == (200, '{"status":"awake","tags":["kv_cache"]}')
    assert not is_sleeping(server) and not is_paused(server)
    assert memory(server)["sleep"] == {"weights": "awake", "kv_cache": "awake", "scheduling": "awake"}


def test_discard_wake_weights_sync_wake_kv_cache_refills_and_verifies(wsync_server, tmp_path):
    directory = model_dir(tmp_path)
    server = wsync_server(backend="ipc", model=directory, args=("--timeout", "120"))
    pid = server.process.pid
    weights = memory(server)["weights_bytes"]
    model = ToyQwen3(directory, seed=3)
    assert weights == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    rss_awake = rss_bytes(pid)

    # SkyRL's colocated bracket: discard (level 2), wake the weights, sync, wake the KV cache.
    assert post(server.url, "/sleep?level=2") == (200, '{"level":2,"status":"sleeping"}')
    rss_asleep = rss_bytes(pid)
    assert rss_awake - rss_asleep >= SHARE * weights, (rss_awake, rss_asleep, weights)
    mem = memory(server)
    assert mem["sleep"]["weights"] == "discarded" and mem["weights_offloaded_bytes"] == 0, mem
    status, body = http_json(server.url, "/start_weight_update", {})
    assert status == 409 and "POST /wake_up?tags=weights first" in body["error"]["message"], body

    assert post(server.url, "/wake_up?tags=weights") == (200, '{"status":"sleeping","tags":["weights"]}')
    assert rss_bytes(pid) - rss_asleep >= SHARE * weights
    health = server.health()
    assert health["weights_consistent"] is False, health
    assert health["memory"]["weights_resident_bytes"] == weights, health
    status, body = http_json(server.url, "/weight_checker", {"action": "checksum", "algorithm": "sha256"})
    assert status == 409 and "discarded" in body["error"]["message"], body
    assert is_sleeping(server)

    with wsync.TrainerEngine(backend="ipc", servers=[server.url], timeout=120, bucket_gb=0.05) as engine:
        engine.send_weights(wsync.StateDictSource(model), weight_version="refilled")
    assert_servers_hold([server], sha256_digests(model.state_dict().items()))
    health = server.health()
    assert health["weights_consistent"] is True and health["weight_version"] == "refilled", health

    assert post(server.url, "/wake_up?tags=kv_cache") == (200, '{"status":"awake","tags":["kv_cache"]}')
    assert not is_sleeping(server) and not is_paused(server)
