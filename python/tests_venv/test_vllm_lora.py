"""A LoRA adapter synced from memory into a real vLLM (CPU, TP=1, --enable-lora).

One server for the module. A wsync.TrainerEngine with a wsync.LoraSource syncs versions
of a rank-8 adapter over nccl (Gloo); after each, vLLM's greedy completion for the
adapter's name equals transformers' on the base weights with that version merged in
(W + alpha/r * B @ A), changes with the version, and the workers' digests of the adapter
equal the trainer's. A failed session (a declared tensor never sent; a corrupted byte)
keeps the previous version serving.
"""

import json

import pytest
import torch

from vllm_server import (PROMPT, MAX_TOKENS, policy, reference_tokens, request, requires_vllm,
                         serve_fixture)

pytestmark = [requires_vllm]

TIMINGS = {}
R, ALPHA = 8, 16.0
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_fixture(
        tmp_path_factory, TIMINGS,
        extra_env={"WSYNC_VLLM_TEST_FAULTS": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
        extra_args=["--enable-lora", "--max-lora-rank", str(R), "--max-loras", "2", "--max-cpu-loras", "2"])


def adapter(seed):
    """PEFT-named, unscaled A/B for every projection of the test model."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in policy(0).named_parameters():
        parts = name.split(".")
        if len(parts) == 6 and parts[4] in MODULES:
            stem = "base_model.model." + name[: -len(".weight")]
            out[stem + ".lora_A.weight"] = torch.randn(R, p.shape[1], generator=gen) * 0.3
            out[stem + ".lora_B.weight"] = torch.randn(p.shape[0], R, generator=gen) * 0.3
    return out


def merged(state):
    """The base model (seed 0) with the adapter merged in, as vLLM applies it."""
    model = policy(0)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in state.items():
            if ".lora_A." in name:
                b = state[name.replace(".lora_A.", ".lora_B.")]
                base = name[len("base_model.model."):].replace(".lora_A.weight", ".weight")
                params[base] += (ALPHA / R) * (b @ a)
    return model


def completion(server, model):
    status, reply = request(server.url, "/v1/completions", timeout=300, body={
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "return_token_ids": True, "ignore_eos": True})
    assert status == 200, reply
    return reply["choices"][0]["token_ids"]


def rpc(server, method, *args):
    status, reply = request(server.url, "/collective_rpc", {"method": method, "args": list(args)})
    return status, reply


def sync(engine, source, version, verify=False):
    # The engine names the adapter to vLLM's workers itself (wsync_lora_start).
    return engine.send_weights(source, weight_version=version, verify=verify)


def base_version(server):
    status, reply = request(server.url, "/weight_info")
    assert status == 200, reply
    return reply["weight_version"]


@pytest.fixture(scope="module")
def trainer(server):
    import wsync
    from wsync.lora import LoraSource
    source = LoraSource(adapter(1), r=R, alpha=ALPHA, target_modules=MODULES, name="math")
    with wsync.TrainerEngine(backend="nccl", servers=[server.url], device="cpu", timeout=120.0,
                             lora=source) as engine:
        yield engine


def test_versions_land_in_memory_and_change_generation(server, trainer):
    import time

    from wsync.lora import LoraSource
    from wsync.worker_server import tensor_digest
    base = completion(server, server.model_dir)
    before = base_version(server)
    seen = [base]
    for n, seed in enumerate([1, 2, 3]):
        state = adapter(seed)
        source = LoraSource(state, r=R, alpha=ALPHA, target_modules=MODULES, name="math")
        t0 = time.perf_counter()
        # The last version is also read back (verify=: the workers digest what they hold).
        stats = sync(trainer, source, f"step-{n}", verify=n == 2)
        TIMINGS.setdefault("lora sync (s)", []).append(round(time.perf_counter() - t0, 3))
        assert stats.verified == (n == 2), stats
        assert (stats.inline_verified_servers, stats.inline_verified_tensors) == (1, len(state))
        if n == 0:
            # The API server learns the name once; the workers build it from memory.
            status, reply = request(server.url, "/v1/load_lora_adapter",
                                    {"lora_name": "math", "lora_path": "wsync://math"})
            assert status == 200, reply
        got = completion(server, "math")
        assert got == reference_tokens(merged(state)), f"version {n}: vLLM and transformers+adapter disagree"
        seen.append(got)
        status, reply = rpc(server, "wsync_lora_digests", "math")
        assert status == 200, reply
        held = reply["results"][0]
        assert held["version"] == f"step-{n}"
        assert held["checksums"] == {k: tensor_digest(v, "xxh3_128") for k, v in state.items()}
    assert len({tuple(t) for t in seen}) == len(seen), seen
    # The base model and its version are untouched by the adapter's sessions.
    assert completion(server, server.model_dir) == base
    assert base_version(server) == before
    status, reply = request(server.url, "/v1/models")
    assert "math" in [m["id"] for m in reply["data"]]


def test_a_corrupted_byte_keeps_the_previous_version(server, trainer):
    from wsync.lora import LoraSource
    before = completion(server, "math")
    status, reply = rpc(server, "wsync_corrupt_next_landing")
    assert status == 200, reply
    source = LoraSource(adapter(10), r=R, alpha=ALPHA, target_modules=MODULES, name="math")
    with pytest.raises(Exception):
        sync(trainer, source, "step-corrupt")
    assert "in-line verification" in server.log_tail(400)
    assert completion(server, "math") == before
    # The next sync lands.
    state = adapter(4)
    sync(trainer, LoraSource(state, r=R, alpha=ALPHA, target_modules=MODULES, name="math"), "step-3")
    assert completion(server, "math") == reference_tokens(merged(state))


def test_an_opened_session_aborts_and_a_wrong_shape_fails_the_update_without_a_stuck_session(server, trainer):
    from wsync.lora import LoraSource
    before = completion(server, "math")
    # wsync_lora_start with start opens vLLM's session itself; a second open is vLLM's refusal.
    spec = {"format": 1, "name": "math", "version": "by-hand", "r": R, "alpha": ALPHA, "target_modules": MODULES}
    status, reply = rpc(server, "wsync_lora_start", json.dumps(spec), "start")
    assert status == 200, reply
    assert reply["results"][0] == str(2 * len(MODULES) * policy(0).config.num_hidden_layers)
    status, _ = rpc(server, "wsync_lora_start", json.dumps(spec), "start")
    assert status == 500
    assert "already active" in server.log_tail(200)
    # What a trainer's Close sends after a failed sync: nothing installs, the session ends.
    status, reply = rpc(server, "wsync_lora_finish", json.dumps({"abort": True}))
    assert status == 200, reply
    assert reply["results"][0] == {"finished": False, "aborted": True}
    status, _ = rpc(server, "wsync_lora_finish", json.dumps({"wsync_digests": {}}))
    assert status == 500
    assert "outside a lora session" in server.log_tail(200)
    # A source that raises mid-pass fails the sync after the session opened: the trainer
    # ends it (wsync_lora_finish with abort) and the previous version keeps serving.
    state = adapter(11)
    import wsync

    class Raising(wsync.TensorListSource):
        def __iter__(self):
            for i, pair in enumerate(super().__iter__()):
                if i == 5:
                    raise RuntimeError("the adapter's shard went missing at tensor 5")
                yield pair

    with pytest.raises(wsync.Error, match="went missing at tensor 5"):
        sync(trainer, Raising(list(state.items())), "step-raising")
    assert completion(server, "math") == before
    # No session stays open: the next sync lands at once.
    sync(trainer, LoraSource(state, r=R, alpha=ALPHA, target_modules=MODULES, name="math"), "step-after-abort")
    assert completion(server, "math") == reference_tokens(merged(state))


def test_a_lora_session_leaves_other_loaded_adapters_loaded(server, trainer, tmp_path):
    # vLLM resets every adapter after a full-weight update; a lora session changes no base
    # weight, so an adapter loaded from disk stays loaded across it.
    from safetensors.torch import save_file

    from wsync.lora import LoraSource
    (tmp_path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "target_modules": MODULES, "bias": "none",
        "task_type": "CAUSAL_LM"}))
    save_file(adapter(21), str(tmp_path / "adapter_model.safetensors"))
    status, reply = request(server.url, "/v1/load_lora_adapter", {"lora_name": "from-disk", "lora_path": str(tmp_path)})
    assert status == 200, reply
    completion(server, "from-disk")
    status, reply = rpc(server, "list_loras")
    assert status == 200, reply
    loaded = reply["results"][0]
    sync(trainer, LoraSource(adapter(22), r=R, alpha=ALPHA, target_modules=MODULES, name="math"), "step-beside")
    status, reply = rpc(server, "list_loras")
    assert status == 200, reply
    # At most the synced adapter's old build is dropped; the disk adapter's stays.
    before_ids, after_ids = _ids(loaded), _ids(reply["results"][0])
    assert after_ids and after_ids <= before_ids and len(before_ids - after_ids) <= 1, (loaded, reply)


def _ids(text):
    """The lora int ids of a worker's list_loras reply (a set, which vLLM's route answers as text)."""
    if isinstance(text, list):
        return {int(x) for x in text}
    return {int(x) for x in text.strip("{}").replace("set()", "").split(",") if x.strip()}


def test_a_rank_above_max_lora_rank_is_refused(server):
    spec = {"format": 1, "name": "big", "version": "v", "r": 2 * R, "alpha": 1.0, "target_modules": ["q_proj"]}
    status, reply = rpc(server, "wsync_lora_start", json.dumps(spec))
    assert status == 500, reply
    assert "max_lora_rank" in server.log_tail(200)


def test_a_missing_tensor_keeps_the_previous_version(server, trainer):
    # Last: a trainer of its own (its init replaces the module trainer's group).
    import wsync
    from wsync.lora import LoraSource
    before = completion(server, "math")
    held = rpc(server, "wsync_lora_digests", "math")[1]["results"][0]["version"]
    # The adapter declares o_proj; the source lacks its matrices, so finish is refused.
    declared = LoraSource(adapter(9), r=R, alpha=ALPHA, target_modules=MODULES, name="math")
    partial = wsync.TensorListSource([(k, v) for k, v in adapter(9).items() if ".o_proj." not in k])
    with wsync.TrainerEngine(backend="nccl", servers=[server.url], device="cpu", timeout=120.0,
                             lora=declared) as engine:
        with pytest.raises(wsync.Error):
            sync(engine, partial, "step-missing")
    assert "did not land" in server.log_tail(400)
    assert completion(server, "math") == before
    status, reply = rpc(server, "wsync_lora_digests", "math")
    assert reply["results"][0]["version"] == held != "step-missing"
