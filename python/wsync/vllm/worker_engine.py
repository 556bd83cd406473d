"""The worker side: vLLM's ``WeightTransferEngine`` over wsync's receiving core.

vLLM builds one engine per worker process (``Worker.load_model``) when the server runs
``--weight-transfer-config '{"backend": "wsync"}'``, and drives it from its dev-mode
routes: ``/init_weight_transfer_engine`` -> ``init_transfer_engine``,
``/start_weight_update`` -> ``start_weight_update``, ``/update_weights`` ->
``update_weights``, ``/finish_weight_update`` -> ``finish_weight_update``. Every call runs
on the worker's own thread, one at a time.

The init_info is the one a wsync trainer (``wsync.TrainerEngine``, ``wsync push``) sends
to a wsync server; it names its wsync backend by its fields (see ``backend_of``) or
explicitly with ``"wsync_backend"``. The worker is rank ``rank_offset + dp_index *
world_size + rank`` of the trainer's group, as vLLM numbers workers.

Received tensors are views of wsync's receive buffers, valid only during one chunk's
callback. vLLM's layerwise reload keeps the tensors handed to ``load_weights`` until a
layer has all its weights, which may be in a later chunk, so after each chunk the engine
copies what the reload still holds for layers it has not completed (usually only a layer
split across two chunks).

In-line verification: a wsync trainer sends the xxh3-128 digest of every tensor it read
through the collective RPC ``wsync_inline_digests`` after the session's last
``/update_weights`` and before ``/finish_weight_update`` (vLLM's finish route passes only
``weight_version``). Each worker compares them with the digests of the bytes it handed to
``load_weights`` and answers what it checked; ``finish_weight_update`` then refuses a
session whose bytes differ: it puts back what the layerwise reload still holds, raises
naming the tensors (vLLM answers 500 and keeps the previous weight version), and leaves
the mismatch in ``stats``.
"""

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

import wsync
from wsync import _wsync
from wsync.receiver import BACKEND_OPTIONS
from wsync.worker_server import tensor_digest

# The environment variable holding a server's own settings (JSON object): the keys of
# wsync.ReceiverEngine's backend options. Declared in wsync's env table (wsync env).
OPTIONS_ENV = "WSYNC_VLLM_OPTIONS"
# Hosts a worker dials for the nccl backend's Gloo store when the server names none: this
# machine only (vLLM's routes do not tell the engine who sent init_info).
DEFAULT_STORE_HOSTS = ["127.0.0.1", "::1", "localhost"]
# The bound on every wait of the receiving core, seconds (the trainer's own, if shorter, wins).
DEFAULT_TIMEOUT = 300.0

# Marks a tensor the engine copied out of a receive buffer (see _own_pending).
_OWNED = "_wsync_owned"

# The backends whose receiver answers fetch_weights (their descriptors say so).
_FETCHING = frozenset(b["name"] for b in _wsync.backends() if b["fetches"])


def backend_of(init_info):
    """The wsync backend an init_info dict is for: its ``wsync_backend`` field, else the
    backend whose own init_info fields it carries most of (as wsync's backend-mismatch
    check tells them). ValueError when none fits."""
    named = init_info.get("wsync_backend")
    if named is not None:
        if named not in BACKEND_OPTIONS:
            raise ValueError(f"init_info 'wsync_backend' is {named!r}; this vLLM plugin receives "
                             f"{', '.join(sorted(BACKEND_OPTIONS))}")
        return named
    backend = _wsync.init_info_backend(json.dumps(init_info, default=str))
    if backend is not None:
        if backend not in BACKEND_OPTIONS:
            raise ValueError(f"init_info is for wsync's {backend!r} backend, which the vLLM plugin "
                             f"does not receive (it receives {', '.join(sorted(BACKEND_OPTIONS))})")
        return backend
    raise ValueError("init_info names no wsync backend: send a wsync trainer's init_info (wsync.TrainerEngine) "
                     "or name one with 'wsync_backend' (" + ", ".join(sorted(BACKEND_OPTIONS)) + ")")


def server_options(backend, environ=os.environ):
    """The receiver's backend options for ``backend`` from ``WSYNC_VLLM_OPTIONS``."""
    text = environ.get(OPTIONS_ENV, "")
    try:
        options = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"{OPTIONS_ENV} is not JSON: {e}") from e
    if not isinstance(options, dict):
        raise ValueError(f"{OPTIONS_ENV} must be a JSON object, not {type(options).__name__}")
    known = {k for keys in BACKEND_OPTIONS.values() for k in keys}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"{OPTIONS_ENV} has unknown keys {unknown} (known: {sorted(known)})")
    mine = {k: v for k, v in options.items() if k in BACKEND_OPTIONS[backend]}
    if "allowed_store_hosts" in BACKEND_OPTIONS[backend] and "allowed_store_hosts" not in mine:
        mine["allowed_store_hosts"] = list(DEFAULT_STORE_HOSTS)
    return mine


@dataclass
class WsyncInitInfo(WeightTransferInitInfo):
    """A wsync trainer's init_info: the backend it is for and its fields, as sent."""

    backend: str
    fields: dict = field(default_factory=dict)


@dataclass
class WsyncUpdateInfo(WeightTransferUpdateInfo):
    """A wsync trainer's update_info, as sent."""

    fields: dict = field(default_factory=dict)


@dataclass
class UpdateStats:
    """Timings of this worker's last weight update, seconds."""

    receive_seconds: float = 0.0      # update_weights calls, start to end (data plane included)
    load_seconds: float = 0.0         # inside the model's load_weights
    copy_seconds: float = 0.0         # copying views the layerwise reload still holds after a chunk
    digest_seconds: float = 0.0       # xxh3-128 of each landed tensor (read-back of emptied weights)
    finish_seconds: float = 0.0       # finish_weight_update (layerwise reload's tail)
    tensors: int = 0
    bytes: int = 0
    chunks: int = 0
    inline_digests: int = 0           # the trainer's digests this update was checked against
    inline_verified: int = 0          # tensors this worker landed whose bytes match them
    inline_differing: int = 0         # tensors this worker landed whose bytes differ


# The most differing tensors a message or a reply names.
MAX_NAMED = 5


class WsyncWeightTransferEngine(WeightTransferEngine[WsyncInitInfo, WsyncUpdateInfo]):
    """One vLLM worker's end of a wsync data plane (see the module's doc)."""

    init_info_cls = WsyncInitInfo
    update_info_cls = WsyncUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self._rx = None
        self._reloading = False
        self.stats = UpdateStats()
        self.syncs = 0
        # xxh3-128 of the bytes each HF tensor reached load_weights with in the last
        # finished update: the read-back of weights vLLM empties after loading
        # (wsync.vllm.digests). The update under way fills _landing; finish publishes it.
        self.landed = {}
        self._landing = {}
        # The in-line check of the update under way (check_inline): names of the tensors
        # whose landed bytes differ from the trainer's, with both digests.
        self._differing = []
        # Test-only fault (wsync_corrupt_next_landing): flip one byte of the next tensor landed.
        self._corrupt_next = False
        from wsync.vllm import digests
        digests.install_worker_rpcs()

    # ---- vLLM's hooks ------------------------------------------------------------------
    def parse_init_info(self, init_dict: dict[str, Any]) -> WsyncInitInfo:
        if not isinstance(init_dict, dict):
            raise ValueError(f"Invalid init_info for {type(self).__name__}: a JSON object is needed, "
                             f"not {type(init_dict).__name__}")
        try:
            backend = backend_of(init_dict)
        except ValueError as e:
            raise ValueError(f"Invalid init_info for {type(self).__name__}: {e}") from None
        fields = {k: v for k, v in init_dict.items() if k != "wsync_backend"}
        return WsyncInitInfo(backend=backend, fields=fields)

    def parse_update_info(self, update_dict: dict[str, Any]) -> WsyncUpdateInfo:
        if not isinstance(update_dict, dict):
            raise ValueError(f"Invalid update_info for {type(self).__name__}: a JSON object is needed, "
                             f"not {type(update_dict).__name__}")
        return WsyncUpdateInfo(fields=update_dict)

    @property
    def worker_rank(self):
        """This worker's index among its server's workers, as vLLM numbers them."""
        pc = self.parallel_config
        return pc.data_parallel_index * pc.world_size + pc.rank

    def init_transfer_engine(self, init_info: WsyncInitInfo) -> None:
        # A trainer that vanished inside a session left the layers taken apart.
        self._abort_reload()
        if self._rx is not None and self._rx.backend != init_info.backend:
            self._rx.shutdown()
            self._rx = None
        if self._rx is None:
            pc = self.parallel_config
            self._rx = wsync.ReceiverEngine(
                init_info.backend, worker_rank=self.worker_rank, device=str(self.device),
                timeout=DEFAULT_TIMEOUT, label=f"vLLM worker dp{pc.data_parallel_index}/rank{pc.rank}",
                **server_options(init_info.backend))
        self._rx.init(init_info.fields, "")

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        initialize_layerwise_reload(self.model)
        self._reloading = True
        self._landing = {}
        self._differing = []
        self.stats = UpdateStats()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's own synchronizes the accelerator afterwards; the CPU has nothing to wait for.
        typed = self.parse_update_info(update_info)
        self.receive_weights(typed)
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: WsyncUpdateInfo) -> None:
        if self._rx is None:
            raise RuntimeError("wsync weight transfer is not initialized: POST /init_weight_transfer_engine "
                               "first (a wsync trainer does)")
        stats = self.stats
        copy = self._reloading
        model = self.model

        landed = self._landing

        def load(chunk):
            t0 = time.perf_counter()
            if self._corrupt_next and chunk:
                self._corrupt_next = False
                _flip_first_byte(chunk[0][1])
            for name, tensor in chunk:
                landed[name] = tensor_digest(tensor, "xxh3_128")
            t1 = time.perf_counter()
            model.load_weights(chunk)
            t2 = time.perf_counter()
            if copy:
                self._own_pending()
            t3 = time.perf_counter()
            stats.digest_seconds += t1 - t0
            stats.load_seconds += t2 - t1
            stats.copy_seconds += t3 - t2
            stats.chunks += 1
            stats.tensors += len(chunk)
            stats.bytes += sum(t.numel() * t.element_size() for _, t in chunk)

        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        t0 = time.perf_counter()
        try:
            with disable_mtp_completeness_check():
                self._rx.receive_weights(update_info.fields, load)
        except BaseException:
            # vLLM ends the session on this exception without finish_weight_update.
            self._abort_reload()
            raise
        finally:
            stats.receive_seconds += time.perf_counter() - t0

    def finish_weight_update(self) -> None:
        if not self._reloading:
            return  # the update failed and its reload was undone: nothing to finish
        if self._differing:
            differing, self._differing = self._differing, []
            self._abort_reload()
            raise RuntimeError(
                f"wsync in-line verification: {len(differing)} tensor(s) landed on vLLM worker "
                f"{self.worker_rank} differ from what the trainer read: {'; '.join(differing[:MAX_NAMED])}"
                + (f"; and {len(differing) - MAX_NAMED} more" if len(differing) > MAX_NAMED else "")
                + ". The update is not finished; the previous weight version stays reported")
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        t0 = time.perf_counter()
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        finally:
            self._reloading = False
            self.stats.finish_seconds = time.perf_counter() - t0
        self.landed.update(self._landing)
        self._landing = {}
        self.syncs += 1

    def _own_pending(self):
        """Copies the received tensors vLLM's layerwise reload still holds for layers it
        has not completed: they view receive buffers that the next chunk reuses. A layer
        whose weights all arrived was processed inside load_weights and holds none."""
        from vllm.model_executor.model_loader.reload import layerwise
        for layer in self.model.modules():
            info = layerwise.LAYERWISE_INFO.get(layer)
            if info is None or not info.can_load() or not info.loaded_weights:
                continue
            for _, bound in info.loaded_weights:
                for key, value in bound.arguments.items():
                    if isinstance(value, torch.Tensor) and not value.is_meta and not getattr(value, _OWNED, False):
                        owned = value.clone()
                        setattr(owned, _OWNED, True)
                        bound.arguments[key] = owned

    def _abort_reload(self):
        """Puts back every layer a failed or abandoned update took apart, with the tensors
        it held before (vLLM's layerwise reload keeps them; a layer the update completed
        keeps its new values, so a later sync must land). Idempotent."""
        if not self._reloading:
            return
        self._reloading = False
        self._landing = {}
        from vllm.model_executor.model_loader.reload import layerwise
        for layer in self.model.modules():
            info = layerwise.LAYERWISE_INFO.get(layer)
            if info is not None and info.can_load():
                if info.kernel_tensors is not None:
                    layerwise._place_kernel_tensors(layer, info)
                info.reset()
        layerwise.LOADING_LAYERS.clear()
        if hasattr(self.model, "_original_do_torchao_reload"):
            self.model._do_torchao_reload = self.model._original_do_torchao_reload

    def shutdown(self) -> None:
        self._abort_reload()
        if self._rx is not None:
            self._rx.shutdown()
            self._rx = None

    # ---- wsync's extras (collective RPCs, wsync.vllm.digests) --------------------------
    def check_inline(self, body):
        """In-line verification (module doc): compares ``body["wsync_digests"]`` ({hf_name:
        xxh3-128 hex}, ``"digest_algorithm": "xxh3_128"``) with the bytes this worker landed
        in the update under way; finish_weight_update refuses the update if any differ.
        Returns {"tensors": matched, "not_landed": [names this worker did not land],
        "differing": count, "differ": [up to MAX_NAMED descriptions]}."""
        if not isinstance(body, dict) or not isinstance(body.get("wsync_digests"), dict):
            raise ValueError("wsync_inline_digests needs a JSON object with a 'wsync_digests' object")
        algorithm = body.get("digest_algorithm", "xxh3_128")
        if algorithm != "xxh3_128":
            raise ValueError(f"digest_algorithm {algorithm!r}: the vLLM plugin verifies in-line with 'xxh3_128' only")
        if not self._reloading:
            raise RuntimeError("wsync_inline_digests outside a weight update (after /start_weight_update and "
                               "/update_weights, before /finish_weight_update)")
        digests = body["wsync_digests"]
        matched, not_landed, differing = 0, [], []
        for name, want in digests.items():
            held = self._landing.get(name)
            if held is None:
                not_landed.append(name)
            elif held == want:
                matched += 1
            else:
                differing.append(f"{name} (worker {self.worker_rank} landed {held}, the trainer read "
                                 f"{str(want)[:64]})")
        self._differing = differing
        self.stats.inline_digests = len(digests)
        self.stats.inline_verified = matched
        self.stats.inline_differing = len(differing)
        return {"tensors": matched, "not_landed": not_landed, "differing": len(differing),
                "differ": differing[:MAX_NAMED]}

    def corrupt_next_landing(self):
        """Test-only fault: flips the first byte of the next tensor this worker lands, after
        it arrived and before it is digested and loaded (a data plane that delivered one
        wrong byte)."""
        self._corrupt_next = True

    def fetch_weights(self, body):
        """delta: brings the local checkpoint to ``body["target_version"]`` (wsync's
        ``/fetch_weights``), ahead of the update that applies it."""
        if self._rx is None or self._rx.backend not in _FETCHING:
            raise RuntimeError("fetch_weights needs the delta backend, initialized")
        return self._rx.fetch_weights(body)


def _flip_first_byte(tensor):
    """Inverts the first byte of `tensor` in place (corrupt_next_landing)."""
    if tensor.numel() > 0:
        raw = tensor.reshape(-1).view(torch.uint8)
        raw[0] = raw[0] ^ 0xFF
