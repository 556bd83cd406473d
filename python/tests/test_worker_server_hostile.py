"""Hostile HTTP input against `python -m wsync.worker_server`: the limits and deadlines of
`wsync serve` (tests/e2e/hostile_http_test.cc), over raw sockets on loopback.

The HTTP server is `wsync serve`'s own, so these check that the front hands every request to it.
Bodies over --max-body-mb are 413 however they arrive, a Content-Length that is not a
non-negative decimal is 400 (the HTTP library's own reply), headers and bodies are cut at their deadlines however slowly
they trickle, stalled connections cost a socket (never /health's time), connections are
capped, request bodies held at once are bounded (503 past the budget), JSON nested deeper
than 64 levels is a 400 naming the field, long text fields are 400 without their value, and
hostile query strings are 400. Deadlines here are about 1 s, so each test takes seconds.
"""

import json
import socket
import time

import pytest

import wsync
from receiver_fixtures import http_json, worker_server  # noqa: F401  (fixture)
from wsync.worker_server import StandInModel, WorkerServer

MIB = 1 << 20


@pytest.fixture
def serve():
    """Factory: serve(**WorkerServer keyword args) -> a started in-process WorkerServer over
    one nccl ReceiverEngine (never initialized: these tests need only its HTTP front)."""
    started = []

    def start(**kwargs):
        kwargs.setdefault("timeout", 5)
        server = WorkerServer([wsync.ReceiverEngine("nccl", timeout=5)],
                              [StandInModel(wsync.model_metadata("qwen3-tiny"))], **kwargs).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def port_of(url):
    return int(url.rsplit(":", 1)[1])


def connect(port):
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def request(method, target, body=b"", headers=(), length=None):
    """The bytes of one HTTP/1.1 request (Content-Length: len(body) unless `length` is given)."""
    head = [f"{method} {target} HTTP/1.1", "Host: 127.0.0.1", *headers]
    if body or length is not None:
        head.append(f"Content-Length: {len(body) if length is None else length}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def read_reply(sock, timeout=5.0):
    """(status, parsed JSON body (its text when it is not JSON), headers dict) of the next
    reply on `sock`; (None, None, {}) when the connection closes (or resets) first."""
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return None, None, {}
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", 0))
        while len(rest) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
    except ConnectionResetError:
        return None, None, {}
    try:
        body = json.loads(rest[:length])
    except ValueError:
        body = rest[:length].decode("latin-1")
    return int(lines[0].split()[1]), body, headers


def exchange(port, data, timeout=5.0):
    """Sends `data` on a new connection; (status, JSON body) of the reply."""
    with connect(port) as s:
        s.sendall(data)
        status, body, _ = read_reply(s, timeout)
        return status, body


def closed_within(sock, seconds):
    """True when the peer closes (or resets) `sock` within `seconds`, reading and dropping
    whatever it sends before."""
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                if not sock.recv(65536):
                    return True
            except socket.timeout:
                return False
    except (ConnectionResetError, BrokenPipeError):
        return True
    return False


def assert_error(reply, status, message):
    got_status, body = reply
    assert got_status == status, reply
    assert set(body["error"]) == {"message", "type", "code"} and body["error"]["code"] == status, body
    assert message in body["error"]["message"], body


def test_a_content_length_that_is_not_a_non_negative_decimal_is_400_at_once(serve):
    port = port_of(serve(max_body_bytes=MIB).url)
    for value in ("-1", "abc", "1e3", "+5", "0x10", "1 2", ""):
        t = time.monotonic()
        with connect(port) as s:
            s.sendall(request("POST", "/update_weight_version", headers=[f"Content-Length: {value}"]) + b"{}")
            status, body, headers = read_reply(s)
            assert closed_within(s, 2), "the connection is closed after the refusal"
        assert time.monotonic() - t < 1.0
        assert status == 400 and "Content-Length" in body, (value, status, body)
        assert headers["connection"] == "close"
    # Two that disagree: the library reads one of them.
    reply = exchange(port, request("POST", "/update_weight_version",
                                   headers=["Content-Length: 2", "Content-Length: 3"]) + b"{}")
    assert reply[0] == 400, reply
    assert http_json(f"http://127.0.0.1:{port}", "/health")[0] == 200


def test_bodies_over_the_limit_are_413_however_they_arrive(serve):
    server = serve(max_body_bytes=MIB)
    port = port_of(server.url)
    message = "body of /update_weights exceeds 1048576 bytes"
    # A huge announced Content-Length: 413 before any of the body is sent.
    for length in (10 ** 12, "9" * 40):
        t = time.monotonic()
        with connect(port) as s:
            s.sendall(request("POST", "/update_weights", length=length) + b'{"upd')
            status, body, _ = read_reply(s)
            assert closed_within(s, 2)
        assert time.monotonic() - t < 1.0
        if isinstance(body, dict):
            assert_error((status, body), 413, message)
        else:  # a Content-Length too long for the library to read is refused by it
            assert status == 413 and "Content-Length" in body, (length, status, body)
    # A little over, announced and sent whole: read, dropped and answered 413.
    reply = exchange(port, request("POST", "/update_weights", b'{"update_info": "' + b"x" * MIB + b'"}'))
    assert_error(reply, 413, message)
    # Chunked: counted as it arrives, 413 at its end.
    with connect(port) as s:
        s.sendall(request("POST", "/update_weights", headers=["Transfer-Encoding: chunked"]))
        piece = b'{"update_info": {"names": ["' + b"x" * (64 << 10)
        for _ in range(24):  # 1.5 MiB
            s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            piece = b"y" * (64 << 10)
        s.sendall(b"0\r\n\r\n")
        assert_error(read_reply(s)[:2], 413, message)
    # A chunked body under the limit is read as any other.
    with connect(port) as s:
        body = b'{"new_version": "chunked-1"}'
        s.sendall(request("POST", "/update_weight_version", headers=["Transfer-Encoding: chunked"]) +
                  b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (5, body[:5], len(body) - 5, body[5:]))
        assert read_reply(s)[:2] == (200, {"success": True, "new_version": "chunked-1"})
    # Encodings are refused before the body is read.
    reply = exchange(port, request("POST", "/update_weights", b"\x1f\x8b", headers=["Content-Encoding: gzip"]))
    assert_error(reply, 415, "/update_weights: Content-Encoding 'gzip' is not accepted")
    assert server.health()["status"] == "ok"


def test_sixty_four_idle_connections_are_cut_at_the_header_deadline_and_health_answers(worker_server):
    server = worker_server("nccl", "--http-header-timeout", "1", "--http-body-timeout", "1", "--max-body-mb", "1")
    port = port_of(server.url)
    opened = time.monotonic()
    conns = []
    for i in range(64):  # 32 send nothing, 16 part of their headers, 16 a head and one byte of a body
        s = connect(port)
        if 32 <= i < 48:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        elif i >= 48:
            s.sendall(request("POST", "/update_weights", length=MIB // 2) + b"{")
        conns.append(s)
    worst = 0.0
    for _ in range(5):
        t = time.monotonic()
        assert http_json(server.url, "/health", timeout=5)[0] == 200
        worst = max(worst, time.monotonic() - t)
    assert worst < 0.5, f"/health took {worst:.3f} s under 64 stalled connections"
    closed_after = []
    for s in conns:
        assert closed_within(s, max(0.1, opened + 4 - time.monotonic())), "a stalled connection stayed open"
        closed_after.append(time.monotonic() - opened)
        s.close()
    print(f"[hostile] /health under 64 stalled connections: worst {worst * 1000:.1f} ms; "
          f"all 64 cut {max(closed_after):.2f} s after they opened (deadlines 1 s)")
    assert max(closed_after) < 3.0
    assert http_json(server.url, "/health")[0] == 200


def test_trickling_headers_and_bodies_are_cut_at_their_deadlines(serve):
    server = serve(max_body_bytes=MIB, header_timeout=1, body_timeout=1)
    port = port_of(server.url)
    # Headers, one byte every 0.1 s: each read is quick, the whole is not.
    with connect(port) as s:
        s.sendall(b"GET /health HTTP/1.1\r\n")
        t = time.monotonic()
        while time.monotonic() - t < 5:
            try:
                s.sendall(b"X")
            except OSError:
                break
            if closed_within(s, 0.1):
                break
        headers_s = time.monotonic() - t
    # A body, one byte every 0.1 s.
    with connect(port) as s:
        s.sendall(request("POST", "/update_weight_version", length=100) + b"{")
        t = time.monotonic()
        while time.monotonic() - t < 5:
            try:
                s.sendall(b" ")
            except OSError:
                break
            if closed_within(s, 0.1):
                break
        body_s = time.monotonic() - t
    # An idle kept-alive connection, after a reply.
    with connect(port) as s:
        s.sendall(request("GET", "/health"))
        assert read_reply(s)[0] == 200
        t = time.monotonic()
        assert closed_within(s, 3)
        idle_s = time.monotonic() - t
    print(f"[hostile] trickled headers cut after {headers_s:.2f} s, trickled body after {body_s:.2f} s, "
          f"idle keep-alive after {idle_s:.2f} s (deadlines 1 s)")
    assert 0.7 < headers_s < 2.0 and 0.7 < body_s < 2.0 and 0.7 < idle_s < 2.0
    assert server.health()["status"] == "ok"


def test_connections_beyond_the_cap_wait_until_one_closes(serve):
    server = serve(max_connections=4, header_timeout=10)
    port = port_of(server.url)
    idle = [connect(port) for _ in range(4)]
    time.sleep(0.3)  # all four accepted
    with connect(port) as s:
        s.sendall(request("GET", "/health"))
        with pytest.raises(socket.timeout):
            read_reply(s, timeout=0.7)  # a fifth connection waits in the listen queue
        idle.pop().close()
        t = time.monotonic()
        status, _, _ = read_reply(s, timeout=3)
        assert status == 200, "a slot freed by a closed connection was not reused"
        assert time.monotonic() - t < 2.0
    for s in idle:
        s.close()


def test_bodies_held_at_once_are_bounded_by_the_budget(serve):
    server = serve(max_body_bytes=MIB, body_budget_bytes=MIB + MIB // 2, body_timeout=10)
    port = port_of(server.url)
    head = b'{"new_version": "held", "pad": "'
    big = head + b"p" * (MIB - len(head) - 2) + b'"}'
    assert len(big) == MIB
    with connect(port) as held:
        held.sendall(request("POST", "/update_weight_version", big[:-1], length=len(big)))
        time.sleep(0.3)  # its bytes are in the budget
        reply = exchange(port, request("POST", "/update_weight_version", big))
        assert_error(reply, 503, f"bytes of request bodies, and this one would pass its budget of {MIB + MIB // 2} bytes")
        held.sendall(big[-1:])
        assert read_reply(held)[:2] == (200, {"success": True, "new_version": "held"})
    assert exchange(port, request("POST", "/update_weight_version", big))[0] == 200


def deep(depth):
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("path,prefix", [
    ("/init_weight_transfer_engine", '{"init_info":'),
    ("/update_weights", '{"update_info":'),
    ("/weight_checker", '{"action":"checksum","baseline":'),
    ("/finish_weight_update", '{"weight_version":'),
    ("/update_weight_version", '{"new_version":'),
    ("/collective_rpc", '{"method":'),
    ("/start_weight_update", '{"unread": "a]\\"[", "padding":'),  # a field no route reads
])
def test_json_nested_100000_deep_is_400_naming_the_field(serve, path, prefix):
    server = serve()
    field = prefix.rsplit('"', 2)[-2]
    t = time.monotonic()
    reply = exchange(port_of(server.url), request("POST", path, (prefix + deep(100000) + "}").encode()))
    took = time.monotonic() - t
    assert_error(reply, 400, f"body of {path}: field '{field}' nests deeper than 64 levels")
    assert reply[1]["error"]["message"] == f"body of {path}: field '{field}' nests deeper than 64 levels"
    assert took < 2.0
    assert server.health()["status"] == "ok"


def test_nesting_up_to_64_levels_is_accepted(serve):
    server = serve()
    ok = json.dumps({"new_version": "v64", "pad": json.loads(deep(63))}).encode()  # the top object is level 1
    assert exchange(port_of(server.url), request("POST", "/update_weight_version", ok))[0] == 200
    too_deep = json.dumps({"new_version": "v65", "pad": json.loads(deep(64))}).encode()
    assert_error(exchange(port_of(server.url), request("POST", "/update_weight_version", too_deep)), 400,
                 "body of /update_weight_version: field 'pad' nests deeper than 64 levels")
    assert http_json(server.url, "/weight_info")[1] == {"weight_version": "v64"}


def test_long_text_fields_are_400_naming_the_field_without_the_value(serve):
    server = serve()
    port = port_of(server.url)
    cases = [
        ("/update_weight_version", {"new_version": "v" * 65536},
         "body of /update_weight_version: field 'new_version' is 65536 bytes, over the limit of 256"),
        ("/finish_weight_update", {"weight_version": "v" * 65536},
         "body of /finish_weight_update: field 'weight_version' is 65536 bytes, over the limit of 256"),
        ("/finish_weight_update", {"weight_version": "\u00e9" * 200},
         "body of /finish_weight_update: field 'weight_version' is 400 bytes, over the limit of 256"),
        ("/weight_checker", {"action": "compare", "algorithm": "sha256", "baseline": {"n": ["00"]}},
         "field 'baseline': the digest of n must be a string, not array"),
        ("/finish_weight_update", {"weight_version": 7},
         "body of /finish_weight_update: field 'weight_version' must be a string, not number"),
        ("/update_weight_version", {"new_version": "\ud800x"},
         "malformed JSON in body of /update_weight_version: [json.exception.parse_error.101]"),
    ]
    for path, body, message in cases:
        reply = exchange(port, request("POST", path, json.dumps(body).encode()))
        assert_error(reply, 400, message)
        assert reply[1]["error"]["message"] == message or message.endswith("]") or "digest" in message
        assert len(json.dumps(reply[1])) < 400, "the refused value is not echoed"
    # The longest accepted, and UTF-8 that is not ASCII, round-trip.
    for version in ("v" * 256, "v\u00e9"):
        assert http_json(server.url, "/update_weight_version", {"new_version": version})[0] == 200
        assert http_json(server.url, "/weight_info")[1] == {"weight_version": version}


def test_hostile_query_strings_are_400(serve):
    server = serve()
    port = port_of(server.url)
    reply = exchange(port, request("POST", "/pause?mode=wait%00"))
    assert_error(reply, 400, "/pause: the request target holds an encoded NUL byte (%00), which no path or query "
                             "value may hold")
    assert http_json(server.url, "/is_paused")[1] == {"is_paused": False}
    reply = exchange(port, request("POST", "/reset_prefix_cache?reset_external=true&reset_running_requests=1%00x"))
    assert_error(reply, 400, "/reset_prefix_cache: the request target holds an encoded NUL byte (%00)")
    assert_error(exchange(port, request("GET", "/health%00x")), 400,
                 "/health: the request target holds an encoded NUL byte (%00)")
    query = "&".join(f"a{i}=1" for i in range(2000))
    assert_error(exchange(port, request("GET", f"/health?{query}")), 400,
                 "/health: the query has 2000 arguments, more than the limit of 64")
    assert_error(exchange(port, request("POST", f"/pause?{query}")), 400, "more than the limit of 64")
    query = "&".join(f"a{i}=1" for i in range(63))
    assert exchange(port, request("POST", f"/pause?mode=keep&{query}"))[0] == 200
    assert http_json(server.url, "/is_paused")[1] == {"is_paused": True}
    # Another method, and a long target, are the router's JSON refusals.
    assert_error(exchange(port, request("PUT", "/health")), 405, "PUT /health: method not allowed; use GET")
    assert_error(exchange(port, b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n"), 404, "no route GET /aaa")


def test_malformed_bodies_are_400_and_escapes_are_read_right(serve):
    server = serve()
    port = port_of(server.url)
    for body, message in [
        (b"{x}", "malformed JSON in body of /update_weight_version"),
        (b'{"new_version": "v"}}', "malformed JSON in body of /update_weight_version"),
        (b'{"new_version": "v"} {}', "malformed JSON in body of /update_weight_version"),
        (b'{"new_version": "v}', "malformed JSON in body of /update_weight_version"),
        (b'{"new_version": ["v"}', "malformed JSON"),
        (b'{"new_version" "v"}', "malformed JSON"),
        (b'{"new_version": "v",}', "malformed JSON"),
        (b'{"new_version": }', "malformed JSON in body of /update_weight_version"),
        (b'{"new_version": "\xff\xfe"}', "malformed JSON in body of /update_weight_version"),
        (b'{"\xff": 1}', "malformed JSON"),
        (b"  ", "malformed JSON"),
        (b"[1]", "body of /update_weight_version must be a JSON object"),
        (b'"v"', "body of /update_weight_version must be a JSON object"),
    ]:
        assert_error(exchange(port, request("POST", "/update_weight_version", body)), 400, message)
    version = 'a"}]\\",[{\\\\'
    body = json.dumps({"pad": ["}", "\\", '"', {"x": "]"}], "new_version": version}).encode()
    assert exchange(port, request("POST", "/update_weight_version", body)) == (
        200, {"success": True, "new_version": version})


def test_update_info_reaches_engines_as_text_or_as_a_value(serve):
    # The package's engines get the field's JSON text as it came; an engine whose
    # receive_weights is its own gets the decoded dict. Either way, JSON that is broken
    # inside the field is a 400.
    class Recording(wsync.ReceiverEngine):
        def receive_weights(self, update_info, load_weights):
            received.append(update_info)

    received = []
    metadata = wsync.model_metadata("qwen3-tiny")
    server = WorkerServer([Recording("nccl", timeout=5)], [StandInModel(metadata)], timeout=5).start()
    try:
        info = {"names": ["a\"]}"], "dtype_names": ["bfloat16"], "shapes": [[2, 3]], "packed": True}
        assert http_json(server.url, "/start_weight_update", {})[0] == 200
        assert http_json(server.url, "/update_weights", {"update_info": info}) == (200, {"message": "Weights updated"})
        assert received == [info]  # the session is still open
        reply = exchange(port_of(server.url), request("POST", "/update_weights", b'{"update_info": {"names": [1,]}}'))
        assert_error(reply, 400, "malformed JSON in body of /update_weights")
    finally:
        server.stop()
    native = serve()
    assert http_json(native.url, "/start_weight_update", {})[0] == 200
    reply = exchange(port_of(native.url), request("POST", "/update_weights", b'{"update_info": {"names": [1,]}}'))
    assert reply[0] == 400 and reply[1]["error"]["type"] == "INVALID_ARGUMENT", reply
    assert_error(exchange(port_of(native.url), request("POST", "/update_weights", b'{"update_info": [1]}')), 400,
                 "field 'update_info': entry 0 must be an object, not number")
