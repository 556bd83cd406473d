"""wsync inside a real vLLM at tensor parallel 2 (CPU, two workers over Gloo).

Every worker of the server joins the trainer's broadcast group (ranks 1 and 2) and lands
the full Hugging Face tensors through its own load_weights, which slices its shard; the
read-back verify gathers the shards over vLLM's TP group.
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
