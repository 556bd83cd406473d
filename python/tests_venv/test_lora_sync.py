"""LoRA adapters synced in memory into real `wsync serve --max-loras` processes: a
PEFT-style adapter (LoRA on q_proj and v_proj, built by hand on the toy Qwen3) trained a
few steps with torch and synced after every step, over nccl (Gloo on CPU) and ipc (shared
memory). Each step checks that the server installed that version (/health, /v1/models),
holds the trainer's exact bytes (/weight_checker with "lora"), and that generation naming
the adapter changes with the version and reports it per token while the base model's does
not change. Failures: a finish with a tensor missing, and a trainer killed mid-update,
both leave the previous version serving and the base weights consistent."""

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

import wsync
from wsync.toy_model import ToyQwen3
from conftest import shared

http_json = shared.http_json
R, ALPHA, MODULES = 4, 8.0, ("q_proj", "v_proj")


class LoraLinear(nn.Module):
    """PEFT's LoRA layer, by hand: base(x) + B(A(x)) * alpha / r; the base is frozen."""

    def __init__(self, base, r, alpha):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False, dtype=base.weight.dtype)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, dtype=base.weight.dtype)
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / r
        base.weight.requires_grad_(False)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


def lora_model(seed=0):
    model = ToyQwen3("qwen3-tiny", seed=seed)
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers:
        for name in MODULES:
            setattr(layer.self_attn, name, LoraLinear(getattr(layer.self_attn, name), R, ALPHA))
    return model


def train_step(model, optimizer, step):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 256, (2, 16), generator=g)
    optimizer.zero_grad()
    model.loss(tokens).backward()
    optimizer.step()


def sha256_of(adapter):
    return {name: hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for name, t in adapter}


def post(server, path, body, status=200):
    got, reply = http_json(server.url, path, body, timeout=60)
    assert got == status, f"POST {path} -> {got}: {reply}"
    return reply


def complete(server, model):
    choice = post(server, "/v1/completions", {"model": model, "prompt": "lora", "max_tokens": 6})["choices"][0]
    return choice["token_ids"], choice["weight_versions"]


def adapter_version(server, name="math"):
    for a in server.health()["lora"]["adapters"]:
        if a["name"] == name:
            return a["version"]
    return None


def test_lora_source_names_checks_and_deduplicates_ranks():
    model = lora_model()
    sd = {f"base_model.model.{k.replace('.lora_A.', '.lora_A.default.').replace('.lora_B.', '.lora_B.default.')}": v
          for k, v in model.state_dict().items()}
    adapter = wsync.LoraSource(sd, r=R, alpha=ALPHA, name="math")
    names = [n for n, _, _ in adapter.metadata()]
    assert names[0] == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert len(names) == 2 * len(MODULES) * len(model.model.layers)
    assert adapter.target_modules == sorted(MODULES) and adapter.dtype == "bfloat16"
    assert wsync.LoraSource(model, r=R, alpha=ALPHA, use_rslora=True, name="m").scaling == ALPHA / 2
    # Two ranks holding the same tensors: each sent once; a differing copy is named.
    assert len(wsync.LoraSource([sd, dict(sd)], r=R, alpha=ALPHA, name="math")) == len(names)
    other = dict(sd)
    other[next(k for k in sd if "lora_A" in k)] = torch.ones_like(next(v for k, v in sd.items() if "lora_A" in k))
    with pytest.raises(wsync.InvalidArgumentError, match="differs between rank 0 and rank 1"):
        wsync.LoraSource([sd, other], r=R, alpha=ALPHA, name="math")
    with pytest.raises(wsync.InvalidArgumentError, match="rank 8"):
        wsync.LoraSource(sd, r=8, alpha=ALPHA, name="math")
    with pytest.raises(wsync.InvalidArgumentError, match="not in target_modules"):
        wsync.LoraSource(sd, r=R, alpha=ALPHA, target_modules=["q_proj"], name="math")
    with pytest.raises(wsync.InvalidArgumentError, match="name"):
        wsync.LoraSource(sd, r=R, alpha=ALPHA, name="../x")


@pytest.mark.parametrize("backend", ["nccl", "ipc", "sharded", "delta"])
def test_adapter_trained_and_synced_every_step(backend, wsync_server, tmp_path):
    # sharded: a TP=2 server, whose two workers each receive the whole adapter from
    # trainer rank 0 over the adapter group. delta: the adapter goes through one file
    # below the sync dir, removed once each session ends.
    args, options = ["--max-loras", "2", "--timeout", "60"], {}
    if backend == "sharded":
        args += ["--tp", "2"]
        options = {"model": "qwen3-tiny"}
    if backend == "delta":
        base = ToyQwen3("qwen3-tiny", seed=0).state_dict()
        delta = shared.DeltaSetup(tmp_path, [(n, str(t.dtype)[len("torch."):], t) for n, t in base.items()])
        args += delta.server_args()
        options = {"sync_dir": str(delta.sync_dir)}
    server = wsync_server(backend=backend, args=args, name=backend)
    model = lora_model()
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    adapter = wsync.LoraSource(model, r=R, alpha=ALPHA, target_modules=list(MODULES), name="math")
    assert len(adapter) == 2 * len(MODULES) * len(model.model.layers)
    assert adapter.scaling == ALPHA / R
    base_tokens, base_versions = complete(server, "qwen3-tiny")
    seen = {}
    with wsync.TrainerEngine(backend=backend, servers=[server.url], timeout=60, lora=adapter, **options) as engine:
        for step in range(3):
            train_step(model, optimizer, step)
            stats = engine.send_weights(adapter, weight_version=f"step-{step}", verify=step == 2)
            assert stats.tensors == len(adapter)
            assert stats.verified == (step == 2)
            assert stats.inline_verified_servers == 1, stats
            health = server.health()
            assert adapter_version(server) == f"step-{step}"
            assert health["weight_version"] == "default" and health["weights_consistent"]
            held = post(server, "/weight_checker", {"action": "checksum", "algorithm": "sha256", "lora": "math"})
            assert held["version"] == f"step-{step}"
            assert held["checksums"] == sha256_of(adapter)
            tokens, versions = complete(server, "math")
            assert versions == [f"step-{step}"] * len(tokens)
            assert tokens not in seen.values(), "generation did not change with the adapter version"
            seen[step] = tokens
            assert complete(server, "qwen3-tiny") == (base_tokens, base_versions)
            if backend == "delta":
                assert [p.name for p in (delta.sync_dir / "lora" / "math").iterdir()] == []
    models = http_json(server.url, "/v1/models")[1]["data"]
    assert [(m["id"], m["parent"]) for m in models] == [("qwen3-tiny", None), ("math", "qwen3-tiny")]
    if backend == "sharded":
        # The adapter group carries lora sessions only: a full-weight update on it is
        # refused, and the weights stay as they were.
        post(server, "/start_weight_update", {})
        reply = post(server, "/update_weights", {"update_info": {}}, status=409)
        assert "adapter group" in str(reply), reply
        post(server, "/finish_weight_update", {}, status=409)
        assert server.health()["weights_consistent"]


def test_failed_updates_keep_the_previous_adapter(wsync_server, tmp_path):
    server = wsync_server(backend="nccl", args=["--max-loras", "1", "--timeout", "30", "--session-lease", "2"])
    model = lora_model(seed=1)
    adapter = wsync.LoraSource(model, r=R, alpha=ALPHA, name="math")
    with wsync.TrainerEngine(backend="nccl", servers=[server.url], timeout=30, lora=adapter) as engine:
        engine.send_weights(adapter, weight_version="good")
    good = complete(server, "math")
    assert good[1][0] == "good"

    # A tensor missing at finish: the server refuses to install, and keeps "good".
    partial = wsync.TensorListSource(list(adapter)[:-1])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    with wsync.TrainerEngine(backend="nccl", servers=[server.url], timeout=30, lora=adapter) as engine:
        with pytest.raises(wsync.FailedPreconditionError, match="did not arrive"):
            engine.send_weights(partial, weight_version="partial")
    assert adapter_version(server) == "good"
    assert complete(server, "math") == good
    assert server.health()["weights_consistent"]

    # A trainer killed in the middle of its update: the session ends, "good" keeps serving.
    script = tmp_path / "stalling_trainer.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time, torch, wsync
        names = {[n for n, _ in adapter]!r}
        shapes = {[tuple(t.shape) for _, t in adapter]!r}
        class Stalls:
            def metadata(self):
                return [(n, "{adapter.dtype}", s) for n, s in zip(names, shapes)]
            def __iter__(self):
                for i, (n, s) in enumerate(zip(names, shapes)):
                    if i == len(names) // 2:
                        print("stalling", flush=True)
                        time.sleep(600)
                    yield n, torch.ones(s, dtype=getattr(torch, "{adapter.dtype}"))
        engine = wsync.TrainerEngine(backend="nccl", servers=[{server.url!r}], timeout=600, bucket_gb=1e-5,
                                     lora={adapter.spec!r})
        engine.send_weights(Stalls(), weight_version="killed")
    """))
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=dict(os.environ))
    try:
        lines = []
        while not lines or lines[-1] != "stalling":
            line = trainer.stdout.readline()
            assert line, "".join(lines)  # the trainer exited before stalling
            lines.append(line.strip())
        deadline = time.monotonic() + 20
        while not server.health()["session_active"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.health()["lora"]["staging"]["version"] == "killed"
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
    deadline = time.monotonic() + 30
    while server.health()["session_active"] and time.monotonic() < deadline:
        time.sleep(0.1)
    health = server.health()
    assert not health["session_active"], health
    assert health["weights_consistent"], health
    assert adapter_version(server) == "good"
    assert complete(server, "math") == good

    # The next trainer installs its version.
    with wsync.TrainerEngine(backend="nccl", servers=[server.url], timeout=30, lora=adapter) as engine:
        engine.send_weights(adapter, weight_version="after")
    assert complete(server, "math")[1][0] == "after"
    # A second name is refused while --max-loras 1 is full.
    other = wsync.LoraSource(model, r=R, alpha=ALPHA, name="other")
    with wsync.TrainerEngine(backend="nccl", servers=[server.url], timeout=30, lora=other) as engine:
        with pytest.raises(wsync.FailedPreconditionError, match="max-loras"):
            engine.send_weights(other, weight_version="1")


def test_delta_adapter_files_are_confined_and_checked(wsync_server, tmp_path):
    """A lora session over delta names its file in update_info: a path out of the sync dir,
    a symlink leading out, a file whose tensors differ from the update's or that ends
    early are each refused naming why, and the previous version keeps serving."""
    base = ToyQwen3("qwen3-tiny", seed=0).state_dict()
    delta = shared.DeltaSetup(tmp_path, [(n, str(t.dtype)[len("torch."):], t) for n, t in base.items()])
    server = wsync_server(backend="delta", args=["--max-loras", "1", "--timeout", "30", *delta.server_args()])
    adapter = wsync.LoraSource(lora_model(seed=2), r=R, alpha=ALPHA, name="math")
    with wsync.TrainerEngine(backend="delta", servers=[server.url], timeout=30, lora=adapter,
                             sync_dir=str(delta.sync_dir)) as engine:
        engine.send_weights(adapter, weight_version="good")
    good = complete(server, "math")
    entries = [(n, adapter.dtype, t) for n, t in adapter]
    listing = {"names": [n for n, _, _ in entries], "dtype_names": [d for _, d, _ in entries],
               "shapes": [list(t.shape) for _, _, t in entries], "sync_dir": str(delta.sync_dir)}
    spec = {"format": 1, "name": "math", "version": "bad", "r": R, "alpha": ALPHA,
            "target_modules": sorted(MODULES)}
    files = delta.sync_dir / "lora" / "math"
    outside = tmp_path / "outside.safetensors"
    shared.write_safetensors(outside, entries)
    (files / "link.safetensors").symlink_to(outside)
    reshaped = list(entries)
    reshaped[0] = (reshaped[0][0], adapter.dtype, reshaped[0][2].reshape(-1))
    shared.write_safetensors(files / "reshaped.safetensors", reshaped)
    shared.write_safetensors(files / "extra.safetensors", entries + [("extra", "float32", torch.zeros(2))])
    shared.write_safetensors(files / "short.safetensors", entries)
    with open(files / "short.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 2)
    cases = [
        ("../../outside.safetensors", 400, "must be a relative path of plain names"),
        (str(outside), 400, "must be a relative path of plain names"),
        ("lora/math/link.safetensors", 400, "link.safetensors"),
        ("lora/math/reshaped.safetensors", 400, f"tensor {entries[0][0]} is {adapter.dtype} "),
        ("lora/math/extra.safetensors", 400, f"holds {len(entries) + 1} tensors; the update declares {len(entries)}"),
        ("lora/math/short.safetensors", 500, "lies past the end of the file"),
        ("lora/math/absent.safetensors", 404, "absent.safetensors"),
    ]
    for name, code, message in cases:
        post(server, "/start_weight_update", {"wsync_lora": spec})
        got, reply = http_json(server.url, "/update_weights", {"update_info": {**listing, "wsync_lora_file": name}},
                               timeout=30)
        assert got == code, (name, got, reply)
        assert message in str(reply), (name, reply)
        http_json(server.url, "/finish_weight_update", {}, timeout=30)  # closes what is left open
        assert adapter_version(server) == "good", name
        assert complete(server, "math") == good, name
        assert server.health()["weights_consistent"]


TWO_RANKS = """
import json, sys
sys.path.insert(0, {here!r})
import torch, wsync
from test_lora_sync import lora_model, R, ALPHA
rank = int(sys.argv[1])
adapter = wsync.LoraSource(lora_model(seed=3), r=R, alpha=ALPHA, name="math")
with wsync.TrainerEngine(backend="sharded", servers=[{url!r}], timeout=60, rank=rank, world_size=2,
                         group_port={port}, model="qwen3-tiny", lora=adapter) as engine:
    stats = engine.send_weights(adapter, weight_version="two-ranks")
    print(json.dumps({{"bytes": stats.bytes, "inline": stats.inline_verified_servers}}), flush=True)
"""


def test_sharded_adapter_from_two_trainer_ranks(wsync_server):
    """Two trainer processes in one sharded group, each holding the adapter: rank 0 sends
    it to both workers of a TP=2 server, rank 1 reads its pass and sends nothing."""
    import json
    import socket
    server = wsync_server(backend="sharded", args=["--max-loras", "1", "--timeout", "60", "--tp", "2"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = TWO_RANKS.format(here=os.path.dirname(__file__), url=server.url, port=port)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    stats = [json.loads(next(x for x in out.splitlines() if x.startswith("{"))) for out, _ in outs]
    adapter = wsync.LoraSource(lora_model(seed=3), r=R, alpha=ALPHA, name="math")
    nbytes = sum(t.numel() * t.element_size() for _, t in adapter)
    assert stats[0] == {"bytes": 2 * nbytes, "inline": 1}, stats  # both workers, verified in line
    assert stats[1]["bytes"] == 0, stats
    assert adapter_version(server) == "two-ranks"
    held = post(server, "/weight_checker", {"action": "checksum", "algorithm": "sha256", "lora": "math"})
    assert held["checksums"] == sha256_of(adapter)
