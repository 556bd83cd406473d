"""Megatron-style layouts (wsync.MegatronSource) and a transformers Qwen3-MoE from Python ranks
into a TP=2 server with sharded, checked bit-exact after every step."""

import pytest

from dist_helpers import assert_landed, run_ranks, write_config


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
