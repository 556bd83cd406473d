"""The package speaks Python: WSYNC_LOG_LEVEL is honoured, errors say what happened in
Python terms (URLs, argument names, the callback), never a CLI flag."""

import pydoc
import re

import pytest

import wsync
from wsync.toy_model import ToyQwen3
from conftest import run_python

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z-]+")


def assert_no_flag(message):
    assert not FLAG.search(message), f"a CLI flag in a Python message: {message}"


def test_log_level_is_honoured(wsync_server, toy_model_dir):
    server = wsync_server(backend="nccl", model=toy_model_dir)
    code = f"""
import wsync
from wsync.toy_model import ToyQwen3
with wsync.TrainerEngine(servers=[{server.url!r}], timeout=30, bucket_gb=0.0005) as e:
    e.send_weights(wsync.StateDictSource(ToyQwen3({str(toy_model_dir)!r}, seed=1)))
"""
    import os
    debug = run_python(code, env=dict(os.environ, WSYNC_LOG_LEVEL="debug"))
    assert debug.returncode == 0, debug.stderr
    assert re.search(r"\[debug\] \[python pid \d+\] sync of \d+ bytes", debug.stderr), debug.stderr
    quiet = run_python(code, env=dict(os.environ, WSYNC_LOG_LEVEL="warn"))
    assert quiet.returncode == 0, quiet.stderr
    assert "[debug]" not in quiet.stderr and "[info]" not in quiet.stderr, quiet.stderr


def test_dead_server_names_url_and_connection_refused(toy_model_dir):
    url = "http://127.0.0.1:9"
    with wsync.TrainerEngine(servers=[url], timeout=5) as engine:
        with pytest.raises(wsync.UnavailableError) as info:
            engine.init(wsync.model_metadata(toy_model_dir))
    assert url in str(info.value) and "connection refused" in str(info.value), str(info.value)
    assert isinstance(info.value, ConnectionError)


@pytest.mark.parametrize("servers", ["not a url", ["http://127.0.0.1"], ["http://127.0.0.1:99999"],
                                     ["ftp://127.0.0.1:80"]])
def test_malformed_url_is_a_value_error(servers):
    with pytest.raises(ValueError) as info:
        wsync.TrainerEngine(servers=servers)
    assert "malformed" in str(info.value) or "http://" in str(info.value), str(info.value)
    assert_no_flag(str(info.value))


@pytest.mark.parametrize("kwargs", [dict(timeout=0), dict(bucket_gb=-1), dict(servers=[]),
                                    dict(backend="delta"), dict(backend="delta", sync_dir="/tmp/x", max_file_gb=0),
                                    dict(backend="sharded")])
def test_option_errors_name_python_arguments(kwargs):
    kwargs = dict(dict(servers=["http://127.0.0.1:9"]), **kwargs)
    with pytest.raises(ValueError) as info:
        wsync.TrainerEngine(**kwargs)
    assert_no_flag(str(info.value))


def test_raising_progress_callback_is_named(wsync_server, toy_model_dir):
    server = wsync_server(backend="nccl", model=toy_model_dir)

    def progress(p):
        raise KeyError("my dashboard is down")

    model = ToyQwen3(toy_model_dir, seed=2)
    with wsync.TrainerEngine(servers=[server.url], timeout=30, bucket_gb=0.0005, progress=progress) as engine:
        with pytest.raises(wsync.AbortedError) as info:
            engine.send_weights(wsync.StateDictSource(model))
    text = str(info.value)
    assert "progress callback raised KeyError" in text, text
    assert "KeyboardInterrupt" not in text, text
    assert isinstance(info.value.__cause__, KeyError), repr(info.value.__cause__)
    assert server.health()["session_active"] is False


def test_help_lists_every_backend_and_its_options():
    text = pydoc.render_doc(wsync.TrainerEngine, renderer=pydoc.plaintext)
    for backend in wsync.trainer_backends():
        assert f'"{backend}"' in text, backend
    for option in ("sharded", "lookahead", "piece_mb", "sync_dir", "export_kind", "group_port"):
        assert option in text, option
    assert "--backend-option" not in text
