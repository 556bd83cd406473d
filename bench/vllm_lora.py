"""A LoRA adapter into vLLM: the disk path (write a PEFT directory, then vLLM's
/v1/load_lora_adapter with load_inplace) against wsync's in-memory sync, same server.

One vLLM server (CPU, TP=1, --enable-lora --max-lora-rank R, the wsync engine plugin)
holds a Qwen3-shaped model (--model tiny: the plugin tests' sizes; qwen3-0.6b: its
shapes); a rank-R adapter on every attention and MLP projection, random values, is
installed REPEATS times by each path, alternating. Printed: the median and best
seconds of each path over the versions after the first WARMUP (those are printed apart:
the in-memory path's first includes the trainer's init) and their ratio, and the first completion after each version (the
in-memory path builds vLLM's LoRAModel there, the disk path already did in its load);
each version's completion must differ.

  PYTHONPATH=build/python WSYNC_BIN=build/tools/wsync .venv/bin/python bench/vllm_lora.py \
      [--model tiny|qwen3-0.6b] [--r 32] [--repeats 5] [--warmup 1] [--paths disk,memory] [--backend nccl|ipc]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python", "tests_venv"))

import torch  # noqa: E402  (before wsync: see wsync/__init__.py)
import transformers  # noqa: E402

from vllm_server import MODEL_SIZES, PROMPT, VllmServer, request  # noqa: E402

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=512,
                 tie_word_embeddings=True)


def write_model(directory, sizes):
    config = transformers.Qwen3Config(**sizes, torch_dtype="float32", initializer_range=0.3, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(config)
    model = model.to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model.save_pretrained(directory)
    return model


def adapter_state(model, r, seed, scale=1.0):
    """PEFT-named, unscaled A/B tensors for every projection of every decoder layer."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        if len(parts) != 6 or parts[4] not in MODULES:
            continue
        stem = "base_model.model." + name[: -len(".weight")]
        out_dim, in_dim = p.shape
        out[stem + ".lora_A.weight"] = torch.randn(r, in_dim, generator=gen) * scale
        out[stem + ".lora_B.weight"] = torch.randn(out_dim, r, generator=gen) * scale
    return out


def peft_config(r, alpha):
    return {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": MODULES, "bias": "none",
            "use_rslora": False, "task_type": "CAUSAL_LM", "lora_dropout": 0.0}


def load_from_disk(url, name, directory, state, r, alpha, inplace):
    """The disk path: the PEFT directory written, then vLLM loads it. Seconds."""
    from safetensors.torch import save_file
    t0 = time.perf_counter()
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(peft_config(r, alpha), f)
    save_file(state, os.path.join(directory, "adapter_model.safetensors"))
    status, reply = request(url, "/v1/load_lora_adapter",
                            {"lora_name": name, "lora_path": directory, "load_inplace": inplace}, timeout=600)
    seconds = time.perf_counter() - t0
    if status != 200:
        raise RuntimeError(f"/v1/load_lora_adapter answered {status}: {reply}")
    return seconds


def completion(url, model, max_tokens=8):
    status, reply = request(url, "/v1/completions", timeout=600, body={
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
        "return_token_ids": True, "ignore_eos": True})
    if status != 200:
        raise RuntimeError(f"/v1/completions answered {status}: {reply}")
    return reply["choices"][0]["token_ids"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "qwen3-0.6b"], default="tiny")
    p.add_argument("--r", type=int, default=32)
    p.add_argument("--alpha", type=float, default=64.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1,
                   help="first versions of each path left out of the medians (the trainer's init, vLLM's first "
                        "load); printed all the same")
    p.add_argument("--paths", default="disk,memory")
    p.add_argument("--backend", default="nccl", help="the in-memory path's wsync backend: nccl or ipc")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="the in-memory path's packed buffer size, MB (TrainerEngine bucket_gb); default: the engine's")
    p.add_argument("--keep-log", action="store_true")
    args = p.parse_args()
    paths = args.paths.split(",")
    sizes = dict(MODEL_SIZES) if args.model == "tiny" else dict(QWEN3_06B)
    root = tempfile.mkdtemp(prefix="wsync-vllm-lora-")
    t0 = time.perf_counter()
    model = write_model(os.path.join(root, "model"), sizes)
    print(f"model {args.model} written in {time.perf_counter() - t0:.1f} s", flush=True)
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    if args.model != "tiny":
        env["VLLM_CPU_KVCACHE_SPACE"] = "2"
    srv = VllmServer(os.path.join(root, "model"), os.path.join(root, "vllm.log"), extra_env=env,
                     extra_args=["--enable-lora", "--max-lora-rank", str(args.r), "--max-loras", "2",
                                 "--max-cpu-loras", "2"])
    timings = {path: [] for path in paths}
    firsts = {path: [] for path in paths}
    try:
        srv.wait_ready()
        print(f"vLLM started in {srv.start_seconds:.1f} s; log {srv.log_path}", flush=True)
        base = completion(srv.url, srv.model_dir)
        seen = {tuple(base)}
        adapter_bytes = 0
        for n in range(args.repeats):
            for path in paths:
                state = adapter_state(model, args.r, seed=len(paths) * n + paths.index(path) + 1, scale=0.3)
                adapter_bytes = sum(t.numel() * t.element_size() for t in state.values())
                name = f"bench-{path}"
                if path == "disk":
                    s = load_from_disk(srv.url, name, os.path.join(root, f"peft-{n}"), state, args.r, args.alpha,
                                       inplace=n > 0)
                else:
                    s = sync_in_memory(srv.url, name, state, args.r, args.alpha, f"v{n}", args.backend,
                                       args.bucket_mb)
                timings[path].append(s)
                t0 = time.perf_counter()
                got = completion(srv.url, name)
                first = time.perf_counter() - t0
                firsts[path].append(first)
                print(json.dumps({"path": path, "version": n, "seconds": round(s, 4),
                                  "first_completion_s": round(first, 4), "tokens": got}), flush=True)
                seen.add(tuple(got))
        summary = {"model": args.model, "backend": args.backend, "r": args.r, "adapter_bytes": adapter_bytes,
                   "distinct_completions": len(seen)}
        for path, ts in timings.items():
            steady = ts[args.warmup:] or ts
            summary[path] = {"median_s": round(statistics.median(steady), 4), "best_s": round(min(steady), 4),
                             "warmup_s": [round(t, 4) for t in ts[:args.warmup]],
                             "first_completion_median_s": round(statistics.median(firsts[path]), 4)}
        if "disk" in timings and "memory" in timings:
            summary["disk/memory (median)"] = round(summary["disk"]["median_s"] / summary["memory"]["median_s"], 1)
        print(json.dumps(summary), flush=True)
    except BaseException:
        print(srv.log_tail(80), file=sys.stderr)
        raise
    finally:
        srv.stop()


def sync_in_memory(url, name, state, r, alpha, version, backend, bucket_mb=None):
    """wsync's path: a lora session through the plugin (wsync.vllm.lora), the API server
    told the name after the first version. Seconds."""
    import wsync
    from wsync.lora import LoraSource
    source = LoraSource(state, r=r, alpha=alpha, target_modules=MODULES, name=name)
    engine = _ENGINES.get(name)
    if engine is None:
        extra = {} if bucket_mb is None else {"bucket_gb": bucket_mb / 1024}
        engine = _ENGINES[name] = wsync.TrainerEngine(backend=backend, servers=[url], device="cpu", timeout=300.0,
                                                      lora=source, **extra)
    t0 = time.perf_counter()
    stats = engine.send_weights(source, weight_version=version)
    status, workers = request(url, "/collective_rpc", {"method": "wsync_stats"})
    worker = workers["results"][0] if status == 200 else {}
    print(json.dumps({"phases_s": {"start": round(stats.start_seconds, 4),
                                   "transfer": round(stats.transfer_seconds, 4),
                                   "finish": round(stats.finish_seconds, 4),
                                   "worker_receive": round(worker.get("receive_seconds", 0), 4),
                                   "worker_copy_digest": round(worker.get("copy_seconds", 0), 4)}}), flush=True)
    if name not in _REGISTERED:
        status, reply = request(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": f"wsync://{name}"})
        if status != 200:
            raise RuntimeError(f"/v1/load_lora_adapter answered {status}: {reply}")
        _REGISTERED.add(name)
    return time.perf_counter() - t0


_ENGINES = {}
_REGISTERED = set()

if __name__ == "__main__":
    main()
