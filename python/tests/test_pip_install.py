"""`pip install` from the source tree, offline, into a user's virtual environment, packaging
what the current build directory holds (WSYNC_BUILT: no build runs in a tree other tests
use); the installed package imports outside the source tree."""

import os
import subprocess
from pathlib import Path

import pytest

import wsync
from conftest import SOURCE_DIR


def test_pip_install_into_a_venv(tmp_path):
    build_dir = Path(wsync.__file__).resolve().parents[2]
    if not (build_dir / "CMakeCache.txt").exists():
        pytest.skip(f"wsync is not imported from a CMake build tree ({wsync.__file__})")
    venv = tmp_path / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, timeout=120)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["WSYNC_BUILD_DIR"] = str(build_dir)
    env["WSYNC_BUILT"] = "1"
    install = subprocess.run(
        [python, "-m", "pip", "install", "--no-build-isolation", "--no-index", "--no-deps",
         "--disable-pip-version-check", "-q", str(SOURCE_DIR)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert install.returncode == 0, install.stdout + install.stderr

    env.pop("WSYNC_BUILD_DIR")
    env.pop("WSYNC_BUILT")
    check = subprocess.run(
        [python, "-c", "import wsync, sys; print(wsync.__file__); print(sorted(wsync.trainer_backends()));"
                       "print(wsync.TrainerEngine.__doc__.splitlines()[0]);"
                       "print(len(wsync.model_metadata('qwen3-tiny')));"
                       "import importlib.metadata as m, importlib.util as u;"
                       "print([e.value for e in m.entry_points(group='vllm.general_plugins') if e.name == 'wsync']);"
                       "print(u.find_spec('wsync.vllm.worker_engine').origin)"],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert check.returncode == 0, check.stderr
    path, backends, doc, count, plugin, engine = check.stdout.splitlines()
    assert Path(path).is_relative_to(venv), path
    assert {"nccl", "ipc", "delta"} <= set(eval(backends))
    assert "Sends one trainer rank" in doc
    assert int(count) == len(wsync.model_metadata("qwen3-tiny"))
    # vLLM finds the plugin through the installed package's entry point.
    assert eval(plugin) == ["wsync.vllm:register"]
    assert Path(engine).is_relative_to(venv), engine
