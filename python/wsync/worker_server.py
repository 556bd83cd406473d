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
"""

import argparse
import hashlib
import json
import os
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from wsync import _wsync, errors
from wsync.receiver import ReceiverEngine
from wsync.sources import model_metadata

MAX_BODY_BYTES = 256 << 20  # as `wsync serve`: room for MoE update_info lists

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
    """

    def __init__(self, engines, models, *, host="127.0.0.1", port=0, api_key=None, model_name="",
                 timeout=300.0, session_lease=None):
        if len(engines) != len(models) or not engines:
            raise ValueError(f"{len(engines)} engines for {len(models)} models: give one model per engine")
        self.engines, self.models = list(engines), list(models)
        self.model_name, self.api_key, self.timeout = model_name, api_key, float(timeout)
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
        self._httpd = ThreadingHTTPServer((host, port), _handler_for(self))
        self._httpd.daemon_threads = True
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
        info = _object_field(body, "init_info")
        self._begin("init_weight_transfer_engine", in_session=False)
        try:
            self._on_every_worker("init_weight_transfer_engine", lambda i, e: e.init(info, peer))
        finally:
            self._end()
        return {"message": "Weight transfer initialized"}

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
        info = _object_field(body, "update_info")
        self._begin("update_weights", in_session=True)

        def receive(i, engine):
            try:
                engine.receive_weights(info, self.models[i].load_weights)
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
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            raise RouteError(400, "INVALID_ARGUMENT", "field 'weight_version' must be a string")
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
        self._begin("fetch_weights")
        try:
            replies = self._on_every_worker("fetch_weights", lambda i, e: e.fetch_weights(body))
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
        action = body["action"]
        if not isinstance(action, str) or action not in ("checksum", "compare", "reset"):
            raise RouteError(400, "INVALID_ARGUMENT",
                             f"unknown weight_checker action {action!r} (field 'action': checksum, reset or compare)")
        if "algorithm" not in body:
            raise RouteError(501, "UNIMPLEMENTED",
                             f"weight_checker '{action}' without an 'algorithm' is vLLM's runtime-parameter checker, "
                             "which wsync.worker_server does not have; name an 'algorithm' (sha256 or xxh3_128) for "
                             "digests of the model's parameters by HF name")
        if action == "reset":
            raise RouteError(400, "INVALID_ARGUMENT",
                             "weight_checker action 'reset' takes no 'algorithm' (it overwrites runtime parameters)")
        algorithm = body["algorithm"]
        if algorithm not in ("sha256", "xxh3_128", "xxh3-128"):
            raise RouteError(400, "INVALID_ARGUMENT",
                             f"field 'algorithm': unknown digest algorithm '{algorithm}' (use sha256 or xxh3_128)")
        baseline = _object_field(body, "baseline") if action == "compare" else None
        sums = self.checksums(algorithm.replace("-", "_"))
        if action == "checksum":
            return {"checksums": sums}
        mismatches = [n for n, h in sums.items() if baseline.get(n) != h]
        mismatches += [n for n in baseline if n not in sums]
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

    def reset_prefix_cache(self, query):
        for name in ("reset_running_requests", "reset_external"):
            value = query.get(name, "false")
            if value not in ("true", "True", "1", "false", "False", "0"):
                raise RouteError(400, "INVALID_ARGUMENT", f"query parameter {name}={value} is not a boolean")
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
        method = body.get("method")
        if not isinstance(method, str) or not method:
            raise RouteError(400, "INVALID_ARGUMENT", "collective_rpc needs a string field 'method'")
        raise RouteError(501, "UNIMPLEMENTED",
                         f"collective_rpc '{method}': this server dispatches no worker methods by name; it runs "
                         "only its named routes (/init_weight_transfer_engine, /start_weight_update, "
                         "/update_weights, /finish_weight_update, /weight_checker, ...)")

    def route(self, method, path, query, body, peer):
        """(HTTP status, reply dict) of one request."""
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
                "/start_weight_update": self.start_update,
                "/update_weights": lambda: self.update(body),
                "/finish_weight_update": lambda: self.finish(body),
                "/fetch_weights": lambda: self.fetch(body),
                "/weight_checker": lambda: self.weight_checker(body),
                "/pause": lambda: self.pause(query),
                "/resume": self.resume,
                "/reset_prefix_cache": lambda: self.reset_prefix_cache(query),
                "/update_weight_version": lambda: self.set_version(body),
                "/sleep": lambda: self.unsupported(path, "sleep mode (its models' memory is their own)"),
                "/wake_up": lambda: self.unsupported(path, "sleep mode (its models' memory is their own)"),
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
        version = body.get("new_version")
        if not isinstance(version, str):
            raise RouteError(400, "INVALID_ARGUMENT", "field 'new_version' must be a string")
        with self._mu:
            self._version = version
        return {"success": True, "new_version": version}


def _object_field(body, field):
    value = body.get(field)
    if value is None:
        raise RouteError(400, "INVALID_ARGUMENT", f"missing field '{field}'")
    if not isinstance(value, dict):
        raise RouteError(400, "INVALID_ARGUMENT", f"field '{field}' must be an object")
    return value


def _handler_for(server):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # requests are not logged; errors are
            pass

        def _reply(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _handle(self, method):
            parsed = urllib.parse.urlsplit(self.path)
            query = dict(urllib.parse.parse_qsl(parsed.query))
            try:
                if server.api_key and parsed.path != "/health":
                    if self.headers.get("Authorization") != f"Bearer {server.api_key}":
                        raise RouteError(401, "UNAUTHENTICATED",
                                         f"{parsed.path} needs 'Authorization: Bearer <api key>'")
                body = {}
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY_BYTES:
                    raise RouteError(413, "PAYLOAD_TOO_LARGE",
                                     f"body of {parsed.path} exceeds {MAX_BODY_BYTES} bytes")
                if length:
                    try:
                        body = json.loads(self.rfile.read(length))
                    except ValueError:
                        raise RouteError(400, "INVALID_ARGUMENT", f"malformed JSON body for {parsed.path}")
                    if not isinstance(body, dict):
                        raise RouteError(400, "INVALID_ARGUMENT", f"body of {parsed.path} must be a JSON object")
                status, reply = server.route(method, parsed.path, query, body, self.client_address[0])
            except Exception as e:  # noqa: BLE001  (every failure becomes a JSON reply)
                err = _error_of(e)
                if err.status >= 500:
                    print(f"wsync.worker_server: {method} {parsed.path}: {err}", file=sys.stderr, flush=True)
                status, reply = err.status, {"error": {"message": str(err), "type": err.code,
                                                       "code": err.status}}
            self._reply(status, reply)

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
    p.add_argument("--allow-store-host", action="append", default=[],
                   help="nccl: a host whose Gloo store workers may dial besides the trainer's address")
    p.add_argument("--ipc-shm-dir", help="ipc: where the trainer's shared-memory regions lie")
    p.add_argument("--base-checkpoint", help="delta: the base checkpoint (version 0)")
    p.add_argument("--local-checkpoint-dir", help="delta: the local mutable checkpoint")
    p.add_argument("--sync-root", help="delta: sync dirs must lie below this directory")
    a = p.parse_args(argv)
    if a.workers < 1:
        p.error("--workers must be >= 1")

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
                          model_name=a.model, timeout=a.timeout, session_lease=a.session_lease)
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
