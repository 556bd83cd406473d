"""Python `sharded` from DTensor ranks against the C++ `wsync bench sharded`, same fleet shape.

    PYTHONPATH=build/python WSYNC_BIN=build/tools/wsync .venv/bin/python bench/python_distributed.py \\
        --model qwen3-0.6b --ranks 4 --servers 2 --tp 2 --iters 3

Python: --ranks processes (gloo, CPU), each holding only its FSDP-style dim-0 shards of the
model's tensors as DTensors (``DTensor.from_local`` over a CPU mesh: no rank ever builds
the full model), sync with ``wsync.DTensorSource`` through ``TrainerEngine(backend=
"sharded")`` into --servers fresh `wsync serve --backend sharded --tp T` processes: each
rank sends the workers its own rows, nothing is gathered (the run fails if a rank's
largest gather buffer is not 0). Then the same fleet shape and layout from C++: ``wsync
bench sharded --trainer-layout fsdp`` (its trainer ranks are threads of one process, its
FsdpSource all-gathers each tensor on every rank). Printed per side: the median whole sync
over --iters syncs after the first, bytes each rank sent, and for Python each rank's peak
RSS growth during the syncs above its resident state before them (its own shards, torch),
the same from before the engine was built through the first sync (the engine's staging
and the servers' first plan), and its largest gather buffer.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--wsync-bin", default=os.environ.get("WSYNC_BIN", "build/tools/wsync"))
    p.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--spec", default="", help=argparse.SUPPRESS)
    p.add_argument("--skip-cpp", action="store_true", help="run the Python side only")
    p.add_argument("--inline-verify", choices=["on", "off"], default="on",
                   help="the Python ranks' in-line verification (split tensors by row ranges)")
    return p.parse_args()


def rss_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def worker(args):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import wsync
    spec = json.loads(args.spec)
    rank, world = args.worker, args.ranks
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    mesh = init_device_mesh("cpu", (world,))
    state = {}
    g = torch.Generator().manual_seed(rank)
    own = 0
    for name, dtype, shape in wsync.model_metadata(args.model):
        rows = shape[0]
        size = -(-rows // world)
        start = min(rows, rank * size)
        local_shape = (max(0, min(rows, start + size) - start),) + tuple(shape[1:])
        local = torch.empty(local_shape, dtype=getattr(torch, dtype))
        local.copy_(torch.rand(local_shape, generator=g) if local.numel() else local)
        own += local.numel() * local.element_size()
        state[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                         stride=torch.empty(shape, device="meta").stride())
    source = wsync.DTensorSource(state)
    start_rss = rss_bytes("VmRSS")
    start_ok = reset_peak()
    engine = wsync.TrainerEngine(backend="sharded", servers=spec["servers"], rank=rank, world_size=world,
                                 timeout=600, inline_verify=args.inline_verify == "on", model=args.model)
    t0 = time.monotonic()
    engine.init(source)
    init_s = time.monotonic() - t0
    first = engine.send_weights(source, weight_version="warm")
    first_peak = rss_bytes("VmHWM")
    before = rss_bytes("VmRSS")
    peak_ok = reset_peak()
    times, sent, finish, verified = [], 0, [], []
    for i in range(args.iters):
        dist.barrier()
        t0 = time.monotonic()
        stats = engine.send_weights(source, weight_version=f"v{i}")
        times.append(stats.seconds if rank == 0 else time.monotonic() - t0)
        sent = stats.bytes
        if rank == 0:
            finish.append(stats.finish_seconds)
            verified.append((stats.inline_verified_servers, stats.inline_verified_tensors, stats.inline_digests))
    peak = rss_bytes("VmHWM")
    print(json.dumps({"rank": rank, "init_s": init_s, "first_s": first.seconds, "times": times, "bytes": sent,
                      "own_shard_bytes": own, "rss_before": before, "peak_growth": peak - before if peak_ok else None,
                      "first_growth": first_peak - start_rss if start_ok else None,
                      "peak_gather_bytes": source.peak_gather_bytes, "held": len(source.held_names()),
                      "held_rows": len(source.held_rows()), "finish": finish,
                      "verified": verified}), flush=True)
    engine.shutdown()
    dist.destroy_process_group()


def start_servers(args, workdir):
    procs, urls = [], []
    for i in range(args.servers):
        ready = os.path.join(workdir, f"server{i}.url")
        log = open(os.path.join(workdir, f"server{i}.log"), "w")
        procs.append(subprocess.Popen([args.wsync_bin, "serve", "--port", "0", "--ready-file", ready, "--backend",
                                       "sharded", "--model", args.model, "--tp", str(args.tp)],
                                      stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 300
        while not (os.path.exists(ready) and open(ready).read().strip()):
            if procs[-1].poll() is not None or time.monotonic() > deadline:
                sys.exit(f"server {i} did not start; see {log.name}")
            time.sleep(0.1)
        urls.append(open(ready).read().strip())
    return procs, urls


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def main():
    args = parse_args()
    if args.worker >= 0:
        return worker(args)
    import socket
    workdir = tempfile.mkdtemp(prefix="wsync-bench-dist-")
    procs, urls = start_servers(args, workdir)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        spec = json.dumps({"servers": urls, "port": port})
        ranks = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), "--spec", spec, "--model", args.model,
                                   "--ranks", str(args.ranks), "--iters", str(args.iters),
                                   "--inline-verify", args.inline_verify],
                                  stdout=subprocess.PIPE, text=True) for r in range(args.ranks)]
        out = []
        for p in ranks:
            stdout, _ = p.communicate(timeout=1800)
            out += [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)
    out.sort(key=lambda r: r["rank"])
    if len(out) != args.ranks:
        sys.exit(f"only {len(out)} of {args.ranks} ranks reported: {out}")
    workers = args.servers * args.tp
    print(f"python sharded: {args.model}, {args.servers} server(s) x TP={args.tp}, {args.ranks} DTensor ranks")
    print(f"  sync median {median(out[0]['times']):.3f} s (rank 0's whole sync), first {out[0]['first_s']:.3f} s, "
          f"init {out[0]['init_s']:.2f} s; fleet bytes {out[0]['bytes']} ({out[0]['bytes'] / workers / 1e6:.1f} MB "
          f"per worker on average)")
    print(f"  in-line verification {args.inline_verify}: finish median {median(out[0]['finish']):.3f} s; "
          f"(servers, tensors verified, digests sent) per sync {out[0]['verified']}")
    for r in out:
        growth = "n/a" if r["peak_growth"] is None else f"{r['peak_growth'] / 1e6:.1f} MB"
        if r["first_growth"] is not None:
            growth += f" (through init and the first sync, staging included: {r['first_growth'] / 1e6:.1f} MB)"
        sent = "" if r["rank"] == 0 else f", sent {r['bytes'] / 1e6:.1f} MB"
        print(f"  rank {r['rank']}: own shards {r['own_shard_bytes'] / 1e6:.1f} MB, holds {r['held']} tensors "
              f"({r['held_rows']} as rows only){sent}, peak RSS growth during syncs {growth}, largest gather buffer "
              f"{r['peak_gather_bytes'] / 1e6:.1f} MB")
    sys.stdout.flush()
    if any(r["peak_gather_bytes"] for r in out):
        sys.exit("a rank gathered tensors: the sharded pass should send each rank's own rows")
    if not args.skip_cpp:
        cmd = [args.wsync_bin, "bench", "sharded", "--model", args.model, "--servers", str(args.servers), "--tp",
               str(args.tp), "--trainer-ranks", str(args.ranks), "--trainer-layout", "fsdp", "--iters",
               str(args.iters)]
        print("C++: " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
