"""A wsync sync into vLLM (the `wsync` engine plugin) against the same sync into `wsync serve`.

One vLLM server (CPU, TP=1, --weight-transfer-config '{"backend": "wsync"}') and one
`wsync serve` per backend hold the same Qwen3-shaped model; a wsync.TrainerEngine pushes
it REPEATS times to each, per backend (nccl over Gloo, ipc over shared memory, sharded
over Gloo point-to-point: each worker gets only its slices, landed in vLLM's parameters
by name). Printed:
median sync seconds per target, and inside vLLM's worker the share of the receive spent in
the model's load_weights (vLLM's own load cost: fusing, slicing, its layerwise reload).
Into vLLM it pushes twice, with in-line verification on (the default: the trainer hashes
its pass, the workers compare at finish) and off, alternating, and prints both.

  PYTHONPATH=build/python WSYNC_BIN=build/tools/wsync .venv/bin/python bench/vllm_plugin.py
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python", "tests_venv"))

import torch  # noqa: E402,F401  (before wsync: see wsync/__init__.py)
import transformers  # noqa: E402

import wsync  # noqa: E402
from vllm_server import VllmServer, free_port, request  # noqa: E402


def model_of(args, seed):
    config = transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads or args.hidden // 64,
        num_key_value_heads=args.kv_heads or max(1, args.hidden // 128), head_dim=args.head_dim,
        max_position_embeddings=512, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(seed)
    return transformers.Qwen3ForCausalLM(config).eval()


def wsync_serve(model_dir, backend, log):
    port = free_port()
    proc = subprocess.Popen([os.environ.get("WSYNC_BIN", "build/tools/wsync"), "serve", "--model", model_dir,
                             "--backend", backend, "--port", str(port), "--checkpoint", model_dir],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if request(url, "/health", timeout=2)[0] == 200:
                return proc, url
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"wsync serve on {url} did not start")


def push(url, backend, model, repeats, vllm=None, inline_verify=True, model_dir=None):
    seconds, shares, phases = [], [], []
    options = {"model": model_dir} if backend == "sharded" else {}
    with wsync.TrainerEngine(backend=backend, servers=[url], device="cpu", timeout=300.0,
                             inline_verify=inline_verify, **options) as engine:
        engine.send_weights(wsync.StateDictSource(model))  # init and warm-up, not counted
        for _ in range(repeats):
            stats = engine.send_weights(wsync.StateDictSource(model))
            if inline_verify:
                assert stats.inline_verified_servers == 1, stats
            seconds.append(stats.seconds)
            phases.append((stats.start_seconds, stats.transfer_seconds, stats.finish_seconds))
            if vllm is not None:
                w = vllm.worker_stats()[0]
                shares.append((w["load_seconds"], w["receive_seconds"], w["copy_seconds"], w["digest_seconds"]))
    phase = [round(statistics.median(p[i] for p in phases), 3) for i in range(3)]
    print(f"  {backend} into {'vLLM' if vllm else 'wsync serve'} (in-line verify {'on' if inline_verify else 'off'}):"
          f" start/transfer/finish medians {phase} s, sync median {statistics.median(seconds):.3f} s")
    return seconds, shares


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--heads", type=int, default=0, help="attention heads (default hidden/64)")
    p.add_argument("--kv-heads", type=int, default=0, help="KV heads (default hidden/128)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backends", default="nccl,ipc", help="comma-separated: nccl, ipc, sharded")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="wsync-vllm-bench-")
    model = model_of(args, 0)
    model_dir = os.path.join(root, "model")
    model.save_pretrained(model_dir)
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(f"model: {len(model.state_dict())} tensors, {size / 1e6:.1f} MB float32")
    vllm = VllmServer(model_dir, os.path.join(root, "vllm.log"))
    serves = []
    try:
        vllm.wait_ready()
        print(f"vLLM start: {vllm.start_seconds:.1f} s")
        for backend in args.backends.split(","):
            log = open(os.path.join(root, f"serve-{backend}.log"), "w")
            proc, url = wsync_serve(model_dir, backend, log)
            serves.append(proc)
            into_serve, _ = push(url, backend, model, args.repeats, model_dir=model_dir)
            into_vllm, shares = push(vllm.url, backend, model, args.repeats, vllm, model_dir=model_dir)
            push(vllm.url, backend, model, args.repeats, vllm, inline_verify=False, model_dir=model_dir)
            push(vllm.url, backend, model, args.repeats, vllm, inline_verify=True, model_dir=model_dir)
            load = statistics.median(s[0] for s in shares)
            recv = statistics.median(s[1] for s in shares)
            copy = statistics.median(s[2] for s in shares)
            digest = statistics.median(s[3] for s in shares)
            print(f"{backend}: wsync serve {statistics.median(into_serve):.3f} s, vLLM {statistics.median(into_vllm):.3f} s"
                  f" (x{statistics.median(into_vllm) / statistics.median(into_serve):.2f}); in vLLM's worker: receive"
                  f" {recv:.3f} s, load_weights {load:.3f} s ({100 * load / recv:.0f}%), copy {copy:.3f} s,"
                  f" digest {digest:.3f} s")
    finally:
        vllm.stop()
        for proc in serves:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
