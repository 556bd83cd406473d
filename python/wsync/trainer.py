"""The trainer side: ``TrainerEngine`` sends a trainer rank's weights to inference servers."""

import os

from wsync import _wsync
from wsync._wsync import SyncStats

__all__ = ["TrainerEngine", "SyncStats"]


def _option_text(key, value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (str, int, float)):
        return str(value)
    raise TypeError(f"backend option {key}={value!r}: give a str, number, bool or path")


class TrainerEngine:
    """Sends one trainer rank's weights to running inference servers, every step.

    ``TrainerEngine(backend="nccl", servers=[...], data_parallel_size=1, bucket_gb=1.0,
    timeout=300.0, api_key=None, device="cpu", rank=0, world_size=1, packed=True,
    num_buffers=2, store_host="127.0.0.1", progress=None, **backend_options)``

    backend
        ``"nccl"`` (broadcast: NCCL on GPU, Gloo on CPU), ``"ipc"`` (colocated: CUDA IPC
        or POSIX shared memory) or ``"delta"`` (XOR deltas through a shared directory);
        ``wsync.trainer_backends()`` lists what this build has. Every server must run the
        same backend (``wsync serve --backend ...``).
    servers
        Base URLs of the inference servers, deployment-major (``[dep0_dp0, dep0_dp1, ...]``).
        Needed on rank 0 only.
    data_parallel_size
        Servers per deployment (SkyRL's ``data_parallel_size``).
    bucket_gb
        Size of a packed buffer, GB (at least the largest tensor). The engine's own memory
        is ``num_buffers`` such buffers: it never copies the whole model.
    timeout
        Seconds any one wait may take (HTTP calls, rendezvous, data plane).
    api_key
        Sent as ``Authorization: Bearer KEY`` (servers started with ``--api-key``).
    device
        Where the source's tensors live and the data plane runs: ``"cpu"`` or ``"cuda:N"``.
    rank, world_size
        This trainer rank and the number of ranks. Rank 0 sends; every other rank only
        makes its one pass over its source per sync (so that collectives inside the
        source, such as an FSDP all-gather, run on every rank). The ``ipc`` backend's
        multi-GPU rank groups (every rank exporting its own GPU's slots) are not offered
        from Python yet: with ``world_size > 1`` rank 0 alone exports.
    packed, num_buffers
        Pack tensors into ``bucket_gb`` buffers (vLLM's packed mode) and how many buffers
        rotate, so packing overlaps the previous chunk's transfer.
    store_host
        Address the rendezvous store listens on (servers dial it; ``nccl``).
    progress
        ``callable(dict)`` called after every chunk with ``bytes_done``, ``bytes_total``,
        ``chunks_done``, ``chunks_total`` (from the engine's thread, GIL held). An exception
        it raises aborts the sync.
    **backend_options
        The backend's own settings (``wsync push --backend-option KEY=VALUE``): ``nccl``:
        piece_mb; ``ipc``: mode, export_kind, backing, stall_after_chunks; ``delta``:
        sync_dir (required), max_file_gb, publish_threads, base_checkpoint, base_model_path,
        local_checkpoint_dir (the last two are SkyRL's init keys; see docs/protocol.md). An unknown key
        raises ``wsync.InvalidArgumentError`` listing the known ones.

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
    message. Not thread-safe: one call at a time.
    """

    def __init__(self, backend="nccl", servers=(), data_parallel_size=1, bucket_gb=1.0,
                 timeout=300.0, api_key=None, device="cpu", rank=0, world_size=1, packed=True,
                 num_buffers=2, store_host="127.0.0.1", progress=None, **backend_options):
        if isinstance(servers, str):
            servers = [s for s in servers.split(",") if s]
        self._options = dict(
            backend=backend, servers=list(servers), data_parallel_size=int(data_parallel_size),
            bucket_gb=float(bucket_gb), timeout=float(timeout), device=str(device), rank=int(rank),
            world_size=int(world_size), packed=bool(packed), num_buffers=int(num_buffers),
            store_host=store_host,
            backend_options={k: _option_text(k, v) for k, v in backend_options.items()})
        self._engine = _wsync._TrainerEngine(api_key=api_key, progress=progress, **self._options)

    def init(self, source_or_metadata):
        """Discovers the servers and builds the data plane for a model.

        ``source_or_metadata``: a source (its ``metadata()`` is read, its tensors are not) or
        the ``[(name, dtype_name, shape), ...]`` list itself. Every server must answer
        ``/health`` with this engine's backend. ``send_weights`` calls it on first use.
        """
        self._engine.init(source_or_metadata)

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
        return self._engine.send_weights(source, weight_version, bool(verify))

    def shutdown(self):
        """Tears the data plane down. Idempotent; the engine takes no call after it."""
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
