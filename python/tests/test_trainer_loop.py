"""A real training loop: a Qwen3-shaped torch module, AdamW steps, a sync after each step
into two `wsync serve` processes, every sync checked against the test's own sha256."""

import torch

import wsync
from wsync.toy_model import ToyQwen3
from conftest import assert_servers_hold, sha256_digests


def test_adamw_steps_sync_into_two_servers(wsync_server, toy_model_dir):
    servers = [wsync_server(backend="nccl", model=toy_model_dir, name=f"dp{i}") for i in range(2)]
    model = ToyQwen3(toy_model_dir, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(2)
    vocab = model.model.embed_tokens.weight.shape[0]
    source = wsync.StateDictSource(model)
    seen = []
    with wsync.TrainerEngine(backend="nccl", servers=[s.url for s in servers], timeout=60,
                             bucket_gb=0.0002, progress=seen.append) as engine:
        engine.init(source)
        previous = None
        for step in range(3):
            tokens = torch.randint(0, vocab, (4, 17), generator=gen)
            loss = model.loss(tokens)
            opt.zero_grad()
            loss.backward()
            opt.step()
            stats = engine.send_weights(wsync.StateDictSource(model), weight_version=f"step-{step}")
            want = sha256_digests(model.state_dict().items())
            assert want != previous  # the step changed the weights
            previous = want
            assert_servers_hold(servers, want)
            assert stats.tensors == len(want)
            assert stats.bytes == sum(t.numel() * t.element_size() for t in model.state_dict().values())
            assert stats.chunks > 1 and stats.seconds > 0
            assert set(stats.as_dict()) == {"seconds", "start_seconds", "transfer_seconds",
                                            "finish_seconds", "bytes", "tensors", "chunks",
                                            "verified", "verify_seconds", "inline_digests",
                                            "inline_verified_servers", "inline_unverified_servers",
                                            "inline_verified_tensors"}
            assert stats.inline_verified_servers == 2 and stats.inline_verified_tensors == len(want)
            assert "SyncStats(seconds=" in repr(stats)
            for s in servers:
                assert s.health().get("weight_version") == f"step-{step}"
    assert seen and seen[-1]["bytes_done"] == seen[-1]["bytes_total"] > 0
    assert engine.closed


def test_model_metadata_lists_registered_models():
    meta = wsync.model_metadata("qwen3-tiny")
    names = [n for n, _, _ in meta]
    assert names[0] == "model.embed_tokens.weight" and "lm_head.weight" in names
    assert all(d == "bfloat16" for _, d, _ in meta)
    assert dict((n, s) for n, _, s in meta)["model.embed_tokens.weight"] == (4096, 256)
    assert "qwen3-0.6b" in wsync.registered_models()
    try:
        wsync.model_metadata("no-such-model")
    except wsync.NotFoundError as e:
        assert "no-such-model" in str(e)
    else:
        raise AssertionError("an unknown model must raise NotFoundError")


def test_other_ranks_only_drain_their_source(toy_model_dir):
    model = ToyQwen3(toy_model_dir, seed=5)

    class CountingSource(wsync.StateDictSource):
        passes = 0

        def __iter__(self):
            CountingSource.passes += 1
            yield from super().__iter__()

    with wsync.TrainerEngine(servers=[], rank=1, world_size=2, group_port=0) as engine:
        for _ in range(2):
            stats = engine.send_weights(CountingSource(model))
            assert stats.bytes == 0
    assert CountingSource.passes == 2
