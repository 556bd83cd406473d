"""Times the in-memory sync of a LoRA adapter into a real `wsync serve --max-loras`
process: a rank-32 adapter on every attention and MLP projection (q/k/v/o/gate/up/down)
of a model's shapes (default qwen3-0.6b), random values, synced version after version.

    PYTHONPATH=build/python python3 bench/lora_sync.py [--model qwen3-0.6b] [--r 32]
        [--backend nccl|ipc|sharded|delta] [--tp 1] [--syncs 10] [--wsync build/tools/wsync]

Prints one JSON line per sync (its wall time as send_weights measures it and the server's
adapter version afterwards), then a summary line: adapter bytes, median and best seconds,
GB/s. delta: the server's base checkpoint is a sparse file of zeros of the model's
shapes, and the adapter goes through one file below the sync dir per sync. The disk path
this replaces (write a PEFT directory, then vLLM's
/v1/load_lora_adapter) needs vLLM and is measured apart.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy

import wsync
from wsync.lora import LoraSource

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapter_tensors(model, r, seed):
    """PEFT-named A/B matrices (float32 bits as numpy) for every targeted module of `model`."""
    rng = numpy.random.default_rng(seed)
    out = {}
    for name, _, shape in wsync.model_metadata(model):
        parts = name.split(".")
        if len(parts) != 6 or parts[0] != "model" or parts[1] != "layers" or parts[4] not in MODULES:
            continue
        module = name[: -len(".weight")]
        out[f"{module}.lora_A.weight"] = rng.standard_normal((r, shape[1]), dtype=numpy.float32)
        out[f"{module}.lora_B.weight"] = rng.standard_normal((shape[0], r), dtype=numpy.float32)
    return out


SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def zero_checkpoint(model, directory):
    """A safetensors checkpoint of `model`'s tensors, all zeros, as a sparse file."""
    header, offset = {}, 0
    for name, dtype, shape in wsync.model_metadata(model):
        nbytes = int(numpy.prod(shape)) * (4 if dtype == "float32" else 2)
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + offset)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--r", type=int, default=32)
    p.add_argument("--backend", default="nccl")
    p.add_argument("--tp", type=int, default=1, help="the server's TP size (each worker holds the whole adapter)")
    p.add_argument("--syncs", type=int, default=10)
    p.add_argument("--wsync", default=os.environ.get("WSYNC_BIN", "build/tools/wsync"))
    a = p.parse_args()
    tensors = adapter_tensors(a.model, a.r, seed=0)
    adapter = LoraSource(tensors, r=a.r, alpha=2 * a.r, target_modules=MODULES, name="bench")
    nbytes = sum(t.nbytes for t in tensors.values())
    with tempfile.TemporaryDirectory() as tmp:
        ready = os.path.join(tmp, "url")
        extra, options = [], {}
        if a.backend == "sharded":
            options = {"model": a.model}
        if a.backend == "delta":
            zero_checkpoint(a.model, os.path.join(tmp, "base"))
            extra = ["--base-checkpoint", os.path.join(tmp, "base"), "--sync-root", os.path.join(tmp, "shared")]
            options = {"sync_dir": os.path.join(tmp, "shared", "sync")}
        server = subprocess.Popen([a.wsync, "serve", "--port", "0", "--ready-file", ready, "--model", a.model,
                                   "--backend", a.backend, "--max-loras", "1", "--timeout", "600", "--tp", str(a.tp),
                                   *extra],
                                  stdout=subprocess.DEVNULL, stderr=sys.stderr, env=dict(os.environ, TMPDIR=tmp))
        try:
            deadline = time.monotonic() + 600
            while not (os.path.exists(ready) and open(ready).read().strip()):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"server did not start (rc {server.poll()})")
                time.sleep(0.05)
            url = open(ready).read().strip()
            seconds = []
            with wsync.TrainerEngine(backend=a.backend, servers=[url], timeout=600, lora=adapter, **options) as engine:
                for k in range(a.syncs + 1):
                    for t in tensors.values():
                        t += 1e-3  # a new version each sync
                    stats = engine.send_weights(adapter, weight_version=f"v{k}")
                    with urllib.request.urlopen(url + "/health", timeout=60) as r:
                        version = json.loads(r.read())["lora"]["adapters"][0]["version"]
                    print(json.dumps({"sync": k, "seconds": round(stats.seconds, 5), "version": version,
                                      "warmup": k == 0}), flush=True)
                    if k > 0:
                        seconds.append(stats.seconds)
            print(json.dumps({"model": a.model, "r": a.r, "backend": a.backend, "tp": a.tp, "modules": MODULES,
                              "tensors": len(tensors), "bytes": nbytes,
                              "median_seconds": round(statistics.median(seconds), 5),
                              "best_seconds": round(min(seconds), 5),
                              "median_gb_per_s": round(nbytes / statistics.median(seconds) / 1e9, 3)}))
        finally:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
