"""examples/skyrl_style_loop.py runs as documented: it starts its servers, trains, syncs
after every step and verifies each sync against its own sha256 digests."""

import os
import subprocess
import sys
from pathlib import Path

import wsync
from conftest import SOURCE_DIR, wsync_bin

EXAMPLE = str(SOURCE_DIR / "examples" / "skyrl_style_loop.py")


def test_example_trains_and_syncs_verified(tmp_path):
    # The example runs from elsewhere, importing this same package.
    env = dict(os.environ, PYTHONPATH=str(Path(wsync.__file__).resolve().parents[1]))
    run = subprocess.run([sys.executable, EXAMPLE, "--steps", "2", "--verify", "--wsync-bin", wsync_bin(),
                          "--bucket-gb", "0.001", "--timeout", "60"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    steps = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all("verified yes" in line for line in steps), run.stdout


def test_example_help():
    run = subprocess.run([sys.executable, EXAMPLE, "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "--servers" in run.stdout and "SkyRL" in run.stdout
