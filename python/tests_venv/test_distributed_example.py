"""examples/distributed_trainer.py under torchrun with 2 CPU ranks: FSDP2 into 2 TP=2 servers
with sharded, every step verified against the servers' sha256 digests by rank 0."""

import os
import socket
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "distributed_trainer.py"


def test_example_runs_under_torchrun(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           str(EXAMPLE), "--steps", "2", "--verify"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("rank ")]
    assert sum("(verified)" in line for line in lines) == 2, out.stdout
    assert sum(line.startswith("rank 1 step") for line in lines) == 2, out.stdout
