"""A vLLM-shaped HTTP front over ReceiverEngine workers and Python models.

It answers the routes a wsync trainer calls (vLLM's dev-mode weight-transfer routes plus
wsync's ``/health`` and ``/fetch_weights``), hands each payload to every worker's
``ReceiverEngine`` at once, and lands each received chunk through the worker's model's
own ``load_weights``. ``/weight_checker {"action": "checksum", "algorithm": ...}`` digests
the model's parameters by HF name, as ``wsync serve`` does, so a trainer's ``--verify``
checks what the model really holds.

Run it as a process (a stand-in model built from a registered model's tensor list)::

    /usr/bin/python3 -m wsync.worker_server --backend nccl --model qwen3-tiny --port 8001

or in-process over your own models (anything with ``load_weights(iterable of (name,
tensor))`` and ``named_parameters()`` or ``state_dict()``)::

    server = WorkerServer([wsync.ReceiverEngine("nccl")], [model], port=8001)
    server.start()          # serves on the native server's threads; server.url says where
    ...
    server.stop()

The HTTP server, the routes, the session rules (start .. update .. finish, one call at a
time, the session lease, a new trainer's takeover), the error replies and the limits on
hostile input are ``wsync serve``'s own (the native ``_wsync._HostedServer``); this module
only builds the workers and lands and digests tensors in Python. What it does not do:
generate, sleep/wake, draft models, sharded (TP) parameters, vLLM's runtime-parameter
weight checker (those routes answer 501 naming what is missing).
"""

import argparse
import atexit
import hashlib
import json
import os
import sys
import threading
import weakref

from wsync import _wsync
from wsync.receiver import BACKEND_OPTIONS, ReceiverEngine
from wsync.sources import model_metadata

# Limits and deadlines, as `wsync serve` has them (HttpServerOptions).
MAX_BODY_BYTES = 256 << 20    # bytes; room for MoE update_info lists; 413 above
DISCARD_BYTES = 16 << 20      # bytes read and dropped past the limit to answer 413, then the cut
HEADER_TIMEOUT = 10.0         # seconds for a request's headers (and an idle keep-alive wait)
BODY_TIMEOUT = 30.0           # seconds for a body once its headers are in (256 MiB needs 9 MB/s)
MAX_CONNECTIONS = 1024        # open connections; beyond, new ones wait in the listen queue


def tensor_digest(tensor, algorithm):
    """Hex digest of a tensor's bytes (row-major) with `algorithm` ('sha256' or 'xxh3_128')."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    data = _bytes_view(t.contiguous())
    if algorithm == "sha256":
        return hashlib.sha256(memoryview(data).cast("B")).hexdigest()
    return _wsync._hex_digest(algorithm, data)


def _bytes_view(t):
    """A numpy view of a contiguous CPU tensor's bytes (dtypes numpy lacks as int views)."""
    import torch
    t = t.reshape(-1)
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    elif t.dtype == torch.bool or "float8" in str(t.dtype):
        t = t.view(torch.uint8)
    return t.numpy()


def tensor_copy_digest(tensor, algorithm):
    """(a CPU copy of `tensor`, the hex digest of the copy's bytes), the copy and the
    digest made in one pass over the bytes where the tensor is a contiguous CPU tensor."""
    import torch
    t = tensor.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        copy = t.to("cpu", copy=True).contiguous()
        return copy, tensor_digest(copy, algorithm)
    copy = torch.empty_like(t, memory_format=torch.contiguous_format)
    return copy, _wsync._copy_hex_digest(algorithm, _bytes_view(t), _bytes_view(copy))


def tensors_copy_digest_into(srcs, dsts, algorithm, threads=0):
    """Copies each tensor of `srcs` into the contiguous CPU tensor of `dsts` at the same
    index (the same dtype and shape) and returns the hex digest of each copy's bytes. A
    contiguous CPU source is copied and digested in one pass over its bytes, all of them
    on up to `threads` threads (0: as many as this process may use)."""
    out = [None] * len(srcs)
    fast = [i for i, t in enumerate(srcs) if t.device.type == "cpu" and t.is_contiguous()]
    if fast:
        digests = _wsync._copy_hex_digests(algorithm, [_bytes_view(srcs[i].detach()) for i in fast],
                                           [_bytes_view(dsts[i]) for i in fast], threads)
        for i, hex_ in zip(fast, digests):
            out[i] = hex_
    for i, t in enumerate(srcs):
        if out[i] is None:
            dsts[i].copy_(t.detach())
            out[i] = tensor_digest(dsts[i], algorithm)
    return out


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
    and `models` (the model each worker loads into, one per engine), served by the native
    server from construction on: `url` says where.

    Calls that touch the workers (init, update, finish, fetch, checksum) run one at a time,
    on every worker at once; another arriving meanwhile gets 409 naming the call in flight.
    GET routes answer during long calls. A session idle for `session_lease` seconds
    (default: `timeout`; <= 0: never) expires.

    HTTP limits (`wsync serve`'s defaults and flags): `max_body_bytes` (256 MiB: 413
    above), `header_timeout` (10 s for a request's headers or an idle keep-alive wait),
    `body_timeout` (30 s for a body once its headers are in), `max_connections` (1024 open
    at once; more wait in the listen queue), `body_budget_bytes` (bodies held at once,
    default max(2 x max_body_bytes, 64 MiB): 503 past it), `discard_bytes` (16 MiB read and
    dropped past the limit so that the client sees its 413; the connection is cut after).
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
        self._stopped = threading.Event()
        self._native = _wsync._HostedServer(
            [_Worker(e, m) for e, m in zip(self.engines, self.models)], model=model_name,
            backend=self.engines[0].backend, device=self.engines[0].device, timeout=self.timeout,
            session_lease=None if session_lease is None else float(session_lease), host=host, port=int(port),
            api_key=api_key or "", max_body_bytes=int(max_body_bytes), header_timeout=float(header_timeout),
            body_timeout=float(body_timeout), max_connections=int(max_connections),
            body_budget_bytes=int(body_budget_bytes or 0), discard_bytes=int(discard_bytes))
        _LIVE.add(self)

    @property
    def url(self):
        return self._native.url

    def health(self):
        """The /health body, as a dict."""
        return json.loads(self._native.health())

    def start(self):
        """Returns at once: the server serves on its own threads from construction on."""
        return self

    def serve_forever(self):
        """Blocks until stop()."""
        while not self._stopped.wait(1.0):
            pass

    def stop(self):
        """Stops serving (in-flight calls finish first) and shuts every engine down."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._native.stop()
        for engine in self.engines:
            engine.shutdown()


# Servers still serving at exit are stopped first: their threads call into Python.
_LIVE = weakref.WeakSet()


def _stop_all():
    for server in list(_LIVE):
        server.stop()


atexit.register(_stop_all)


class _Worker:
    """One worker's calls, as the native server makes them (JSON arrives as bytes): its
    engine's, landing through its model's load_weights; digests of its model's tensors."""

    def __init__(self, engine, model):
        self.engine, self.model = engine, model

    def _native(self, method):
        """The native half of a wsync ReceiverEngine whose `method` is ReceiverEngine's
        own: it takes the JSON text as it came. None for any other engine object, which
        gets the parsed value."""
        engine = self.engine
        if isinstance(engine, ReceiverEngine) and getattr(type(engine), method) is getattr(ReceiverEngine, method):
            return engine._native
        return None

    def init(self, info, peer):
        native = self._native("init")
        if native:
            native.init(info, peer)
        else:
            self.engine.init(json.loads(info), peer)

    def receive(self, info):
        native = self._native("receive_weights")
        if native:
            native.receive(info, self.model.load_weights)
        else:
            self.engine.receive_weights(json.loads(info), self.model.load_weights)

    def fetch(self, body):
        native = self._native("fetch_weights")
        if native:
            return native.fetch(body)
        return json.dumps(self.engine.fetch_weights(json.loads(body)))

    def shutdown(self):
        self.engine.shutdown()

    def checksums(self, algorithm):
        return {name: tensor_digest(t, algorithm) for name, t in parameters_of(self.model).items()}


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m wsync.worker_server",
        description="A vLLM-shaped weight-sync server in Python: ReceiverEngine workers landing each "
                    "update through a stand-in torch model's load_weights.")
    p.add_argument("--backend", default=_wsync.DEFAULT_BACKEND, choices=sorted(BACKEND_OPTIONS))
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

    # Each flag goes to the backends whose receiver options schema has its key.
    flags = {"allowed_store_hosts": a.allow_store_host, "ipc_shm_dir": a.ipc_shm_dir,
             "base_checkpoint": a.base_checkpoint, "local_checkpoint_dir": a.local_checkpoint_dir,
             "sync_root": a.sync_root}
    allowed = BACKEND_OPTIONS.get(a.backend, ())
    options = {key: value for key, value in flags.items() if value and key in allowed}
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
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
