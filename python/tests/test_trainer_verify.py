"""send_weights(verify=True): the read-back check of a sync from Python, against real
`wsync serve` processes. A pass that agrees with what the servers hold is verified; a
source whose second pass differs from its first (what a server holding other weights
looks like to the check) raises DataLossError naming the server and the tensors."""

import pytest
import torch

import wsync
from wsync.toy_model import ToyQwen3
from conftest import assert_servers_hold, sha256_digests


class SecondPassDiffers:
    """A source whose second pass yields other values for one tensor."""

    def __init__(self, model, name):
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.name, self.passes = name, 0

    def metadata(self):
        return [(k, wsync.dtype_name(v.dtype), tuple(v.shape)) for k, v in self.state.items()]

    def __iter__(self):
        self.passes += 1
        for k, v in self.state.items():
            yield k, (v + 1 if self.passes == 2 and k == self.name else v)


def test_verify_true_checks_every_server_by_read_back(wsync_server, toy_model_dir):
    servers = [wsync_server(backend="nccl", model=toy_model_dir, name=f"s{i}") for i in range(2)]
    model = ToyQwen3(toy_model_dir, seed=3)
    with wsync.TrainerEngine(backend="nccl", servers=[s.url for s in servers], timeout=60) as engine:
        stats = engine.send_weights(wsync.StateDictSource(model), weight_version="v1", verify=True)
        assert stats.verified is True and stats.verify_seconds > 0
        assert stats.as_dict()["verified"] is True
        assert "verified=True" in repr(stats)
        assert_servers_hold(servers, sha256_digests(model.state_dict().items()))
        unchecked = engine.send_weights(wsync.StateDictSource(model), weight_version="v2")
        assert unchecked.verified is False
        assert unchecked.inline_verified_servers == 2 and unchecked.inline_digests == len(model.state_dict())
    with wsync.TrainerEngine(backend="nccl", servers=[s.url for s in servers], timeout=60,
                             inline_verify=False) as engine:
        off = engine.send_weights(wsync.StateDictSource(model), weight_version="v3")
        assert off.inline_digests == 0 and off.inline_verified_servers == 0
    with wsync.TrainerEngine(backend="nccl", servers=[s.url for s in servers], timeout=60) as engine:

        name = "model.layers.0.mlp.up_proj.weight"
        with pytest.raises(wsync.DataLossError) as e:
            engine.send_weights(SecondPassDiffers(model, name), weight_version="v3", verify=True)
        text = str(e.value)
        assert servers[0].url in text and name in text and "1 of" in text and "xxh3_128" in text


class Temporaries:
    """A source that yields a fresh copy of every tensor, as an all-gathering or casting
    one does: each copy is freed once the engine asks for the next."""

    def __init__(self, model):
        self.state = {k: v.detach() for k, v in model.state_dict().items()}

    def metadata(self):
        return [(k, wsync.dtype_name(v.dtype), tuple(v.shape)) for k, v in self.state.items()]

    def __iter__(self):
        for k, v in self.state.items():
            yield k, v.clone()


def test_verify_true_digests_each_temporary_before_the_source_frees_it(wsync_server, toy_model_dir):
    servers = [wsync_server(backend="nccl", model=toy_model_dir, name="s")]
    model = ToyQwen3(toy_model_dir, seed=5)
    with wsync.TrainerEngine(backend="nccl", servers=[s.url for s in servers], timeout=60) as engine:
        stats = engine.send_weights(Temporaries(model), weight_version="v1", verify=True)
        assert stats.verified is True
    assert_servers_hold(servers, sha256_digests(model.state_dict().items()))
