"""A distributed trainer under torchrun: every rank sends its own shards to the servers.

    torchrun --nproc-per-node 2 examples/distributed_trainer.py                # FSDP2
    torchrun --nproc-per-node 4 examples/distributed_trainer.py --source megatron --layout tp2pp2ep1
    torchrun --nproc-per-node 2 examples/distributed_trainer.py --backend nccl  # gather onto rank 0

Runs on the CPU (gloo) with torch 2.x and transformers (the repository's .venv:
`.venv/bin/torchrun`, with PYTHONPATH=build/python). Without --servers, rank 0 starts
--num-servers `wsync serve` processes (from --wsync-bin, each with --tp) on free loopback
ports and tells the other ranks their URLs. The policy is a transformers Qwen3 built from
a tiny config (the same seed on every rank), trained with AdamW on random tokens;
after each step every rank calls send_weights:

  --source dtensor    FSDP2 fully_shard; wsync.DTensorSource(model) describes each rank's
                      shards. With sharded each rank sends the workers the bytes of their
                      slices that lie in its own shards: nothing is gathered.
  --source megatron   a Megatron-style layout (--layout tpXppYepZ): wsync.MegatronSource
                      holds the rank's parameters in the engine's table; this example lays
                      its replicated HF model out into them every step (load_hf), where a
                      real Megatron trainer passes its own parameters (params=...).

--verify makes rank 0 compare every server's /weight_checker sha256 with the full model's.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch
import torch.distributed as dist

import wsync


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--servers", default="", help="comma-separated server URLs; empty: rank 0 starts local ones")
    p.add_argument("--num-servers", type=int, default=2, help="local servers to start without --servers")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size of the local servers")
    p.add_argument("--wsync-bin", default=os.environ.get("WSYNC_BIN", "build/tools/wsync"),
                   help="the wsync binary for local servers (default: $WSYNC_BIN or build/tools/wsync)")
    p.add_argument("--backend", default="sharded", choices=["sharded", "nccl"], help="weight-transfer backend")
    p.add_argument("--source", default="dtensor", choices=["dtensor", "megatron"])
    p.add_argument("--layout", default="tp2pp1ep1", help="Megatron layout over the ranks (--source megatron)")
    p.add_argument("--model", default="", help="config.json dir of the servers' model (default: a tiny Qwen3)")
    p.add_argument("--steps", type=int, default=3, help="training steps, each followed by a sync")
    p.add_argument("--timeout", type=float, default=60.0, help="bound on every wait, seconds")
    p.add_argument("--verify", action="store_true", help="compare every server's sha256 with the model's")
    return p.parse_args()


def tiny_config(directory):
    from transformers import Qwen3Config
    Qwen3Config(architectures=["Qwen3ForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                tie_word_embeddings=True, dtype="bfloat16").save_pretrained(directory)
    return directory


def start_servers(args, model, workdir):
    procs, urls = [], []
    for i in range(args.num_servers):
        ready = os.path.join(workdir, f"server{i}.url")
        log = open(os.path.join(workdir, f"server{i}.log"), "w")
        procs.append(subprocess.Popen([args.wsync_bin, "serve", "--port", "0", "--ready-file", ready,
                                       "--backend", args.backend, "--model", model, "--tp", str(args.tp)],
                                      stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        while not (os.path.exists(ready) and open(ready).read().strip()):
            if procs[-1].poll() is not None or time.monotonic() > deadline:
                sys.exit(f"server {i} did not start; see {log.name}")
            time.sleep(0.05)
        urls.append(open(ready).read().strip())
    return procs, urls


def sha256(t):
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def verify(urls, full, dtype):
    want = {n: sha256(t.to(dtype)) for n, t in full.items() if n != "lm_head.weight"}
    for url in urls:
        req = urllib.request.Request(url + "/weight_checker", method="POST",
                                     headers={"Content-Type": "application/json"},
                                     data=json.dumps({"action": "checksum", "algorithm": "sha256"}).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            got = json.loads(r.read())["checksums"]
        bad = [n for n in want if got.get(n) != want[n]]
        if bad:
            sys.exit(f"{url} differs from the trainer in {len(bad)} tensors, first {bad[0]}")
    return True


def main():
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    workdir = tempfile.mkdtemp(prefix="wsync-dist-example-") if rank == 0 else None
    procs = []
    setup = [None]
    if rank == 0:
        model_dir = args.model or tiny_config(os.path.join(workdir, "model"))
        urls = [u for u in args.servers.split(",") if u]
        if not urls:
            procs, urls = start_servers(args, model_dir, workdir)
        setup = [(model_dir, urls)]
    dist.broadcast_object_list(setup, src=0)
    model_dir, urls = setup[0]
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
        config = AutoConfig.from_pretrained(model_dir)
        torch.manual_seed(0)
        policy = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        options = {"model": model_dir} if args.backend == "sharded" else {}
        # group_port=None: rank 0 picks the trainer group's port and shares it over torch.distributed.
        with wsync.TrainerEngine(backend=args.backend, servers=urls, rank=rank, world_size=world,
                                 timeout=args.timeout, **options) as engine:
            if args.source == "dtensor":
                from torch.distributed.fsdp import fully_shard
                for layer in policy.model.layers:
                    fully_shard(layer)
                fully_shard(policy)
                source = wsync.DTensorSource(policy, dtype=torch.bfloat16)
            else:
                source = wsync.MegatronSource(engine, model_dir, args.layout)
            opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
            for step in range(args.steps):
                data_rank = rank if args.source == "dtensor" else 0  # Megatron here: replicated
                ids = torch.randint(0, config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(
                    step * 1000 + data_rank))
                policy(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                full = None
                if args.verify or args.source == "megatron":
                    full = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t)
                            for n, t in policy.state_dict().items()}
                if args.source == "megatron":
                    source.load_hf({n: t.to(torch.bfloat16) for n, t in full.items()})
                stats = engine.send_weights(source, weight_version=f"step-{step}")
                checked = rank == 0 and args.verify and verify(urls, full, torch.bfloat16)
                print(f"rank {rank} step {step}: sent {stats.bytes} B in {stats.seconds * 1e3:.1f} ms"
                      + (" (verified)" if checked else ""), flush=True)
                dist.barrier()
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=10)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
