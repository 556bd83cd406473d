"""The reference server's toy generation against real `wsync serve` processes: pause
abort|wait|keep with requests in flight (keep with a real sync in the middle), the
per-token weight versions, /abort_requests, the prefix cache and its resets.

The expected tokens never come from wsync: ``Reference`` recomputes the token function
documented in src/server/generation.h from the weights the test itself pushed.
"""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import wsync
from wsync.toy_model import ToyQwen3
from conftest import http_json, tensor_bytes

MASK = (1 << 64) - 1
INITIAL_STATE = 0x243F6A8885A308D3
PROBE_SEED = 0x13198A2E03707344
GOLDEN = 0x9E3779B97F4A7C15
INTERVAL_MS = 20  # --token-interval-ms of the servers whose requests must stay in flight


def mix(x):
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def fold(h, data):
    data = data + b"\0" * (-len(data) % 8)
    for i in range(0, len(data), 8):
        h = mix(h ^ int.from_bytes(data[i:i + 8], "little"))
    return h


def absorb(state, token, probe):
    return mix(((state ^ probe) + (token + 1) * GOLDEN) & MASK)


class Reference:
    """The token function over one set of weights (a torch module's state dict)."""

    def __init__(self, model):
        sd = model.state_dict()
        embed, norm = sd["model.embed_tokens.weight"], tensor_bytes(sd["model.norm.weight"])
        self.vocab = embed.shape[0]
        self.probes = [fold(fold(PROBE_SEED, tensor_bytes(embed[t])), norm) for t in range(self.vocab)]

    def prefill(self, prompt, state=INITIAL_STATE):
        for t in prompt:
            state = absorb(state, t, self.probes[t])
        return state

    def tokens(self, prompt, n, state=None):
        state = self.prefill(prompt) if state is None else state
        out = []
        for i in range(n):
            if i:
                state = absorb(state, out[-1], self.probes[out[-1]])
            out.append(state % self.vocab)
        return out


def push(servers, model, version):
    with wsync.TrainerEngine(backend="nccl", servers=[s.url for s in servers], timeout=60) as engine:
        engine.init(wsync.StateDictSource(model))
        engine.send_weights(wsync.StateDictSource(model), weight_version=version)


def complete(server, body, timeout=60.0):
    status, reply = http_json(server.url, "/v1/completions", body, timeout=timeout)
    assert status == 200, f"{server.name}: /v1/completions -> {status}: {reply}"
    return reply


def post(server, path, body=None, expect=200, timeout=60.0):
    status, reply = http_json(server.url, path, {} if body is None else body, timeout=timeout)
    assert status == expect, f"{server.name}: {path} -> {status}: {reply}"
    return reply


def generation(server):
    return server.health()["generation"]


def await_running(server, n, seconds=20.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if generation(server)["running"] == n:
            return
        time.sleep(0.01)
    raise AssertionError(f"{server.name}: {n} requests never ran at once: {generation(server)}")


def choice(reply):
    return reply["choices"][0]


@pytest.fixture
def models(toy_model_dir):
    return ToyQwen3(toy_model_dir, seed=11), ToyQwen3(toy_model_dir, seed=12)


def test_identical_requests_on_identical_weights_answer_the_same_tokens(wsync_server, toy_model_dir, models):
    servers = [wsync_server(model=toy_model_dir, name=f"s{i}") for i in range(2)]
    push(servers, models[0], "v1")
    ref = Reference(models[0])
    prompt = "the weights decide"
    replies = [complete(s, {"prompt": prompt, "max_tokens": 12, "request_id": "same"}) for s in servers]
    want = ref.tokens(list(prompt.encode()), 12)
    for s, r in zip(servers, replies):
        assert choice(r)["token_ids"] == want, s.name
        assert choice(r)["finish_reason"] == "length"
        assert choice(r)["weight_versions"] == ["v1"] * 12
        assert r["weight_version"] == "v1" and r["id"] == "same" and r["object"] == "text_completion"
        assert r["model"] == toy_model_dir
        assert r["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 12, "total_tokens": len(prompt) + 12,
                              "prompt_tokens_details": {"cached_tokens": 0}}
    # A list of ids is the same prompt as its bytes.
    assert choice(complete(servers[0], {"prompt": list(prompt.encode()), "max_tokens": 12}))["token_ids"] == want


def test_pause_abort_ends_requests_in_flight_with_their_partial_tokens(wsync_server, toy_model_dir, models):
    server = wsync_server(model=toy_model_dir, args=["--token-interval-ms", INTERVAL_MS])
    push([server], models[0], "v1")
    ref = Reference(models[0])
    prompts = ["abort me", "and me", "me too"]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(complete, server, {"prompt": p, "max_tokens": 2000}) for p in prompts]
        await_running(server, 3)
        time.sleep(0.2)
        assert post(server, "/pause?mode=abort") == {"status": "paused"}
        replies = [f.result(timeout=30) for f in futures]
        for p, r in zip(prompts, replies):
            ids = choice(r)["token_ids"]
            assert choice(r)["finish_reason"] == "abort"
            assert 0 < len(ids) < 2000
            assert ids == ref.tokens(list(p.encode()), len(ids))
            assert choice(r)["weight_versions"] == ["v1"] * len(ids)
        assert http_json(server.url, "/is_paused") == (200, {"is_paused": True})
        # A request made while paused queues until /resume.
        queued = pool.submit(complete, server, {"prompt": "later", "max_tokens": 3})
        time.sleep(0.3)
        g = generation(server)
        assert g["waiting"] == 1 and g["paused"] and g["pause_mode"] == "abort" and g["aborted"] == 3
        assert not queued.done()
        assert post(server, "/resume") == {"status": "resumed"}
        assert choice(queued.result(timeout=30))["token_ids"] == ref.tokens(list(b"later"), 3)
    assert http_json(server.url, "/is_paused") == (200, {"is_paused": False})


def test_pause_wait_returns_once_requests_in_flight_have_finished(wsync_server, toy_model_dir, models):
    server = wsync_server(model=toy_model_dir, args=["--token-interval-ms", INTERVAL_MS])
    push([server], models[0], "v1")
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(complete, server, {"prompt": f"drain {i}", "max_tokens": 25}) for i in range(3)]
        await_running(server, 3)
        started = time.monotonic()
        assert post(server, "/pause?mode=wait") == {"status": "paused"}
        waited = time.monotonic() - started
        g = generation(server)
        assert g["running"] == 0 and g["completed"] == 3, g  # all had ended when the pause answered
        assert waited > 0.1  # 25 tokens at 20 ms do not fit in the time before the pause
        for f in futures:
            r = f.result(timeout=30)
            assert choice(r)["finish_reason"] == "length" and len(choice(r)["token_ids"]) == 25
        post(server, "/resume")


def test_pause_keep_with_a_sync_in_the_middle_continues_on_the_new_weights(wsync_server, toy_model_dir, models):
    server = wsync_server(model=toy_model_dir, args=["--token-interval-ms", INTERVAL_MS])
    old_model, new_model = models
    push([server], old_model, "v1")
    old, new = Reference(old_model), Reference(new_model)
    prompts = [list(b"keep one"), list(b"keep two")]
    n = 60
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(complete, server, {"prompt": p, "max_tokens": n}, 120.0) for p in prompts]
        await_running(server, 2)
        time.sleep(0.3)
        assert post(server, "/pause?mode=keep") == {"status": "paused"}
        assert generation(server)["pause_mode"] == "keep"
        resets = generation(server)["prefix_cache"]["resets"]
        push([server], new_model, "v2")  # start, update, finish while the requests are frozen
        assert generation(server)["running"] == 2
        # The trainer saw that the server caches prefixes and reset its cache, running
        # requests included (as SkyRL does): the frozen requests recompute their state.
        assert generation(server)["prefix_cache"]["resets"] == resets + 1
        assert post(server, "/resume") == {"status": "resumed"}
        replies = [f.result(timeout=60) for f in futures]
    for p, r in zip(prompts, replies):
        ids, versions = choice(r)["token_ids"], choice(r)["weight_versions"]
        assert choice(r)["finish_reason"] == "length" and len(ids) == n and len(versions) == n  # nothing lost
        k = versions.index("v2")
        assert 0 < k < n and versions == ["v1"] * k + ["v2"] * (n - k), versions
        assert ids[:k] == old.tokens(p, k)
        assert ids[k:] == new.tokens(p + ids[:k], n - k)  # recomputed from the new weights
        assert ids[k:] != old.tokens(p, n)[k:]  # not what the old weights give
        assert r["weight_version"] == "v2"


def test_abort_requests_by_id_and_all_without_pausing(wsync_server, toy_model_dir):
    server = wsync_server(model=toy_model_dir, args=["--token-interval-ms", INTERVAL_MS])
    with ThreadPoolExecutor(4) as pool:
        futures = {rid: pool.submit(complete, server, {"prompt": rid, "max_tokens": 2000, "request_id": rid})
                   for rid in ("a", "b", "c")}
        await_running(server, 3)
        assert post(server, "/abort_requests", {"request_ids": ["b", "unknown"]}) == {"status": "aborted", "aborted": 1}
        assert choice(futures["b"].result(timeout=30))["finish_reason"] == "abort"
        assert post(server, "/abort_requests", {"request_ids": ["unknown"]}) == {"status": "aborted", "aborted": 0}
        assert http_json(server.url, "/is_paused") == (200, {"is_paused": False})
        assert generation(server)["running"] == 2
        assert post(server, "/abort_requests") == {"status": "aborted", "aborted": 2}
        for rid in ("a", "c"):
            r = futures[rid].result(timeout=30)
            assert choice(r)["finish_reason"] == "abort" and r["id"] == rid
    # New requests still run: nothing paused.
    assert choice(complete(server, {"prompt": "x", "max_tokens": 2}))["finish_reason"] == "length"


def test_prefix_cache_hits_go_stale_across_a_sync_until_reset(wsync_server, toy_model_dir, models):
    server = wsync_server(model=toy_model_dir)
    old_model, new_model = models
    push([server], old_model, "v1")
    old, new = Reference(old_model), Reference(new_model)
    prompt = [(7 * i) % 500 for i in range(40)]
    body = {"prompt": prompt, "max_tokens": 6}
    first = complete(server, body)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert choice(first)["token_ids"] == old.tokens(prompt, 6)
    hit = complete(server, body)
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert choice(hit)["token_ids"] == choice(first)["token_ids"]
    cache = generation(server)["prefix_cache"]
    assert cache["enabled"] and cache["entries"] == 2 and cache["hits"] == 1
    assert cache["bytes"] == 2 * cache["block_bytes"] and cache["capacity_bytes"] == 16 << 20

    # A sync from a trainer resets the cache of a server that says it caches prefixes.
    resets = generation(server)["prefix_cache"]["resets"]
    push([server], new_model, "v2")
    assert generation(server)["prefix_cache"]["resets"] == resets + 1
    synced = complete(server, body)
    assert synced["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert choice(synced)["token_ids"] == new.tokens(prompt, 6)

    # Weights changed by a path that does not reset it (the weight checker's reset to
    # random values): the cached prefix states are stale, and a reset is what fixes it.
    assert complete(server, body)["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert post(server, "/weight_checker", {"action": "reset"}) == {"status": "reset"}
    stale = complete(server, body)
    assert stale["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert post(server, "/reset_prefix_cache") == {"success": True}
    fresh = complete(server, body)
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert choice(fresh)["token_ids"] != choice(stale)["token_ids"]  # the stale states decided those
    assert complete(server, body)["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert choice(complete(server, body))["token_ids"] == choice(fresh)["token_ids"]
    assert generation(server)["prefix_cache"]["resets"] == resets + 2


def test_reset_prefix_cache_with_running_requests_and_the_clear_cache_of_pause(wsync_server, toy_model_dir):
    server = wsync_server(model=toy_model_dir, args=["--token-interval-ms", INTERVAL_MS])
    prompt = list(range(1, 41))

    def entries():
        return generation(server)["prefix_cache"]["entries"]

    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(complete, server, {"prompt": prompt, "max_tokens": 2000, "request_id": "r"})
        await_running(server, 1)
        assert post(server, "/reset_prefix_cache") == {"success": False}  # vLLM's answer while requests run
        assert entries() == 2
        assert post(server, "/reset_prefix_cache?reset_running_requests=true") == {"success": True}
        assert entries() == 0
        post(server, "/abort_requests", {"request_ids": ["r"]})
        assert choice(running.result(timeout=30))["finish_reason"] == "abort"

    def fill():
        complete(server, {"prompt": prompt, "max_tokens": 1})
        assert entries() == 2

    fill()
    post(server, "/pause?mode=keep")  # keep never clears
    assert entries() == 2
    post(server, "/resume")
    post(server, "/pause?mode=wait&clear_cache=false")
    assert entries() == 2
    post(server, "/resume")
    post(server, "/pause?mode=wait")  # clear_cache defaults to true
    assert entries() == 0
    post(server, "/resume")
    fill()
    post(server, "/pause?mode=abort&clear_cache=true")
    assert entries() == 0
    post(server, "/resume")


def test_without_a_kv_cache_nothing_is_cached(wsync_server, toy_model_dir):
    server = wsync_server(model=toy_model_dir, args=["--kv-cache-mib", 0])
    body = {"prompt": list(range(40)), "max_tokens": 2}
    complete(server, body)
    assert complete(server, body)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cache = generation(server)["prefix_cache"]
    assert not cache["enabled"] and cache["capacity_bytes"] == 0 and cache["resident_bytes"] == 0


def test_per_token_versions_follow_update_weight_version(wsync_server, toy_model_dir, models):
    server = wsync_server(model=toy_model_dir, args=["--token-interval-ms", INTERVAL_MS])
    push([server], models[0], "v1")
    ref = Reference(models[0])
    with ThreadPoolExecutor(2) as pool:
        future = pool.submit(complete, server, {"prompt": "versions", "max_tokens": 40})
        await_running(server, 1)
        time.sleep(0.2)
        assert post(server, "/update_weight_version", {"new_version": "renamed"}) == {"success": True,
                                                                                     "new_version": "renamed"}
        r = future.result(timeout=30)
    versions = choice(r)["weight_versions"]
    k = versions.index("renamed")
    assert 0 < k < 40 and versions == ["v1"] * k + ["renamed"] * (40 - k)
    assert choice(r)["token_ids"] == ref.tokens(list(b"versions"), 40)  # same weights, same tokens
    assert r["weight_version"] == "renamed"
    assert http_json(server.url, "/weight_info") == (200, {"weight_version": "renamed"})


def test_refusals_name_what_they_refuse(wsync_server, toy_model_dir):
    server = wsync_server(model=toy_model_dir)
    status, body = http_json(server.url, "/pause?mode=sideways", {})
    assert status == 400 and "sideways" in body["error"]["message"]
    assert post(server, "/resume") == {"status": "resumed"}  # not paused: fine
    for req, code, needle in [({"max_tokens": 2}, 400, "'prompt'"),
                              ({"prompt": "x", "max_tokens": 5000}, 400, "'max_tokens'"),
                              ({"prompt": [512]}, 400, "element 0"),
                              ({"prompt": "x", "model": "gpt-x"}, 404, "gpt-x"),
                              ({"prompt": "x", "stream": True}, 400, "'stream'")]:
        status, body = http_json(server.url, "/v1/completions", req)
        assert status == code and needle in body["error"]["message"], (req, status, body)
    g = generation(server)
    assert set(g) >= {"running", "waiting", "paused", "pause_mode", "completed", "aborted", "token_interval_ms",
                      "prefix_cache"}
    assert set(g["prefix_cache"]) >= {"enabled", "entries", "bytes", "capacity_bytes", "hits", "resets"}
    assert g["prefix_cache"]["resident_bytes"] == 16 << 20  # the pool is resident from start


def test_a_server_stops_promptly_with_requests_in_flight(wsync_server, toy_model_dir):
    server = wsync_server(model=toy_model_dir, args=["--token-interval-ms", INTERVAL_MS])
    with ThreadPoolExecutor(2) as pool:
        future = pool.submit(http_json, server.url, "/v1/completions", {"prompt": "x", "max_tokens": 4000}, None, 60.0)
        await_running(server, 1)
        started = time.monotonic()
        server.process.terminate()
        server.process.wait(timeout=20)
        assert time.monotonic() - started < 10  # the request does not hold the shutdown
        try:
            status, body = future.result(timeout=30)
        except OSError:
            return  # the HTTP server may close the connection as it stops, before the reply leaves
        assert status == 503 and "shutting down" in body["error"]["message"], (status, body)


def test_frozen_requests_never_hold_the_threads_a_sync_needs(wsync_server, toy_model_dir, models):
    # 10 HTTP worker threads: at most 5 completions at once, the other threads stay free
    # for the weight-transfer routes even while every admitted request is frozen.
    server = wsync_server(model=toy_model_dir, args=["--token-interval-ms", INTERVAL_MS, "--http-threads", 10])
    push([server], models[0], "v1")
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(complete, server, {"prompt": f"hold {i}", "max_tokens": 400}, 120.0) for i in range(5)]
        await_running(server, 5)
        status, reply = http_json(server.url, "/v1/completions", {"prompt": "one more", "max_tokens": 1})
        assert status == 503 and "5 completions are in flight" in reply["error"]["message"], (status, reply)
        assert post(server, "/pause?mode=keep") == {"status": "paused"}
        push([server], models[1], "v2")  # start, update, finish on the threads left free
        post(server, "/resume")
        for f in futures:
            r = f.result(timeout=60)
            assert choice(r)["finish_reason"] == "length" and choice(r)["weight_versions"][-1] == "v2"
