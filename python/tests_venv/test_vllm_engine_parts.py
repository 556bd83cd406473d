"""The vLLM plugin's parts that need no server: registration, which wsync backend an
init_info is for, and the server settings read from WSYNC_VLLM_OPTIONS."""

import json

import pytest

from vllm_server import requires_vllm

pytestmark = [requires_vllm]


def test_the_entry_point_registers_both_engines_once():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    import wsync.vllm
    load_general_plugins()  # finds wsync through <build>/python's dist-info
    wsync.vllm.register()   # a second call is harmless
    assert WeightTransferEngineFactory._registry["wsync"]().__name__ == "WsyncWeightTransferEngine"
    assert WeightTransferTrainerFactory._registry["wsync"]().__name__ == "WsyncTrainerWeightTransferEngine"


def test_the_backend_of_an_init_info():
    from wsync.vllm.worker_engine import backend_of
    assert backend_of({"rank_offset": 1, "world_size": 2, "gloo_store_host": "127.0.0.1"}) == "nccl"
    assert backend_of({"wsync_ipc_protocol": 1, "session": "0" * 32}) == "ipc"
    assert backend_of({"local_checkpoint_dir": "/x", "sync_dir": "/y"}) == "delta"
    assert backend_of({"wsync_backend": "delta"}) == "delta"
    with pytest.raises(ValueError, match="names no wsync backend"):
        backend_of({"bogus": 1})
    with pytest.raises(ValueError, match="does not receive"):
        backend_of({"owner_sets": [], "plan_digests": []})
    with pytest.raises(ValueError, match="'wsync_backend' is 'sharded'"):
        backend_of({"wsync_backend": "sharded"})


def test_server_options_from_the_environment():
    from wsync.vllm.worker_engine import DEFAULT_STORE_HOSTS, OPTIONS_ENV, server_options
    assert server_options("nccl", {}) == {"allowed_store_hosts": DEFAULT_STORE_HOSTS}
    env = {OPTIONS_ENV: json.dumps({"allowed_store_hosts": ["10.0.0.1"], "sync_root": "/s"})}
    assert server_options("nccl", env) == {"allowed_store_hosts": ["10.0.0.1"]}
    assert server_options("delta", env) == {"sync_root": "/s"}
    assert server_options("ipc", env) == {}
    with pytest.raises(ValueError, match="unknown keys \\['port'\\]"):
        server_options("nccl", {OPTIONS_ENV: '{"port": 1}'})
    with pytest.raises(ValueError, match="is not JSON"):
        server_options("nccl", {OPTIONS_ENV: "{"})
