"""Python inference workers receive from the wsync trainer: `python -m wsync.worker_server`
(ReceiverEngine workers landing every chunk through a torch model's load_weights) driven by
`wsync push`, checked against digests this test computes itself with hashlib."""

import threading
import time

import pytest
import torch

import wsync
from receiver_fixtures import (http_json, push, random_model, sha256_digests, worker_server,  # noqa: F401
                               write_checkpoint)
from wsync.worker_server import StandInModel, WorkerServer


@pytest.fixture
def checkpoint(tmp_path):
    """qwen3-tiny's tensors, random, written by this test: (directory, [(name, tensor)])."""
    pairs = random_model("qwen3-tiny", seed=7)
    return write_checkpoint(tmp_path / "ckpt", pairs), pairs


@pytest.mark.parametrize("backend,workers", [("nccl", 2), ("ipc", 1)])
def test_worker_server_holds_the_trainers_weights_bit_for_bit(tmp_path, worker_server, checkpoint, backend,
                                                              workers):
    ckpt, pairs = checkpoint
    server = worker_server(backend, workers=workers)
    health = http_json(server.url, "/health")[1]
    assert (health["server"], health["backend"], health["tp"]) == ("wsync", backend, workers)
    # The checkpoint as it is (sync 0), in 1 MiB chunks: many load_weights calls per sync.
    r = push(tmp_path, "push0", [server], "--backend", backend, "--checkpoint", ckpt, "--bucket-gb", 1 / 1024)
    assert r.returncode == 0, r.description + "\n" + server.logs()
    assert server.checksums("sha256") == sha256_digests(pairs)
    # Then three trained steps, each verified by the trainer against the model's digests.
    r = push(tmp_path, "push3", [server], "--backend", backend, "--checkpoint", ckpt, "--steps", 3,
             "--verify", "--verify-algorithm", "sha256", "--weight-version", "step-3")
    assert r.returncode == 0, r.description + "\n" + server.logs()
    assert r.stdout.count(" yes") == 4, r.stdout
    health = http_json(server.url, "/health")[1]
    assert health["weight_version"] == "step-3"
    assert health["weights_consistent"] is True
    assert server.checksums("sha256") != sha256_digests(pairs)  # the steps changed the weights


def test_delta_worker_reloads_every_version(tmp_path, worker_server, checkpoint):
    ckpt, pairs = checkpoint
    root = tmp_path / "shared"
    root.mkdir()
    server = worker_server("delta", "--base-checkpoint", ckpt, "--sync-root", root,
                           "--local-checkpoint-dir", tmp_path / "local")
    r = push(tmp_path, "push", [server], "--backend", "delta", "--sync-dir", root / "sync", "--checkpoint", ckpt,
             "--steps", 2, "--verify", "--verify-algorithm", "sha256")
    assert r.returncode == 0, r.description + "\n" + server.logs()
    assert r.stdout.count(" yes") == 3, r.stdout


class FlakyModel(StandInModel):
    """Raises from load_weights while `fail` is set, after loading the chunk's first tensor."""

    def __init__(self, metadata):
        super().__init__(metadata)
        self.fail = True
        self.calls = 0

    def load_weights(self, weights):
        self.calls += 1
        assert all(isinstance(t, torch.Tensor) for _, t in weights)
        if self.fail:
            self.fail = False
            raise RuntimeError("disk on fire while loading")
        return super().load_weights(weights)


def test_load_weights_that_raises_fails_the_sync_with_its_text_then_the_next_sync_lands(tmp_path, checkpoint):
    ckpt, pairs = checkpoint
    metadata = wsync.model_metadata("qwen3-tiny")
    model = FlakyModel(metadata)
    engine = wsync.ReceiverEngine("nccl", timeout=30, metadata=metadata)
    server = WorkerServer([engine], [model], model_name="qwen3-tiny", timeout=30).start()
    server.url  # noqa: B018  (bound before the trainer starts)
    try:
        r = push(tmp_path, "failing", [server], "--backend", "nccl", "--checkpoint", ckpt)
        assert r.returncode != 0, r.description
        assert "load_weights raised RuntimeError: disk on fire while loading" in r.stderr, r.description
        health = http_json(server.url, "/health")[1]
        assert health["weights_consistent"] is False and health["session_active"] is False
        r = push(tmp_path, "next", [server], "--backend", "nccl", "--checkpoint", ckpt, "--verify",
                 "--verify-algorithm", "sha256")
        assert r.returncode == 0, r.description
        got = http_json(server.url, "/weight_checker", {"action": "checksum", "algorithm": "sha256"})[1]
        assert got["checksums"] == sha256_digests(pairs)
        assert http_json(server.url, "/health")[1]["weights_consistent"] is True
    finally:
        server.stop()


def test_load_weights_receives_views_of_the_receive_buffers(tmp_path, checkpoint):
    """Each chunk's tensors are torch views (no copy) on the engine's device; between
    chunks the same buffer is lent again."""
    ckpt, pairs = checkpoint
    seen = []

    class Recording(StandInModel):
        def load_weights(self, weights):
            for name, t in weights:
                seen.append((name, t.device.type, t.is_contiguous(), t.data_ptr()))
            return super().load_weights(weights)

    metadata = wsync.model_metadata("qwen3-tiny")
    server = WorkerServer([wsync.ReceiverEngine("ipc", timeout=30)], [Recording(metadata)], timeout=30).start()
    try:
        r = push(tmp_path, "push", [server], "--backend", "ipc", "--checkpoint", ckpt, "--bucket-gb", 1 / 1024)
        assert r.returncode == 0, r.description
    finally:
        server.stop()
    assert [n for n, *_ in seen] == [n for n, _ in pairs]
    assert all(dev == "cpu" and contiguous for _, dev, contiguous, _ in seen)
    assert len({ptr for *_, ptr in seen}) < len(seen)  # slots are lent again, not copied out


def test_engine_refuses_bad_options_and_updates_naming_them():
    with pytest.raises(wsync.InvalidArgumentError, match="unknown backend 'carrier-pigeon'"):
        wsync.ReceiverEngine("carrier-pigeon")
    with pytest.raises(TypeError, match="takes no option 'sync_root'"):
        wsync.ReceiverEngine("nccl", sync_root="/tmp")
    with pytest.raises(wsync.InvalidArgumentError, match="worker_rank -2"):
        wsync.ReceiverEngine("nccl", worker_rank=-2)
    meta = [("model.norm.weight", torch.bfloat16, [8])]
    with wsync.ReceiverEngine("ipc", metadata=meta, timeout=5) as rx:
        assert repr(rx) == "wsync.ReceiverEngine(backend='ipc', worker_rank=0, device='cpu')"
        update = {"names": ["model.norm.weight"], "dtype_names": ["bfloat16"], "shapes": [[16]]}
        with pytest.raises(wsync.InvalidArgumentError, match=r"model.norm.weight.*\[16\]|\[8\].*model.norm.weight"):
            rx.receive_weights(update, lambda weights: None)
        with pytest.raises(wsync.FailedPreconditionError, match="no ipc staging region is mapped"):
            rx.receive_weights(dict(update, shapes=[[8]]), lambda weights: None)
        deep = []
        for _ in range(70):
            deep = [deep]
        with pytest.raises(wsync.InvalidArgumentError,
                           match="^update_info: field 'shapes' nests deeper than 64 levels$"):
            rx.receive_weights(dict(update, shapes=deep), lambda weights: None)


def test_worker_server_answers_errors_as_json_with_their_status(tmp_path):
    metadata = wsync.model_metadata("qwen3-tiny")
    server = WorkerServer([wsync.ReceiverEngine("nccl", timeout=5)], [StandInModel(metadata)], timeout=5,
                          api_key="k").start()
    try:
        assert http_json(server.url, "/health")[0] == 200
        status, body = http_json(server.url, "/start_weight_update", {})
        assert status == 401 and body["error"]["type"] == "UNAUTHENTICATED"
        status, body = http_json(server.url, "/update_weights", {"update_info": {}}, api_key="k")
        assert status == 409 and "start_weight_update must be called before update_weights" in body["error"]["message"]
        status, body = http_json(server.url, "/init_weight_transfer_engine", {"nope": 1}, api_key="k")
        assert status == 400 and "missing field 'init_info'" in body["error"]["message"]
        status, body = http_json(server.url, "/weight_checker", {"action": "checksum", "algorithm": "md5"}, api_key="k")
        assert status == 400 and "md5" in body["error"]["message"]
        assert http_json(server.url, "/no_such_route", {}, api_key="k")[0] == 404
        assert http_json(server.url, "/get_world_size", api_key="k")[1] == {"world_size": 1}
        # Checksums of the model as it is: zeros, keyed by HF name.
        sums = http_json(server.url, "/weight_checker", {"action": "checksum", "algorithm": "sha256"}, api_key="k")[1]
        assert sums["checksums"] == sha256_digests(StandInModel(metadata).named_parameters())
        # A start during a session is refused; finish closes it.
        assert http_json(server.url, "/start_weight_update", {}, api_key="k")[0] == 200
        assert http_json(server.url, "/start_weight_update", {}, api_key="k")[0] == 409
        assert http_json(server.url, "/finish_weight_update", {"weight_version": "v1"}, api_key="k")[0] == 200
        assert http_json(server.url, "/weight_info", api_key="k")[1] == {"weight_version": "v1"}
    finally:
        server.stop()
    assert not [t for t in threading.enumerate() if t.name == "wsync-worker-server"]


def test_worker_server_answers_vllms_new_routes_as_vllm_or_501_naming_what_is_missing():
    metadata = wsync.model_metadata("qwen3-tiny")
    server = WorkerServer([wsync.ReceiverEngine("nccl", timeout=5)], [StandInModel(metadata)], timeout=5).start()
    try:
        # /weight_checker: `action` is required; without an `algorithm` it is vLLM's
        # runtime-parameter checker, which this front does not have.
        status, body = http_json(server.url, "/weight_checker", {"algorithm": "sha256"})
        assert status == 400 and "needs a field 'action'" in body["error"]["message"], body
        status, body = http_json(server.url, "/weight_checker", {"action": "checksum"})
        assert status == 501 and body["error"]["type"] == "UNIMPLEMENTED", body
        assert "runtime-parameter checker" in body["error"]["message"] and "'algorithm'" in body["error"]["message"]
        status, body = http_json(server.url, "/weight_checker", {"action": "reset", "algorithm": "sha256"})
        assert status == 400 and "takes no 'algorithm'" in body["error"]["message"], body
        status, body = http_json(server.url, "/weight_checker", {"action": "compare", "algorithm": "sha256",
                                                                  "baseline": {"model.norm.weight": "00"}})
        assert status == 200 and body["match"] is False and "model.norm.weight" in body["mismatches"], body
        # /reset_prefix_cache answers as vLLM does.
        assert http_json(server.url, "/reset_prefix_cache?reset_running_requests=true", {}) == (200, {"success": True})
        status, body = http_json(server.url, "/reset_prefix_cache?reset_running_requests=maybe", {})
        assert status == 400 and "reset_running_requests=maybe" in body["error"]["message"], body
        assert http_json(server.url, "/is_sleeping") == (200, {"is_sleeping": False})
        status, info = http_json(server.url, "/server_info")
        assert status == 200 and info["capabilities"]["prefix_caching"] is False, info
        assert info["capabilities"]["weight_transfer_backend"] == "nccl", info
        for path, missing in (("/sleep", "sleep mode"), ("/wake_up", "sleep mode"),
                              ("/abort_requests", "requests to abort"), ("/v1/completions", "generation")):
            status, body = http_json(server.url, path, {})
            assert status == 501 and missing in body["error"]["message"] and path in body["error"]["message"], body
        status, body = http_json(server.url, "/collective_rpc", {"method": "reload_weights"})
        assert status == 501 and "collective_rpc 'reload_weights'" in body["error"]["message"], body
        assert http_json(server.url, "/collective_rpc", {})[0] == 400
    finally:
        server.stop()


def test_a_session_whose_trainer_vanished_expires_after_its_lease():
    metadata = wsync.model_metadata("qwen3-tiny")
    server = WorkerServer([wsync.ReceiverEngine("ipc", timeout=5)], [StandInModel(metadata)], timeout=5,
                          session_lease=0.3).start()
    try:
        assert http_json(server.url, "/start_weight_update", {})[0] == 200
        assert http_json(server.url, "/start_weight_update", {})[0] == 409  # within the lease
        time.sleep(0.5)
        assert http_json(server.url, "/start_weight_update", {})[0] == 200  # the old one expired
        health = http_json(server.url, "/health")[1]
        assert (health["expired_sessions"], health["session_active"]) == (1, True)
    finally:
        server.stop()
