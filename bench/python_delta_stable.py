#!/usr/bin/python3
"""delta from Python: a source that keeps its tensors (read in place) against the same
source hiding that (each tensor copied to staging first), in one run.

  PYTHONPATH=build/python WSYNC_BIN=build/tools/wsync /usr/bin/python3 bench/python_delta_stable.py

MODEL-shaped bf16 arrays (numpy uint16 bits) go through wsync.TrainerEngine(backend=
"delta") into --servers `wsync serve --backend delta` servers, whose base checkpoint is
the first arrays. Each step changes --changed of each tensor's elements, then syncs
both kinds, alternating which goes first: a wsync.TensorListSource (yields_stable_tensors: True) and the
same TensorListSource with yields_stable_tensors False. Per sync: SyncStats.seconds, the
process's CPU seconds around send_weights (of them, kernel time) and its minor page
faults. Prints the medians per kind after --warmup steps, and the ratios.
The last sync is verified: sha256 of every array, computed here, against each server's
POST /weight_checker.
"""

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

import wsync


class Hidden(wsync.TensorListSource):
    """A TensorListSource that does not say it keeps its tensors."""

    yields_stable_tensors = False


def minor_faults():
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def write_base(path, arrays):
    header, offset = {}, 0
    for name, a in arrays:
        header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for _, a in arrays:
            f.write(a.tobytes())


def start_server(wsync_bin, model, base, root, work, i):
    ready = os.path.join(work, f"server{i}.url")
    log = open(os.path.join(work, f"server{i}.log"), "w")
    p = subprocess.Popen([wsync_bin, "serve", "--host", "127.0.0.1", "--port", "0", "--ready-file", ready,
                          "--backend", "delta", "--model", model, "--base-checkpoint", base, "--sync-root", root],
                         stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if p.poll() is not None:
            sys.exit(f"server {i} exited with {p.returncode}: see {log.name}")
        if os.path.exists(ready) and open(ready).read().strip():
            return p, open(ready).read().strip()
        time.sleep(0.1)
    sys.exit(f"server {i} was not ready within 120 s")


def checksums(url):
    req = urllib.request.Request(url + "/weight_checker", data=json.dumps({"action": "checksum",
                                 "algorithm": "sha256"}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["checksums"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", help="registered model")
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--steps", type=int, default=8, help="steps; each syncs both kinds")
    p.add_argument("--warmup", type=int, default=2,
                   help="first steps left out of the medians (the first sync, and staging buffers' first touch)")
    p.add_argument("--changed", type=float, default=0.01, help="fraction of each tensor's elements changed per step")
    p.add_argument("--wsync-bin", default=os.environ.get("WSYNC_BIN", "wsync"))
    args = p.parse_args()

    rng = np.random.default_rng(7)
    metadata = wsync.model_metadata(args.model)
    arrays = [(n, rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)) for n, _, shape in metadata]
    work = tempfile.mkdtemp(prefix="wsync-pydelta-")
    base_dir, root = os.path.join(work, "base"), os.path.join(work, "root")
    os.makedirs(base_dir)
    os.makedirs(root)
    write_base(os.path.join(base_dir, "model.safetensors"), arrays)
    procs, urls = zip(*[start_server(args.wsync_bin, args.model, base_dir, root, work, i)
                        for i in range(args.servers)])
    samples = {"kept": [], "hidden": []}
    try:
        with wsync.TrainerEngine(backend="delta", servers=list(urls), timeout=600,
                                 sync_dir=os.path.join(root, "sync"), base_checkpoint=base_dir) as engine:
            for step in range(args.steps):
                order = ["kept", "hidden"] if step % 2 == 0 else ["hidden", "kept"]
                for kind in order:
                    for _, a in arrays:
                        flat = a.reshape(-1)
                        k = max(1, int(flat.size * args.changed))
                        flat[rng.integers(0, flat.size, size=k)] = rng.integers(0, 1 << 16, size=k, dtype=np.uint16)
                    items = [(n, a, "bfloat16") for n, a in arrays]
                    source = wsync.TensorListSource(items) if kind == "kept" else Hidden(items)
                    t0, faults0 = os.times(), minor_faults()
                    stats = engine.send_weights(source)
                    t1, faults = os.times(), minor_faults() - faults0
                    user, system = t1.user - t0.user, t1.system - t0.system
                    cpu = user + system
                    if step >= args.warmup:
                        samples[kind].append((stats.seconds, cpu))
                    print(f"step {step} {kind:6s}: sync {stats.seconds:.3f} s, cpu {cpu:.3f} s (system {system:.3f} s), "
                          f"{faults} page faults",
                          flush=True)
        want = {n: hashlib.sha256(a.tobytes()).hexdigest() for n, a in arrays}
        for url in urls:
            got = checksums(url)
            bad = [n for n in want if got.get(n) != want[n]]
            if bad:
                sys.exit(f"{url} holds other weights: {bad[:3]}")
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
    med = {k: (statistics.median(s for s, _ in v), statistics.median(c for _, c in v)) for k, v in samples.items()}
    gb = sum(a.nbytes for _, a in arrays) / 1e9
    print(f"{args.model}, {gb:.2f} GB, {args.servers} server(s), {len(samples['kept'])} syncs per kind timed, "
          f"{os.cpu_count()} cpus; verified")
    for k in ("hidden", "kept"):
        print(f"  {k:6s}: sync median {med[k][0]:.3f} s, cpu median {med[k][1]:.3f} s")
    print(f"  hidden/kept: sync {med['hidden'][0] / med['kept'][0]:.3f}x, cpu {med['hidden'][1] / med['kept'][1]:.3f}x")


if __name__ == "__main__":
    main()
