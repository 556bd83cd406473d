"""An MTP drafter inside a real vLLM (CPU) reloads from the same wsync stream.

A tiny GLM-4.5-architecture model (a dense first layer, an MoE layer, one MTP layer) served
with `--speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'` and
`--load-format dummy`; a wsync.TrainerEngine pushes three versions of the whole model over
nccl (Gloo), MTP layer included, in ordinary sessions. After each, the drafter's own
parameters (read by `/collective_rpc wsync_drafter_digests`) hold the pushed MTP tensors,
the target's verify passes, and vLLM still completes with its drafter drafting.
"""

import hashlib
import json

import pytest
import torch

from vllm_server import VllmServer, request, requires_vllm

pytestmark = [requires_vllm]

TIMINGS = {}
SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=4, n_shared_experts=1,
             num_experts_per_tok=2, first_k_dense_replace=1, num_nextn_predict_layers=1)
CONFIG = dict(SIZES, architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", partial_rotary_factor=0.5,
              max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=True,
              use_qk_norm=False, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
              tie_word_embeddings=False, torch_dtype="float32", hidden_act="silu")


def glm_tensors(seed):
    """A GLM-4.5 checkpoint of the tiny config, in its Hugging Face names and shapes
    (per-expert tensors; the MTP layer is model.layers.2), drawn from `seed`."""
    h, heads, kv, hd = SIZES["hidden_size"], SIZES["num_attention_heads"], SIZES["num_key_value_heads"], SIZES["head_dim"]
    inter, moe, experts = SIZES["intermediate_size"], SIZES["moe_intermediate_size"], SIZES["n_routed_experts"]
    shapes = {"model.embed_tokens.weight": (SIZES["vocab_size"], h), "lm_head.weight": (SIZES["vocab_size"], h),
              "model.norm.weight": (h,)}
    for layer in range(SIZES["num_hidden_layers"] + 1):
        p = f"model.layers.{layer}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (heads * hd, h), p + "self_attn.q_proj.bias": (heads * hd,),
                       p + "self_attn.k_proj.weight": (kv * hd, h), p + "self_attn.k_proj.bias": (kv * hd,),
                       p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.v_proj.bias": (kv * hd,),
                       p + "self_attn.o_proj.weight": (h, heads * hd)})
        if layer == 0:
            shapes.update({p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                           p + "mlp.down_proj.weight": (h, inter)})
            continue
        shapes.update({p + "mlp.gate.weight": (experts, h), p + "mlp.gate.e_score_correction_bias": (experts,),
                       p + "mlp.shared_experts.gate_proj.weight": (moe, h),
                       p + "mlp.shared_experts.up_proj.weight": (moe, h),
                       p + "mlp.shared_experts.down_proj.weight": (h, moe)})
        for e in range(experts):
            shapes.update({p + f"mlp.experts.{e}.gate_proj.weight": (moe, h),
                           p + f"mlp.experts.{e}.up_proj.weight": (moe, h),
                           p + f"mlp.experts.{e}.down_proj.weight": (h, moe)})
        if layer == SIZES["num_hidden_layers"]:
            shapes.update({p + "enorm.weight": (h,), p + "hnorm.weight": (h,), p + "eh_proj.weight": (h, 2 * h),
                           p + "shared_head.norm.weight": (h,)})
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * 0.3 for name, shape in shapes.items()}


def _sha256(t):
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-mtp")
    model_dir = root / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(CONFIG))
    srv = VllmServer(str(model_dir), str(root / "vllm.log"), extra_args=[
        "--load-format", "dummy", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}'])
    try:
        srv.wait_ready()
        TIMINGS["vllm mtp start (s)"] = round(srv.start_seconds, 1)
        yield srv
    finally:
        srv.stop()
        for k, v in TIMINGS.items():
            print(f"[timing] {k}: {v}")


def drafter_digests(server):
    status, reply = request(server.url, "/collective_rpc", {"method": "wsync_drafter_digests", "args": ["sha256"]})
    assert status == 200, reply
    return reply["results"][0]


def test_the_mtp_drafter_reloads_from_the_same_stream(server):
    import wsync
    mtp = f"model.layers.{SIZES['num_hidden_layers']}."
    # The drafter's own parameters that hold one HF tensor unchanged (norms, the MTP
    # block's norms and attention biases), by vLLM name -> HF name.
    plain = {"model.layers.2.enorm.weight": mtp + "enorm.weight", "model.layers.2.hnorm.weight": mtp + "hnorm.weight",
             "model.layers.2.shared_head.norm.weight": mtp + "shared_head.norm.weight",
             "model.layers.2.mtp_block.input_layernorm.weight": mtp + "input_layernorm.weight",
             "model.layers.2.mtp_block.post_attention_layernorm.weight": mtp + "post_attention_layernorm.weight"}
    seen = []
    with wsync.TrainerEngine(backend="nccl", servers=[server.url], device="cpu", timeout=120.0) as engine:
        for n, seed in enumerate((101, 102, 103)):
            tensors = glm_tensors(seed)
            stats = engine.send_weights(wsync.StateDictSource(tensors), weight_version=f"mtp-{n}")
            TIMINGS.setdefault("nccl mtp sync (s)", []).append(round(stats.seconds, 3))
            assert stats.inline_verified_tensors == len(tensors), stats
            held = drafter_digests(server)
            missing = sorted(set(plain) - set(held["checksums"]))
            assert not missing, (missing, sorted(held["checksums"]), held["empty"])
            assert {v: held["checksums"][v] for v in plain} == {v: _sha256(tensors[h]) for v, h in plain.items()}
            seen.append(held["checksums"])
            assert request(server.url, "/weight_info")[1]["weight_version"] == f"mtp-{n}"
    assert seen[0] != seen[1] != seen[2]
    status, reply = request(server.url, "/v1/completions", timeout=300, body={
        "model": server.model_dir, "prompt": [3, 14, 15, 92], "max_tokens": 8, "temperature": 0.0,
        "return_token_ids": True, "ignore_eos": True})
    assert status == 200 and len(reply["choices"][0]["token_ids"]) == 8, reply
