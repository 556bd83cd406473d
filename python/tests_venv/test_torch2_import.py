"""The package on torch 2.x from PyPI: imports in either order and moves a tensor."""
import subprocess
import sys

import torch

import wsync


def test_torch_is_2x_from_the_venv():
    assert int(torch.__version__.split(".")[0]) >= 2
    assert wsync.model_metadata is not None


def test_wsync_imports_before_torch_in_a_fresh_interpreter():
    code = "import wsync, torch; print(torch.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == torch.__version__
