"""vLLM's sleep and wake on `wsync serve --device cuda:0`: the device memory a sleep
releases is measured from outside (torch.cuda.mem_get_info in this process sees the whole
GPU's free memory) and by /health's device_used_bytes; level 1 brings the same bytes back;
SkyRL's colocated bracket (discard, wake the weights, sync from torch tensors on the GPU
through the ipc backend, wake the KV cache) refills and verifies them, and generation then
reads the new weights from the GPU.

Skips without torch, CUDA or a GPU (label gpu).
"""

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs torch with CUDA and a GPU", allow_module_level=True)

import wsync  # noqa: E402
from wsync.toy_model import ToyQwen3  # noqa: E402
from conftest import assert_servers_hold, sha256_digests  # noqa: E402
from test_generation import Reference, choice, complete  # noqa: E402
from test_sleep_wake import SHARE, is_sleeping, memory, model_dir, post  # noqa: E402

DEVICE = "cuda:0"


def free_bytes():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info(0)[0]


def used(server):
    return memory(server)["device_used_bytes"][DEVICE]


def test_gpu_sleep_releases_device_memory_and_the_bracket_refills_it(wsync_server, tmp_path):
    directory = model_dir(tmp_path)
    server = wsync_server(backend="ipc", model=directory, device=DEVICE, args=("--timeout", "120"))
    weights = memory(server)["weights_bytes"]
    before = server.checksums("sha256")

    free_awake, used_awake = free_bytes(), used(server)
    assert post(server.url, "/sleep?level=1") == (200, "")
    assert free_bytes() - free_awake >= SHARE * weights
    assert used_awake - used(server) >= SHARE * weights
    assert memory(server)["weights_offloaded_bytes"] == weights
    assert post(server.url, "/wake_up") == (200, "")
    assert free_awake - free_bytes() < (1 - SHARE) * weights
    assert server.checksums("sha256") == before  # level 1 kept the bytes
    assert not is_sleeping(server)

    model = ToyQwen3(directory, seed=5).to(DEVICE)
    free_awake = free_bytes()
    assert post(server.url, "/sleep?level=2") == (200, "")
    assert free_bytes() - free_awake >= SHARE * weights
    assert post(server.url, "/wake_up?tags=weights") == (200, "")
    assert server.health()["weights_consistent"] is False
    with wsync.TrainerEngine("ipc", [server.url], device=DEVICE, timeout=120.0) as engine:
        engine.send_weights(wsync.StateDictSource(model), weight_version="refilled")
    assert_servers_hold([server], sha256_digests(model.state_dict().items()))
    assert post(server.url, "/wake_up?tags=kv_cache") == (200, "")
    assert not is_sleeping(server) and server.health()["weights_consistent"] is True

    prompt = list(b"after the bracket")
    reply = complete(server, {"prompt": prompt, "max_tokens": 8})
    assert choice(reply)["token_ids"] == Reference(model.cpu()).tokens(prompt, 8)
    assert choice(reply)["weight_versions"] == ["refilled"] * 8
