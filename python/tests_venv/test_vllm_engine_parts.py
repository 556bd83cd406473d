"""The vLLM plugin's parts that need no server: registration, which wsync backend an
init_info is for, and the server settings read from WSYNC_VLLM_OPTIONS."""

import json

import pytest

from vllm_server import requires_vllm

pytestmark = [requires_vllm]


def test_the_entry_point_registers_both_engines_once():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    import wsync.vllm
    load_general_plugins()  # finds wsync through <build>/python's dist-info
    wsync.vllm.register()   # a second call is harmless
    assert WeightTransferEngineFactory._registry["wsync"]().__name__ == "WsyncWeightTransferEngine"
    assert WeightTransferTrainerFactory._registry["wsync"]().__name__ == "WsyncTrainerWeightTransferEngine"


def test_the_backend_of_an_init_info():
    from wsync.vllm.worker_engine import backend_of
    assert backend_of({"rank_offset": 1, "world_size": 2, "gloo_store_host": "127.0.0.1"}) == "nccl"
    assert backend_of({"wsync_ipc_protocol": 1, "session": "0" * 32}) == "ipc"
    assert backend_of({"local_checkpoint_dir": "/x", "sync_dir": "/y"}) == "delta"
    assert backend_of({"wsync_backend": "delta"}) == "delta"
    assert backend_of({"owner_sets": [], "plan_digests": []}) == "sharded"
    assert backend_of({"wsync_backend": "sharded"}) == "sharded"
    with pytest.raises(ValueError, match="names no wsync backend"):
        backend_of({"bogus": 1})
    with pytest.raises(ValueError, match="'wsync_backend' is 'bogus'"):
        backend_of({"wsync_backend": "bogus"})


def test_server_options_from_the_environment():
    from wsync.vllm.worker_engine import DEFAULT_STORE_HOSTS, OPTIONS_ENV, server_options
    assert server_options("nccl", {}) == {"allowed_store_hosts": DEFAULT_STORE_HOSTS}
    env = {OPTIONS_ENV: json.dumps({"allowed_store_hosts": ["10.0.0.1"], "sync_root": "/s"})}
    assert server_options("nccl", env) == {"allowed_store_hosts": ["10.0.0.1"]}
    assert server_options("delta", env) == {"sync_root": "/s"}
    assert server_options("ipc", env) == {}
    with pytest.raises(ValueError, match="unknown keys \\['port'\\]"):
        server_options("nccl", {OPTIONS_ENV: '{"port": 1}'})
    with pytest.raises(ValueError, match="is not JSON"):
        server_options("nccl", {OPTIONS_ENV: "{"})


def _module_tree(table):
    """A torch module whose parameters are the sharding table's, by vLLM name."""
    import torch
    root = torch.nn.Module()
    for param in table:
        module = root
        *path, attr = param["name"].split(".")
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(attr, torch.nn.Parameter(torch.zeros(param["shape"]), requires_grad=False))
    return root


def test_sharded_slices_map_onto_the_models_parameters_or_are_refused_by_name(tmp_path):
    # The Qwen3 mapping at TP=2, rank 1: qkv_proj holds this rank's q, k and v heads; the
    # padded vocabulary and the row-parallel projections are split; norms are whole.
    import torch
    from vllm_server import MODEL_SIZES, write_model
    from wsync.receiver import sharding_table
    from wsync.vllm.slices import plan_targets
    model_dir = write_model(tmp_path / "model")
    table = sharding_table(model_dir, 1, 2)
    by_name = {p["name"]: p for p in table}
    hidden, head_dim = MODEL_SIZES["hidden_size"], MODEL_SIZES["head_dim"]
    qkv = by_name["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv["shape"] == [(4 + 2 + 2) * head_dim // 2, hidden]
    assert [(p["hf_name"].split(".")[-2], p["hf_start"], p["dst_start"]) for p in qkv["pieces"]] == [
        ("q_proj", 2 * head_dim, 0), ("k_proj", head_dim, 2 * head_dim), ("v_proj", head_dim, 3 * head_dim)]
    assert by_name["model.layers.0.self_attn.o_proj.weight"]["pieces"][0]["dim"] == 1
    assert by_name["model.norm.weight"]["pieces"][0]["primary"] is False  # rank 0's copy is primary
    assert {p["name"] for p in table} == {n for n, _ in _module_tree(table).named_parameters()}
    assert len(plan_targets(_module_tree(table), table, "worker")) == len(table)

    broken = _module_tree(table)
    layer0 = getattr(broken.model.layers, "0")
    delattr(layer0.self_attn, "k_norm")
    layer0.mlp.gate_up_proj.weight = torch.nn.Parameter(torch.zeros(3, 3), requires_grad=False)
    layer0.mlp.register_parameter("extra", torch.nn.Parameter(torch.zeros(1), requires_grad=False))
    with pytest.raises(ValueError) as refused:
        plan_targets(broken, table, "worker 1")
    message = str(refused.value)
    assert "3 tensor(s) are not mapped" in message, message
    assert "model.layers.0.self_attn.k_norm.weight: vLLM's model has no module" in message
    assert "model.layers.0.mlp.gate_up_proj.weight: vLLM holds shape [3, 3]" in message
    assert "model.layers.0.mlp.extra: no entry of wsync's sharding table fills this vLLM parameter" in message


def test_sharded_padded_vocabulary_rows_are_zeroed_before_slices_land(tmp_path):
    # vLLM pads the vocabulary to a multiple of 64 and splits the padded rows: with 500
    # tokens at TP=2, rank 1 holds rows 256..511, of which 256..499 come from the trainer.
    import json
    from vllm_server import write_model
    from wsync.receiver import sharding_table
    from wsync.vllm.slices import plan_targets
    model_dir = write_model(tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    config["vocab_size"] = 500
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    table = sharding_table(model_dir, 1, 2)
    embed = next(p for p in table if p["name"] == "model.embed_tokens.weight")
    assert embed["shape"][0] == 256
    assert [(p["hf_start"], p["length"], p["dst_start"]) for p in embed["pieces"]] == [(256, 244, 0)]
    zeroed = {t.name for t in plan_targets(_module_tree(table), table, "worker") if t.zero}
    assert zeroed == {"model.embed_tokens.weight", "lm_head.weight"}


def test_row_digests_are_named_unverifiable_not_differing():
    # A tensor no trainer rank held whole comes with {"rows": [[begin, end, hex], ...]};
    # the plugin's workers digest whole tensors, so they name it unverifiable (the trainer
    # then counts it so) instead of failing the finish. The method alone, on an engine
    # object holding one landed digest: no vLLM worker is started for this rule.
    from types import SimpleNamespace

    from wsync.vllm.worker_engine import UpdateStats, WsyncWeightTransferEngine
    engine = object.__new__(WsyncWeightTransferEngine)
    engine._reloading, engine._lora, engine._slices, engine._rx = True, None, None, None
    engine._landing, engine.stats = {"a": "11", "b": "22"}, UpdateStats()
    engine.parallel_config = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    reply = engine.check_inline({"wsync_digests": {"a": "11", "b": {"rows": [[0, 2, "22"]]}},
                                 "digest_algorithm": "xxh3_128"})
    assert (reply["tensors"], reply["differing"], reply["not_landed"]) == (1, 0, ["b"])
    assert "row ranges" in reply["unverifiable"]["b"]


def test_a_gpu_trainers_row_digests_are_checked_by_the_same_ranges():
    # A trainer that digests on its GPU (init_info wsync_device_digests) cuts a tensor over
    # 32 MiB into row ranges of about 16 MiB; the worker digests what it lands by the same
    # ranges, so such a tensor is verified, and a flipped byte in one range names it.
    import torch

    from wsync import _wsync
    from wsync.vllm.worker_engine import UpdateStats, WsyncWeightTransferEngine

    def engine_with(device_rows):
        from types import SimpleNamespace
        engine = object.__new__(WsyncWeightTransferEngine)
        engine._reloading, engine._lora, engine._slices, engine._rx = True, None, None, None
        engine._device_rows, engine.stats = device_rows, UpdateStats()
        engine.parallel_config = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
        return engine

    big = torch.arange(2560 * 4096, dtype=torch.float32).reshape(2560, 4096)  # 40 MiB, 16 KiB rows
    small = torch.ones(64, 64, dtype=torch.bfloat16)
    ranges = [(0, 1024), (1024, 2048), (2048, 2560)]  # 16 MiB of rows each, the last one short
    assert _wsync.device_digest_rows(2560, big.numel() * 4) == ranges
    assert _wsync.device_digest_rows(64, small.numel() * 2) == []
    rows = [[b, e, _wsync._hex_digest("xxh3_128", big[b:e].numpy())] for b, e in ranges]
    assert len({r[2] for r in rows}) == 3
    want = {"big": {"rows": rows}, "small": _wsync._hex_digest("xxh3_128", small.view(torch.int16).numpy())}

    engine = engine_with(True)
    engine._landing = {"big": engine._landed_digest(big), "small": engine._landed_digest(small)}
    reply = engine.check_inline({"wsync_digests": want, "digest_algorithm": "xxh3_128"})
    assert (reply["tensors"], reply["differing"], reply["not_landed"]) == (2, 0, [])

    flipped = big.clone()
    flipped[1500, 7] += 1
    engine._landing["big"] = engine._landed_digest(flipped)
    reply = engine.check_inline({"wsync_digests": want, "digest_algorithm": "xxh3_128"})
    assert (reply["tensors"], reply["differing"]) == (1, 1)
    assert reply["differ"][0].startswith("big (worker 0 landed ")

    # A trainer digesting on the host sends the same tensor whole: no flag, one digest.
    engine = engine_with(False)
    whole = _wsync._hex_digest("xxh3_128", big.numpy())
    assert engine._landed_digest(big) == whole


def test_sharded_slices_of_a_gpu_trainer_are_digested_by_its_row_ranges():
    # A sharded group on GPUs (init_info wsync_device_digests) digests a tensor it holds
    # whole and over 32 MiB by the device rule's ranges; ranges named at init win.
    import torch

    from wsync import _wsync
    from wsync.vllm.slices import SliceLanding, device_rows

    def hex_of(t):
        return _wsync._hex_digest("xxh3_128", t.contiguous().numpy())

    big = torch.arange(2560 * 4096, dtype=torch.float32).reshape(2560, 4096)
    landing = SliceLanding([], hex_of)
    landing.begin({"named": [(0, 5), (5, 2560)]}, device_rows=True)
    assert landing._digest_of("big", big) == [(b, e, hex_of(big[b:e])) for b, e in device_rows(big)]
    assert [r[:2] for r in landing._digest_of("named", big)] == [(0, 5), (5, 2560)]
    assert landing._digest_of("small", big[:8]) == hex_of(big[:8])
    landing.begin({}, device_rows=False)
    assert landing._digest_of("big", big) == hex_of(big)


def test_an_adapters_row_digests_are_checked_against_its_staged_copy():
    # A lora session stages each adapter tensor whole (wsync.vllm.lora.Staging); a trainer
    # that digested a large one on its GPU sends row ranges, and the staged copy is digested
    # by the same ranges: it verifies, a flipped byte names it, ranges that do not tile
    # its rows are refused as differing.
    from types import SimpleNamespace

    import torch

    from wsync import _wsync
    from wsync.vllm.lora import Staging
    from wsync.vllm.worker_engine import UpdateStats, WsyncWeightTransferEngine

    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    tensor = torch.arange(96 * 8, dtype=torch.float32).reshape(96, 8)
    staging = Staging({"name": "math", "target_modules": ["q_proj"]}, {name: (torch.float32, (96, 8))})
    landed = dict(zip([name], staging.land([(name, tensor)])))
    engine = object.__new__(WsyncWeightTransferEngine)
    engine._reloading, engine._lora, engine._slices, engine._rx = False, staging, None, None
    engine._landing, engine.stats = landed, UpdateStats()
    engine.parallel_config = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)

    def rows_of(t, ranges):
        return {"rows": [[b, e, _wsync._hex_digest("xxh3_128", t[b:e].numpy())] for b, e in ranges]}

    def check(want):
        return engine.check_inline({"wsync_digests": {name: want}, "digest_algorithm": "xxh3_128"})

    reply = check(rows_of(tensor, [(0, 40), (40, 96)]))
    assert (reply["tensors"], reply["differing"], reply["not_landed"]) == (1, 0, [])
    flipped = tensor.clone()
    flipped[50, 3] += 1
    reply = check(rows_of(flipped, [(0, 40), (40, 96)]))
    assert (reply["tensors"], reply["differing"]) == (0, 1)
    assert reply["differ"][0].startswith(f"{name} (worker 0 landed rows [0, 40)")
    reply = check(rows_of(tensor, [(0, 40), (41, 96)]))
    assert (reply["tensors"], reply["differing"]) == (0, 1)
    assert "do not tile its 96 rows" in reply["differ"][0]
