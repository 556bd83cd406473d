"""CUDA torch tensors into `wsync serve --backend ipc --device cuda:0`, zero-copy and packed.

A small Qwen3-shaped module (qwen3-tiny's tensors, as nested torch modules, so that its
state_dict() names are the Hugging Face ones) trains a few AdamW steps on cuda:0 and is
sent after each step to a real `wsync serve` process on the same GPU. Zero-copy needs the
parameters as views into one flat torch CUDA buffer (StateDictSource(model, storage=flat)):
the server then copies straight from the trainer's tensors. Every sync is checked against
sha256 digests this test computes itself over each tensor's bytes, copied to the host.

Skips without torch, CUDA or a GPU (label gpu).
"""

import json
import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs torch with CUDA and a GPU", allow_module_level=True)

import wsync  # noqa: E402
from conftest import run_python, sha256_digests  # noqa: E402

MODEL = "qwen3-tiny"
DEVICE = "cuda:0"
ALIGN = 256  # bytes between tensors in the flat buffer, as cudaMalloc aligns allocations
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@pytest.fixture
def server(wsync_server):
    """One `wsync serve --backend ipc --device cuda:0` on the trainer's GPU."""
    return wsync_server(backend="ipc", model=MODEL, device=DEVICE, args=("--timeout", "60"))


def child(parent, dotted):
    """The submodule of `parent` at `dotted` ("model.layers.0.mlp"), made as needed."""
    m = parent
    for part in dotted.split(".") if dotted else []:
        if not hasattr(m, part):
            m.add_module(part, torch.nn.Module())
        m = getattr(m, part)
    return m


class Qwen3Shaped(torch.nn.Module):
    """Every tensor of `metadata` as a parameter at its Hugging Face name, on cuda:0.

    flat=True lays them out back to back (ALIGN-aligned) in ONE torch CUDA buffer,
    `self.flat`, each parameter a view into it; otherwise each is its own allocation.
    """

    def __init__(self, metadata, flat, seed):
        super().__init__()
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        for name, dtype, shape in metadata:
            parent, _, leaf = name.rpartition(".")
            t = torch.randn(tuple(shape), generator=gen, device=DEVICE).to(TORCH_DTYPES[dtype]) * 0.02
            child(self, parent).register_parameter(leaf, torch.nn.Parameter(t))
        self.flat = None
        if flat:
            # In state_dict() order, which the source iterates: each tensor after the last.
            params = list(self.named_parameters())
            offsets, total = [], 0
            for _, p in params:
                offsets.append(total)
                total = (total + p.numel() * p.element_size() + ALIGN - 1) // ALIGN * ALIGN
            self.flat = torch.zeros(total, dtype=torch.uint8, device=DEVICE)
            for (name, p), offset in zip(params, offsets):
                view = self.flat[offset:offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
                view.copy_(p.detach())
                parent, _, leaf = name.rpartition(".")
                child(self, parent).register_parameter(leaf, torch.nn.Parameter(view))

    def train_steps(self, steps, seed):
        """A few AdamW steps on random data (updates in place: views stay views)."""
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        for _ in range(steps):
            opt.zero_grad()
            loss = sum((p.float() * torch.randn(p.shape, generator=gen, device=DEVICE)).sum()
                       for p in self.parameters())
            loss.backward()
            opt.step()
        torch.cuda.synchronize()


def digests(model):
    """sha256 of each tensor's bytes (copied to the host), by name: computed here."""
    return sha256_digests(model.state_dict().items())


def flat_model(seed):
    return Qwen3Shaped(wsync.model_metadata(MODEL), flat=True, seed=seed)


def sync_and_verify(engine, source, model, server, step, chunks=None):
    stats = engine.send_weights(source, weight_version=f"step-{step}")
    expected = digests(model)
    got = server.checksums()
    assert got == expected, f"step {step}: server differs on {sorted(k for k in expected if got.get(k) != expected[k])}"
    if chunks is not None:
        assert stats.chunks == chunks, f"step {step}: {stats.chunks} chunk(s)"
    return stats


@pytest.mark.parametrize("mode", ["zero_copy", "packed"])
def test_cuda_tensors_from_a_flat_buffer_land_bit_exact(server, mode):
    model = flat_model(seed=1)
    source = wsync.StateDictSource(model, storage=model.flat)
    with wsync.TrainerEngine("ipc", [server.url], device=DEVICE, timeout=60.0, mode=mode) as engine:
        engine.init(source)
        for step in range(1, 5):
            model.train_steps(2, seed=step)
            stats = sync_and_verify(engine, source, model, server, step, chunks=1 if mode == "zero_copy" else None)
            if mode == "packed":
                assert stats.chunks >= 1
            assert stats.bytes == sum(p.numel() * p.element_size() for p in model.parameters())


def test_auto_learns_the_flat_buffer_then_sends_zero_copy(server):
    model = flat_model(seed=2)
    source = wsync.StateDictSource(model, storage=model.flat)
    with wsync.TrainerEngine("ipc", [server.url], device=DEVICE, timeout=60.0, bucket_gb=0.001,
                             mode="auto") as engine:
        engine.init(source)
        chunks = []
        for step in range(1, 4):
            model.train_steps(1, seed=10 + step)
            chunks.append(sync_and_verify(engine, source, model, server, step).chunks)
        # The first pass packs (several chunks of a 1 MiB bucket) and shows that the
        # buffer holds every tensor; the later syncs are one zero-copy go each.
        assert chunks[0] > 1 and chunks[1:] == [1, 1], chunks


def test_separate_cuda_tensors_pack_and_zero_copy_names_why(server):
    model = Qwen3Shaped(wsync.model_metadata(MODEL), flat=False, seed=3)
    source = wsync.StateDictSource(model)
    with wsync.TrainerEngine("ipc", [server.url], device=DEVICE, timeout=60.0, mode="auto") as engine:
        engine.init(source)
        for step in range(1, 3):
            model.train_steps(1, seed=20 + step)
            assert sync_and_verify(engine, source, model, server, step).chunks >= 1
    with wsync.TrainerEngine("ipc", [server.url], device=DEVICE, timeout=60.0, mode="zero_copy") as engine:
        engine.init(source)
        with pytest.raises(wsync.FailedPreconditionError, match=r"offers no storage\(\)"):
            engine.send_weights(source)
    # The server still holds the last verified weights and serves.
    assert server.checksums() == digests(model)


def test_a_tensor_outside_the_storage_is_named_and_auto_packs(server):
    model = flat_model(seed=4)
    name = "model.layers.1.mlp.up_proj.weight"
    moved = child(model, name.rpartition(".")[0])
    moved.weight = torch.nn.Parameter(moved.weight.detach().clone())  # its own allocation now
    source = wsync.StateDictSource(model, storage=model.flat)
    with wsync.TrainerEngine("ipc", [server.url], device=DEVICE, timeout=60.0, mode="zero_copy") as engine:
        engine.init(source)
        with pytest.raises(wsync.FailedPreconditionError,
                           match=rf"tensor {name} .* does not lie inside the source's storage"):
            engine.send_weights(source)
    with wsync.TrainerEngine("ipc", [server.url], device=DEVICE, timeout=60.0, mode="auto") as engine:
        engine.init(source)
        for step in range(1, 4):
            model.train_steps(1, seed=30 + step)
            assert sync_and_verify(engine, source, model, server, step).chunks >= 1


CHILD = r"""
import json, os, sys, wsync
sys.path.insert(0, os.environ["WSYNC_TEST_DIR"])
import test_gpu_ipc as t
model = t.flat_model(seed=5)
source = wsync.StateDictSource(model, storage=model.flat)
out = {"ok": True, "error": ""}
try:
    with wsync.TrainerEngine("ipc", [os.environ["WSYNC_TEST_URL"]], device=t.DEVICE, timeout=60.0, mode="zero_copy") as engine:
        engine.init(source)
        model.train_steps(1, seed=50)
        engine.send_weights(source, weight_version="expandable")
except wsync.Error as e:
    out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
out["digests"] = t.digests(model)
print(json.dumps(out))
"""


def test_expandable_segments_export_through_their_fd_or_say_why(server):
    """torch's expandable segments allocate with cuMemCreate: the flat buffer goes out as
    its allocation's POSIX fd, or the sync fails naming why it cannot (no fd handle type,
    no ptrace rights to take the fd, a buffer spread over several allocations)."""
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    env = dict(env, WSYNC_TEST_URL=server.url, WSYNC_TEST_DIR=os.path.dirname(os.path.abspath(__file__)))
    r = run_python(CHILD, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if out["ok"]:
        assert server.checksums() == out["digests"]
    else:
        reasons = ["POSIX fd handle type", "pidfd_getfd", "ptrace", "several cuMemCreate allocations"]
        assert any(w in out["error"] for w in reasons), out["error"]
