"""The toy generation of `wsync serve --device cuda:0`: its probe copies each token's
weights from the GPU shards to the host on the worker's thread. Weights come from a torch
module on cuda:0 through the ipc backend; the tokens are checked against the token
function recomputed here (test_generation.Reference) from the module's own tensors,
including pause keep with a sync in the middle (the trainer resets the prefix cache,
running requests included, so the frozen request recomputes its state on the new weights).

Skips without torch, CUDA or a GPU (label gpu).
"""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs torch with CUDA and a GPU", allow_module_level=True)

import wsync  # noqa: E402
from wsync.toy_model import ToyQwen3  # noqa: E402
from test_generation import Reference, await_running, choice, complete, post  # noqa: E402

DEVICE = "cuda:0"


def push(server, model, version):
    with wsync.TrainerEngine("ipc", [server.url], device=DEVICE, timeout=60.0) as engine:
        engine.init(wsync.StateDictSource(model))
        engine.send_weights(wsync.StateDictSource(model), weight_version=version)


def test_gpu_shards_drive_the_tokens_and_keep_survives_a_sync(wsync_server, toy_model_dir):
    server = wsync_server(backend="ipc", model=toy_model_dir, device=DEVICE,
                          args=("--timeout", "60", "--token-interval-ms", "20"))
    old_model = ToyQwen3(toy_model_dir, seed=21).to(DEVICE)
    new_model = ToyQwen3(toy_model_dir, seed=22).to(DEVICE)
    push(server, old_model, "v1")
    old, new = Reference(old_model.cpu()), Reference(new_model.cpu())
    old_model.to(DEVICE)
    new_model.to(DEVICE)
    prompt = list(b"on the gpu")
    first = complete(server, {"prompt": prompt, "max_tokens": 8})
    assert choice(first)["token_ids"] == old.tokens(prompt, 8)
    n = 50
    with ThreadPoolExecutor(2) as pool:
        future = pool.submit(complete, server, {"prompt": prompt, "max_tokens": n}, 120.0)
        await_running(server, 1)
        time.sleep(0.3)
        assert post(server, "/pause?mode=keep") == {"status": "paused"}
        push(server, new_model, "v2")
        post(server, "/resume")
        r = future.result(timeout=60)
    ids, versions = choice(r)["token_ids"], choice(r)["weight_versions"]
    assert len(ids) == n
    k = versions.index("v2")
    assert 0 < k < n
    assert ids[:k] == old.tokens(prompt, k)
    assert ids[k:] == new.tokens(prompt + ids[:k], n - k)  # the trainer's reset: recomputed
