"""One trainer rank of test_distributed_trainers.py, run as its own process.

``python dist_worker.py RANK SPEC_JSON``: joins a gloo process group of ``spec["world"]``
ranks, builds a transformers Qwen3 (dense or MoE) from ``spec["model_dir"]`` (the same
seed on every rank), shards it (FSDP2 ``fully_shard``, or a Megatron layout of wsync's
table), trains ``spec["steps"]`` AdamW steps and syncs after each, printing one JSON line
per sync: {"ok", "type", "message", "seconds", "mismatch"}. Rank 0 checks every server
after every sync itself (unless ``spec["check_servers"]`` is false: a vLLM server): POST /weight_checker sha256 digests against hashlib digests of
the full model (gathered here with ``full_tensor()``, cast to the servers' dtype).
"""

import datetime
import hashlib
import json
import os
import sys
import time
import urllib.request

import torch
import torch.distributed as dist

import wsync


def checksums(url):
    req = urllib.request.Request(url + "/weight_checker", method="POST",
                                 data=json.dumps({"action": "checksum", "algorithm": "sha256"}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["checksums"]


def digest(t):
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def full_state(model):
    """Every tensor of the model, whole (a test-side all-gather of each DTensor)."""
    out = {}
    for name, t in model.state_dict().items():
        out[name] = t.full_tensor() if hasattr(t, "full_tensor") else t
    return out


def checkpoint_names(full):
    """The test's own cut of transformers 5's fused experts into the checkpoint's per-expert
    tensors ([E, 2I, H] gate then up; [E, H, I] down)."""
    out = {}
    for name, t in full.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = t[e, :half]
                out[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = t[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def build_model(spec):
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(spec["model_dir"])
    torch.manual_seed(1234)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def train_step(model, opt, rank, step, mixed):
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def main():
    rank = int(sys.argv[1])
    spec = json.loads(sys.argv[2])
    world = spec["world"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['torch_port']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=spec.get("torch_timeout", 120)))
    model = build_model(spec)
    servers_dtype = spec.get("servers_dtype", "float32")
    cast = None if servers_dtype == "float32" else getattr(torch, servers_dtype)
    options = dict(spec.get("backend_options", {}))
    engine = wsync.TrainerEngine(backend=spec["backend"], servers=spec["servers"], timeout=spec["timeout"],
                                 rank=rank, world_size=world, bucket_gb=spec.get("bucket_gb", 0.001), **options)
    if spec["source"] == "dtensor":
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        source = wsync.DTensorSource(model, dtype=cast)
    else:
        source = wsync.MegatronSource(engine, spec["model_dir"], spec["layout"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(spec["steps"]):
        # A Megatron-style rank here trains the whole model replicated (every rank the same
        # data) and lays it out into its own parameters with the engine's table.
        train_step(model, opt, 0 if spec["source"] == "megatron" else rank, step, spec.get("mixed", False))
        fault = spec.get("faults", {}).get(str(step), {})
        if fault.get("wait_file"):
            while not os.path.exists(fault["wait_file"]):
                time.sleep(0.02)
        full = full_state(model)  # a collective: every rank
        if fault.get("kill_rank") == rank:
            os._exit(3)
        if spec["source"] == "megatron":
            source.load_hf(full)
        run = source
        if fault.get("raise_rank") == rank:
            run = _Raising(source)
        t0 = time.monotonic()
        out = {"step": step}
        try:
            stats = engine.send_weights(run, weight_version=f"step-{step}")
            out.update(ok=True, bytes=stats.bytes,
                       inline={"digests": stats.inline_digests, "servers": stats.inline_verified_servers,
                               "unverified_servers": stats.inline_unverified_servers,
                               "tensors": stats.inline_verified_tensors})
        except Exception as e:  # reported to the test, which asserts on it
            out.update(ok=False, type=type(e).__name__, message=str(e))
        out["seconds"] = time.monotonic() - t0
        out["mismatch"] = {}
        if rank == 0 and out["ok"] and spec.get("check_servers", True):
            want = {n: digest(t if cast is None or not t.is_floating_point() else t.to(cast))
                    for n, t in checkpoint_names(full).items() if n not in spec.get("dropped", [])}
            bad = {}
            for url in spec["servers"]:
                got = checksums(url)
                differ = sorted(n for n in want if got.get(n) != want[n])
                extra = sorted(set(got) - set(want))
                if differ or extra:
                    bad[url] = {"differ": differ[:3], "extra": extra[:3], "n": len(differ)}
            out["mismatch"] = bad
        if isinstance(source, wsync.DTensorSource):
            out["peak_gather_bytes"] = source.peak_gather_bytes
        print(json.dumps(out), flush=True)
        if rank == 0 and spec.get("signal_dir"):
            open(os.path.join(spec["signal_dir"], f"done{step}"), "w").close()
        if not out["ok"] and spec.get("exit_on_failure"):
            os._exit(0)  # a peer may be gone: no barrier, no teardown
        dist.barrier()
    engine.shutdown()
    dist.destroy_process_group()


class _Raising:
    """The source, but its pass raises once its collectives are through (a check at its end)."""

    def __init__(self, source):
        self._s = source

    def metadata(self):
        return self._s.metadata()

    def without(self, names):
        return _Raising(self._s.without(names))

    def held_names(self):
        return self._s.held_names()

    def held_rows(self):
        return self._s.held_rows()

    def iter_held(self):
        yield from self._s.iter_held()
        raise RuntimeError("this rank's gradient norm check failed after its pass")

    def __iter__(self):
        yield from self._s
        raise RuntimeError("this rank's gradient norm check failed after its pass")


if __name__ == "__main__":
    main()
