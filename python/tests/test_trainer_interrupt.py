"""Ctrl-C in a Python trainer mid-sync: it exits with KeyboardInterrupt within about two
seconds, and a new trainer's next sync to the same servers lands, verified."""

import os
import signal
import subprocess
import sys
import time

import wsync
from wsync.toy_model import ToyQwen3
from conftest import assert_servers_hold, sha256_digests

TRAINER = r"""
import sys, time
import wsync
from wsync.toy_model import ToyQwen3

class SlowSource(wsync.StateDictSource):
    def __iter__(self):
        for i, pair in enumerate(super().__iter__()):
            if i == 2:
                print("SYNCING", flush=True)
            time.sleep(0.25)
            yield pair

model = ToyQwen3(sys.argv[1], seed=9)
engine = wsync.TrainerEngine(servers=sys.argv[2].split(","), timeout=60, bucket_gb=0.0001)
try:
    engine.send_weights(SlowSource(model))
except KeyboardInterrupt:
    print("INTERRUPTED", time.monotonic(), flush=True)
    raise
print("FINISHED", flush=True)
"""


def test_sigint_stops_a_slow_sync_and_the_servers_take_the_next(wsync_server, toy_model_dir, tmp_path):
    servers = [wsync_server(backend="nccl", model=toy_model_dir, name=f"dp{i}") for i in range(2)]
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, toy_model_dir, ",".join(s.url for s in servers)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline and "SYNCING" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, f"the trainer ended early: {proc.stderr.read()}"
        assert "SYNCING" in line
        time.sleep(0.3)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)
        ended = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert "INTERRUPTED" in out and "FINISHED" not in out, out + err
    assert "KeyboardInterrupt" in err, err
    assert proc.returncode != 0
    # time.monotonic() is one clock for every process of the host.
    raised = float(out.split("INTERRUPTED", 1)[1].split()[0])
    print(f"KeyboardInterrupt {raised - sent:.3f} s after SIGINT, exit {ended - sent:.3f} s")
    assert raised - sent < 2.0, f"send_weights raised KeyboardInterrupt {raised - sent:.2f} s after SIGINT"
    assert ended - sent < 10.0, f"the trainer took {ended - sent:.2f} s to exit"
    for s in servers:
        h = s.health()
        assert h["session_active"] is False and h["syncs"] == 0, h

    model = ToyQwen3(toy_model_dir, seed=10)
    with wsync.TrainerEngine(servers=[s.url for s in servers], timeout=30, bucket_gb=0.0005) as engine:
        engine.send_weights(wsync.StateDictSource(model), weight_version="after-interrupt")
    assert_servers_hold(servers, sha256_digests(model.state_dict().items()))
