"""numpy sources, bfloat16 (as uint16 bits) and float32, into every backend that runs on
CPU: nccl (Gloo), ipc (shared memory) and delta (a sync dir); each sync verified against
the test's own sha256 of every array's bytes."""

import os

import numpy as np
import pytest

import wsync
from wsync.toy_model import write_config
from conftest import DeltaSetup, assert_servers_hold, run_python, sha256_digests


def random_arrays(metadata, seed):
    """One array per tensor: float32 values, or their top 16 bits (bfloat16) as uint16."""
    rng = np.random.default_rng(seed)
    out = []
    for name, dtype, shape in metadata:
        values = rng.standard_normal(shape, dtype=np.float32)
        if dtype == "bfloat16":
            values = (values.view(np.uint32) >> 16).astype(np.uint16)
        out.append((name, values, dtype))
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("backend", ["nccl", "ipc", "delta"])
def test_numpy_source_syncs(backend, dtype, wsync_server, tmp_path):
    model = write_config(tmp_path / "model", dtype=dtype)
    metadata = wsync.model_metadata(model)
    assert {d for _, d, _ in metadata} == {dtype}
    first = random_arrays(metadata, seed=1)
    server_args, options = [], {}
    if backend == "delta":
        delta = DeltaSetup(tmp_path, [(n, d, a) for n, a, d in first])
        server_args, options = delta.server_args(), delta.trainer_options()
    servers = [wsync_server(backend=backend, model=model, args=server_args, name=f"{backend}{i}")
               for i in range(2)]
    with wsync.TrainerEngine(backend=backend, servers=[s.url for s in servers], timeout=60,
                             bucket_gb=0.0002, **options) as engine:
        for step, seed in enumerate([2, 3]):
            arrays = random_arrays(metadata, seed)
            source = wsync.TensorListSource(arrays)
            assert source.metadata() == metadata
            stats = engine.send_weights(source, weight_version=f"v{step}")
            assert stats.tensors == len(metadata) or backend == "delta"
            assert_servers_hold(servers, sha256_digests((n, a) for n, a, _ in arrays))


class ReusedBufferSource:
    """Yields every array as a view of one buffer that it overwrites for the next: a source
    of temporaries, as an all-gathering or casting one is. It says nothing of
    yields_stable_tensors."""

    def __init__(self, arrays):
        self._arrays = arrays

    def metadata(self):
        return [(name, dtype, tuple(a.shape)) for name, a, dtype in self._arrays]

    def __iter__(self):
        buffer = np.empty(max(a.nbytes for _, a, _ in self._arrays), np.uint8)
        for name, a, _ in self._arrays:
            view = buffer[:a.nbytes].view(a.dtype).reshape(a.shape)
            view[...] = a
            yield name, view


def test_shipped_sources_say_whether_they_keep_their_tensors():
    arrays = [("a", np.zeros((2, 3), np.float32)), ("b", np.zeros(4, np.int32))]
    assert wsync.TensorListSource(arrays).yields_stable_tensors is True
    assert wsync.StateDictSource(dict(arrays)).yields_stable_tensors is True
    assert wsync.StateDictSource(dict(arrays), copy_non_contiguous=True).yields_stable_tensors is False
    assert wsync.StateDictSource(dict(arrays), dtype="float16").yields_stable_tensors is False
    assert not hasattr(ReusedBufferSource([]), "yields_stable_tensors")


@pytest.mark.parametrize("kind", ["kept", "reused"])
def test_delta_reads_kept_tensors_in_place_and_copies_temporaries(kind, wsync_server, tmp_path):
    """delta reads a source's host tensors in place when the source keeps them
    (yields_stable_tensors) and copies each one before the next otherwise; the servers
    hold exactly the source's last arrays either way."""
    model = write_config(tmp_path / "model", dtype="bfloat16")
    metadata = wsync.model_metadata(model)
    delta = DeltaSetup(tmp_path, [(n, d, a) for n, a, d in random_arrays(metadata, seed=1)])
    servers = [wsync_server(backend="delta", model=model, args=delta.server_args(), name=f"delta{i}")
               for i in range(2)]
    code = f"""
import sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
import wsync
from test_sources_numpy import ReusedBufferSource, random_arrays
metadata = wsync.model_metadata({str(model)!r})
with wsync.TrainerEngine(backend="delta", servers={[s.url for s in servers]!r}, timeout=60,
                         **{delta.trainer_options()!r}) as engine:
    for seed in (2, 3):
        arrays = random_arrays(metadata, seed)
        source = wsync.TensorListSource(arrays) if {kind!r} == "kept" else ReusedBufferSource(arrays)
        engine.send_weights(source)
"""
    child = run_python(code, timeout=120, env=dict(os.environ, WSYNC_LOG_LEVEL="debug"))
    assert child.returncode == 0, child.stderr
    said = {"kept": "the source's tensors are read in place",
            "reused": "the source's tensors are copied to staging first"}
    assert said[kind] in child.stderr, child.stderr
    other = said["reused" if kind == "kept" else "kept"]
    assert other not in child.stderr, child.stderr
    assert_servers_hold(servers, sha256_digests((n, a) for n, a, _ in random_arrays(metadata, seed=3)))


def test_numpy_metadata_may_name_dtypes_as_objects():
    arrays = [("a", np.zeros((2, 3), np.float32)), ("b", np.zeros(4, np.int32))]
    assert wsync.TensorListSource(arrays).metadata() == [("a", "float32", (2, 3)), ("b", "int32", (4,))]
    assert wsync.dtype_name(np.float32) == "float32"
    assert wsync.dtype_name(np.dtype("float16")) == "float16"
    assert wsync.dtype_name("torch.bfloat16") == "bfloat16"


def test_model_metadata_refuses_a_deeply_nested_config(tmp_path):
    """A config.json nested 100,000 deep is a ValueError naming the file and the field,
    not a crash of the interpreter."""
    (tmp_path / "config.json").write_text(
        '{"architectures": ["Qwen3ForCausalLM"], "rope_scaling": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(ValueError) as e:
        wsync.model_metadata(str(tmp_path))
    assert str(e.value) == f"{tmp_path / 'config.json'}: field 'rope_scaling' nests deeper than 64 levels"
