"""wsync inside a real vLLM (CPU, TP=1): the `wsync` weight-transfer engine plugin.

One `vllm serve --weight-transfer-config '{"backend": "wsync"}'` for the whole module; a
wsync.TrainerEngine pushes versions of a tiny Qwen3 over each CPU backend. After each sync
the server's weights (vLLM's own /weight_checker) equal digests the test computes from
the trainer's tensors, the trainer's read-back verify passes, and vLLM's greedy
completion equals transformers' on the same weights.
"""

import os
import subprocess
import sys
import threading
import time

import pytest

from vllm_server import (check_server_weights, policy, push_and_check, reference_tokens, request, requires_vllm,
                         serve_fixture)

pytestmark = [requires_vllm]

# Every timing this module measures, printed at the end (pytest -s shows it).
TIMINGS = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # WSYNC_VLLM_TEST_FAULTS adds the fault RPC of the in-line verification test.
    yield from serve_fixture(tmp_path_factory, TIMINGS, extra_env={"WSYNC_VLLM_TEST_FAULTS": "1"})


def test_nccl_over_gloo(server):
    push_and_check(server, "nccl", [11, 12, 13], TIMINGS)


def test_ipc_over_shared_memory(server):
    # Slots of ~210 KB: layers span chunks, so vLLM's reload holds tensors across them.
    push_and_check(server, "ipc", [21, 22], TIMINGS, bucket_gb=0.0002)


def test_bad_init_info_is_refused_in_vllms_shape(server):
    # vLLM turns a worker's exception into its own error shape: 500, InternalServerError,
    # and the worker's message cut short ("Worker failed with error '<first chars>...'").
    # The engine stays usable (the next test syncs again).
    def refused(init_info):
        status, reply = request(server.url, "/init_weight_transfer_engine", {"init_info": init_info})
        assert status == 500, (status, reply)
        assert set(reply["error"]) == {"message", "type", "param", "code"}, reply
        assert reply["error"]["type"] == "InternalServerError" and reply["error"]["code"] == 500, reply
        return reply["error"]["message"]

    # No wsync backend named by the fields (the plugin's parse_init_info refuses).
    assert "Worker failed with error 'Invalid init_info for Wsy" in refused({"bogus": 1})
    # A field wsync's nccl receiver does not know (its own parse refuses).
    assert "Worker failed with error" in refused(
        {"wsync_backend": "nccl", "rank_offset": 1, "world_size": 2, "gloo_store_host": "127.0.0.1",
         "gloo_store_port": 1, "gloo_prefix": "x", "unknown_field": 3})
    assert "unknown field 'unknown_field'" in server.log_tail(400)


def test_nccl_again_after_the_refusals(server):
    # Buffers of ~210 KB: layers span chunks, so vLLM's reload holds tensors across them.
    push_and_check(server, "nccl", [31, 32], TIMINGS, bucket_gb=0.0002)


def test_delta_through_a_sync_directory(server):
    # Versions are XOR deltas against the model directory the server started from; the
    # workers fetch each one through a collective RPC, then reload it at update_weights.
    sync_dir = f"{server.sync_root}/sync"
    push_and_check(server, "delta", [51, 52, 53], TIMINGS, sync_dir=sync_dir, base_checkpoint=server.model_dir)


def test_sharded_slices_land_in_vllms_parameters(server):
    # Each worker receives only its slices, planned from the model directory both sides
    # read, and copies them into vLLM's fused parameters by name; in-line verification
    # digests what landed, and the read-back verify and vLLM's checker agree.
    push_and_check(server, "sharded", [55, 56, 57], TIMINGS, model=server.model_dir)


def test_vllms_trainer_abstraction_selects_wsync_by_name(server):
    # Trainer code written against vLLM's trainer engines (SkyRL's is): the entry point
    # registers "wsync" here too, and vLLM's HTTP client names the server.
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from wsync.vllm.trainer_engine import WsyncTrainerInitInfo

    model = policy(61)
    info = WsyncTrainerInitInfo(rank=0, wsync_backend="nccl", verify=True, options={"timeout": 120.0})
    engine = WeightTransferTrainerFactory.trainer_init(info, client=HTTPVLLMWeightSyncClient(server.url),
                                                       source=ModuleSource(model))
    try:
        for n, seed in enumerate((61, 62), start=1):
            model.load_state_dict(policy(seed).state_dict())
            engine.send_weights()
            assert engine.last_stats.verified
            check_server_weights(server, model)
            assert server.weight_version() == f"wsync-{n}"
            assert server.completion() == reference_tokens(model)
    finally:
        engine.shutdown()


def test_pause_keep_around_a_sync_with_a_request_in_flight(server):
    # vLLM's layerwise reload takes the layers apart between start and finish, so a vLLM
    # fleet is paused around a sync; mode=keep freezes a running request, which then
    # finishes on the new weights after /resume.
    import wsync
    done = {}
    thread = threading.Thread(target=lambda: done.setdefault("tokens", server.completion(max_tokens=240)))
    thread.start()
    time.sleep(0.2)
    assert request(server.url, "/pause?mode=keep", {})[0] == 200
    assert request(server.url, "/is_paused")[1] == {"is_paused": True}
    model = policy(71)
    with wsync.TrainerEngine(backend="nccl", servers=[server.url], device="cpu", timeout=120.0) as engine:
        assert engine.send_weights(wsync.StateDictSource(model), weight_version="paused", verify=True).verified
    assert request(server.url, "/resume", {})[0] == 200
    thread.join(120)
    assert len(done["tokens"]) == 240
    check_server_weights(server, model)
    assert server.completion() == reference_tokens(model)


def test_a_trainer_killed_inside_a_session_then_a_verified_sync(server):
    import wsync
    before = policy(80)
    with wsync.TrainerEngine(backend="nccl", servers=[server.url], device="cpu", timeout=60.0) as engine:
        assert engine.send_weights(wsync.StateDictSource(before), verify=True).verified
    # A trainer that stalls once start_weight_update succeeded, then dies there.
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from vllm_server import policy\n"
            "import wsync\n"
            "engine = wsync.TrainerEngine(backend='nccl', servers=[%r], device='cpu', timeout=60.0)\n"
            "engine.send_weights(wsync.StateDictSource(policy(81)))\n") % (os.path.dirname(__file__), server.url)
    env = dict(os.environ, WSYNC_FAULT_TRAINER_STALL="after-start")
    dying = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        for line in dying.stderr:
            if "stalled after start_weight_update" in line or time.monotonic() > deadline:
                break
        assert dying.poll() is None, "the trainer exited before stalling"
    finally:
        dying.kill()
        dying.wait(30)
    # vLLM keeps a session open until finish_weight_update (it has no lease): the next
    # trainer's start is refused, naming why, and the finish its failure posts closes that
    # session (the init before it put back what the abandoned update took apart).
    with wsync.TrainerEngine(backend="nccl", servers=[server.url], device="cpu", timeout=60.0) as engine:
        with pytest.raises(wsync.Error, match="already active"):
            engine.send_weights(wsync.StateDictSource(policy(82)))
    # Closing by hand is harmless either way (refused once the trainer's finish closed it).
    status, reply = request(server.url, "/finish_weight_update", {})
    assert status == 200 or "without a matching start_weight_update" in reply["error"]["message"], reply
    check_server_weights(server, before)
    assert server.completion() == reference_tokens(before)
    push_and_check(server, "nccl", [82], TIMINGS)


def test_the_cli_pushes_a_checkpoint_and_verifies_it(server):
    # `wsync push --verify` against vLLM: the model directory the server started from, whose
    # safetensors are the weights of policy(0).
    out = subprocess.run([os.environ.get("WSYNC_BIN", "wsync"), "push", "--servers", server.url, "--backend", "nccl",
                          "--checkpoint", server.model_dir, "--verify", "--timeout", "120"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    model = policy(0)
    check_server_weights(server, model)
    assert server.completion() == reference_tokens(model)


def test_every_sync_into_vllm_is_verified_in_line(server):
    # The trainer's digests reach the workers by collective RPC before finish; every
    # tensor's landed bytes match, with no read-back (verify=False).
    import wsync
    model = policy(81)
    n = len(model.state_dict())
    with wsync.TrainerEngine(backend="nccl", servers=[server.url], device="cpu", timeout=120.0) as engine:
        stats = engine.send_weights(wsync.StateDictSource(model), weight_version="inline-81")
    assert not stats.verified  # no read-back
    assert (stats.inline_digests, stats.inline_verified_servers, stats.inline_unverified_servers,
            stats.inline_verified_tensors) == (n, 1, 0, n)
    worker = server.worker_stats()[0]
    assert (worker["inline_digests"], worker["inline_verified"], worker["inline_differing"]) == (n, n, 0)
    assert server.weight_version() == "inline-81"
    assert server.completion() == reference_tokens(model)


def test_a_corrupted_landing_fails_finish_naming_the_tensor(server):
    # wsync_corrupt_next_landing (WSYNC_VLLM_TEST_FAULTS) fakes a data plane that delivered
    # one wrong byte: the worker flips the first byte of the next tensor it lands, before
    # digesting it and handing it to load_weights. The trainer's digest (of what it read)
    # differs: finish is refused, the sync fails naming the tensor, the version stays.
    import wsync
    good, bad = policy(91), policy(92)
    with wsync.TrainerEngine(backend="nccl", servers=[server.url], device="cpu", timeout=120.0) as engine:
        assert engine.send_weights(wsync.StateDictSource(good), weight_version="good").inline_verified_servers == 1
        status, reply = request(server.url, "/collective_rpc", {"method": "wsync_corrupt_next_landing"})
        assert status == 200, reply
        with pytest.raises(Exception) as failed:
            engine.send_weights(wsync.StateDictSource(bad), weight_version="corrupt")
        message = str(failed.value)
        assert "in-line verification" in message and "differ from what the trainer read" in message, message
        named = [name for name in bad.state_dict() if f"{name} (worker 0 landed" in message]
        assert len(named) == 1, message
        assert server.weight_version() == "good"
        worker = server.worker_stats()[0]
        assert worker["inline_differing"] == 1 and worker["inline_verified"] == len(bad.state_dict()) - 1, worker
        # The session is closed: the next sync lands and verifies.
        stats = engine.send_weights(wsync.StateDictSource(bad), weight_version="after")
        assert stats.inline_verified_tensors == len(bad.state_dict())
    assert server.weight_version() == "after"
    check_server_weights(server, bad)
    assert server.completion() == reference_tokens(bad)
