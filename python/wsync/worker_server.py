"""A vLLM-shaped HTTP front over ReceiverEngine workers and a Python model.

This is the thin adapter a vLLM engine subclass would be: it answers the routes a wsync
trainer calls (vLLM's dev-mode weight-transfer routes plus wsync's ``/health`` and
``/fetch_weights``), hands each payload to every worker's ``ReceiverEngine`` at once, and
lands each received chunk through the worker's model's own ``load_weights``.
``/weight_checker {"action": "checksum"}`` digests the model's parameters by HF name, as
``wsync serve`` does, so a trainer's ``--verify`` checks what the model really holds.

Run it as a process (a stand-in model built from a registered model's tensor list)::

    /usr/bin/python3 -m wsync.worker_server --backend nccl --model qwen3-tiny --port 8001

or in-process over your own models (anything with ``load_weights(iterable of (name,
tensor))`` and ``named_parameters()`` or ``state_dict()``)::

    server = WorkerServer([wsync.ReceiverEngine("nccl")], [model], port=8001)
    server.start()          # serves on a thread; server.url says where
    ...
    server.stop()

What it does not do: generate, sleep/wake, draft models, sharded (TP) parameters, vLLM's
runtime-parameter weight checker (those routes answer 501 naming what is missing). As in
``wsync serve``, a session (start .. finish) with no call for ``session_lease`` seconds
expires, so a trainer that vanished mid-session does not block the next one. Every wait is
bounded by the engines' timeout.

Hostile clients get what ``wsync serve`` gives them (the flags have serve's names):

- size: a body over ``max_body_bytes`` (``--max-body-mb``, 256 MiB) is 413: before any of it
  is read when its Content-Length says so (one up to ``discard_bytes`` over is read and
  dropped first, so that a client that writes its whole body before reading still sees the
  413), or once a chunked body passes it (cut ``discard_bytes`` past it). A Content-Length
  that is not a non-negative decimal is 400, a Content-Encoding other than identity 415.
- time: headers must be complete within ``header_timeout`` (``--http-header-timeout``, 10 s)
  of the connection's start or of its previous reply (an idle kept-alive connection is
  closed then), a body within ``body_timeout`` (``--http-body-timeout``, 30 s) of its
  headers; the connection is cut then, however slowly bytes trickle in (each read waits only
  for what is left of its deadline). A reply not taken within ``body_timeout`` is dropped.
- connections: one thread each, at most ``max_connections`` (``--http-max-connections``,
  1024); beyond that the server stops accepting and new ones wait in the listen queue. A
  stalled connection costs a socket and an idle thread, never another request's time.
- memory: the bodies being read or handled at once hold at most ``body_budget_bytes``
  (default twice the body limit, at least 64 MiB), counted as bytes arrive; a body that
  would pass it is read to its end without being kept and answered 503. A body is parsed
  lazily: one linear pass (numpy, no values built) refuses nesting deeper than 64 levels
  (400 naming the top-level field) and finds the top-level fields; a route decodes only the
  fields it reads, and ``update_info``, ``init_info`` and the ``/fetch_weights`` body go to
  the native engines as the JSON text they came as. Measured with tracemalloc, beyond the
  body itself: one copy of the field handed on plus at most ~24 MiB of scan temporaries
  (1.0x extra for a 256 MiB update_info; the scan takes ~2 s for it, ``json.loads`` 9 s),
  where ``json.loads`` held 5x a real update_info list and 25x ``[{},{},...]``. Each native
  engine then parses its own copy of the text (peak RSS of the whole process for a 64 MiB
  update_info, one worker: 13x a real list, 65x ``[{},...]``; it was 16x and 89x). A field
  no route reads is checked for balanced brackets and closed strings only.
- text: ``weight_version``/``new_version`` at most 256 bytes, names (``method``, digest
  names, baseline names) 1024; longer is 400 naming the field, without echoing the value.
  A request target holding an encoded NUL (``%00``) or more than 64 query arguments is 400.
- error replies are JSON ``{"error": {"message", "type", "code"}}``, the library's own
  protocol refusals (a malformed request line, too many headers, an unknown method) too.
"""

import argparse
import functools
import hashlib
import io
import json
import os
import re
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from wsync import _wsync, errors
from wsync.receiver import ReceiverEngine
from wsync.sources import model_metadata

# Limits and deadlines, as `wsync serve` has them (HttpServerOptions, core/json_limits.h).
MAX_BODY_BYTES = 256 << 20    # bytes; room for MoE update_info lists; 413 above
DISCARD_BYTES = 16 << 20      # bytes read and dropped past the limit to answer 413, then the cut
HEADER_TIMEOUT = 10.0         # seconds for a request's headers (and an idle keep-alive wait)
BODY_TIMEOUT = 30.0           # seconds for a body once its headers are in (256 MiB needs 9 MB/s)
MAX_CONNECTIONS = 1024        # open connections; beyond, new ones wait in the listen queue
MIN_BODY_BUDGET = 64 << 20    # the body budget is twice the body limit, at least this
MAX_JSON_DEPTH = 64           # nesting of arrays and objects; the top-level object is depth 1
MAX_BODY_FIELDS = 1024        # top-level fields of a body (vLLM's have a handful)
MAX_QUERY_ARGS = 64           # query arguments of a request target
MAX_VERSION_BYTES = 256       # weight_version, new_version
MAX_NAME_BYTES = 1024         # tensor names, method names, digest algorithm names

# wsync status code -> HTTP status, as the C++ server maps them (control/http_routes.cc).
_HTTP_STATUS = {
    "INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "NOT_FOUND": 404, "FAILED_PRECONDITION": 409,
    "PAYLOAD_TOO_LARGE": 413, "UNIMPLEMENTED": 501, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
}


class RouteError(Exception):
    """A refusal with its HTTP status and wsync status name."""

    def __init__(self, status, code, message):
        super().__init__(message)
        self.status, self.code = status, code


def _error_of(exc):
    """RouteError for an exception raised while serving a route."""
    if isinstance(exc, RouteError):
        return exc
    if isinstance(exc, errors.Error):
        return RouteError(_HTTP_STATUS.get(exc.code, 500), exc.code, str(exc))
    text = str(exc)
    return RouteError(500, "INTERNAL", f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def tensor_digest(tensor, algorithm):
    """Hex digest of a tensor's bytes (row-major) with `algorithm` ('sha256' or 'xxh3_128')."""
    import torch
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    elif t.dtype == torch.bool or "float8" in str(t.dtype):
        t = t.view(torch.uint8)
    data = t.numpy()
    if algorithm == "sha256":
        return hashlib.sha256(memoryview(data).cast("B")).hexdigest()
    return _wsync._hex_digest(algorithm, data)


def parameters_of(model):
    """{hf_name: tensor} of a model: named_parameters() (and buffers), else state_dict()."""
    if hasattr(model, "named_parameters"):
        out = dict(model.named_parameters())
        if hasattr(model, "named_buffers"):
            out.update(model.named_buffers())
        return out
    return dict(model.state_dict())


class StandInModel:
    """A model holding one zeroed torch tensor per HF tensor of `metadata`, loaded in place.

    ``load_weights`` copies each ``(name, tensor)`` into the tensor of that name (vLLM's
    default weight loader) and returns the names it loaded.
    """

    def __init__(self, metadata, device="cpu"):
        import torch
        self._params = {name: torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
                        for name, dtype, shape in metadata}

    def named_parameters(self):
        return iter(self._params.items())

    def load_weights(self, weights):
        loaded = set()
        for name, tensor in weights:
            param = self._params.get(name)
            if param is None:
                raise KeyError(f"the model has no parameter {name}")
            if tuple(param.shape) != tuple(tensor.shape) or param.dtype != tensor.dtype:
                raise ValueError(f"{name} is {param.dtype} {list(param.shape)} in the model, "
                                 f"the update sends {tensor.dtype} {list(tensor.shape)}")
            param.copy_(tensor)
            loaded.add(name)
        return loaded


class WorkerServer:
    """The HTTP routes over `engines` (one ReceiverEngine per worker, worker_rank 0..N-1)
    and `models` (the model each worker loads into, one per engine).

    Calls that touch the workers (init, update, finish, fetch, checksum) run one at a time;
    another arriving meanwhile gets 409 naming the call in flight. GET routes answer during
    long calls. A session idle (no call in flight) for `session_lease` seconds (default:
    `timeout`; <= 0: never) expires.

    HTTP limits (the module docstring says what each does; defaults are `wsync serve`'s):
    `max_body_bytes` (256 MiB: 413 above), `header_timeout` (10 s for a request's headers or
    an idle keep-alive wait), `body_timeout` (30 s for a body once its headers are in; also
    for a reply to be taken), `max_connections` (1024 open at once; more wait in the listen
    queue), `body_budget_bytes` (bodies held at once, default max(2 x max_body_bytes,
    64 MiB): 503 past it), `discard_bytes` (16 MiB read and dropped past the limit so that
    the client sees its 413; the connection is cut after that).
    """

    def __init__(self, engines, models, *, host="127.0.0.1", port=0, api_key=None, model_name="",
                 timeout=300.0, session_lease=None, max_body_bytes=MAX_BODY_BYTES,
                 header_timeout=HEADER_TIMEOUT, body_timeout=BODY_TIMEOUT, max_connections=MAX_CONNECTIONS,
                 body_budget_bytes=None, discard_bytes=DISCARD_BYTES):
        if len(engines) != len(models) or not engines:
            raise ValueError(f"{len(engines)} engines for {len(models)} models: give one model per engine")
        if header_timeout <= 0 or body_timeout <= 0 or max_connections < 1 or max_body_bytes < 0:
            raise ValueError(f"header_timeout {header_timeout} and body_timeout {body_timeout} must be > 0, "
                             f"max_connections {max_connections} >= 1, max_body_bytes {max_body_bytes} >= 0")
        self.engines, self.models = list(engines), list(models)
        self.model_name, self.api_key, self.timeout = model_name, api_key, float(timeout)
        self.max_body_bytes, self.discard_bytes = int(max_body_bytes), int(discard_bytes)
        self.header_timeout, self.body_timeout = float(header_timeout), float(body_timeout)
        self.body_budget = int(body_budget_bytes if body_budget_bytes is not None
                               else max(2 * self.max_body_bytes, MIN_BODY_BUDGET))
        self._budget_mu = threading.Lock()
        self._body_bytes_held = 0  # GUARDED_BY(_budget_mu): request bodies being read or handled
        self._mu = threading.Lock()
        self._busy = None  # the call in flight
        self._active = False
        self._lease = float(timeout if session_lease is None else session_lease)
        self._last_call = time.monotonic()  # end of the session's last call
        self._expired = 0
        self._touched = False  # an update ran in the current session
        self._consistent = True
        self._version = "default"
        self._syncs = 0
        self._paused = False
        self._httpd = _HttpServer((host, port), _handler_for(self), int(max_connections))
        self._thread = None

    @property
    def url(self):
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self):
        """Serves on a daemon thread; returns at once."""
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="wsync-worker-server",
                                        daemon=True)
        self._thread.start()
        return self

    def serve_forever(self):
        self._httpd.serve_forever()

    def stop(self):
        """Stops serving and shuts every engine down."""
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for engine in self.engines:
            engine.shutdown()

    # ---- request bodies ---------------------------------------------------------------
    def _any_not_native(self, method):
        """Whether some engine takes `method`'s argument as a parsed value, not JSON text."""
        return any(_native_of(engine, method) is None for engine in self.engines)

    def _charge(self, n):
        """Takes n more body bytes from the budget; False (nothing taken) when it would pass it."""
        with self._budget_mu:
            if self._body_bytes_held + n > self.body_budget:
                return False
            self._body_bytes_held += n
            return True

    def _release(self, n):
        if n:
            with self._budget_mu:
                self._body_bytes_held -= n

    def _over_budget(self, path):
        with self._budget_mu:
            held = self._body_bytes_held
        return RouteError(503, "UNAVAILABLE",
                          f"{path}: the server holds {held} bytes of request bodies, and this one would pass its "
                          f"budget of {self.body_budget} bytes (twice the body limit); retry once the calls in "
                          "flight end")

    # ---- state ------------------------------------------------------------------------
    def _expire_idle_session(self):
        """Closes a session idle past its lease (its trainer is gone). Needs self._mu."""
        if (self._active and self._busy is None and self._lease > 0
                and time.monotonic() - self._last_call > self._lease):
            self._active = False
            self._expired += 1
            if self._touched:  # an update landed in a session that never finished
                self._consistent = False

    def _begin(self, what, in_session=None):
        """Holds the workers for `what`; in_session True/False: a session must/must not be open."""
        with self._mu:
            self._expire_idle_session()
            if self._busy is not None:
                raise RouteError(409, "FAILED_PRECONDITION", f"{what}: {self._busy} is in progress")
            if in_session is True and not self._active:
                raise RouteError(409, "FAILED_PRECONDITION",
                                 f"{what}: no weight update is active: call start_weight_update first")
            if in_session is False and self._active:
                raise RouteError(409, "FAILED_PRECONDITION",
                                 f"{what}: a weight update is active: finish it first")
            self._busy = what

    def _end(self):
        with self._mu:
            self._busy = None
            self._last_call = time.monotonic()

    def _on_every_worker(self, what, call):
        """Runs call(i, engine) on every worker at once; raises the first failure."""
        results = [None] * len(self.engines)

        def run(i):
            try:
                results[i] = ("ok", call(i, self.engines[i]))
            except BaseException as e:  # noqa: B902  (handed to the caller's thread)
                results[i] = ("error", e)

        threads = [threading.Thread(target=run, args=(i,), name=f"{what} worker {i}")
                   for i in range(len(self.engines))]
        for t in threads:
            t.start()
        # The engines bound their own waits; this bounds a load_weights that never returns.
        for i, t in enumerate(threads):
            t.join(timeout=self.timeout + 30)
            if t.is_alive():
                raise RouteError(504, "DEADLINE_EXCEEDED",
                                 f"{what}: worker {i} did not finish within {self.timeout + 30:.0f} s")
        for kind, value in results:
            if kind == "error":
                raise value
        return [value for _, value in results]

    # ---- routes -----------------------------------------------------------------------
    def health(self):
        with self._mu:
            self._expire_idle_session()
            return {"status": "ok", "server": "wsync", "frontend": "python", "model": self.model_name,
                    "backend": self.engines[0].backend, "tp": len(self.engines), "dp": 1, "dp_rank": -1,
                    "device": self.engines[0].device, "weight_version": self._version,
                    "syncs": self._syncs, "weights_consistent": self._consistent,
                    "session_active": self._active, "expired_sessions": self._expired}

    def init(self, body, peer):
        info = body.object_text("init_info")
        value = body.get("init_info") if self._any_not_native("init") else None

        def init(i, engine):
            native = _native_of(engine, "init")
            return native.init(info, peer or "") if native else engine.init(value, peer)

        self._begin("init_weight_transfer_engine", in_session=False)
        try:
            self._on_every_worker("init_weight_transfer_engine", init)
        finally:
            self._end()
        return {"message": "Weight transfer initialized"}

    def shutdown_transfer(self):
        """Releases every engine's data plane (vLLM's /shutdown_weight_transfer_engine); a
        later init sets it up again."""
        with self._mu:
            self._expire_idle_session()
            if self._active:  # vLLM's words
                raise RouteError(409, "FAILED_PRECONDITION", "Cannot release a trainer connection during a weight update")
        self._begin("shutdown_weight_transfer_engine", in_session=False)
        try:
            self._on_every_worker("shutdown_weight_transfer_engine", lambda i, engine: engine.shutdown())
        finally:
            self._end()
        return {"message": "Weight transfer shut down"}

    def start_update(self):
        with self._mu:
            self._expire_idle_session()
            if self._active:
                raise RouteError(409, "FAILED_PRECONDITION",
                                 "start_weight_update: a weight update is already active")
            self._active = True
            self._touched = False
            self._last_call = time.monotonic()
        return {"message": "Weight update started"}

    def update(self, body):
        # One object for every worker, or vLLM's list form: one per worker, indexed by
        # global worker rank (here the worker's index: one DP replica).
        n, infos = body.update_infos(len(self.engines))  # JSON texts, handed on as they came
        if infos is None:
            # Past validation, as a worker's IndexError is in vLLM: the session ends.
            with self._mu:
                self._expire_idle_session()
                if self._active and self._busy is None:
                    self._active = False
            raise RouteError(400, "INVALID_ARGUMENT",
                             f"update_info is a list of {n} entries; vLLM's list form takes one per worker of the "
                             f"deployment, indexed by global worker rank, and this one has {len(self.engines)} "
                             "(/get_world_size)")
        values = [None] * len(infos)
        if self._any_not_native("receive_weights"):
            value = body.get("update_info")
            values = value if isinstance(value, list) else [value]
        self._begin("update_weights", in_session=True)

        def receive(i, engine):
            k = i if len(infos) > 1 else 0
            try:
                native = _native_of(engine, "receive_weights")
                if native:
                    native.receive(infos[k], self.models[i].load_weights)
                else:
                    engine.receive_weights(values[k], self.models[i].load_weights)
            except errors.Error:
                raise
            except Exception as e:  # noqa: BLE001  (the model's own exception, reported as such)
                text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                raise RouteError(500, "INTERNAL", f"worker {i}: load_weights raised {text}") from e

        try:
            with self._mu:
                self._touched = True
            self._on_every_worker("update_weights", receive)
        except BaseException:
            with self._mu:
                self._active = False  # a failed update ends the session
                self._consistent = False
            raise
        finally:
            self._end()
        return {"message": "Weights updated"}

    def finish(self, body):
        version = body.string("weight_version", MAX_VERSION_BYTES)
        self._begin("finish_weight_update", in_session=True)
        with self._mu:
            self._active = False
            self._consistent = True
            self._syncs += 1
            if version is not None:
                self._version = version
            self._busy = None
        return {"message": "Weight update finished"}

    def fetch(self, body):
        text = body.text()
        value = body.value() if self._any_not_native("fetch_weights") else None

        def fetch(i, engine):
            native = _native_of(engine, "fetch_weights")
            return json.loads(native.fetch(text)) if native else engine.fetch_weights(value)

        self._begin("fetch_weights")
        try:
            replies = self._on_every_worker("fetch_weights", fetch)
        finally:
            self._end()
        reply = dict(replies[0])
        reply["applied_by_workers"] = sum(int(r.get("applied_by_workers", 0)) for r in replies)
        reply["workers"] = len(replies)
        return reply

    def checksums(self, algorithm):
        self._begin("weight_checker")
        try:
            sums = []
            for model in self.models:
                sums.append({name: tensor_digest(t, algorithm) for name, t in parameters_of(model).items()})
        finally:
            self._end()
        for i, other in enumerate(sums[1:], start=1):
            if other != sums[0]:
                differ = sorted(n for n in set(sums[0]) | set(other) if sums[0].get(n) != other.get(n))
                raise RouteError(500, "DATA_LOSS", f"worker {i} differs from worker 0 in {differ[:3]}")
        return sums[0]

    def weight_checker(self, body):
        # vLLM's rules: `action` is required. A body naming an `algorithm` asks for wsync's
        # digests by HF name; without one it is vLLM's runtime-parameter checker, which this
        # front does not have (its models' parameters are the user's own).
        if "action" not in body:
            raise RouteError(400, "INVALID_ARGUMENT",
                             "weight_checker needs a field 'action' (checksum, reset or compare)")
        action = body.get("action")
        if not isinstance(action, str):
            raise RouteError(400, "INVALID_ARGUMENT", "field 'action' must be a string (checksum, reset or compare)")
        action = body.string("action", MAX_NAME_BYTES)
        if action not in ("checksum", "compare", "reset"):
            raise RouteError(400, "INVALID_ARGUMENT",
                             f"unknown weight_checker action {action!r} (field 'action': checksum, reset or compare)")
        baseline = None
        if body.get("baseline") is not None:
            baseline = body.digests("baseline")
        if action == "compare" and baseline is None:  # vLLM's words and status
            raise RouteError(400, "INVALID_ARGUMENT", "action='compare' requires a 'baseline' object")
        if "algorithm" not in body:
            raise RouteError(501, "UNIMPLEMENTED",
                             f"weight_checker '{action}' without an 'algorithm' is vLLM's runtime-parameter checker, "
                             "which wsync.worker_server does not have; name an 'algorithm' (sha256 or xxh3_128) for "
                             "digests of the model's parameters by HF name")
        if action == "reset":
            raise RouteError(400, "INVALID_ARGUMENT",
                             "weight_checker action 'reset' takes no 'algorithm' (it overwrites runtime parameters)")
        algorithm = body.get("algorithm")
        if not isinstance(algorithm, str):
            raise RouteError(400, "INVALID_ARGUMENT", "field 'algorithm' must be a string (sha256 or xxh3_128)")
        algorithm = body.string("algorithm", MAX_NAME_BYTES)
        if algorithm not in ("sha256", "xxh3_128", "xxh3-128"):
            raise RouteError(400, "INVALID_ARGUMENT",
                             f"field 'algorithm': unknown digest algorithm '{algorithm}' (use sha256 or xxh3_128)")
        sums = self.checksums(algorithm.replace("-", "_"))
        if action == "checksum":
            return {"checksums": sums}
        mismatches = sorted(n for n in sums.keys() | baseline.keys() if sums.get(n) != baseline.get(n))
        return {"match": not mismatches, "mismatches": mismatches}

    def pause(self, query):
        mode = query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            raise RouteError(400, "INVALID_ARGUMENT", f"unknown pause mode '{mode}': use abort, wait or keep")
        with self._mu:
            self._paused = True
        return {"status": "paused"}  # vLLM's reply

    def resume(self):
        with self._mu:
            self._paused = False
        return {"status": "resumed"}

    def reset_prefix_cache(self, query, body):
        # Each flag from the query or the body (a JSON boolean); both naming it differently is a 400.
        for name in ("reset_running_requests", "reset_external"):
            value = query.get(name, "false")
            if value not in ("true", "True", "1", "false", "False", "0"):
                raise RouteError(400, "INVALID_ARGUMENT", f"query parameter {name}={value} is not a boolean")
            in_body = body.get(name)
            if in_body is None:
                continue
            if not isinstance(in_body, bool):
                raise RouteError(400, "INVALID_ARGUMENT",
                                 f"field '{name}' must be a boolean, not {_type_name(in_body)}")
            from_query = value in ("true", "True", "1")
            if name in query and from_query != in_body:
                raise RouteError(400, "INVALID_ARGUMENT",
                                 f"{name} is {str(from_query).lower()} in the query and {str(in_body).lower()} "
                                 "in the body; name it once")
        return {"success": True}  # vLLM's reply; this front keeps no prefix cache

    def server_info(self):
        """What this front can do, under the capability keys `wsync serve` reports."""
        return {"server": "wsync", "frontend": "python", "model": self.model_name, "capabilities": {
            "weight_transfer_backend": self.engines[0].backend, "sleep_mode": False, "generation": False,
            "prefix_caching": False, "runtime_weight_checker": False, "draft_weight_updates": False}}

    @staticmethod
    def unsupported(path, what):
        raise RouteError(501, "UNIMPLEMENTED", f"{path}: wsync.worker_server has no {what}")

    @staticmethod
    def collective_rpc(body):
        if not isinstance(body.get("method"), str) or not body.get("method"):
            raise RouteError(400, "INVALID_ARGUMENT", "collective_rpc needs a string field 'method'")
        method = body.string("method", MAX_NAME_BYTES)
        raise RouteError(501, "UNIMPLEMENTED",
                         f"collective_rpc '{method}': this server dispatches no worker methods by name; it runs "
                         "only its named routes (/init_weight_transfer_engine, /start_weight_update, "
                         "/update_weights, /finish_weight_update, /weight_checker, ...)")

    _GET_ROUTES = frozenset(("/health", "/get_world_size", "/weight_info", "/is_paused", "/is_sleeping",
                             "/server_info"))
    _POST_ROUTES = frozenset((
        "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
        "/fetch_weights", "/weight_checker", "/pause", "/resume", "/reset_prefix_cache", "/update_weight_version",
        "/sleep", "/wake_up", "/release_kv_cache_memory", "/abort_requests", "/v1/completions", "/collective_rpc",
        "/start_draft_weight_update"))

    @classmethod
    def has_route(cls, method, path):
        """Whether `route` answers method+path with anything but 404 (checked before a body is read)."""
        return path in (cls._GET_ROUTES if method == "GET" else cls._POST_ROUTES if method == "POST" else ())

    def route(self, method, path, query, body, peer):
        """(HTTP status, reply dict) of one request; `body` is a _Body."""
        if method == "GET":
            if path == "/health":
                return 200, self.health()
            if path == "/get_world_size":
                return 200, {"world_size": len(self.engines)}
            if path == "/weight_info":
                with self._mu:
                    return 200, {"weight_version": self._version}
            if path == "/is_paused":
                with self._mu:
                    return 200, {"is_paused": self._paused}
            if path == "/is_sleeping":
                return 200, {"is_sleeping": False}  # it never sleeps
            if path == "/server_info":
                return 200, self.server_info()
        elif method == "POST":
            routes = {
                "/init_weight_transfer_engine": lambda: self.init(body, peer),
                "/shutdown_weight_transfer_engine": self.shutdown_transfer,
                "/start_weight_update": self.start_update,
                "/update_weights": lambda: self.update(body),
                "/finish_weight_update": lambda: self.finish(body),
                "/fetch_weights": lambda: self.fetch(body),
                "/weight_checker": lambda: self.weight_checker(body),
                "/pause": lambda: self.pause(query),
                "/resume": self.resume,
                "/reset_prefix_cache": lambda: self.reset_prefix_cache(query, body),
                "/update_weight_version": lambda: self.set_version(body),
                "/sleep": lambda: self.unsupported(path, "sleep mode (its models' memory is their own)"),
                "/wake_up": lambda: self.unsupported(path, "sleep mode (its models' memory is their own)"),
                "/release_kv_cache_memory": lambda: self.unsupported(path, "KV cache (it does not generate)"),
                "/abort_requests": lambda: self.unsupported(path, "requests to abort (it does not generate)"),
                "/v1/completions": lambda: self.unsupported(path, "generation"),
                "/collective_rpc": lambda: self.collective_rpc(body),
            }
            if path == "/start_draft_weight_update":
                raise RouteError(400, "INVALID_ARGUMENT", "this server has no draft model")
            if path in routes:
                return 200, routes[path]()
        raise RouteError(404, "NOT_FOUND", f"no route {method} {path}")

    def set_version(self, body):
        if not isinstance(body.get("new_version"), str):
            raise RouteError(400, "INVALID_ARGUMENT", "field 'new_version' must be a string")
        version = body.string("new_version", MAX_VERSION_BYTES)
        with self._mu:
            self._version = version
        return {"success": True, "new_version": version}


def _native_of(engine, method):
    """The native half of a wsync ReceiverEngine whose `method` is ReceiverEngine's own: it
    takes the JSON text of the request as it came (no Python objects, no re-encoding per
    worker). None for any other engine object, which gets the parsed value."""
    if isinstance(engine, ReceiverEngine) and getattr(type(engine), method) is getattr(ReceiverEngine, method):
        return engine._native
    return None


class _Malformed(ValueError):
    """JSON text whose structure is broken (the reason, for a 400)."""


_NON_SPACE = re.compile(rb"[^ \t\r\n]")
_SCAN_BLOCK = 1 << 20  # bytes per numpy pass: its temporaries are at most ~24 MiB


def _type_name(value):
    """nlohmann's name for a JSON value's type, as `wsync serve`'s messages say it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


@functools.lru_cache(maxsize=None)
def _scan_tables():
    """(marks, steps): by byte value, whether the scan looks at it, and how it moves the nesting."""
    import numpy as np
    marks, steps = np.zeros(256, dtype=np.bool_), np.zeros(256, dtype=np.int8)
    marks[[0x22, 0x5B, 0x5D, 0x7B, 0x7D, 0x2C, 0x3A]] = True
    steps[[0x5B, 0x7B]], steps[[0x5D, 0x7D]] = 1, -1
    return marks, steps


def _last_non_space(arr, start, end):
    """Index after the last non-whitespace byte of arr[start:end] (start when there is none)."""
    import numpy as np
    while end > start:
        lo = max(start, end - (1 << 16))
        a = arr[lo:end]
        hits = np.flatnonzero((a != 32) & (a != 9) & (a != 10) & (a != 13))
        if hits.size:
            return lo + int(hits[-1]) + 1
        end = lo
    return start


def _object_fields(data, what, max_depth=MAX_JSON_DEPTH, max_fields=MAX_BODY_FIELDS):
    """{name: (start, end)}: where the value of each top-level field of the JSON object `data`
    (bytes-like) lies, found in one linear pass that builds no values.

    Strings (and brackets inside them) are skipped; nesting deeper than `max_depth` is a 400
    naming the top-level field whose value is too deep, as `wsync serve` says it ("body of
    /update_weights: field 'update_info' nests deeper than 64 levels"); text that is not an
    object is a 400; broken structure (an unclosed string or bracket, text after the object,
    a field without a name or value) raises _Malformed. Values are not checked beyond that:
    the route that reads a field decodes it. A later duplicate field wins, as in json.loads.
    """
    import numpy as np
    first = _NON_SPACE.search(data)
    if first is None:
        raise _Malformed("it holds no JSON value")
    lead = first.start()
    if data[lead] != 0x7B:  # '{'
        raise RouteError(400, "INVALID_ARGUMENT", f"{what} must be a JSON object")
    text = data
    if b"\\" in data:  # blank escaped backslashes, then escaped quotes: every '"' left opens or closes a string
        text = data.replace(b"\\\\", b"  ").replace(b'\\"', b"  ")
    arr = np.frombuffer(text, dtype=np.uint8)
    marks, steps = _scan_tables()
    seps = []  # offsets of ',' and ':' between the top-level fields
    parity, depth, close_at = 0, 0, -1
    for lo in range(0, len(arr), _SCAN_BLOCK):
        a = arr[lo:lo + _SCAN_BLOCK]
        pos = np.flatnonzero(marks[a])  # the bytes that matter: '"' [ ] { } , :
        if not pos.size:
            continue
        c = a[pos]
        outside = ((np.cumsum(c == 0x22, dtype=np.int32) + parity) & 1) == 0  # False within a string
        step = steps[c] * outside
        level = np.cumsum(step, dtype=np.int32)
        level += depth  # the nesting after each byte
        sep = pos[outside & (level == 1) & ((c == 0x2C) | (c == 0x3A))]
        if len(seps) + sep.size > 2 * max_fields:
            raise RouteError(400, "INVALID_ARGUMENT", f"{what} has more than {max_fields} top-level fields")
        seps.extend((sep + lo).tolist())
        if int(level.max()) > max_depth:
            at = lo + int(pos[np.argmax(level > max_depth)])
            colon = next((p for p in reversed(seps) if p < at and data[p] == 0x3A), -1)
            if colon < 0:
                raise RouteError(400, "INVALID_ARGUMENT", f"{what}: JSON nests deeper than {max_depth} levels")
            before = [p for p in seps if p < colon]
            start = before[-1] + 1 if before else lead + 1
            try:
                name = str(json.loads(bytes(data[start:colon])))[:64]
            except ValueError:
                name = "?"
            raise RouteError(400, "INVALID_ARGUMENT", f"{what}: field '{name}' nests deeper than {max_depth} levels")
        if int(level.min()) < 0:
            raise _Malformed("a ']' or '}' closes nothing")
        if close_at < 0:
            ends = pos[(step == -1) & (level == 0)]
            if ends.size:
                close_at = lo + int(ends[0])
        parity, depth = int(not outside[-1]), int(level[-1])
    if parity:
        raise _Malformed("a string is not closed")
    if depth or close_at < 0:
        raise _Malformed("the object is not closed")
    if _NON_SPACE.search(data, close_at + 1):
        raise _Malformed("text follows the top-level object")
    if not seps:
        if _NON_SPACE.search(data, lead + 1, close_at):
            raise _Malformed("the object holds text that is not a \"name\": value field")
        return {}
    if len(seps) % 2 == 0:
        raise _Malformed("a field has no name, or its value no ':'")
    fields, start = {}, lead + 1
    for k in range(0, len(seps), 2):
        colon = seps[k]
        end = seps[k + 1] if k + 1 < len(seps) else close_at
        if data[colon] != 0x3A or (k + 1 < len(seps) and data[end] != 0x2C):
            raise _Malformed(f"field {k // 2 + 1} is not a \"name\": value pair")
        try:
            name = json.loads(bytes(data[start:colon]))
        except ValueError as e:
            raise _Malformed(f"the name of field {k // 2 + 1}: {e}") from None
        if not isinstance(name, str):
            raise _Malformed(f"the name of field {k // 2 + 1} is not a string")
        value = _NON_SPACE.search(data, colon + 1, end)
        if value is None:
            raise _Malformed(f"field '{name[:64]}' has no value")
        fields[name] = (value.start(), _last_non_space(arr, value.start(), end))
        start = end + 1
    return fields


def _array_items(data, max_items):
    """(n, [(start, end)] of each element) of the JSON array `data` of n elements, whose
    structure the body's scan has checked (strings closed, brackets balanced, depth bounded),
    found in one linear pass that builds no values; the list is None when n > max_items."""
    import numpy as np
    text = data.replace(b"\\\\", b"  ").replace(b'\\"', b"  ") if b"\\" in data else data
    arr = np.frombuffer(text, dtype=np.uint8)
    marks, steps = _scan_tables()
    cuts, n_cuts, parity, depth = [], 0, 0, 0
    for lo in range(0, len(arr), _SCAN_BLOCK):
        a = arr[lo:lo + _SCAN_BLOCK]
        pos = np.flatnonzero(marks[a])
        if not pos.size:
            continue
        c = a[pos]
        outside = ((np.cumsum(c == 0x22, dtype=np.int32) + parity) & 1) == 0
        level = np.cumsum(steps[c] * outside, dtype=np.int32) + depth
        at = pos[outside & (level == 1) & (c == 0x2C)]
        n_cuts += int(at.size)
        if n_cuts < max_items:  # positions are kept only while the list may still fit
            cuts.extend((at + lo).tolist())
        parity, depth = int(not outside[-1]), int(level[-1])
    close = _last_non_space(arr, 0, len(arr)) - 1  # the closing ']'
    if not n_cuts and _NON_SPACE.search(data, 1, close) is None:
        return 0, []  # []
    if n_cuts + 1 > max_items:
        return n_cuts + 1, None
    bounds = [0, *cuts, close]
    items = []
    for a_, b_ in zip(bounds, bounds[1:]):
        first = _NON_SPACE.search(data, a_ + 1, b_)
        if first is None:
            raise RouteError(400, "INVALID_ARGUMENT", "field 'update_info': a list entry is empty")
        items.append((first.start(), _last_non_space(arr, first.start(), b_)))
    return len(items), items


class _Body:
    """A request's JSON object body: its top-level fields located, each decoded only when a
    route reads it (a field no route reads costs nothing beyond the body's own bytes)."""

    def __init__(self, path, data=b""):
        self.what = f"body of {path}"
        self._data = data
        self._fields = {}
        self._decoded = {}
        if data:
            try:
                self._fields = _object_fields(data, self.what)
            except _Malformed as e:
                raise RouteError(400, "INVALID_ARGUMENT", f"malformed JSON in {self.what}: {e}") from None

    def __contains__(self, name):
        return name in self._fields

    def text(self):
        """The whole body (JSON text of an object)."""
        return bytes(self._data) if self._data else b"{}"

    def value(self):
        """The whole body decoded: a dict."""
        return {name: self.get(name) for name in self._fields}

    def raw(self, name):
        """The JSON text of field `name`, or None when absent."""
        span = self._fields.get(name)
        return None if span is None else bytes(memoryview(self._data)[span[0]:span[1]])

    def get(self, name, default=None):
        """Field `name` decoded (default when absent)."""
        if name not in self._fields:
            return default
        if name not in self._decoded:
            try:
                self._decoded[name] = json.loads(self.raw(name))
            except (ValueError, RecursionError) as e:
                raise RouteError(400, "INVALID_ARGUMENT",
                                 f"malformed JSON in {self.what}: field '{name}': {e}") from None
        return self._decoded[name]

    def string(self, name, max_bytes):
        """Field `name` as a str of at most max_bytes of UTF-8, or None when absent or null;
        a 400 naming the field (never echoing the value) otherwise."""
        value = self.get(name)
        if value is None:
            return None
        if not isinstance(value, str):
            raise RouteError(400, "INVALID_ARGUMENT",
                             f"{self.what}: field '{name}' must be a string, not {_type_name(value)}")
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise RouteError(400, "INVALID_ARGUMENT",
                             f"{self.what}: field '{name}' is not valid Unicode text (a lone surrogate)") from None
        if size > max_bytes:
            raise RouteError(400, "INVALID_ARGUMENT",
                             f"{self.what}: field '{name}' is {size} bytes, over the limit of {max_bytes}")
        return value

    def object_text(self, name):
        """The JSON text of field `name`, which must be an object."""
        text = self.raw(name)
        if text is None or text == b"null":
            raise RouteError(400, "INVALID_ARGUMENT", f"missing field '{name}'")
        if not text.startswith(b"{"):
            raise RouteError(400, "INVALID_ARGUMENT", f"field '{name}' must be an object")
        return text

    def update_infos(self, world_size):
        """(n, JSON texts) of field 'update_info': (1, [the object]) when it is one, else
        vLLM's list form of n entries, which must be objects (a 400 otherwise); the texts are
        None unless n is `world_size` (one per worker, by rank). The list is scanned, not
        decoded: a list longer than the world is refused before any entry is built."""
        text = self.object_or_list_text("update_info")
        if text.startswith(b"{"):
            return 1, [text]
        n, items = _array_items(text, world_size)
        if n != world_size:
            return n, None
        texts = []
        for k, (start, end) in enumerate(items):
            item = bytes(memoryview(text)[start:end])
            if not item.startswith(b"{"):
                kind = {0x5B: "array", 0x22: "string", 0x74: "boolean", 0x66: "boolean", 0x6E: "null"}.get(
                    item[0], "number")
                raise RouteError(400, "INVALID_ARGUMENT", f"field 'update_info': entry {k} must be an object, not {kind}")
            texts.append(item)
        return n, texts

    def object_or_list_text(self, name):
        """The JSON text of field `name`, which must be an object or a list."""
        text = self.raw(name)
        if text is None:
            raise RouteError(400, "INVALID_ARGUMENT", f"missing field '{name}'")
        if not text.startswith((b"{", b"[")):
            raise RouteError(400, "INVALID_ARGUMENT", f"field '{name}' must be an object or a list of objects, not "
                                                      f"{_type_name(self.get(name))}")
        return text

    def digests(self, name):
        """Field `name` as {tensor name: digest}: an object of strings, names at most
        MAX_NAME_BYTES, nothing nested (so that decoding it costs a few times its size)."""
        text = self.object_text(name)
        shape = f"field '{name}' must be an object of name: digest"
        try:
            _object_fields(text, f"{self.what}: field '{name}'", max_depth=1, max_fields=len(text))
        except (RouteError, _Malformed):
            raise RouteError(400, "INVALID_ARGUMENT", shape) from None
        value = self.get(name)
        for key, digest in value.items():
            if not isinstance(digest, str):
                raise RouteError(400, "INVALID_ARGUMENT", shape)
            size = len(key.encode("utf-8", "surrogatepass"))
            if size > MAX_NAME_BYTES:
                raise RouteError(400, "INVALID_ARGUMENT", f"{self.what}: field '{name}' has a name of {size} bytes, "
                                                          f"over the limit of {MAX_NAME_BYTES}")
        return value


def _target_refusal(target):
    """Why the request target is refused (400), or "": an encoded NUL would cut a value short
    (`/pause?mode=wait%00x` read as mode=wait), and a query of thousands of arguments costs
    a dict entry each. The same rules as `wsync serve` (HttpRouter::TargetRefusal)."""
    nul = target.find("%00")
    if nul >= 0:
        q = target.find("?")
        if 0 <= q < nul:
            arg = target[target.rfind("&", q, nul) + 1 if target.rfind("&", q, nul) >= 0 else q + 1:]
            where = f" in query parameter '{arg.split('=', 1)[0][:64]}'"
        else:
            where = " in its path"
        return f"the request target holds an encoded NUL byte (%00){where}, which no path or query value may hold"
    q = target.find("?")
    if q >= 0:
        args = 1 + target.count("&", q)
        if args > MAX_QUERY_ARGS:
            return f"the query has {args} arguments, more than the limit of {MAX_QUERY_ARGS}"
    return ""


class _ConnectionCut(Exception):
    """The connection ended, failed or passed its deadline while a request was read: it is
    closed without a reply."""


class _DeadlineReader(io.RawIOBase):
    """A socket's reading end that gives up at an absolute deadline (time.monotonic()
    seconds; None: none), however slowly bytes trickle in: each recv waits only for what is
    left of it, then raises TimeoutError."""

    def __init__(self, sock):
        super().__init__()
        self._sock, self.deadline = sock, None

    def readable(self):
        return True

    def readinto(self, buf):
        if self.deadline is None:
            self._sock.settimeout(None)
        else:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the connection's deadline passed")
            self._sock.settimeout(left)
        return self._sock.recv_into(buf)


class _HttpServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with at most `max_connections` open connections: at the limit it
    stops accepting, and new connections wait in the kernel's listen queue until one closes.
    Connections that end badly (reset, cut at a deadline) are not reported."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address, handler, max_connections):
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def get_request(self):
        # An OSError makes serve_forever poll again (and see shutdown()) without accepting.
        if not self._slots.acquire(timeout=0.2):
            raise OSError("at the limit of open connections")
        try:
            return super().get_request()
        except BaseException:
            self._slots.release()
            raise

    def shutdown_request(self, request):  # once per accepted connection, when it is done
        try:
            super().shutdown_request(request)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


# HTTP status -> wsync status name, for refusals made before a route runs.
_CODE_OF_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED",
                   413: "PAYLOAD_TOO_LARGE",
                   415: "UNSUPPORTED_MEDIA_TYPE", 501: "UNIMPLEMENTED", 503: "UNAVAILABLE"}


def _handler_for(server):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # a reply's head and body go out as two writes

        def setup(self):
            super().setup()
            self.rfile.close()  # the library's reader, replaced by one with deadlines
            self._reader = _DeadlineReader(self.connection)
            self._reader.deadline = time.monotonic() + server.header_timeout
            self.rfile = io.BufferedReader(self._reader, 1 << 16)
            self._expect_100 = False

        def log_message(self, fmt, *args):  # requests are not logged; errors are
            pass

        def handle_expect_100(self):  # "100 Continue" goes out once the head is admitted
            self._expect_100 = True
            return True

        def send_error(self, code, message=None, explain=None):
            # The library's own refusals (a malformed request line, a target over 64 KiB,
            # too many headers, an unknown method) as JSON errors too; the connection closes.
            text = message or self.responses.get(code, ("request refused",))[0]
            self._reply(code, {"error": {"message": text, "type": _CODE_OF_STATUS.get(code, "INVALID_ARGUMENT"),
                                         "code": code}}, close=True)

        def _reply(self, status, body, close=False, allow=None):
            data = json.dumps(body).encode()
            self._reader.deadline = None
            self.connection.settimeout(server.body_timeout)  # for the client to take the reply
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            if allow:
                self.send_header("Allow", allow)
            self.send_header("Content-Length", str(len(data)))
            if close:
                self.send_header("Connection", "close")  # also sets close_connection
            self.end_headers()
            self.wfile.write(data)
            self._reader.deadline = time.monotonic() + server.header_timeout  # the next request's head

        def _framing(self, path):
            """('length', n), ('chunked', None) or ('none', 0): how the body arrives."""
            lengths = self.headers.get_all("Content-Length") or []
            encodings = self.headers.get_all("Transfer-Encoding") or []
            if encodings:
                te = ",".join(encodings).strip().lower()
                if te != "chunked":
                    raise RouteError(400, "INVALID_ARGUMENT",
                                     f"{path}: Transfer-Encoding '{te[:64]}' is not accepted; send chunked or a "
                                     "Content-Length")
                if lengths:
                    raise RouteError(400, "INVALID_ARGUMENT",
                                     f"{path}: both Transfer-Encoding and Content-Length are given")
                return "chunked", None
            if not lengths:
                return "none", 0
            values = {v.strip() for v in lengths}
            value = values.pop()
            if values or not re.fullmatch(r"[0-9]+", value):
                shown = value if not values else ", ".join(sorted({v.strip()[:32] for v in lengths}))
                raise RouteError(400, "INVALID_ARGUMENT",
                                 f"{path}: Content-Length '{shown[:64]}' is not a non-negative decimal number")
            return "length", int(value) if len(value) <= 18 else 1 << 62

        def _pieces(self, kind, length):
            """The body's bytes as they arrive (each read returns what has come), at most 1 MiB at a time."""
            if kind == "length":
                while length:
                    piece = self.rfile.read1(min(length, 1 << 20))
                    if not piece:
                        raise _ConnectionCut("the body ended early")
                    length -= len(piece)
                    yield piece
                return
            while True:  # chunked: size line, data, CRLF; a zero size, trailers, an empty line
                line = self.rfile.readline(1024)
                size = line.split(b";", 1)[0].strip()
                if not line.endswith(b"\n") or not re.fullmatch(rb"[0-9A-Fa-f]{1,16}", size):
                    raise RouteError(400, "INVALID_ARGUMENT", "malformed chunk size line in a chunked body")
                left = int(size, 16)
                if left == 0:
                    for _ in range(64):
                        if self.rfile.readline(8192) in (b"\r\n", b"\n", b""):
                            return
                    raise RouteError(400, "INVALID_ARGUMENT", "more than 64 trailer lines after a chunked body")
                while left:
                    piece = self.rfile.read1(min(left, 1 << 20))
                    if not piece:
                        raise _ConnectionCut("the body ended early")
                    left -= len(piece)
                    yield piece
                if self.rfile.readline(1024) not in (b"\r\n", b"\n"):
                    raise RouteError(400, "INVALID_ARGUMENT", "a chunk of a chunked body does not end with CRLF")

        def _read_body(self, path, kind, length, charged):
            """The body, counted against the limit and the server's budget as it arrives."""
            limit = server.max_body_bytes
            if kind == "length" and length > limit + server.discard_bytes:
                raise RouteError(413, "PAYLOAD_TOO_LARGE", f"body of {path} exceeds {limit} bytes")
            if self._expect_100:
                self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            buf, received, too_large, over_budget = bytearray(), 0, False, False
            try:
                for piece in self._pieces(kind, length):
                    received += len(piece)
                    if received > limit:  # counted, not kept; a body that goes on is cut off
                        too_large, buf = True, bytearray()
                        if received - limit > server.discard_bytes:
                            raise _ConnectionCut("the body ran past the limit")
                    elif not over_budget and server._charge(len(piece)):
                        charged[0] += len(piece)
                        buf += piece
                    else:  # read to its end without being kept, answered 503
                        over_budget, buf = True, bytearray()
                    if too_large or over_budget:
                        server._release(charged[0])
                        charged[0] = 0
            except OSError as e:  # a reset or the body deadline
                raise _ConnectionCut(str(e)) from e
            self._unread = False
            if too_large:
                raise RouteError(413, "PAYLOAD_TOO_LARGE", f"body of {path} exceeds {limit} bytes")
            if over_budget:
                raise server._over_budget(path)
            return buf

        def _handle(self, method):
            self._reader.deadline = time.monotonic() + server.body_timeout  # the head is in
            target = self.path
            path = target.split("?", 1)[0].split("%00", 1)[0]
            self._unread = True
            allow = None  # the Allow header of a 405
            charged = [0]  # body bytes taken from the server's budget
            try:
                try:
                    refusal = _target_refusal(target)
                    if refusal:
                        raise RouteError(400, "INVALID_ARGUMENT", f"{path}: {refusal}")
                    parsed = urllib.parse.urlsplit(target)
                    path = parsed.path
                    query = dict(urllib.parse.parse_qsl(parsed.query, max_num_fields=MAX_QUERY_ARGS))
                    kind, length = self._framing(path)
                    if kind == "none" or length == 0:
                        self._unread = False
                    if server.api_key and path != "/health":
                        if self.headers.get("Authorization") != f"Bearer {server.api_key}":
                            raise RouteError(401, "UNAUTHENTICATED",
                                             f"{path} needs 'Authorization: Bearer <api key>'")
                    if not server.has_route(method, path):
                        other = "POST" if method == "GET" else "GET"
                        if server.has_route(other, path):  # vLLM's 405, with Allow
                            allow = other
                            raise RouteError(405, "METHOD_NOT_ALLOWED",
                                             f"{method} {path}: method not allowed; use {other}")
                        raise RouteError(404, "NOT_FOUND", f"no route {method} {path}")
                    encoding = (self.headers.get("Content-Encoding") or "identity").strip()
                    if encoding.lower() not in ("identity", ""):
                        raise RouteError(415, "UNSUPPORTED_MEDIA_TYPE",
                                         f"{path}: Content-Encoding '{encoding[:64]}' is not accepted; send the body "
                                         "unencoded")
                    data = self._read_body(path, kind, length, charged) if self._unread else b""
                    body = _Body(path, data)
                    status, reply = server.route(method, path, query, body, self.client_address[0])
                except _ConnectionCut:
                    self.close_connection = True
                    return
                except Exception as e:  # noqa: BLE001  (every failure becomes a JSON reply)
                    err = _error_of(e)
                    if err.status >= 500 and err.status != 503:
                        print(f"wsync.worker_server: {method} {path}: {err}", file=sys.stderr, flush=True)
                    status, reply = err.status, {"error": {"message": str(err), "type": err.code,
                                                           "code": err.status}}
            finally:
                body = data = None
                server._release(charged[0])
            # A request refused before its body was read closes its connection: the body's
            # bytes would be read as the next request.
            self._reply(status, reply, close=self._unread, allow=allow)

        def do_GET(self):
            self._handle("GET")

        def do_POST(self):
            self._handle("POST")

    return Handler


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m wsync.worker_server",
        description="A vLLM-shaped weight-sync server in Python: ReceiverEngine workers landing each "
                    "update through a stand-in torch model's load_weights.")
    p.add_argument("--backend", default="nccl", choices=sorted(_wsync.receiver_backends()))
    p.add_argument("--model", default="qwen3-tiny", help="registered model name or a config.json directory")
    p.add_argument("--workers", type=int, default=1, help="ReceiverEngine workers (worker_rank 0..N-1)")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N (worker i on cuda:N+i)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: a free port (printed, and written to --ready-file)")
    p.add_argument("--ready-file", help="write the server's URL here once it listens")
    p.add_argument("--timeout", type=float, default=300.0, help="bound on every wait, seconds")
    p.add_argument("--session-lease", type=float,
                   help="a session with no call for this many seconds expires (default: --timeout; <= 0: never)")
    p.add_argument("--api-key", default=os.environ.get("WSYNC_API_KEY"))
    p.add_argument("--max-body-mb", type=float, default=MAX_BODY_BYTES / (1 << 20),
                   help="largest request body in MiB (413 above)")
    p.add_argument("--http-header-timeout", type=float, default=HEADER_TIMEOUT,
                   help="seconds for a request's headers to arrive, and for an idle kept-alive connection to send "
                        "its next request; the connection is cut after that, however slowly bytes trickle in")
    p.add_argument("--http-body-timeout", type=float, default=BODY_TIMEOUT,
                   help="seconds for a request's body to arrive once its headers have; the connection is cut after")
    p.add_argument("--http-max-connections", type=int, default=MAX_CONNECTIONS,
                   help="open HTTP connections at most; beyond it new connections wait in the listen queue")
    p.add_argument("--allow-store-host", action="append", default=[],
                   help="nccl: a host whose Gloo store workers may dial besides the trainer's address")
    p.add_argument("--ipc-shm-dir", help="ipc: where the trainer's shared-memory regions lie")
    p.add_argument("--base-checkpoint", help="delta: the base checkpoint (version 0)")
    p.add_argument("--local-checkpoint-dir", help="delta: the local mutable checkpoint")
    p.add_argument("--sync-root", help="delta: sync dirs must lie below this directory")
    a = p.parse_args(argv)
    if a.workers < 1:
        p.error("--workers must be >= 1")
    if not 0 <= a.max_body_mb <= 1 << 20:
        p.error("--max-body-mb must be in [0, 1048576]")
    if a.http_header_timeout <= 0 or a.http_body_timeout <= 0:
        p.error("--http-header-timeout and --http-body-timeout must be > 0")
    if not 1 <= a.http_max_connections <= 1 << 20:
        p.error("--http-max-connections must be in [1, 1048576]")

    options = {}
    if a.backend == "nccl" and a.allow_store_host:
        options["allowed_store_hosts"] = a.allow_store_host
    if a.backend == "ipc" and a.ipc_shm_dir:
        options["ipc_shm_dir"] = a.ipc_shm_dir
    if a.backend == "delta":
        for key in ("base_checkpoint", "local_checkpoint_dir", "sync_root"):
            if getattr(a, key):
                options[key] = getattr(a, key)
    metadata = model_metadata(a.model)
    engines, models = [], []
    for rank in range(a.workers):
        device = a.device
        if device.startswith("cuda:"):
            device = f"cuda:{int(device[5:]) + rank}"
        engines.append(ReceiverEngine(a.backend, worker_rank=rank, device=device, timeout=a.timeout,
                                      metadata=metadata, **options))
        models.append(StandInModel(metadata, device=device))
    server = WorkerServer(engines, models, host=a.host, port=a.port, api_key=a.api_key,
                          model_name=a.model, timeout=a.timeout, session_lease=a.session_lease,
                          max_body_bytes=int(a.max_body_mb * (1 << 20)), header_timeout=a.http_header_timeout,
                          body_timeout=a.http_body_timeout, max_connections=a.http_max_connections)
    print(f"wsync.worker_server: {a.backend} backend, {a.workers} worker(s) of {a.model} on {a.device}, "
          f"listening on {server.url}", flush=True)
    if a.ready_file:
        tmp = a.ready_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(server.url + "\n")
        os.replace(tmp, a.ready_file)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
