#!/usr/bin/python3
"""A SkyRL-shaped RL loop in Python: train a policy a step, then sync its weights into the
inference servers, every step.

    /usr/bin/python3 examples/skyrl_style_loop.py                 # starts 2 local servers
    /usr/bin/python3 examples/skyrl_style_loop.py --servers http://h1:8000,http://h2:8000 \\
        --model /path/to/config_dir

Without --servers it starts `wsync serve` processes itself (from --wsync-bin) on free
loopback ports and stops them at the end. The policy is wsync.toy_model.ToyQwen3: a small
Qwen3-shaped torch module with the Hugging Face names and shapes of --model (a registered
name such as qwen3-tiny, or a config.json directory; by default a tiny float32 config
written to a temp dir), trained with AdamW on random tokens on the CPU. After each step,
`send_weights(StateDictSource(policy))` syncs it and the sync's stats are printed; with
--verify each server's /weight_checker sha256 is compared with the trainer's own.
Run it with Debian's /usr/bin/python3 (it has python3-torch), with the package importable
(PYTHONPATH=build/python, or after `pip install`).
"""

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch

import wsync
from wsync.toy_model import ToyQwen3, write_config


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--servers", default="", help="comma-separated server URLs; empty: start local ones")
    p.add_argument("--num-servers", type=int, default=2, help="local servers to start without --servers")
    p.add_argument("--wsync-bin", default=os.environ.get("WSYNC_BIN", "build/tools/wsync"),
                   help="the wsync binary for local servers (default: $WSYNC_BIN or build/tools/wsync)")
    p.add_argument("--backend", default="nccl", choices=["nccl", "ipc"],
                   help="weight-transfer backend (local servers run it too)")
    p.add_argument("--model", default="", help="registered model name or config.json dir (default: a tiny float32 one)")
    p.add_argument("--steps", type=int, default=5, help="training steps, each followed by a sync")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--bucket-gb", type=float, default=1.0, help="packed buffer size, GB")
    p.add_argument("--timeout", type=float, default=300.0, help="bound on every wait, seconds")
    p.add_argument("--verify", action="store_true", help="compare every server's sha256 with the trainer's")
    return p.parse_args()


def start_servers(args, model, workdir):
    procs, urls = [], []
    for i in range(args.num_servers):
        ready = os.path.join(workdir, f"server{i}.url")
        log = open(os.path.join(workdir, f"server{i}.log"), "w")
        procs.append(subprocess.Popen(
            [args.wsync_bin, "serve", "--port", "0", "--ready-file", ready, "--backend", args.backend,
             "--model", model], stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        while not (os.path.exists(ready) and open(ready).read().strip()):
            if procs[-1].poll() is not None or time.monotonic() > deadline:
                sys.exit(f"server {i} did not start; see {log.name}")
            time.sleep(0.05)
        urls.append(open(ready).read().strip())
    return procs, urls


def server_digests(url):
    req = urllib.request.Request(url + "/weight_checker", method="POST",
                                 data=json.dumps({"action": "checksum", "algorithm": "sha256"}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)["checksums"]


def own_digests(policy):
    out = {}
    for name, t in policy.state_dict().items():
        t = t.detach().contiguous()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        out[name] = hashlib.sha256(t.numpy().tobytes()).hexdigest()
    return out


def main():
    args = parse_args()
    workdir = tempfile.mkdtemp(prefix="wsync-example-")
    model = args.model or write_config(os.path.join(workdir, "model"))
    procs, urls = [], [u for u in args.servers.split(",") if u]
    try:
        if not urls:
            procs, urls = start_servers(args, model, workdir)
        print(f"servers: {', '.join(urls)}")
        policy = ToyQwen3(model, seed=0)
        opt = torch.optim.AdamW(policy.parameters(), lr=args.lr)
        vocab = policy.model.embed_tokens.weight.shape[0]
        with wsync.TrainerEngine(backend=args.backend, servers=urls, bucket_gb=args.bucket_gb,
                                 timeout=args.timeout) as engine:
            engine.init(wsync.StateDictSource(policy))
            for step in range(1, args.steps + 1):
                # SkyRL: generate rollouts with the inference engines, then train on them.
                tokens = torch.randint(0, vocab, (args.batch, args.seq_len))
                loss = policy.loss(tokens)
                opt.zero_grad()
                loss.backward()
                opt.step()
                # SkyRL: broadcast the new policy to the inference engines.
                stats = engine.send_weights(wsync.StateDictSource(policy), weight_version=f"step-{step}")
                line = (f"step {step}: loss {loss.item():.4f}  sync {stats.seconds * 1e3:.1f} ms  "
                        f"{stats.bytes / 1e6:.2f} MB  {stats.tensors} tensors  {stats.chunks} chunks")
                if args.verify:
                    want = own_digests(policy)
                    ok = all(server_digests(u) == want for u in urls)
                    line += f"  verified {'yes' if ok else 'NO'}"
                    if not ok:
                        print(line)
                        return 1
                print(line, flush=True)
        return 0
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
