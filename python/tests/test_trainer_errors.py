"""Failures a trainer meets, each a clear exception of the right class naming the tensor or
server; the live servers keep serving and the next sync lands, verified."""

import numpy as np
import pytest
import torch

import wsync
from wsync.toy_model import ToyQwen3
from conftest import assert_servers_hold, sha256_digests


class ListSource:
    """A hand-written source (no wsync helper): metadata() and __iter__ over a list."""

    def __init__(self, pairs, metadata=None, fail_at=None, extra=None):
        self.pairs, self.fail_at, self.extra = pairs, fail_at, extra
        self._metadata = metadata or [(n, t.dtype, tuple(t.shape)) for n, t in pairs]

    def metadata(self):
        return self._metadata

    def __iter__(self):
        for i, pair in enumerate(self.pairs):
            if i == self.fail_at:
                raise RuntimeError(f"data loader lost its shard at tensor {i}")
            yield pair
        if self.extra is not None:
            yield self.extra


@pytest.fixture
def deployment(wsync_server, toy_model_dir):
    servers = [wsync_server(backend="nccl", model=toy_model_dir, name=f"dp{i}") for i in range(2)]
    model = ToyQwen3(toy_model_dir, seed=3)
    engine = wsync.TrainerEngine(servers=[s.url for s in servers], timeout=30, bucket_gb=0.0005)
    engine.init(wsync.StateDictSource(model))
    yield servers, model, engine
    engine.shutdown()


def perturb(model, seed):
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)


def sync_and_verify(engine, model, servers, seed):
    perturb(model, seed)
    engine.send_weights(wsync.StateDictSource(model), weight_version=f"ok-{seed}")
    assert_servers_hold(servers, sha256_digests(model.state_dict().items()))


def assert_still_serving(servers):
    for s in servers:
        h = s.health()
        assert h["session_active"] is False, f"{s.name} kept a session open: {h}"


def test_source_raising_mid_iteration_aborts_everywhere(deployment):
    servers, model, engine = deployment
    sync_and_verify(engine, model, servers, 1)
    pairs = list(model.state_dict().items())
    with pytest.raises(wsync.AbortedError) as info:
        engine.send_weights(ListSource(pairs, fail_at=5))
    message = str(info.value)
    assert "RuntimeError: data loader lost its shard at tensor 5" in message
    assert pairs[5][0] in message
    assert isinstance(info.value.__cause__, RuntimeError)
    assert info.value.__cause__.__traceback__ is not None
    assert_still_serving(servers)
    sync_and_verify(engine, model, servers, 2)


def test_wrong_shape_names_the_tensor(deployment):
    servers, model, engine = deployment
    pairs = list(model.state_dict().items())
    name, t = pairs[3]
    bad = pairs[:3] + [(name, t.reshape(-1))] + pairs[4:]
    with pytest.raises(wsync.InvalidArgumentError) as info:
        engine.send_weights(ListSource(bad, metadata=[(n, str(x.dtype), tuple(x.shape)) for n, x in pairs]))
    assert name in str(info.value) and "shape" in str(info.value)
    assert_still_serving(servers)
    sync_and_verify(engine, model, servers, 3)


def test_extra_tensor_names_it(deployment):
    servers, model, engine = deployment
    pairs = list(model.state_dict().items())
    with pytest.raises(wsync.InvalidArgumentError) as info:
        engine.send_weights(ListSource(pairs, extra=("model.extra.weight", torch.zeros(4))))
    assert "model.extra.weight" in str(info.value)
    assert_still_serving(servers)
    sync_and_verify(engine, model, servers, 4)


def test_metadata_that_differs_from_init_is_refused_before_sending(deployment):
    servers, model, engine = deployment
    pairs = list(model.state_dict().items())[:-1]
    with pytest.raises(wsync.InvalidArgumentError) as info:
        engine.send_weights(ListSource(pairs))
    assert "lists 24 tensors" in str(info.value) and "25" in str(info.value)
    sync_and_verify(engine, model, servers, 5)


def test_metadata_raising_is_the_cause(deployment):
    servers, model, engine = deployment

    class Broken:
        def metadata(self):
            raise KeyError("no such shard")

        def __iter__(self):
            return iter(())

    with pytest.raises(wsync.InvalidArgumentError) as info:
        engine.send_weights(Broken())
    assert "KeyError" in str(info.value) and "no such shard" in str(info.value)
    assert isinstance(info.value.__cause__, KeyError)
    with pytest.raises(wsync.InvalidArgumentError, match="not a weight source"):
        engine.send_weights(object())


def test_non_contiguous_tensor_is_named_unless_copied(deployment):
    servers, model, engine = deployment
    name = "model.layers.0.mlp.up_proj.weight"
    weight = model.state_dict()[name]
    transposed = weight.t().contiguous().t()  # same values, column-major storage
    assert not transposed.is_contiguous() and torch.equal(transposed, weight)
    state = dict(model.state_dict())
    state[name] = transposed
    with pytest.raises(wsync.InvalidArgumentError) as info:
        engine.send_weights(wsync.StateDictSource(state))
    assert name in str(info.value) and "contiguous" in str(info.value)
    assert_still_serving(servers)
    perturb(model, 6)
    state = dict(model.state_dict())
    state[name] = state[name].t().contiguous().t()
    engine.send_weights(wsync.StateDictSource(state, copy_non_contiguous=True))
    assert_servers_hold(servers, sha256_digests(model.state_dict().items()))


def test_dead_server_is_named_and_the_live_one_takes_the_next_sync(wsync_server, toy_model_dir):
    live = wsync_server(backend="nccl", model=toy_model_dir, name="live")
    doomed = wsync_server(backend="nccl", model=toy_model_dir, name="doomed")
    model = ToyQwen3(toy_model_dir, seed=4)
    with wsync.TrainerEngine(servers=[live.url, doomed.url], timeout=10, bucket_gb=0.0005) as engine:
        sync_and_verify(engine, model, [live, doomed], 1)
        doomed.kill()
        with pytest.raises(wsync.Error) as info:
            engine.send_weights(wsync.StateDictSource(model))
        assert doomed.url in str(info.value), str(info.value)
        assert isinstance(info.value, (wsync.UnavailableError, wsync.DeadlineExceededError,
                                       wsync.AbortedError)), repr(info.value)
    assert_still_serving([live])
    with wsync.TrainerEngine(servers=[live.url], timeout=30, bucket_gb=0.0005) as engine:
        sync_and_verify(engine, model, [live], 2)


def test_unreachable_server_at_init(toy_model_dir):
    with wsync.TrainerEngine(servers=["http://127.0.0.1:9"], timeout=5) as engine:
        with pytest.raises(wsync.UnavailableError, match="127.0.0.1:9"):
            engine.init(wsync.model_metadata(toy_model_dir))


def test_unknown_backend_option_is_a_value_error():
    with pytest.raises(wsync.InvalidArgumentError) as info:
        wsync.TrainerEngine(backend="nccl", servers=["http://127.0.0.1:9"], no_such_knob=1)
    assert "no_such_knob" in str(info.value)
    assert isinstance(info.value, ValueError)
    with pytest.raises(wsync.InvalidArgumentError, match="rank 2"):
        wsync.TrainerEngine(servers=["http://127.0.0.1:9"], rank=2, world_size=2)


def test_unsupported_and_foreign_tensors_are_named(deployment):
    servers, model, engine = deployment
    pairs = list(model.state_dict().items())
    name = pairs[0][0]
    for bad in ([1.0, 2.0], np.zeros(pairs[0][1].shape, dtype=np.complex64)):
        with pytest.raises(wsync.InvalidArgumentError) as info:
            engine.send_weights(ListSource([(name, bad)] + pairs[1:], metadata=[
                (n, str(t.dtype), tuple(t.shape)) for n, t in pairs]))
        assert name in str(info.value)
    sync_and_verify(engine, model, servers, 7)


def test_a_refusing_server_answers_in_the_exception(wsync_server, toy_model_dir):
    from conftest import http_json
    server = wsync_server(model=toy_model_dir, args=["--api-key", "right-key"])
    model = ToyQwen3(toy_model_dir, seed=8)
    with wsync.TrainerEngine(servers=[server.url], timeout=10, api_key="wrong-key") as engine:
        with pytest.raises(wsync.UnauthenticatedError) as info:
            engine.send_weights(wsync.StateDictSource(model))
    assert isinstance(info.value, PermissionError) and server.url in str(info.value)
    assert "401" in str(info.value) and "Authorization: Bearer" in str(info.value)  # the server's reply
    with wsync.TrainerEngine(servers=[server.url], timeout=30, api_key="right-key") as engine:
        engine.send_weights(wsync.StateDictSource(model))
    status, body = http_json(server.url, "/weight_checker", {"action": "checksum", "algorithm": "sha256"},
                             api_key="right-key")
    assert status == 200 and body["checksums"] == sha256_digests(model.state_dict().items())
