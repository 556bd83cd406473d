"""The engine makes no host copy of the model: over init and a sync from Python, the
trainer process's peak RSS grows by at most its packed buffers (nccl on CPU, two buffers)."""

import resource

import torch

import wsync
from wsync.toy_model import write_config
from conftest import assert_servers_hold, sha256_digests

MIB = 1 << 20


def peak_rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def test_sync_adds_at_most_the_packed_buffers(wsync_server, tmp_path):
    # About 250 MiB of float32, the largest tensor 32 MiB (the packed buffer's size).
    model = write_config(tmp_path / "model", vocab_size=8192, hidden_size=1024, intermediate_size=3072,
                         num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                         head_dim=64, dtype="float32")
    server = wsync_server(backend="nccl", model=model)
    pairs = [(name, torch.ones(shape).mul_(i + 1)) for i, (name, _, shape) in enumerate(wsync.model_metadata(model))]
    model_bytes = sum(t.numel() * 4 for _, t in pairs)
    largest = max(t.numel() * 4 for _, t in pairs)
    assert model_bytes > 200 * MIB
    before = peak_rss()
    with wsync.TrainerEngine(servers=[server.url], timeout=120, bucket_gb=largest / 1e9, num_buffers=2) as engine:
        engine.init(wsync.TensorListSource(pairs))
        stats = engine.send_weights(wsync.TensorListSource(pairs))
        grown = peak_rss() - before
    assert stats.bytes == model_bytes
    # Two packed buffers of `largest` bytes, plus slack for threads and allocator arenas;
    # a copy of the model would be four times the buffers.
    print(f"peak RSS grew by {grown / MIB:.0f} MiB; buffers {2 * largest / MIB:.0f} MiB, model {model_bytes / MIB:.0f} MiB")
    assert grown <= 2 * largest + 48 * MIB, f"peak RSS grew by {grown / MIB:.0f} MiB during init and the sync"
    assert_servers_hold([server], sha256_digests(pairs))
