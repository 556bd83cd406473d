"""`wsync.worker_server` answers the vLLM 0.32 routes it shares with `wsync serve` by the
same rules (docs/protocol.md, "Parity with vLLM 0.32"): list-form update_info (one entry
per worker, exactly the world size), /weight_checker compare needing its baseline (vLLM's
400 and words), sorted mismatches, /reset_prefix_cache flags from the query or the body,
/release_kv_cache_memory known (501: this front has no KV cache),
/shutdown_weight_transfer_engine refused inside a session, and a wrong method 405. Exact
status codes and error bodies, over HTTP on loopback against an in-process server.
"""

import urllib.error
import urllib.request

import pytest

import wsync
from conftest import http_json
from wsync.worker_server import StandInModel, WorkerServer

COMPARE_NEEDS_BASELINE = "action='compare' requires a 'baseline' object"


class Recording(wsync.ReceiverEngine):
    """An engine whose receive_weights is its own: it records the update_info it is given."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.received = []

    def receive_weights(self, update_info, load_weights):
        self.received.append(update_info)


@pytest.fixture
def two_workers():
    metadata = wsync.model_metadata("qwen3-tiny")
    engines = [Recording("nccl", timeout=5), Recording("nccl", timeout=5)]
    server = WorkerServer(engines, [StandInModel(metadata), StandInModel(metadata)], timeout=5).start()
    yield server, engines
    server.stop()


def error(status, code, message):
    return status, {"error": {"message": message, "type": code, "code": status}}


def info(name):
    return {"names": [name], "dtype_names": ["bfloat16"], "shapes": [[2]]}


def test_list_form_update_info_gives_each_worker_its_own_entry(two_workers):
    server, engines = two_workers
    assert http_json(server.url, "/get_world_size") == (200, {"world_size": 2})
    assert http_json(server.url, "/start_weight_update", {})[0] == 200
    reply = http_json(server.url, "/update_weights", {"update_info": [info("a"), info("b")]})
    assert reply == (200, {"message": "Weights updated"})
    assert [e.received for e in engines] == [[info("a")], [info("b")]]
    # The object form still reaches every worker alike.
    assert http_json(server.url, "/update_weights", {"update_info": info("c")})[0] == 200
    assert [e.received[-1] for e in engines] == [info("c"), info("c")]
    assert http_json(server.url, "/finish_weight_update", {})[0] == 200


@pytest.mark.parametrize("update_info, message", [
    ([info("a")], "update_info is a list of 1 entries; vLLM's list form takes one per worker of the deployment, "
                  "indexed by global worker rank, and this one has 2 (/get_world_size)"),
    ([info("a")] * 3, "update_info is a list of 3 entries; vLLM's list form takes one per worker of the "
                      "deployment, indexed by global worker rank, and this one has 2 (/get_world_size)"),
    ([], "update_info is a list of 0 entries; vLLM's list form takes one per worker of the deployment, "
         "indexed by global worker rank, and this one has 2 (/get_world_size)"),
    ([info("a"), [1]], "field 'update_info': entry 1 must be an object, not array"),
    ([info("a"), "x"], "field 'update_info': entry 1 must be an object, not string"),
    (7, "field 'update_info' must be an object or a list of objects, not number"),
])
def test_refused_update_info_lists_are_400_and_reach_no_worker(two_workers, update_info, message):
    server, engines = two_workers
    assert http_json(server.url, "/start_weight_update", {})[0] == 200
    reply = http_json(server.url, "/update_weights", {"update_info": update_info})
    assert reply == error(400, "INVALID_ARGUMENT", message)
    assert [e.received for e in engines] == [[], []]
    # A list of the wrong length ends the session, as a worker's IndexError does in vLLM;
    # a value of the wrong type is a validation error, which leaves it open.
    assert server.health()["session_active"] is not message.startswith("update_info is a list of")


def test_a_list_far_longer_than_the_world_is_refused_without_decoding_it(two_workers):
    server, engines = two_workers
    assert http_json(server.url, "/start_weight_update", {})[0] == 200
    reply = http_json(server.url, "/update_weights", {"update_info": [{}] * 200000})
    assert reply == error(400, "INVALID_ARGUMENT",
                          "update_info is a list of 200000 entries; vLLM's list form takes one per worker of the "
                          "deployment, indexed by global worker rank, and this one has 2 (/get_world_size)")


@pytest.mark.parametrize("body", [
    {"action": "compare"},
    {"action": "compare", "baseline": None},
    {"action": "compare", "algorithm": "sha256"},
    {"action": "compare", "algorithm": "sha256", "baseline": None},
])
def test_compare_without_a_baseline_is_vllms_400(two_workers, body):
    server, _ = two_workers
    assert http_json(server.url, "/weight_checker", body) == error(400, "INVALID_ARGUMENT", COMPARE_NEEDS_BASELINE)


def test_compare_lists_mismatches_sorted_and_checks_baseline_values(two_workers):
    server, _ = two_workers
    status, sums = http_json(server.url, "/weight_checker", {"action": "checksum", "algorithm": "sha256"})
    assert status == 200
    checksums = sums["checksums"]
    same = http_json(server.url, "/weight_checker", {"action": "compare", "algorithm": "sha256",
                                                     "baseline": checksums})
    assert same == (200, {"match": True, "mismatches": []})
    changed = dict(checksums, **{"model.norm.weight": "00", "zz.extra": "00"})
    del changed["model.embed_tokens.weight"]
    reply = http_json(server.url, "/weight_checker", {"action": "compare", "algorithm": "sha256",
                                                      "baseline": changed})
    assert reply == (200, {"match": False,
                           "mismatches": ["model.embed_tokens.weight", "model.norm.weight", "zz.extra"]})
    bad = http_json(server.url, "/weight_checker", {"action": "compare", "algorithm": "sha256",
                                                    "baseline": {"a": 1}})
    assert bad == error(400, "INVALID_ARGUMENT", "field 'baseline': the digest of a must be a string, not number")


def test_reset_prefix_cache_reads_its_flags_from_the_query_or_the_body(two_workers):
    server, _ = two_workers
    ok = (200, {"success": True})
    assert http_json(server.url, "/reset_prefix_cache", {}) == ok
    assert http_json(server.url, "/reset_prefix_cache?reset_running_requests=true", {}) == ok
    assert http_json(server.url, "/reset_prefix_cache", {"reset_running_requests": True}) == ok
    assert http_json(server.url, "/reset_prefix_cache?reset_running_requests=true",
                     {"reset_running_requests": True, "reset_external": False}) == ok
    assert http_json(server.url, "/reset_prefix_cache?reset_running_requests=false",
                     {"reset_running_requests": True}) == error(
        400, "INVALID_ARGUMENT",
        "reset_running_requests is false in the query and true in the body; name it once")
    assert http_json(server.url, "/reset_prefix_cache", {"reset_external": "yes"}) == error(
        400, "INVALID_ARGUMENT", "field 'reset_external' must be a boolean, not string")
    assert http_json(server.url, "/reset_prefix_cache?reset_external=maybe", {}) == error(
        400, "INVALID_ARGUMENT", "query parameter reset_external=maybe is not a boolean")


def test_release_kv_cache_memory_is_a_known_route_this_front_does_not_have(two_workers):
    server, _ = two_workers
    assert http_json(server.url, "/release_kv_cache_memory", {}) == error(
        501, "UNIMPLEMENTED", "/release_kv_cache_memory: wsync.worker_server has no KV cache (it does not generate)")
    assert http_json(server.url, "/weight_info") == (200, {"weight_version": "default"})


def test_shutdown_weight_transfer_engine_refuses_inside_a_session_as_vllm(two_workers):
    server, _ = two_workers
    assert http_json(server.url, "/start_weight_update", {})[0] == 200
    assert http_json(server.url, "/shutdown_weight_transfer_engine", {}) == error(
        409, "FAILED_PRECONDITION", "Cannot release a trainer connection during a weight update")
    assert http_json(server.url, "/finish_weight_update", {})[0] == 200
    assert http_json(server.url, "/shutdown_weight_transfer_engine", {}) == (
        200, {"message": "Weight transfer shut down"})


def test_a_routes_path_under_another_method_is_vllms_405_with_allow(two_workers):
    server, _ = two_workers
    assert http_json(server.url, "/update_weights") == error(
        405, "METHOD_NOT_ALLOWED", "GET /update_weights: method not allowed; use POST")
    assert http_json(server.url, "/weight_info", {}) == error(
        405, "METHOD_NOT_ALLOWED", "POST /weight_info: method not allowed; use GET")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(server.url + "/start_weight_update", timeout=10)
    assert refused.value.code == 405 and refused.value.headers["Allow"] == "POST"
    assert http_json(server.url, "/no_such_route") == error(404, "NOT_FOUND", "no route GET /no_such_route")


def test_workers_whose_models_differ_fail_the_checksum_naming_the_tensors(two_workers):
    server, _ = two_workers
    server.models[1].named_parameters().__next__()[1].fill_(1)  # model.embed_tokens.weight
    assert http_json(server.url, "/weight_checker", {"action": "checksum", "algorithm": "sha256"}) == error(
        500, "DATA_LOSS", "worker 1 differs from worker 0 in model.embed_tokens.weight")
