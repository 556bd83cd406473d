"""Failures in a distributed Python trainer end every rank's call within the engine timeout,
named, and the next sync lands."""

import threading
import time

from dist_helpers import (SLACK, TIMEOUT, assert_failed_everywhere, assert_landed, free_port, run_ranks,
                          start_server, stderr_of, write_config)


def test_failures_end_every_rank_and_the_next_sync_lands(tmp_path):
    """Sharded from 2 FSDP2 ranks into a TP=2 server. Step 1: rank 1's source raises after
    its pass: both ranks raise naming it; step 2 lands. Step 3: the server is killed: both
    ranks raise naming it; it restarts on its port and step 4 lands. Then rank 1 dies before
    a sync: rank 0's call ends with a named error, and a fresh pair of ranks lands."""
    model_dir = write_config(tmp_path / "model", dtype="float32")
    port = free_port()
    proc, url = start_server(tmp_path, "server", port, model_dir, 2)
    signals = tmp_path / "signals"
    signals.mkdir()
    try:
        spec = {"backend": "sharded", "servers": [url], "model_dir": model_dir, "source": "dtensor",
                "steps": 5, "backend_options": {"model": model_dir}, "dropped": ["lm_head.weight"],
                "signal_dir": str(signals),
                "faults": {"1": {"raise_rank": 1}, "3": {"wait_file": str(signals / "killed")},
                           "4": {"wait_file": str(signals / "restarted")}}}

        def restart():
            deadline = time.monotonic() + 240
            while not (signals / "done2").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.kill()
            proc.wait()
            (signals / "killed").touch()
            while not (signals / "done3").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            restarted.append(start_server(tmp_path, "server", port, model_dir, 2)[0])
            (signals / "restarted").touch()

        restarted = []
        helper = threading.Thread(target=restart, daemon=True)
        helper.start()
        results, _, logs = run_ranks(spec, tmp_path, world=2, tag="faults")
        helper.join(timeout=60)
        assert_failed_everywhere(results, logs, 1, ["gradient norm check failed"])
        assert_failed_everywhere(results, logs, 3, [url])
        for step in (0, 2, 4):
            for r, lines in enumerate(results):
                line = lines[step]
                assert line["ok"], f"rank {r} step {step}: {line}\n" + stderr_of(logs)
            assert results[0][step]["mismatch"] == {}, results[0][step]

        spec = {"backend": "sharded", "servers": [url], "model_dir": model_dir, "source": "dtensor",
                "steps": 2, "backend_options": {"model": model_dir}, "dropped": ["lm_head.weight"],
                "exit_on_failure": True, "faults": {"1": {"kill_rank": 1}}}
        results, _, logs = run_ranks(spec, tmp_path, world=2, tag="killed")
        assert results[0][0]["ok"], results
        line = results[0][1]
        assert not line["ok"] and line["seconds"] < TIMEOUT + SLACK, line
        # The sharded pass gathers nothing, so the engine's trainer group sees rank 1 go, and
        # its silent heartbeat names it.
        assert line["type"] in ("UnavailableError", "AbortedError", "DeadlineExceededError"), line
        assert "trainer rank 1" in line["message"], line
        spec = dict(spec, steps=1, faults={})
        results, _, logs = run_ranks(spec, tmp_path, world=2, tag="after")
        assert_landed(results, logs, 1)
    finally:
        for p in [proc] + restarted:
            if p.poll() is None:
                p.kill()


def test_a_killed_rank_of_four_is_named_on_every_other_rank(tmp_path):
    """4 FSDP2 ranks into a TP=2 server with sharded: rank 2 dies before sync 1; ranks 0, 1 and
    3 each raise within the engine timeout, naming trainer rank 2."""
    model_dir = write_config(tmp_path / "model", dtype="float32")
    proc, url = start_server(tmp_path, "server", free_port(), model_dir, 2)
    try:
        spec = {"backend": "sharded", "servers": [url], "model_dir": model_dir, "source": "dtensor",
                "steps": 2, "backend_options": {"model": model_dir}, "dropped": ["lm_head.weight"],
                "exit_on_failure": True, "faults": {"1": {"kill_rank": 2}}}
        results, _, logs = run_ranks(spec, tmp_path, world=4, tag="killed4")
        for r in (0, 1, 3):
            assert results[r][0]["ok"], f"rank {r}: {results[r]}\n" + stderr_of(logs)
            line = results[r][1]
            assert not line["ok"] and line["seconds"] < TIMEOUT + SLACK, (r, line)
            assert "trainer rank 2" in line["message"], (r, line)
    finally:
        proc.kill()
