#!/usr/bin/python3
"""The Python trainer path against the C++ one, for the same sync, in one run.

  PYTHONPATH=build/python WSYNC_BIN=build/tools/wsync /usr/bin/python3 bench/python_vs_cpp.py [--json]

1. Broadcast on CPU: two `wsync serve --backend nccl --model MODEL` servers. The C++
   trainer (`wsync push --model MODEL --steps N`) syncs them N times after one warm-up
   sync; then a Python process (a child of this script) builds MODEL-shaped bf16 torch
   tensors (wsync.model_metadata), and wsync.TrainerEngine syncs the same servers N times
   after one warm-up. Per-sync time is SyncStats.seconds on both sides (start ..
   finish_weight_update; `wsync push` prints the same field); the Python side's wall time
   around send_weights is reported too. Median, min..max, ratio Python/C++.
2. Peak RSS of the Python trainer: its VmRSS once the tensors exist, before the engine
   does, then the peak (VmHWM, reset through /proc/self/clear_refs "5" at that point, so
   that making the tensors does not count) over the engine's init and syncs. The engine's
   own share, peak minus that baseline, must stay within two packed buffers (2 x the
   packed buffer size, which is the bucket or the largest tensor if that is larger) plus a
   fixed allowance (--fixed-mib) for what does not grow with the model.
   Each path runs --rounds times, alternating C++ and Python, the samples pooled.
3. ipc on one GPU, when torch.cuda is available: `wsync serve --backend ipc --device
   cuda:0`, `wsync push --backend ipc --device cuda:0 --ipc-mode packed|zero_copy`
   against the Python path with CUDA tensors in one flat buffer (packed, and zero-copy
   through StateDictSource-style storage=).

The last Python sync of each part is verified: sha256 of every tensor's bytes, computed
here, against the servers' POST /weight_checker.
"""

import argparse
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ALIGN = 256


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", help="registered model for the CPU broadcast part")
    p.add_argument("--gpu-model", default="qwen3-0.6b", help="registered model for the GPU ipc part")
    p.add_argument("--syncs", type=int, default=5, help="timed syncs per path and round (after one warm-up)")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of C++ then Python (then C++ ...), alternating, samples pooled")
    p.add_argument("--bucket-gb", type=float, default=0.25, help="packed buffer size in GiB, both paths")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any sync or server wait may take")
    p.add_argument("--wsync-bin", default=os.environ.get("WSYNC_BIN", "wsync"), help="the wsync binary ($WSYNC_BIN)")
    p.add_argument("--skip-cpu", action="store_true", help="skip the CPU broadcast part")
    p.add_argument("--skip-gpu", action="store_true", help="skip the GPU ipc part")
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the last Python sync")
    p.add_argument("--fixed-mib", type=float, default=16.0,
                   help="allowance beside the two packed buffers for engine memory that does not grow "
                        "with the model (threads' stacks, the HTTP client, Gloo's pairs)")
    p.add_argument("--json", action="store_true", help="print the results as JSON after the table")
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: run one Python trainer path
    return p.parse_args(argv)


# ---- shared helpers -------------------------------------------------------------------

def proc_status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss():
    """Resets VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def post(url, route, body, timeout):
    req = urllib.request.Request(url + route, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def summary(values):
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


class Servers:
    """`wsync serve` processes on loopback, killed on exit."""

    def __init__(self, args, count, extra):
        self.tmp = tempfile.TemporaryDirectory(prefix="wsync-bench-")
        self.procs, self.urls, self.logs = [], [], []
        try:
            for i in range(count):
                ready = os.path.join(self.tmp.name, f"ready{i}")
                log = open(os.path.join(self.tmp.name, f"serve{i}.log"), "w+")
                self.logs.append(log)
                self.procs.append(subprocess.Popen(
                    [args.wsync_bin, "serve", "--port", "0", "--timeout", str(args.timeout), "--ready-file", ready]
                    + extra, stdout=log, stderr=subprocess.STDOUT))
                deadline = time.monotonic() + 120
                while not (os.path.exists(ready) and os.path.getsize(ready) > 0):
                    if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        raise RuntimeError(f"wsync serve {' '.join(extra)} did not start: {log.read()[-2000:]}")
                    time.sleep(0.05)
                with open(ready) as f:
                    self.urls.append(f.read().strip())
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        for log in self.logs:
            log.close()
        self.tmp.cleanup()


def run_push(args, urls, extra, model):
    """`wsync push` over `urls`: the per-sync seconds of its timed syncs (its sync 0 warms up)."""
    cmd = [args.wsync_bin, "push", "--servers", ",".join(urls), "--model", model, "--steps", str(args.syncs),
           "--bucket-gb", str(args.bucket_gb), "--timeout", str(args.timeout)] + extra
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout * (args.syncs + 2))
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr[-2000:]}")
    rows = []
    for line in r.stdout.splitlines():
        cols = line.split()
        # sync changed bytes(MB) seconds GB/s chunks verified
        if len(cols) == 7 and re.fullmatch(r"\d+", cols[0]):
            rows.append((int(cols[0]), float(cols[3]), int(cols[5])))
    timed = [s for sync, s, _ in rows if sync > 0]
    if len(timed) != args.syncs:
        raise RuntimeError(f"could not read {args.syncs} sync rows from wsync push:\n{r.stdout[-2000:]}")
    return {"seconds": timed, "chunks": rows[-1][2]}


def run_child(args, part, urls, mode=""):
    """The Python path of one part in a fresh process (its own RSS), as JSON."""
    spec = json.dumps({"part": part, "urls": urls, "mode": mode})
    cmd = [sys.executable, os.path.abspath(__file__), "--child", spec, "--syncs", str(args.syncs),
           "--bucket-gb", str(args.bucket_gb), "--timeout", str(args.timeout),
           "--model", args.model, "--gpu-model", args.gpu_model] + (["--no-verify"] if args.no_verify else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout * (args.syncs + 2))
    if r.returncode != 0:
        raise RuntimeError(f"the Python trainer ({part} {mode}) failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---- the Python trainer (child process) -----------------------------------------------

def tensor_digests(pairs):
    import torch
    out = {}
    for name, t in pairs:
        host = t.detach().contiguous().cpu().reshape(-1)
        out[name] = hashlib.sha256(host.view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def make_tensors(metadata, device):
    """MODEL-shaped tensors of random values; on a GPU, views into one flat buffer."""
    import torch
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    gen = torch.Generator(device=device).manual_seed(0)
    flat, offsets, total = None, [], 0
    if device != "cpu":
        for _, dtype, shape in metadata:
            offsets.append(total)
            n = torch.empty((), dtype=dtypes[dtype]).element_size()
            for d in shape:
                n *= d
            total = (total + n + ALIGN - 1) // ALIGN * ALIGN
        flat = torch.empty(total, dtype=torch.uint8, device=device)
    pairs = []
    for i, (name, dtype, shape) in enumerate(metadata):
        if flat is not None:
            n = torch.empty((), dtype=dtypes[dtype]).element_size()
            for d in shape:
                n *= d
            t = flat[offsets[i]:offsets[i] + n].view(dtypes[dtype]).view(tuple(shape))
        else:
            t = torch.empty(tuple(shape), dtype=dtypes[dtype], device=device)
        t.uniform_(-0.05, 0.05, generator=gen)
        pairs.append((name, t))
    return pairs, flat


def child_main(args):
    import torch
    import wsync
    spec = json.loads(args.child)
    gpu = spec["part"] == "gpu_ipc"
    device = "cuda:0" if gpu else "cpu"
    model = args.gpu_model if gpu else args.model
    metadata = wsync.model_metadata(model)
    pairs, flat = make_tensors(metadata, device)
    source = wsync.TensorListSource(pairs, storage=flat)
    baseline = proc_status("VmRSS")  # the tensors exist; the engine does not yet
    reset = reset_peak_rss()  # forget the peak of making the tensors
    options = {"mode": spec["mode"]} if gpu else {}
    engine = wsync.TrainerEngine("ipc" if gpu else "nccl", spec["urls"], device=device, bucket_gb=args.bucket_gb,
                                 timeout=args.timeout, **options)
    after_create = proc_status("VmRSS")
    engine.init(source)
    after_init = proc_status("VmRSS")
    seconds, wall, chunks = [], [], 0
    stats = engine.send_weights(source, weight_version="python-warmup")  # warm-up (first touch, first export)
    with torch.no_grad():
        for i in range(args.syncs):
            for _, t in pairs:
                t.add_(1e-3)  # a new step's weights, written in place as a trainer's step does
            if gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            stats = engine.send_weights(source, weight_version=f"python-{i}")
            wall.append(time.perf_counter() - t0)
            seconds.append(stats.seconds)
            chunks = stats.chunks
    peak = proc_status("VmHWM")
    verified = None
    if not args.no_verify:
        want = tensor_digests(pairs)
        verified = all(post(u, "/weight_checker", {"action": "checksum", "algorithm": "sha256"},
                            args.timeout)["checksums"] == want for u in spec["urls"])
    engine.shutdown()
    print(json.dumps({"seconds": seconds, "wall": wall, "chunks": chunks, "rss_baseline": baseline,
                      "rss_after_create": after_create, "rss_after_init": after_init, "rss_peak": peak,
                      "largest_tensor": max(t.numel() * t.element_size() for _, t in pairs), "peak_reset": reset, "verified": verified,
                      "model_bytes": sum(t.numel() * t.element_size() for _, t in pairs)}))


# ---- the parts ------------------------------------------------------------------------

def cpu_part(args):
    with Servers(args, 2, ["--backend", "nccl", "--model", args.model]) as s:
        cpp, py = alternate(args, lambda: run_push(args, s.urls, ["--backend", "nccl"], args.model),
                            lambda: run_child(args, "cpu_nccl", s.urls))
    bucket = int(args.bucket_gb * (1 << 30))
    share = max(r["rss_peak"] - r["rss_baseline"] for r in py["runs"])
    last = py["runs"][-1]
    packed = max(bucket, last["largest_tensor"])  # a packed buffer holds at least the largest tensor
    return {
        "model": args.model, "servers": 2, "bucket_bytes": bucket, "model_bytes": last["model_bytes"],
        "cpp": {**summary(cpp["seconds"]), "chunks": cpp["chunks"]},
        "python": {**summary(py["seconds"]), "chunks": py["chunks"], "wall": summary(py["wall"]),
                   "verified": py["verified"]},
        "rss": {"after_tensors": last["rss_baseline"], "after_create": last["rss_after_create"],
                "after_init": last["rss_after_init"], "peak_during_syncs": last["rss_peak"],
                "engine_share": share, "packed_buffer": packed, "bound": 2 * packed,
                "fixed_allowance": int(args.fixed_mib * (1 << 20)),
                "within_bound": share <= 2 * packed + int(args.fixed_mib * (1 << 20)), "peak_reset": all(r["peak_reset"] for r in py["runs"])},
    }


def alternate(args, cpp_run, py_run):
    """--rounds of C++ then Python, the per-sync samples of each pooled."""
    cpp = {"seconds": [], "chunks": 0}
    py = {"seconds": [], "wall": [], "chunks": 0, "verified": True, "runs": []}
    for _ in range(args.rounds):
        c = cpp_run()
        cpp["seconds"] += c["seconds"]
        cpp["chunks"] = c["chunks"]
        p = py_run()
        py["seconds"] += p["seconds"]
        py["wall"] += p["wall"]
        py["chunks"] = p["chunks"]
        py["verified"] = None if p["verified"] is None else (py["verified"] and p["verified"])
        py["runs"].append(p)
    return cpp, py


def gpu_part(args):
    try:
        import torch
        if not torch.cuda.is_available():
            return {"skipped": "torch.cuda is not available"}
    except ImportError:
        return {"skipped": "torch is not installed"}
    rows = {}
    with Servers(args, 1, ["--backend", "ipc", "--device", "cuda:0", "--model", args.gpu_model]) as s:
        for mode in ("packed", "zero_copy"):
            cpp, py = alternate(
                args, lambda: run_push(args, s.urls, ["--backend", "ipc", "--device", "cuda:0", "--ipc-mode", mode],
                                       args.gpu_model),
                lambda: run_child(args, "gpu_ipc", s.urls, mode))
            rows[mode] = {"cpp": {**summary(cpp["seconds"]), "chunks": cpp["chunks"]},
                          "python": {**summary(py["seconds"]), "chunks": py["chunks"], "wall": summary(py["wall"]),
                                     "verified": py["verified"]},
                          "model_bytes": py["runs"][-1]["model_bytes"]}
    return {"model": args.gpu_model, "modes": rows}


def ms(v):
    return "-" if v is None else f"{v * 1e3:.1f}"


def print_table(results):
    print(f"{'part':<26} {'path':<8} {'median ms':>10} {'min..max ms':>17} {'chunks':>7} {'Py/C++':>7}")
    lines = []
    if "cpu" in results:
        c = results["cpu"]
        lines.append((f"nccl cpu {c['model']} x2", c["cpp"], c["python"]))
    if "gpu" in results and "modes" in results["gpu"]:
        for mode, r in results["gpu"]["modes"].items():
            lines.append((f"ipc cuda:0 {results['gpu']['model']} {mode}", r["cpp"], r["python"]))
    for name, cpp, py in lines:
        ratio = py["median"] / cpp["median"] if cpp["median"] else float("nan")
        print(f"{name:<26} {'C++':<8} {ms(cpp['median']):>10} {ms(cpp['min']) + '..' + ms(cpp['max']):>17} "
              f"{cpp['chunks']:>7}")
        print(f"{'':<26} {'Python':<8} {ms(py['median']):>10} {ms(py['min']) + '..' + ms(py['max']):>17} "
              f"{py['chunks']:>7} {ratio:>7.3f}")
        print(f"{'':<26} {'Py wall':<8} {ms(py['wall']['median']):>10} "
              f"{ms(py['wall']['min']) + '..' + ms(py['wall']['max']):>17}   (verified: {py['verified']})")
    if "cpu" in results:
        r = results["cpu"]["rss"]
        mib = 1 << 20
        print(f"Python trainer RSS: {r['after_tensors'] / mib:.1f} MiB with the tensors, "
              f"{r['after_create'] / mib:.1f} MiB with the engine made, {r['after_init'] / mib:.1f} MiB after init, "
              f"peak {r['peak_during_syncs'] / mib:.1f} MiB over init and syncs: the engine's share "
              f"{r['engine_share'] / mib:.1f} MiB, bound 2 packed buffers of max(bucket, largest tensor) = "
              f"2 x {r['packed_buffer'] / mib:.1f} = {r['bound'] / mib:.1f} MiB, "
              f"{(r['engine_share'] - r['bound']) / mib:+.1f} MiB beside them "
              f"({'within' if r['within_bound'] else 'OVER'} the fixed allowance of {r['fixed_allowance'] / mib:.0f} MiB"
              f"{'' if r['peak_reset'] else '; VmHWM could not be reset, the peak includes making the tensors'})")
    if "gpu" in results and "skipped" in results["gpu"]:
        print(f"ipc on a GPU: skipped ({results['gpu']['skipped']})")


def main():
    args = parse_args()
    if args.child:
        child_main(args)
        return 0
    results = {"syncs": args.syncs, "rounds": args.rounds, "bucket_gb": args.bucket_gb}
    if not args.skip_cpu:
        results["cpu"] = cpu_part(args)
    if not args.skip_gpu:
        results["gpu"] = gpu_part(args)
    print_table(results)
    if args.json:
        print(json.dumps(results, indent=2))
    failed = "cpu" in results and not results["cpu"]["rss"]["within_bound"]
    verified = [results["cpu"]["python"]["verified"]] if "cpu" in results else []
    verified += [r["python"]["verified"] for r in results.get("gpu", {}).get("modes", {}).values()]
    return 1 if failed or False in verified else 0


if __name__ == "__main__":
    sys.exit(main())
