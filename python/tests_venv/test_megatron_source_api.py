"""wsync.MegatronSource's Python side on one rank (no servers): the parameter names of the
engine's table, params copied in by name, and errors that name the parameter, the rank
and the layout."""

import pytest
import torch

import wsync


@pytest.fixture
def engine():
    # Port 9 (discard): nothing is sent; the engine only hosts the source's group.
    with wsync.TrainerEngine(backend="sharded", servers=["http://127.0.0.1:9"], model="qwen3-tiny") as e:
        yield e


def test_params_load_by_megatron_name(engine):
    names = wsync.MegatronSource(engine, "qwen3-tiny", "tp1pp1ep1").params_names()
    assert names[0][0] == "embedding.word_embeddings.weight"
    assert any(n == "decoder.layers.0.self_attention.linear_qkv.weight" for n, _, _ in names)
    params = {"module." + n: torch.randn(s) for n, _, s in names}  # fp32, cast to the table's dtype
    src = wsync.MegatronSource(engine, "qwen3-tiny", tp=1, pp=1, ep=1, coords={"tp": 0, "pp": 0},
                               params=lambda: params, name_map=lambda n: n.removeprefix("module."))
    src.load()
    assert [m[0] for m in src.metadata()] == [m[0] for m in wsync.model_metadata("qwen3-tiny")]


def test_errors_name_the_parameter_and_the_rank(engine):
    names = wsync.MegatronSource(engine, "qwen3-tiny", "tp1pp1ep1").params_names()
    params = {n: torch.zeros(s) for n, _, s in names}
    first = names[0][0]

    def load(given):
        wsync.MegatronSource(engine, "qwen3-tiny", "tp1pp1ep1", params=given).load()

    with pytest.raises(wsync.InvalidArgumentError, match=f"parameter {first} of trainer rank 0"):
        load(dict(params, **{first: torch.zeros(3)}))
    with pytest.raises(ValueError, match=f"first {first}"):
        load({k: v for k, v in params.items() if k != first})
    with pytest.raises(ValueError, match="decoder.bogus.weight is not a parameter of trainer rank 0"):
        load(dict(params, **{"decoder.bogus.weight": torch.zeros(1)}))
    with pytest.raises(ValueError, match="disagree with layout"):
        wsync.MegatronSource(engine, "qwen3-tiny", "tp1pp1ep1", coords={"tp": 1})
