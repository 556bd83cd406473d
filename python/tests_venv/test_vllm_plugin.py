"""wsync inside a real vLLM (CPU, TP=1): the `wsync` weight-transfer engine plugin.

One `vllm serve --weight-transfer-config '{"backend": "wsync"}'` for the whole module; a
wsync.TrainerEngine pushes versions of a tiny Qwen3 over each CPU backend. After each sync
the server's weights (vLLM's own /weight_checker) equal digests the test computes from
the trainer's tensors, the trainer's read-back verify passes, and vLLM's greedy
completion equals transformers' on the same weights.
"""

import hashlib
import os
import time

import pytest

import wsync
from vllm_server import (VllmServer, policy, reference_tokens, request, requires_vllm, vllm_layout_digests,
                         write_model)

pytestmark = [requires_vllm]

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
LINEAR_SUFFIXES = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")

# Every timing this module measures, printed at the end (pytest -s shows it).
TIMINGS = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    model_dir = write_model(str(root / "model"), seed=0)
    srv = VllmServer(model_dir, str(root / "vllm.log"),
                     extra_env={"WSYNC_VLLM_OPTIONS": '{"ipc_shm_dir": "%s"}' % (root / "shm")})
    os.makedirs(root / "shm", exist_ok=True)
    try:
        srv.wait_ready()
        TIMINGS["vllm start (s)"] = round(srv.start_seconds, 1)
        yield srv
    finally:
        srv.stop()
        for k, v in TIMINGS.items():
            print(f"[timing] {k}: {v}")


def _push_and_check(server, backend, seeds, **engine_options):
    """Pushes one policy per seed over `backend`; checks weights, verify and completions."""
    tokens = []
    with wsync.TrainerEngine(backend=backend, servers=[server.url], device="cpu", timeout=120.0,
                             **engine_options) as engine:
        for n, seed in enumerate(seeds):
            model = policy(seed)
            t0 = time.perf_counter()
            stats = engine.send_weights(wsync.StateDictSource(model), weight_version=f"{backend}-{n}", verify=True)
            TIMINGS.setdefault(f"{backend} sync+verify (s)", []).append(round(time.perf_counter() - t0, 3))
            TIMINGS.setdefault(f"{backend} sync (s)", []).append(round(stats.seconds, 3))
            assert stats.verified
            worker = server.worker_stats()[0]
            TIMINGS.setdefault(f"{backend} worker (s)", []).append(
                {k: round(worker[k], 4) for k in ("receive_seconds", "load_seconds", "copy_seconds",
                                                  "digest_seconds", "finish_seconds")})
            assert worker["tensors"] == len(model.state_dict())
            # vLLM's own checker: sha256 of its fused parameters, recomputed here. vLLM on the
            # CPU empties linear layers' weights once it has prepacked them for its GEMM
            # kernels: those read back as empty, and the completions below check them.
            held, want = server.checksums(), vllm_layout_digests(model)
            assert set(held) == set(want)
            emptied = {k for k, v in held.items() if v == EMPTY_SHA256}
            assert all(k.endswith(LINEAR_SUFFIXES) for k in emptied), sorted(emptied)
            assert {k: v for k, v in held.items() if k not in emptied} == \
                {k: v for k, v in want.items() if k not in emptied}
            assert any(k.endswith("embed_tokens.weight") for k in set(held) - emptied)
            assert server.weight_version() == f"{backend}-{n}"
            got = server.completion()
            assert got == reference_tokens(model), f"{backend} version {n}: vLLM and transformers disagree"
            tokens.append(got)
    assert len({tuple(t) for t in tokens}) == len(tokens), f"completions did not change with the weights: {tokens}"


def test_nccl_over_gloo(server):
    _push_and_check(server, "nccl", seeds=[11, 12, 13])
