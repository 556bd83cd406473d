"""FSDP2 ranks (wsync.DTensorSource) into TP=1 and TP=2 servers with sharded, nccl and delta;
rank 0 checks every server's sha256 digests against the full model after every step. With
sharded every rank sends its own shards: no rank gathers anything (peak_gather_bytes 0)."""

import pytest

from dist_helpers import assert_landed, run_ranks, shared, write_config


@pytest.mark.parametrize("backend", ["sharded", "nccl", "delta"])
def test_fsdp2_two_ranks_into_tp1_and_tp2(backend, wsync_server, tmp_path):
    """FSDP2 fully_shard over 2 ranks, fp32 trained and sent as bf16, into a TP=1 and a TP=2 server."""
    model_dir = write_config(tmp_path / "model", dtype="bfloat16")
    options = {}
    args = []
    if backend == "sharded":
        options = {"model": model_dir}
    if backend == "delta":
        import torch
        from dist_worker import build_model
        base = [(n, "bfloat16", t.detach().to(torch.bfloat16))
                for n, t in build_model({"model_dir": model_dir}).state_dict().items() if n != "lm_head.weight"]
        delta = shared.DeltaSetup(tmp_path, base)
        options = delta.trainer_options()
        args = delta.server_args()
    servers = [wsync_server(backend=backend, model=model_dir, args=["--tp", "1", *args]),
               wsync_server(backend=backend, model=model_dir, args=["--tp", "2", *args])]
    spec = {"backend": backend, "servers": [s.url for s in servers], "model_dir": model_dir,
            "source": "dtensor", "steps": 2, "servers_dtype": "bfloat16", "backend_options": options,
            "dropped": ["lm_head.weight"]}
    results, _, logs = run_ranks(spec, tmp_path)
    assert_landed(results, logs, 2)
    if backend == "sharded":
        assert_no_gather(results)


def assert_no_gather(results):
    """Every rank sent bytes of its own and gathered nothing."""
    for r, lines in enumerate(results):
        for line in lines:
            assert line["peak_gather_bytes"] == 0, (r, line)
            assert line["bytes"] > 0, (r, line)


@pytest.mark.parametrize("tps", [(2, 2), (1, 2)], ids=["2xtp2", "tp1+tp2"])
def test_fsdp2_four_ranks_sharded(tps, wsync_server, tmp_path):
    """4 FSDP2 ranks, mixed precision (bf16 autocast, fp32 masters sent as bf16), each sending
    its own dim-0 shards, no gather, into 2 servers x TP=2 and into a TP=1 beside a TP=2."""
    model_dir = write_config(tmp_path / "model", dtype="bfloat16")
    servers = [wsync_server(backend="sharded", model=model_dir, args=["--tp", str(tp)]) for tp in tps]
    spec = {"backend": "sharded", "servers": [s.url for s in servers], "model_dir": model_dir,
            "source": "dtensor", "steps": 2, "servers_dtype": "bfloat16", "mixed": True,
            "backend_options": {"model": model_dir}, "dropped": ["lm_head.weight"]}
    results, _, logs = run_ranks(spec, tmp_path, world=4)
    assert_landed(results, logs, 2)
    assert_no_gather(results)
    # No rank holds a tensor whole, yet every server verifies every tensor in-line: each
    # part's rows are digested by a rank holding them, each server digests the same rows.
    for line in results[0]:
        inline = line["inline"]
        assert inline["digests"] > 0 and inline["unverified_servers"] == 0, line
        assert (inline["servers"], inline["tensors"]) == (len(servers), inline["digests"]), line
