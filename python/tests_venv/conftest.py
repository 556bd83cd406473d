"""The fixtures of python/tests/conftest.py (real `wsync serve` processes), for the venv tests."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "wsync_shared_conftest", Path(__file__).resolve().parents[1] / "tests" / "conftest.py")
shared = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shared)

wsync_server = shared.wsync_server
