"""The trainer side: ``TrainerEngine`` sends a trainer rank's weights to inference servers."""

import os

from wsync import _wsync
from wsync._wsync import SyncStats
from wsync.errors import InvalidArgumentError

__all__ = ["TrainerEngine", "SyncStats"]

# The trainer option naming the servers' model, for the backends that plan from it (their
# descriptors' model_option): those passes leave out the tensors the servers drop.
_MODEL_OPTION = {b["name"]: b["model_option"] for b in _wsync.backends() if b["model_option"]}


def _option_text(key, value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (str, int, float)):
        return str(value)
    raise TypeError(f"backend option {key}={value!r}: give a str, number, bool or path")


def _torch_distributed_ready():
    import sys
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _broadcast_from_rank0(value):
    """Rank 0's ``value`` on every rank of torch.distributed's default group."""
    import torch.distributed as dist
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _bind_host_toward(host):
    """This host's address on the route to ``host`` (``host`` itself when it is loopback)."""
    import ipaddress
    import socket
    try:
        if ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            return host
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # no packet is sent: this only picks the route
            return s.getsockname()[0]
    except OSError:
        return host


def _native(source):
    """What the native engine takes for ``source``: a ``wsync.MegatronSource``'s engine-side
    source (its parameters copied in first), else ``source`` itself."""
    from wsync.distributed import MegatronSource
    if isinstance(source, MegatronSource):
        return source.load()
    return source


class _Without:
    """A source without some of its names (the ones the servers drop), for ``sharded``."""

    def __init__(self, source, names):
        self._source, self._names = source, set(names)
        self.yields_ready_tensors = getattr(source, "yields_ready_tensors", False)

    def metadata(self):
        return [m for m in self._source.metadata() if m[0] not in self._names]

    def held_names(self):
        held = self._source.held_names() if hasattr(self._source, "held_names") else None
        return None if held is None else [n for n in held if n not in self._names]

    def held_rows(self):
        rows = self._source.held_rows() if hasattr(self._source, "held_rows") else None
        return None if rows is None else [r for r in rows if r[0] not in self._names]

    def iter_held(self):
        return ((n, t) for n, t in self._source.iter_held() if n not in self._names)

    def __iter__(self):
        return ((n, t) for n, t in self._source if n not in self._names)


class TrainerEngine:
    """Sends one trainer rank's weights to running inference servers, every step.

    ``TrainerEngine(backend="nccl", servers=[...], data_parallel_size=1, bucket_gb=None,
    timeout=300.0, api_key=None, device="cpu", rank=0, world_size=1, packed=True,
    num_buffers=2, store_host="127.0.0.1", group_port=None, bind_host=None, progress=None,
    inline_verify=True, **backend_options)``

    backend
        ``"nccl"`` (broadcast: NCCL on GPU, Gloo on CPU), ``"ipc"`` (colocated: CUDA IPC
        or POSIX shared memory), ``"delta"`` (XOR deltas through a shared directory) or
        ``"sharded"`` (each server worker receives only the slices it holds: NCCL
        point-to-point on GPU, Gloo on CPU); ``wsync.trainer_backends()`` lists what this
        build has. Every server must run the same backend (``wsync serve --backend ...``).
    servers
        Base URLs of the inference servers, deployment-major (``[dep0_dp0, dep0_dp1, ...]``).
        Needed on rank 0 only.
    data_parallel_size
        Servers per deployment (SkyRL's ``data_parallel_size``).
    bucket_gb
        Size of a packed buffer, GB (at least the largest tensor). The engine's own memory
        is ``num_buffers`` such buffers: it never copies the whole model. Default 1.0; with
        ``lora=`` a ``wsync.LoraSource``, its ``bucket_gb`` (16 MB or twice its largest
        matrix: an adapter moves in several chunks, each landing while the next is packed).
    timeout
        Seconds any one wait may take (HTTP calls, rendezvous, data plane).
    api_key
        Sent as ``Authorization: Bearer KEY`` (servers started with ``--api-key``).
    device
        Where the source's tensors live and the data plane runs: ``"cpu"`` or ``"cuda:N"``.
        ``delta`` publishes host tensors: a CUDA tensor fails the sync naming it.
    rank, world_size
        This trainer rank and the number of ranks. With ``nccl`` and ``delta`` (and ``ipc``
        on the CPU) rank 0 sends; every other rank only makes its one pass over its source
        per sync (so that collectives inside the source, such as an FSDP gather, run on
        every rank). With ``sharded`` every rank sends the tensors it holds (its source's
        ``held_names()``: ``wsync.DTensorSource``, ``wsync.MegatronSource``) straight to
        the workers that keep their slices, and with ``ipc`` on CUDA every rank on a GPU
        no lower rank is on exports its own staging slots: both run on wsync's own trainer
        group, which the engines form when they are built (a Gloo group meeting at rank 0's
        store, ``store_host``:``group_port``). Every rank builds its engine and calls
        ``init`` / ``send_weights`` the same number of times, at the same time. See "One
        failure ends every rank" below.
    packed, num_buffers
        Pack tensors into ``bucket_gb`` buffers (vLLM's packed mode) and how many buffers
        rotate, so packing overlaps the previous chunk's transfer.
    store_host
        Address rank 0's rendezvous stores listen on: the data plane's (servers dial it;
        ``nccl``, ``sharded``) and, with ``world_size > 1``, the trainer group's (every
        rank dials it: give rank 0's address on every rank).
    group_port
        With ``world_size > 1``: the port of the trainer group's store on rank 0. ``None``
        (the default) lets rank 0 pick a free port and tells the other ranks through
        ``torch.distributed`` (initialized, default group: one broadcast while the engines
        are built, so build them on every rank at once). ``0`` opts out of the trainer
        group: ranks then never learn each other's failures, and a failure on one rank
        may leave the others in their sources' collectives.
    bind_host
        With a trainer group of its own (``sharded``; ``ipc`` on CUDA): the address this
        rank's group connections listen on, which every other rank must reach. ``None``:
        ``store_host`` when that is a loopback address (ranks on one host), else this
        host's address on the route to ``store_host``.
    progress
        ``callable(dict)`` called after every chunk with ``bytes_done``, ``bytes_total``,
        ``chunks_done``, ``chunks_total`` (from the engine's thread, GIL held). An exception
        it raises aborts the sync.
    inline_verify
        Hash every tensor as the sync's pass reads it (xxh3-128) and send the digests with
        finish to the servers that declare in-line verification; such a server refuses to
        finish a sync whose shards differ (``wsync.DataLossError`` naming the tensors).
        ``SyncStats.inline_verified_servers`` counts the servers that checked it.
    lora
        A ``wsync.LoraSource`` (or its ``spec``): every sync is then a lora session that
        installs that adapter at the sync's ``weight_version`` (docs/lora.md), on every
        backend (``sharded``: Gloo only, rank 0 sends; ``delta``: one file per session
        below ``sync_dir``).
    **backend_options
        The backend's own settings, as keyword arguments: ``nccl``: piece_mb; ``ipc``:
        mode, export_kind, backing, stall_after_chunks; ``delta``: sync_dir (required),
        max_file_gb, publish_threads, base_checkpoint, base_model_path,
        local_checkpoint_dir (the last two are SkyRL's init keys; see docs/protocol.md),
        state_dir (a local directory where the trainer keeps its last published version,
        a file as large as the model; default under $TMPDIR);
        ``sharded``: model (required: the servers' model, a registered name or a
        config.json directory), lookahead (chunks in flight, 0..64), stall_rank (fault
        injection for tests). An unknown key raises ``wsync.InvalidArgumentError``
        listing the known ones.

    Use it as a context manager, or call ``shutdown()``::

        with wsync.TrainerEngine(servers=urls) as engine:
            engine.init(source)
            for step in range(steps):
                train_step()
                stats = engine.send_weights(source, weight_version=f"step-{step}")

    The GIL is released while the engine works. Ctrl-C during a call cancels the sync on
    every server (their sessions close; they keep serving their previous weights) and
    raises ``KeyboardInterrupt`` once the engine has stopped; the next sync works as usual.
    Errors raise ``wsync.Error`` subclasses (``wsync.errors``) carrying the server's own
    message: a server that cannot be reached is ``wsync.UnavailableError`` naming its URL
    (``ConnectionError``), a malformed argument ``ValueError``. Not thread-safe: one call
    at a time.

    One failure ends every rank (``world_size > 1``). The ranks form a trainer group
    through rank 0's store (``store_host``, ``group_port``). When a rank's part of a sync
    fails (a dead server, a source that raises or disagrees with its metadata, a raising
    progress callback), that rank

    1. posts its cause to the group at once (unless another rank's cause came first:
       then its failure is a consequence, and the group keeps the first);
    2. keeps pulling its source to the end, discarding the tensors, for at most
       ``timeout`` seconds, so that ranks whose iterators are collectives (an FSDP
       all-gather per tensor) can finish theirs;
    3. raises.

    A failed sync (or init) also ends wsync's own trainer group, where the backend has one:
    the next call on every rank forms a new one and initializes the data plane again.

    At the end of every sync each rank posts its outcome; a rank whose own part succeeded
    waits for the others' and raises the first cause posted, naming its rank (for
    example ``trainer rank 0 failed: http://...: connection refused ...``), with the same
    exception class on every rank. A rank that gives no sign of life for ``timeout``
    seconds raises ``wsync.DeadlineExceededError`` on the others, and a rank 0 whose
    process is gone ``wsync.UnavailableError``; a rank whose process is gone while
    wsync's trainer group waits on it is named within seconds (``wsync.UnavailableError``:
    ``trainer rank 2 left the trainer group ...``). What wsync cannot do is finish a
    collective for a rank whose source raised: the other ranks' iterators then return
    when that rank's process exits or tears its process group down, or at
    ``torch.distributed``'s own timeout (give ``init_process_group`` a ``timeout`` close
    to this engine's).
    """

    def __init__(self, backend=_wsync.DEFAULT_BACKEND, servers=(), data_parallel_size=1, bucket_gb=None,
                 timeout=300.0, api_key=None, device="cpu", rank=0, world_size=1, packed=True,
                 num_buffers=2, store_host="127.0.0.1", group_port=None, bind_host=None, progress=None,
                 inline_verify=True, **backend_options):
        # lora: a wsync.LoraSource (or its .spec): every sync is a lora session (wsync.lora).
        lora_source = backend_options.pop("lora", None)
        lora = getattr(lora_source, "spec", lora_source)
        if bucket_gb is None:
            bucket_gb = getattr(lora_source, "bucket_gb", 1.0) if lora is not None else 1.0
        if isinstance(servers, str):
            servers = [s.strip() for s in servers.split(",") if s.strip()]
        if progress is not None and not callable(progress):
            raise TypeError(f"progress must be a callable taking a dict, not {type(progress).__name__}")
        world_size, rank = int(world_size), int(rank)
        if world_size < 1 or not 0 <= rank < world_size:
            raise InvalidArgumentError(f"rank {rank} is outside world_size {world_size}")
        share_port = world_size > 1 and group_port is None
        if group_port is not None and int(group_port) < 0:
            raise ValueError(f"group_port is {group_port}; give a port, 0 (no trainer group) or None")
        if share_port and not _torch_distributed_ready():
            raise ValueError("world_size > 1 needs group_port (the trainer group's port on rank 0) or an "
                             "initialized torch.distributed to agree on one")
        self._options = dict(
            backend=backend, servers=list(servers), data_parallel_size=int(data_parallel_size),
            bucket_gb=float(bucket_gb), timeout=float(timeout), device=str(device), rank=int(rank),
            world_size=int(world_size), packed=bool(packed), num_buffers=int(num_buffers),
            store_host=store_host, inline_verify=bool(inline_verify),
            backend_options={k: _option_text(k, v) for k, v in backend_options.items()})
        # The native engine: -1 no trainer group, 0 rank 0 picks a free port.
        port = 0 if share_port else -1 if world_size == 1 or int(group_port) == 0 else int(group_port)
        if share_port and rank != 0:
            port = _broadcast_from_rank0(None)
        if bind_host is None:
            bind_host = _bind_host_toward(store_host) if world_size > 1 else store_host
        self._engine = _wsync._TrainerEngine(api_key=api_key, progress=progress, group_port=port,
                                             bind_host=str(bind_host), lora=lora, **self._options)
        if share_port and rank == 0:
            _broadcast_from_rank0(self._engine.group_port)
        self._engine.start()
        self._options["group_port"] = self._engine.group_port or None

    def init(self, source_or_metadata):
        """Discovers the servers and builds the data plane for a model.

        ``source_or_metadata``: a source (its ``metadata()`` is read, its tensors are not) or
        the ``[(name, dtype_name, shape), ...]`` list itself. Every server must answer
        ``/health`` with this engine's backend. ``send_weights`` calls it on first use.
        """
        self._engine.init(self._prepared(source_or_metadata))

    def send_weights(self, source, weight_version=None, verify=False):
        """Syncs ``source`` to every server in one pass over it; returns a ``SyncStats``.

        The source's metadata must list the tensors ``init`` saw (any order). Each tensor
        is checked as it streams; a mismatch, an exception from the source's iterator, a
        refusing or dead server, or Ctrl-C aborts the sync on every server, which keep
        serving the weights of the last completed sync. ``weight_version`` is what the
        servers report as their ``weight_version`` (``GET /health``) once the sync lands.
        Errors: ``wsync.InvalidArgumentError`` (a tensor disagrees with the metadata, or is
        not contiguous: named), ``wsync.AbortedError`` (the source raised: the original
        exception is ``__cause__``), ``wsync.UnavailableError`` (a server cannot be
        reached: named), ``wsync.DeadlineExceededError``, ...

        ``verify=True`` then checks the sync by read-back: every server digests every
        tensor it holds (xxh3-128) while this rank digests a second pass over ``source``,
        and any difference raises ``wsync.DataLossError`` naming the server and the
        tensors; ``stats.verified`` says it passed. Every rank must pass the same
        ``verify`` (the second pass may be a collective: other ranks drain it).
        """
        return self._engine.send_weights(self._prepared(source), weight_version, bool(verify))

    def _prepared(self, source):
        """``source`` as the native engine takes it. A backend that plans from the servers'
        model (``sharded``) covers the servers' tensors only, so the names its servers drop (``wsync._wsync.dropped_names``: a tied
        ``lm_head.weight``, rotary buffers) are left out of its passes here, as vLLM skips them:
        through the source's own ``without(names)`` when it has one (``DTensorSource``: those
        tensors are then never gathered), else by filtering its passes."""
        from wsync.distributed import DTensorSource
        source = _native(source)
        model_option = _MODEL_OPTION.get(self._options["backend"])
        model = self._options["backend_options"].get(model_option) if model_option else None
        if not model or not hasattr(source, "metadata") \
                or not hasattr(source, "__iter__"):
            return source
        key = id(source)
        cached = self._dropping.get(key)
        if cached is not None and cached[0] is source:
            return cached[1]
        names = [m[0] for m in source.metadata()]
        dropped = _wsync.dropped_names(names, model)
        if not dropped:
            out = source
        elif isinstance(source, DTensorSource) or callable(getattr(source, "without", None)):
            out = source.without(dropped)
        else:
            out = _Without(source, dropped)
        self._dropping = {key: (source, out)}
        return out

    _dropping = {}

    def shutdown(self):
        """Tears the data plane down. Idempotent; the engine takes no call after it.

        With ``world_size > 1``, rank 0 holds the trainer group's store, where every rank
        reads the last sync's outcome: it first waits until the other ranks have read it
        (at most the timeout, and a few seconds once the ranks still to read it are gone).
        """
        self._engine.shutdown()

    @property
    def options(self):
        """The settings this engine was built with, as a dict (the API key left out)."""
        return dict(self._options)

    @property
    def closed(self):
        """Whether ``shutdown()`` ran."""
        return self._engine.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False

    def __repr__(self):
        o = self.options
        state = "closed" if self.closed else "open"
        return (f"TrainerEngine(backend={o['backend']!r}, servers={o['servers']!r}, "
                f"device={o['device']!r}, rank={o['rank']}, {state})")
