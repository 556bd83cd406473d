"""wsync inside a real vLLM at tensor parallel 2 (CPU, two workers over Gloo).

Every worker of the server joins the trainer's broadcast group (ranks 1 and 2) and lands
the full Hugging Face tensors through its own load_weights, which slices its shard; the
read-back verify gathers the shards over vLLM's TP group. With `sharded` each worker
receives only its own slices and lands them in its parameters by name.
"""

import pytest

from vllm_server import push_and_check, requires_vllm, serve_fixture

pytestmark = [requires_vllm]

TIMINGS = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_fixture(tmp_path_factory, TIMINGS, tp=2)


def test_nccl_over_gloo_tp2(server):
    push_and_check(server, "nccl", [41, 42], TIMINGS, tp=2)


def test_ipc_over_shared_memory_tp2(server):
    push_and_check(server, "ipc", [43, 44], TIMINGS, tp=2)


def test_delta_tp2(server):
    # Both workers fetch each version into the one local checkpoint (one applies, the other
    # finds it done), then each reloads it and slices its shard.
    push_and_check(server, "delta", [45, 46], TIMINGS, tp=2, sync_dir=f"{server.sync_root}/sync",
                   base_checkpoint=server.model_dir)


def test_sharded_tp2(server):
    push_and_check(server, "sharded", [47, 48, 49], TIMINGS, tp=2, model=server.model_dir)


RANK = """
import json, sys
sys.path.insert(0, {here!r})
from vllm_server import policy
import wsync
rank = int(sys.argv[1])
with wsync.TrainerEngine(backend="sharded", servers=[{url!r}], device="cpu", timeout=120.0, rank=rank, world_size=2,
                         group_port={port}, model={model!r}) as engine:
    for n, seed in enumerate({seeds!r}):
        stats = engine.send_weights(wsync.StateDictSource(policy(seed)), weight_version=f"ranks-{{n}}", verify=True)
        print(json.dumps({{"verified": stats.verified, "inline": stats.inline_verified_tensors, "bytes": stats.bytes,
                          "seconds": stats.seconds}}), flush=True)
"""


def test_sharded_from_two_trainer_ranks_tp2(server):
    # Two trainer processes (each holding the whole policy) form wsync's trainer group and
    # split the sends between them; each vLLM worker receives its slices from both.
    import json
    import os
    import subprocess
    import sys

    from vllm_server import check_server_weights, free_port, policy, reference_tokens
    seeds = [58, 59]
    code = RANK.format(here=os.path.dirname(__file__), url=server.url, port=free_port(), model=server.model_dir,
                       seeds=seeds)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    lines = [[json.loads(x) for x in out.splitlines() if x.startswith("{")] for out, _ in outs]
    model = policy(seeds[-1])
    n = len(model.state_dict())
    assert [(x["verified"], x["inline"]) for x in lines[0]] == [(True, n)] * len(seeds), lines
    assert all(x["bytes"] > 0 for x in lines[1]), lines  # rank 1 sent its share
    TIMINGS["sharded tp2 two ranks sync (s)"] = [round(x["seconds"], 3) for x in lines[0]]
    check_server_weights(server, model, tp=2)
    assert server.completion() == reference_tokens(model)



def test_dtensor_ranks_split_tensors_are_verified_by_row_ranges_tp2(server, tmp_path):
    # Two FSDP2 ranks (wsync.DTensorSource) each hold a dim-0 half of every tensor: no rank
    # holds one whole, so each is digested by the row ranges the ranks hold. Both vLLM
    # workers digest the same ranges (announced at init) and verify every tensor in line.
    from dist_helpers import assert_landed, run_ranks
    spec = {"backend": "sharded", "servers": [server.url], "model_dir": server.model_dir, "source": "dtensor",
            "steps": 2, "backend_options": {"model": server.model_dir}, "dropped": ["lm_head.weight"],
            "check_servers": False}
    results, _, logs = run_ranks(spec, tmp_path)
    assert_landed(results, logs, 2)
    for line in results[0]:
        inline = line["inline"]
        assert inline["digests"] > 0 and inline == {"digests": inline["digests"], "servers": 1,
                                                    "unverified_servers": 0, "tensors": inline["digests"]}, line
