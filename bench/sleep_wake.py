"""Times vLLM-style sleep and wake on a real `wsync serve` process and reports the memory
each step releases, as the server's /health says and as the kernel (host RSS) or
torch.cuda.mem_get_info (device free memory, when the server is on a GPU) measure it.

    python3 bench/sleep_wake.py --model qwen3-8b --device cuda:0 [--wsync build/tools/wsync]

Prints one JSON line per step: the call, its wall time, resident weights, host RSS and,
on a GPU, the device's free memory.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request


def call(url, path, post=True, timeout=600.0):
    req = urllib.request.Request(url + path, data=b"" if post else None, method="POST" if post else "GET")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read().decode()
    return json.loads(text) if text else None


def rss(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return -1


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="ipc")
    p.add_argument("--wsync", default=os.environ.get("WSYNC_BIN", "build/tools/wsync"))
    p.add_argument("--ready-seconds", type=float, default=600)
    a = p.parse_args()
    free = None
    if a.device.startswith("cuda"):
        import torch
        index = int(a.device.split(":")[1])

        def free():
            return torch.cuda.mem_get_info(index)[0]
    with tempfile.TemporaryDirectory() as tmp:
        ready = os.path.join(tmp, "url")
        server = subprocess.Popen([a.wsync, "serve", "--port", "0", "--ready-file", ready, "--model", a.model,
                                   "--device", a.device, "--backend", a.backend, "--offload-dir", tmp,
                                   "--timeout", "600"], stdout=subprocess.DEVNULL, stderr=sys.stderr)
        try:
            deadline = time.monotonic() + a.ready_seconds
            while not (os.path.exists(ready) and open(ready).read().strip()):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"server did not start (rc {server.poll()})")
                time.sleep(0.1)
            url = open(ready).read().strip()
            for path in ["/sleep?level=1", "/wake_up", "/sleep?level=2", "/wake_up?tags=weights",
                         "/wake_up?tags=kv_cache"]:
                started = time.perf_counter()
                call(url, path)
                seconds = time.perf_counter() - started
                mem = call(url, "/health", post=False)["memory"]
                row = {"call": path, "seconds": round(seconds, 4), "weights_bytes": mem["weights_bytes"],
                       "weights_resident_bytes": mem["weights_resident_bytes"], "host_rss_bytes": rss(server.pid)}
                if free:
                    row["device_free_bytes"] = free()
                    row["device_used_bytes"] = mem.get("device_used_bytes")
                print(json.dumps(row), flush=True)
        finally:
            server.terminate()
            server.wait(timeout=60)


if __name__ == "__main__":
    main()
