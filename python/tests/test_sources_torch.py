"""torch sources: bfloat16 parameters that require grad, names mapped or dropped by a
callable, a source's storage() block; each sync verified against the test's own sha256."""

import pytest
import torch

import wsync
from wsync.toy_model import ToyQwen3, write_config
from conftest import assert_servers_hold, sha256_digests


@pytest.fixture
def bf16_model_dir(tmp_path):
    return write_config(tmp_path / "bf16", dtype="bfloat16")


def test_bf16_parameters_that_require_grad(wsync_server, bf16_model_dir):
    servers = [wsync_server(model=bf16_model_dir, name=f"dp{i}") for i in range(2)]
    model = ToyQwen3(bf16_model_dir, seed=11)
    params = list(model.named_parameters())
    assert params[0][1].dtype == torch.bfloat16 and params[0][1].requires_grad
    with wsync.TrainerEngine(servers=[s.url for s in servers], timeout=30) as engine:
        stats = engine.send_weights(wsync.TensorListSource(params))  # not detached by the caller
    assert stats.tensors == len(params)
    assert_servers_hold(servers, sha256_digests(model.state_dict().items()))


def test_name_map_renames_and_drops(wsync_server, toy_model_dir):
    server = wsync_server(model=toy_model_dir)
    model = ToyQwen3(toy_model_dir, seed=12)
    wrapped = {"module." + n: t for n, t in model.state_dict().items()}
    wrapped["module.rotary.inv_freq"] = torch.zeros(8)  # a buffer the servers do not hold

    def to_hf(name):
        return None if name.endswith("inv_freq") else name[len("module."):]

    source = wsync.StateDictSource(wrapped, name_map=to_hf)
    assert [n for n, _, _ in source.metadata()] == list(model.state_dict())
    with wsync.TrainerEngine(servers=[server.url], timeout=30) as engine:
        engine.send_weights(source)
    assert_servers_hold([server], sha256_digests(model.state_dict().items()))


def test_storage_block_is_offered_and_tensors_sync_from_it(wsync_server, toy_model_dir):
    server = wsync_server(model=toy_model_dir)
    meta = wsync.model_metadata(toy_model_dir)
    sizes = [torch.Size(shape).numel() for _, _, shape in meta]
    flat = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(13))
    views, offset = [], 0
    for (name, _, shape), n in zip(meta, sizes):
        views.append((name, flat[offset:offset + n].view(shape)))
        offset += n
    source = wsync.TensorListSource(views, storage=flat)
    assert source.storage() is flat
    with wsync.TrainerEngine(servers=[server.url], timeout=30) as engine:
        engine.send_weights(source)
    assert_servers_hold([server], sha256_digests(views))


def test_storage_that_is_not_a_tensor_is_refused(toy_model_dir):
    model = ToyQwen3(toy_model_dir, seed=14)
    with wsync.TrainerEngine(servers=[], rank=1, world_size=2, group_port=0) as engine:
        with pytest.raises(wsync.InvalidArgumentError, match="storage"):
            engine.send_weights(wsync.StateDictSource(model, storage="not a tensor"))


def test_a_cuda_tensor_for_a_cpu_engine_is_named():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pairs = [("w", torch.zeros(4, device="cuda:0"))]
    with wsync.TrainerEngine(servers=[], rank=1, world_size=2, group_port=0) as engine:
        with pytest.raises(wsync.InvalidArgumentError, match="w lives on cuda:0"):
            engine.send_weights(wsync.TensorListSource(pairs))


def test_copy_and_digest_in_one_pass_equals_copy_then_digest():
    # What a vLLM worker does with each LoRA tensor it lands (wsync.vllm.lora): the copy
    # holds the same bytes in its own storage, the digest is theirs, for every dtype's
    # byte view, contiguous or not.
    import hashlib

    from wsync.worker_server import tensor_copy_digest, tensor_digest
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64):
        t = (torch.arange(37 * 129) * 7 % 1001).reshape(37, 129).to(dtype)
        for src in (t, t.t()):
            copy, hex_ = tensor_copy_digest(src, "xxh3_128")
            assert torch.equal(copy, src) and copy.data_ptr() != src.data_ptr()
            assert hex_ == tensor_digest(src.contiguous(), "xxh3_128")
        copy, hex_ = tensor_copy_digest(t, "sha256")
        raw = t.view(torch.int16) if dtype in (torch.bfloat16, torch.float16) else t
        assert hex_ == hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def test_copies_into_given_tensors_digest_each_on_several_threads():
    # A vLLM worker's LoRA staging (wsync.vllm.lora.Staging): each source lands in its own
    # preallocated view, a transposed (non-contiguous) source through the slow path.
    from wsync.worker_server import tensor_digest, tensors_copy_digest_into
    flat = torch.empty(3 * 64 * 129 * 4, dtype=torch.uint8)
    srcs = [(torch.arange(64 * 129) * 3 % 997).reshape(64, 129).to(torch.float32),
            (torch.arange(129 * 64) % 101).reshape(129, 64).to(torch.float32).t(),
            (torch.arange(64 * 129) % 13).reshape(64, 129).to(torch.bfloat16)]
    dsts = [flat[:64 * 129 * 4].view(torch.float32).view(64, 129),
            flat[64 * 129 * 4:2 * 64 * 129 * 4].view(torch.float32).view(64, 129),
            flat[2 * 64 * 129 * 4:2 * 64 * 129 * 4 + 64 * 129 * 2].view(torch.bfloat16).view(64, 129)]
    for threads in (1, 3):
        flat.zero_()
        digests = tensors_copy_digest_into(srcs, dsts, "xxh3_128", threads=threads)
        for src, dst, hex_ in zip(srcs, dsts, digests):
            assert torch.equal(dst, src)
            assert hex_ == tensor_digest(src.contiguous(), "xxh3_128")
    with pytest.raises(Exception, match="bytes into a buffer of"):
        tensors_copy_digest_into([srcs[0]], [dsts[2]], "xxh3_128")
