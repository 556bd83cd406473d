"""The receiving side for inference workers written in Python.

``ReceiverEngine`` is one worker's end of a wsync data plane, in the shape of vLLM's
worker-side weight-transfer engine: ``init(init_info)`` with the dict a trainer posts to
``/init_weight_transfer_engine``, then ``receive_weights(update_info, load_weights)`` with
the dict of each ``/update_weights``, which calls the model's own
``load_weights([(hf_name, tensor), ...])`` as the tensors arrive: once or more per received
chunk, each call with whole modules (a decoder layer's tensors together), so that loading
one part overlaps the receipt of the rest. A wsync trainer (the
CLI's ``wsync push`` or ``wsync.TrainerEngine``) drives it exactly as it drives
``wsync serve``; ``wsync.worker_server`` puts the HTTP routes in front of it.

The tensors handed to ``load_weights`` are torch tensors viewing wsync's receive buffers
(no copy), valid only during that call: copy what you keep (``param.copy_(tensor)``, as a
vLLM weight loader does). They live on the engine's device for NCCL and CUDA IPC, in host
memory for the Gloo, shared-memory and delta planes. On a CUDA engine the device is
synchronized after each ``load_weights`` call, so asynchronous copies are safe.

``sharded`` lands slices, not whole tensors: the engine plans them from the worker's model
and tensor-parallel place (``model``, ``tp_size``), and ``receive_weights`` calls
``load_slices([(param, piece, tensor), ...])`` per chunk, where ``param`` and ``piece``
index ``sharding_table(model, tp_rank, tp_size)`` and ``tensor`` is the HF tensor's slice
(its shape the HF shape with the piece's ``dim`` cut to its ``length``), to be copied at
``dst_start`` along ``dim`` of the parameter (of its sub-tensor ``[dst_index]`` when that
is not -1).
"""

import json

from wsync import _wsync

# Backend settings a receiver takes, by backend: each backend's receiver options schema
# (its descriptor, through the binding), for the backends a single worker's receiver hosts.
# The same names as ``wsync serve``'s flags take them (``--allow-store-host``,
# ``--ipc-shm-dir``, ``--base-checkpoint``, ...).
BACKEND_OPTIONS = {b["name"]: tuple(o["key"] for o in b["receiver_options"] if not o["hidden"])
                   for b in _wsync.backends() if b["single_worker_receiver"]}


def _dtype_name(dtype):
    """'bfloat16' for torch.bfloat16 or 'bfloat16'."""
    name = str(dtype)
    return name[len("torch."):] if name.startswith("torch.") else name


class ReceiverEngine:
    """One inference worker's receiver.

    Args:
        backend: ``"nccl"`` (Gloo broadcast on CPU, NCCL on GPU), ``"ipc"`` (shared memory
            or CUDA IPC slots on this host) or ``"delta"`` (a local checkpoint advanced by
            the trainer's delta files).
        worker_rank: this worker's index within its server: it is rank
            ``rank_offset + worker_rank`` of the trainer's broadcast group (reader
            ``reader_offset + worker_rank`` of an ipc region), as vLLM numbers workers.
        device: ``"cpu"`` or ``"cuda:N"``: where NCCL and CUDA IPC receive.
        timeout: seconds; bound on every wait (the trainer's own, if shorter, wins).
        metadata: optional list of ``(hf_name, dtype, shape)`` the worker holds (dtype a
            torch dtype or its name). Given, every update must name only these tensors
            and receive buffers are reserved at ``init``; omitted, the worker takes any
            tensor list and reserves buffers at the first update. Either way the names
            servers drop (``rotary_emb.inv_freq``, an MTP layer's copies of embed_tokens
            and the head; ``lm_head.weight`` when metadata lists
            ``model.embed_tokens.weight`` without it: a tied model)
            are taken and never passed to ``load_weights``, unless metadata lists them.
        max_update_bytes: an update whose tensors add up to more is refused (default
            1 TiB).
        label: names the worker in messages (default ``"worker <rank>"``).
        model: the worker's model (a registered name or a directory holding config.json),
            for a backend that lands slices (``sharded``, which needs it); the worker is TP
            rank ``worker_rank % tp_size`` of ``tp_size``, and holds an MTP drafter beside
            the target when ``mtp_drafter`` is set.
        **backend_options: ``allowed_store_hosts`` (nccl: hosts whose Gloo store the
            worker may dial besides the HTTP peer's own address), ``ipc_shm_dir`` (ipc),
            ``base_checkpoint``, ``local_checkpoint_dir``, ``sync_root`` (delta).

    Errors raise ``wsync.Error`` subclasses carrying the engine's message. Calls may come
    from any thread, one at a time (a second concurrent call raises
    ``wsync.FailedPreconditionError``). Usable as a context manager (``shutdown`` on exit).
    """

    def __init__(self, backend=_wsync.DEFAULT_BACKEND, worker_rank=0, device="cpu", timeout=300.0, *,
                 metadata=None, max_update_bytes=None, label=None, model=None, tp_size=1, mtp_drafter=False,
                 **backend_options):
        allowed = BACKEND_OPTIONS.get(backend, ())
        for key in backend_options:
            if key not in allowed:
                raise TypeError(f"ReceiverEngine(backend={backend!r}) takes no option {key!r}"
                                f" (it takes: {', '.join(allowed) or 'none'})")
        meta = [(str(n), _dtype_name(d), [int(x) for x in s]) for n, d, s in (metadata or [])]
        self._native = _wsync._ReceiverEngine(
            backend, int(worker_rank), str(device), float(timeout), json.dumps(backend_options),
            meta, max_update_bytes, label or f"worker {int(worker_rank)}", str(model or ""), int(tp_size),
            bool(mtp_drafter))

    @property
    def backend(self):
        return self._native.backend

    @property
    def worker_rank(self):
        return self._native.worker_rank

    @property
    def device(self):
        return self._native.device

    def init(self, init_info, peer_address=""):
        """Joins the trainer's data plane with ``init_info`` (the dict of
        ``/init_weight_transfer_engine``). For nccl this blocks until the trainer's group
        has formed. ``peer_address`` is the IP address of the HTTP client that sent it:
        the nccl backend dials the trainer's Gloo store only there (or at
        ``allowed_store_hosts``)."""
        self._native.init(json.dumps(init_info), peer_address or "")

    def receive_weights(self, update_info, load_weights, load_slices=None):
        """Receives one update (the dict of ``/update_weights``), calling
        ``load_weights([(hf_name, tensor), ...])`` with views of the receive buffers as they
        arrive (one or more calls per chunk, each of whole modules), valid during the call
        (``load_slices([(param, piece, tensor), ...])`` per chunk for a backend that lands
        slices: see the module's doc). Returns once every chunk is
        loaded. An exception raised by either ends the receive and is raised here
        unchanged; the trainer's sync fails with its text, and the engine takes the
        trainer's next init and sync."""
        self._native.receive(json.dumps(update_info), load_weights, load_slices)

    def fetch_weights(self, body):
        """delta only: brings the local checkpoint to ``body["target_version"]`` from the
        sync directory (the body of ``/fetch_weights``); returns the route's reply."""
        return json.loads(self._native.fetch(json.dumps(body)))

    def row_digest_ranges(self):
        """``{hf_name: [(begin, end), ...]}``: the dim-0 row ranges by which the trainer's
        in-line digests cover tensors no trainer rank holds whole (``sharded``, from the last
        ``init``); empty for other backends."""
        return self._native.row_digest_ranges()

    def shutdown(self):
        """Releases the communicator and mappings; ``init`` may be called again."""
        self._native.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False

    def __repr__(self):
        return (f"wsync.ReceiverEngine(backend={self.backend!r}, worker_rank={self.worker_rank}, "
                f"device={self.device!r})")


def sharding_table(model, tp_rank, tp_size, mtp_drafter=False):
    """The parameters of worker ``tp_rank`` of ``tp_size`` of ``model`` as the sharded
    backend lands them, in the order ``load_slices``' ``param`` indexes: ``[{"name",
    "dtype", "shape", "drafter", "pieces": [{"hf_name", "dim", "hf_start", "length",
    "dst_index", "dst_start", "primary", "hf_shape", "numel"}, ...]}, ...]`` (names are
    vLLM's parameter names; ``primary`` marks the one copy of each HF element across the
    TP group)."""
    return _wsync.sharding_table(str(model), int(tp_rank), int(tp_size), bool(mtp_drafter))


__all__ = ["ReceiverEngine", "BACKEND_OPTIONS", "sharding_table"]
