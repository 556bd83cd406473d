"""What trainers have, synced as vLLM takes it: names the servers drop and a cast on the way.

Real `wsync serve` processes on loopback, driven through ``wsync.TrainerEngine``; every
expected digest is computed here (hashlib over the test's own tensors and casts).

* A tied model's ``state_dict()`` carries ``lm_head.weight`` (embed_tokens itself) and
  ``rotary_emb.inv_freq`` buffers; the server drops both, logging each name at debug
  level, and holds exactly the rest.
* An MTP checkpoint's per-layer ``embed_tokens`` / ``shared_head.head`` copies are
  dropped by a ``--speculative mtp`` server; the drafter keeps reading the target's.
* A float32 module into bfloat16 servers fails naming the tensor, both dtypes and the
  fix; ``StateDictSource(..., dtype=torch.bfloat16)`` then lands exactly ``t.to(bf16)``.
"""

import gc
import weakref

import numpy as np
import pytest
import torch
from torch import nn

import wsync
from wsync.toy_model import ToyQwen3, write_config
from conftest import assert_servers_hold, sha256_digests


class _Rotary(nn.Module):
    def __init__(self, head_dim):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)))


def _tied_with_extras(config_dir):
    """A ToyQwen3 of a tied config plus what HF modules carry: lm_head sharing embed_tokens'
    weight and a rotary_emb.inv_freq buffer per layer."""
    model = ToyQwen3(config_dir, seed=3)
    embed = model.model.embed_tokens
    model.lm_head = nn.Linear(embed.weight.shape[1], embed.weight.shape[0], bias=False)
    model.lm_head.weight = embed.weight
    for layer in model.model.layers:
        layer.self_attn.rotary_emb = _Rotary(layer.self_attn.head_dim)
    return model


def test_tied_lm_head_and_rotary_buffers_are_dropped(wsync_server, tmp_path):
    config = write_config(tmp_path / "tied", tie_word_embeddings=True)
    server = wsync_server(backend="nccl", model=config, env={"WSYNC_LOG_LEVEL": "debug"})
    model = _tied_with_extras(config)
    state = model.state_dict()
    dropped = ["lm_head.weight"] + [f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(2)]
    assert all(name in state for name in dropped)
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.loss(torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(4))).backward()
    opt.step()
    with wsync.TrainerEngine(backend="nccl", servers=[server.url], timeout=60, bucket_gb=0.0002) as engine:
        stats = engine.send_weights(wsync.StateDictSource(model), weight_version="tied-1")
    assert stats.tensors == len(state)  # the trainer sent what it has
    want = sha256_digests((n, t) for n, t in model.state_dict().items() if n not in dropped)
    assert_servers_hold([server], want)
    assert server.health()["weight_version"] == "tied-1"
    log = (tmp_path / f"{server.name}.stderr").read_text()
    for name in dropped:
        assert f"dropping {name} (" in log, log[-2000:]
    assert "dropping lm_head.weight (tied to model.embed_tokens.weight (tie_word_embeddings))" in log


def test_mtp_layer_copies_of_embed_and_head_are_dropped(wsync_server):
    model = "deepseek-v3-tiny"  # layers 0-2, MTP layer 3
    server = wsync_server(backend="nccl", model=model, args=("--speculative", "mtp"))
    rng = np.random.default_rng(5)
    items, shapes = [], {}
    for name, dtype, shape in wsync.model_metadata(model):
        if dtype == "bfloat16":  # bf16 bits of finite values: the top exponent bit clear
            items.append((name, rng.integers(0, 1 << 14, size=shape, dtype=np.uint16), dtype))
        else:
            items.append((name, rng.standard_normal(shape).astype(dtype), dtype))
        shapes[name] = shape
    # The checkpoint's copies, with other bytes than the tensors they copy: dropped unchecked.
    copies = [("model.layers.3.embed_tokens.weight", shapes["model.embed_tokens.weight"]),
              ("model.layers.3.shared_head.head.weight", shapes["lm_head.weight"])]
    at = next(i for i, (n, _, _) in enumerate(items) if n.startswith("model.layers.3."))
    for name, shape in reversed(copies):
        items.insert(at, (name, np.full(shape, 0x3f80, dtype=np.uint16), "bfloat16"))
    with wsync.TrainerEngine(backend="nccl", servers=[server.url], timeout=60, bucket_gb=0.002) as engine:
        engine.send_weights(wsync.TensorListSource(items), weight_version="mtp-1")
    copied = {n for n, _ in copies}
    assert_servers_hold([server], sha256_digests((n, t) for n, t, _ in items if n not in copied))
    spec = server.health()["speculative"]
    assert spec["weight_version"] == "mtp-1" and spec["stale"] is False, spec
    assert all(a["same_memory"] for a in spec["shared_with_target"]), spec


def test_float32_module_into_bfloat16_servers_needs_a_cast(wsync_server, tmp_path):
    servers = [wsync_server(backend="nccl", model=write_config(tmp_path / "bf16", dtype="bfloat16"),
                            name=f"dp{i}") for i in range(2)]
    model = ToyQwen3(write_config(tmp_path / "fp32", dtype="float32"), seed=6)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    urls = [s.url for s in servers]
    with wsync.TrainerEngine(backend="nccl", servers=urls, timeout=60, bucket_gb=0.0002) as engine:
        with pytest.raises(wsync.InvalidArgumentError) as info:
            engine.send_weights(wsync.StateDictSource(model))
    text = str(info.value)
    assert ("dtype of model.embed_tokens.weight is bfloat16, update says float32: send it as bfloat16 "
            "(Python: StateDictSource(..., dtype=torch.bfloat16)") in text, text

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(7)
    with wsync.TrainerEngine(backend="nccl", servers=urls, timeout=60, bucket_gb=0.0002) as engine:
        for step in range(2):
            model.loss(torch.randint(0, 512, (2, 9), generator=gen)).backward()
            opt.step()
            opt.zero_grad()
            source = wsync.StateDictSource(model, dtype=torch.bfloat16)
            assert {d for _, d, _ in source.metadata()} == {"bfloat16"}
            assert not source.yields_ready_tensors
            engine.send_weights(source, weight_version=f"step-{step}")
            want = sha256_digests((n, t.to(torch.bfloat16)) for n, t in model.state_dict().items())
            assert_servers_hold(servers, want)
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the module is untouched


def test_cast_is_one_tensor_at_a_time_and_checked():
    state = {"a": torch.randn(4, 4), "b": torch.randn(8), "steps": torch.tensor([3]),
             "c": torch.randn(4, 4).t()}
    source = wsync.StateDictSource(state, dtype="bfloat16")
    assert source.metadata() == [("a", "bfloat16", (4, 4)), ("b", "bfloat16", (8,)),
                                 ("steps", "int64", (1,)), ("c", "bfloat16", (4, 4))]
    it = iter(source)
    name, first = next(it)
    assert name == "a" and first.dtype == torch.bfloat16 and torch.equal(first, state["a"].to(torch.bfloat16))
    alive = weakref.ref(first)
    del first
    gc.collect()
    assert alive() is None  # the source keeps no cast copy: the next one is made when asked for
    rest = dict(it)
    assert rest["steps"] is state["steps"] or torch.equal(rest["steps"], state["steps"])
    assert rest["c"].is_contiguous() and torch.equal(rest["c"], state["c"].to(torch.bfloat16))

    # Per tensor: a name -> dtype callable (None keeps the tensor's own).
    per = wsync.StateDictSource(state, dtype=lambda n: None if n == "b" else torch.float16)
    assert [d for _, d, _ in per.metadata()] == ["float16", "float32", "float16", "float16"]
    # numpy arrays cast too (to bfloat16 through torch).
    arr = wsync.StateDictSource({"x": np.arange(6, dtype=np.float32).reshape(2, 3)}, dtype=torch.bfloat16)
    (_, x), = list(arr)
    assert x.dtype == torch.bfloat16 and x.tolist() == [[0, 1, 2], [3, 4, 5]]

    with pytest.raises(ValueError, match="a source casts to one of bfloat16"):
        wsync.StateDictSource(state, dtype="int8")
    with pytest.raises(ValueError, match="give one or the other"):
        wsync.StateDictSource(state, dtype=torch.bfloat16, storage=torch.zeros(4))
