"""A LoRA adapter synced from memory into a real vLLM at tensor parallel 2 (CPU, two
workers over Gloo, --enable-lora).

Both workers land the whole adapter and agree before either installs a version
(wsync_lora_finish): versions change vLLM's greedy completion as transformers' merged
model predicts, every worker reports the version it holds, and a version whose bytes
differ on the workers is refused by both, the previous one serving on.
"""

import pytest

from test_vllm_lora import ALPHA, MODULES, R, adapter, completion, merged, rpc
from vllm_server import reference_tokens, request, requires_vllm, serve_fixture

pytestmark = [requires_vllm]

TIMINGS = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_fixture(
        tmp_path_factory, TIMINGS, tp=2,
        extra_env={"WSYNC_VLLM_TEST_FAULTS": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
        extra_args=["--enable-lora", "--max-lora-rank", str(R), "--max-loras", "2", "--max-cpu-loras", "2"])


def held_versions(server):
    status, reply = rpc(server, "wsync_lora_digests", "math")
    assert status == 200, reply
    return [w["version"] for w in reply["results"]]


def test_both_workers_install_each_version_or_neither(server):
    import wsync
    from wsync.lora import LoraSource
    state = adapter(31)
    source = LoraSource(state, r=R, alpha=ALPHA, target_modules=MODULES, name="math")
    with wsync.TrainerEngine(backend="nccl", servers=[server.url], device="cpu", timeout=120.0,
                             lora=source) as engine:
        stats = engine.send_weights(source, weight_version="tp2-0")
        assert (stats.inline_verified_servers, stats.inline_verified_tensors) == (1, len(state))
        status, reply = request(server.url, "/v1/load_lora_adapter", {"lora_name": "math", "lora_path": "wsync://math"})
        assert status == 200, reply
        assert held_versions(server) == ["tp2-0", "tp2-0"]
        first = completion(server, "math")
        assert first == reference_tokens(merged(state))

        # A flipped byte on worker 1 alone: worker 0's bytes match, yet it refuses too.
        status, reply = rpc(server, "wsync_corrupt_next_landing", "1")
        assert status == 200, reply
        with pytest.raises(wsync.Error, match="differ"):
            engine.send_weights(LoraSource(adapter(32), r=R, alpha=ALPHA, target_modules=MODULES, name="math"),
                                weight_version="tp2-corrupt")
        assert held_versions(server) == ["tp2-0", "tp2-0"]
        assert completion(server, "math") == first
        log = server.log_tail(400)
        assert "refused on vLLM worker 0 (0 tensor(s) differ here" in log, log[-2000:]
        assert "refused on vLLM worker 1 (1 tensor(s) differ here" in log, log[-2000:]

        state = adapter(33)
        engine.send_weights(LoraSource(state, r=R, alpha=ALPHA, target_modules=MODULES, name="math"),
                            weight_version="tp2-1")
        assert held_versions(server) == ["tp2-1", "tp2-1"]
        assert completion(server, "math") == reference_tokens(merged(state))
