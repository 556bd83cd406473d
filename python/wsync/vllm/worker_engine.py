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

``sharded`` lands each worker's pre-sliced TP shards straight into its parameters by vLLM
name, planned from wsync's sharding table of the served model (``wsync.vllm.slices``).

Received tensors are views of wsync's receive buffers, valid only during one chunk's
callback. vLLM's layerwise reload keeps the tensors handed to ``load_weights`` until a
layer has all its weights, which may be in a later chunk, so after each chunk the engine
copies what the reload still holds for layers it has not completed (usually only a layer
split across two chunks).

An MTP drafter (``--speculative-config '{"method": "mtp", ...}'``) is reloaded from the
same stream, as ``wsync serve --speculative mtp`` reloads it: in an ordinary session the
engine brackets the drafter with its own layerwise reload and hands it, after the target,
each chunk's tensors of the MTP layers (the drafter shares the target's embed_tokens and
lm_head). vLLM hands the engine its target only; the drafter is the one of the worker that
holds the engine (``Worker.get_draft_model``). A draft session
(``/start_draft_weight_update``) lands its stream in the drafter alone, as vLLM's own.

In-line verification: a wsync trainer sends the xxh3-128 digest of every tensor it read
through the collective RPC ``wsync_inline_digests`` after the session's last
``/update_weights`` and before ``/finish_weight_update`` (vLLM's finish route passes only
``weight_version``). Each worker compares them with the digests of the bytes it handed to
``load_weights`` and answers what it checked; ``finish_weight_update`` then refuses a
session whose bytes differ: it puts back what the layerwise reload still holds, raises
naming the tensors (vLLM answers 500 and keeps the previous weight version), and leaves
the mismatch in ``stats``.

A LoRA adapter (docs/lora.md) comes in a lora session: the collective RPC
``wsync_lora_start`` names it before ``/start_weight_update`` (or, given ``"start"``,
opens the session itself); the session lands its tensors in staging beside the version the
worker holds (no layerwise reload: the base weights are untouched), verified in-line as
full weights are, and its finish installs the version, which vLLM's LoRA manager builds
from memory (``wsync.vllm.lora``). A wsync trainer ends it with the collective RPC
``wsync_lora_finish`` (the digests, the check and vLLM's finish in one call, all-or-none
over the server's workers), so that a lora session costs three calls through vLLM's
engine loop: ``wsync_lora_start``, ``/update_weights``, ``wsync_lora_finish``.
"""

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

import wsync
from wsync import _wsync
from wsync.receiver import BACKEND_OPTIONS
from wsync.vllm.slices import device_rows, digest_by_rows
from wsync.worker_server import tensor_digest

# The environment variable holding a server's own settings (JSON object): the keys of
# wsync.ReceiverEngine's backend options. Declared in wsync's env table (wsync env).
OPTIONS_ENV = "WSYNC_VLLM_OPTIONS"
# Hosts a worker dials for the nccl backend's Gloo store when the server names none: this
# machine only (vLLM's routes do not tell the engine who sent init_info).
DEFAULT_STORE_HOSTS = ["127.0.0.1", "::1", "localhost"]
# The bound on every wait of the receiving core, seconds (the trainer's own, if shorter, wins).
DEFAULT_TIMEOUT = 300.0

logger = init_logger(__name__)

# A value not looked up yet.
_UNSET = object()
# Marks a tensor the engine copied out of a receive buffer (see _own_pending).
_OWNED = "_wsync_owned"

# The backends whose receiver answers fetch_weights (their descriptors say so).
_FETCHING = frozenset(b["name"] for b in _wsync.backends() if b["fetches"])
# The backends that land slices planned from the model (their descriptors name a model
# option, the servers' model the trainer plans from).
_SLICING = frozenset(b["name"] for b in _wsync.backends() if b["model_option"])
# The backends whose update_info is the tensor list (neither fetching nor planning from
# the model), which carry LoRA adapters.
_LORA = frozenset(b["name"] for b in _wsync.backends() if not b["fetches"] and not b["model_option"])


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
    load_seconds: float = 0.0         # inside the model's load_weights (sharded: vLLM processing whole layers)
    copy_seconds: float = 0.0         # copying views the layerwise reload still holds after a chunk
                                      # (sharded: copying slices into the parameters)
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
        # sharded: the table's parameters bound to the model (wsync.vllm.slices), per backend.
        self._slices = None
        # The trainer digests on its GPU (init_info wsync_device_digests): a tensor it cuts
        # into row ranges is digested here by the same ranges (_landed_digest).
        self._device_rows = False
        # The MTP drafter reloaded beside the target in the session under way (_CoTarget),
        # and the worker's drafter once looked up (None: it serves none).
        self._co = None
        self._drafter = _UNSET
        # LoRA: the spec wsync_lora_start named for the next session, the session's
        # staging (wsync.vllm.lora.Staging), and the versions held by adapter name:
        # {"spec", "tensors", "digests", "ids": lora int ids vLLM built it under}.
        self._lora_next = None
        self._lora = None
        self._lora_manager = None
        self.adapters = {}
        # By adapter name: the StagingBuffer of a version replaced or refused, which the
        # next session of that adapter writes into.
        self._lora_spare = {}
        self.lora_syncs = 0
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
            self._slices = None
        if self._rx is None:
            pc = self.parallel_config
            label = f"vLLM worker dp{pc.data_parallel_index}/rank{pc.rank}"
            slicing = {}
            if init_info.backend in _SLICING:
                slicing, self._slices = self._slice_plan(label)
            self._rx = wsync.ReceiverEngine(
                init_info.backend, worker_rank=self.worker_rank, device=str(self.device),
                timeout=DEFAULT_TIMEOUT, label=label, **slicing, **server_options(init_info.backend))
        self._rx.init(init_info.fields, "")
        self._device_rows = init_info.fields.get("wsync_device_digests") is True

    def _slice_plan(self, label):
        """(the ReceiverEngine's model and tp_size, the SliceLanding) of a backend that lands
        slices; ValueError for a deployment or model it cannot map."""
        from wsync.receiver import sharding_table
        from wsync.vllm.slices import SliceLanding, plan_targets
        pc = self.parallel_config
        if pc.pipeline_parallel_size != 1:
            raise ValueError(f"backend sharded inside vLLM lands tensor-parallel shards only; this server runs "
                             f"pipeline_parallel_size {pc.pipeline_parallel_size}")
        if self.vllm_config.speculative_config is not None:
            raise ValueError("backend sharded inside vLLM does not land a speculative drafter's weights; use nccl, "
                             "ipc or delta for a server with --speculative-config")
        model_dir = _config_dir(self.model_config)
        tp_rank = self.worker_rank % pc.tensor_parallel_size
        table = sharding_table(model_dir, tp_rank, pc.tensor_parallel_size)
        landing = SliceLanding(plan_targets(self.model, table, label), _xxh3_hex)
        return {"model": model_dir, "tp_size": pc.tensor_parallel_size}, landing

    def start_weight_update(self) -> None:
        if self._lora_next is not None:
            self._start_lora()
            return
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        if self._drafter is _UNSET:
            self._drafter = _mtp_drafter(self)  # the worker's drafter never changes
        self._co = self._drafter if self.model is self._default_model else None
        initialize_layerwise_reload(self.model)
        if self._co is not None:
            initialize_layerwise_reload(self._co.model)
        self._reloading = True
        self._landing = {}
        self._differing = []
        self.stats = UpdateStats()
        if self._slices is not None:
            rows = self._rx.row_digest_ranges() if self._rx is not None and self._rx.backend in _SLICING else {}
            self._slices.begin(rows, self._device_rows)

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
        if self._lora is not None:
            self._receive_lora(update_info)
            return
        stats = self.stats
        copy = self._reloading
        model = self.model
        co = self._co

        landed = self._landing

        def load(chunk):
            t0 = time.perf_counter()
            self._inject_fault(chunk)
            for name, tensor in chunk:
                landed[name] = self._landed_digest(tensor)
            t1 = time.perf_counter()
            model.load_weights(chunk)
            if co is not None:
                drafts = [(name, t) for name, t in chunk if name.startswith(co.prefixes)]
                if drafts:
                    co.model.load_weights(drafts)
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

        load_slices = None
        if self._slices is not None and self._rx.backend in _SLICING:
            if not self._reloading:
                raise RuntimeError("backend sharded lands slices inside a weight update: POST /start_weight_update "
                                   "first (a wsync trainer does)")
            slices = self._slices

            def load_slices(items):
                slices.land(items, landed, _flip_first_byte if items and self._take_fault() else None)
                # load: vLLM's processing of completed layers; copy: the slices copied in.
                stats.load_seconds = slices.process_seconds
                stats.copy_seconds = slices.copy_seconds
                stats.digest_seconds = slices.digest_seconds
                stats.chunks += 1
                stats.tensors = len(slices.names)
                stats.bytes = slices.bytes

        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        t0 = time.perf_counter()
        try:
            with disable_mtp_completeness_check():
                self._rx.receive_weights(update_info.fields, load, load_slices)
        except BaseException:
            # vLLM ends the session on this exception without finish_weight_update.
            self._abort_reload()
            raise
        finally:
            stats.receive_seconds += time.perf_counter() - t0

    def _landed_digest(self, tensor):
        """The xxh3-128 hex of a landed tensor, or [(begin, end, hex), ...] of its rows where
        the trainer digests on its GPU and cuts a tensor of this size into row ranges
        (``wsync.vllm.slices.device_rows``, the trainer's own rule)."""
        return digest_by_rows(tensor, device_rows(tensor) if self._device_rows else [], _xxh3_hex)

    def finish_weight_update(self) -> None:
        if self._lora is not None:
            self._finish_lora()
            return
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
        if self._slices is not None and self._rx is not None and self._rx.backend in _SLICING:
            unfinished = self._slices.unfinished()
            if unfinished:
                self._abort_reload()
                raise RuntimeError(f"backend sharded: vLLM worker {self.worker_rank} did not receive every slice of "
                                   f"{', '.join(unfinished[:MAX_NAMED])}"
                                   + (f" and {len(unfinished) - MAX_NAMED} more" if len(unfinished) > MAX_NAMED else "")
                                   + "; the update is not finished")
            self._slices.digest_split(self._landing)
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        t0 = time.perf_counter()
        try:
            if self._co is not None:
                finalize_layerwise_reload(self._co.model, self._co.model_config)
            finalize_layerwise_reload(self.model, self.model_config)
        finally:
            self._reloading = False
            self._co = None
            self.stats.finish_seconds = time.perf_counter() - t0
        if self._slices is not None:
            # A tensor this worker got only a slice of has its digest on TP rank 0 alone:
            # what this worker held for it before describes the previous weights.
            for name in self._slices.names:
                self.landed.pop(name, None)
        # A tensor digested by row ranges has no whole digest to answer a read-back with.
        self.landed.update({k: v for k, v in self._landing.items() if isinstance(v, str)})
        for name, digest in self._landing.items():
            if not isinstance(digest, str):
                self.landed.pop(name, None)
        self._landing = {}
        self.syncs += 1

    def _own_pending(self):
        """Copies the received tensors vLLM's layerwise reload still holds for layers it
        has not completed: they view receive buffers that the next chunk reuses. A layer
        whose weights all arrived was processed inside load_weights and holds none."""
        from vllm.model_executor.model_loader.reload import layerwise
        for layer in self._reloaded_modules():
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
        keeps its new values, so a later sync must land); a lora session's staging is
        dropped. Idempotent."""
        self._lora = None
        if not self._reloading:
            return
        self._reloading = False
        self._landing = {}
        if self._slices is not None:
            self._slices.abort()
        from vllm.model_executor.model_loader.reload import layerwise
        for layer in self._reloaded_modules():
            info = layerwise.LAYERWISE_INFO.get(layer)
            if info is not None and info.can_load():
                if info.kernel_tensors is not None:
                    layerwise._place_kernel_tensors(layer, info)
                info.reset()
        layerwise.LOADING_LAYERS.clear()
        for model in [self.model] + ([self._co.model] if self._co is not None else []):
            if hasattr(model, "_original_do_torchao_reload"):
                model._do_torchao_reload = model._original_do_torchao_reload
        self._co = None

    def _reloaded_modules(self):
        """The modules of the session's models (the target's, then the drafter's own)."""
        seen = set()
        for model in [self.model] + ([self._co.model] if self._co is not None else []):
            for layer in model.modules():
                if id(layer) not in seen:
                    seen.add(id(layer))
                    yield layer

    def shutdown(self) -> None:
        self._abort_reload()
        if self._rx is not None:
            self._rx.shutdown()
            self._rx = None
            self._slices = None

    # ---- wsync's extras (collective RPCs, wsync.vllm.digests) --------------------------
    def check_inline(self, body):
        """In-line verification (module doc): compares ``body["wsync_digests"]`` ({hf_name:
        xxh3-128 hex}, ``"digest_algorithm": "xxh3_128"``) with the bytes this worker landed
        in the update under way; finish_weight_update refuses the update if any differ.
        Returns {"tensors": matched, "not_landed": [names this worker did not land or
        cannot check], "differing": count, "differ": [up to MAX_NAMED descriptions],
        "unverifiable": {name: why, for those it cannot check}}."""
        if not isinstance(body, dict) or not isinstance(body.get("wsync_digests"), dict):
            raise ValueError("wsync_inline_digests needs a JSON object with a 'wsync_digests' object")
        algorithm = body.get("digest_algorithm", "xxh3_128")
        if algorithm != "xxh3_128":
            raise ValueError(f"digest_algorithm {algorithm!r}: the vLLM plugin verifies in-line with 'xxh3_128' only")
        if not self._reloading and self._lora is None:
            raise RuntimeError("wsync_inline_digests outside a weight update (after /start_weight_update and "
                               "/update_weights, before /finish_weight_update)")
        if self._slices is not None and self._rx is not None and self._rx.backend in _SLICING:
            self._slices.digest_split(self._landing)
        digests = body["wsync_digests"]
        matched, not_landed, differing, reasons = 0, [], [], {}
        for name, want in digests.items():
            held = self._landing.get(name)
            staged = self._lora.tensors.get(name) if self._lora is not None else None
            if isinstance(held, str) and isinstance(want, dict) and staged is not None:
                # An adapter tensor the trainer digested by row ranges (a large one on its
                # GPU): its staged copy is digested by the same ranges when they tile it.
                rows = staged.shape[0] if staged.dim() else 0
                ranges = _tiling_ranges(want, rows)
                if ranges is None:
                    differing.append(f"{name} (the trainer's row ranges do not tile its {rows} rows)")
                    continue
                held = digest_by_rows(staged, ranges, _xxh3_hex)
            if held is None:
                not_landed.append(name)
            elif isinstance(want, str) != isinstance(held, str):
                # {"rows": [[begin, end, hex], ...]} (a tensor no trainer rank held whole)
                # against a whole digest, or the reverse: the ranges were not announced at
                # init (only sharded's are).
                not_landed.append(name)
                reasons[name] = ("digested by row ranges the vLLM worker was not told of" if isinstance(held, str)
                                 else "the worker digested it by row ranges, the trainer whole")
            elif (held == want) if isinstance(want, str) else (_rows_of(want) == [tuple(r) for r in held]):
                matched += 1
            else:
                differing.append(f"{name} (worker {self.worker_rank} landed {_digest_text(held)}, the trainer read "
                                 f"{_digest_text(want)})")
        self._differing = differing
        self.stats.inline_digests = len(digests)
        self.stats.inline_verified = matched
        self.stats.inline_differing = len(differing)
        return {"tensors": matched, "not_landed": not_landed, "differing": len(differing),
                "differ": differing[:MAX_NAMED], "unverifiable": reasons}

    # ---- LoRA adapters (wsync.vllm.lora) ------------------------------------------------
    def lora_start(self, body, manager):
        """wsync_lora_start: the next session is a lora session for ``body`` (the start's
        ``wsync_lora`` object); `manager` is the worker's LoRA manager. Returns the number of
        tensors the declaration fixes."""
        from wsync.vllm import lora
        if manager is None:
            raise RuntimeError("a LoRA adapter needs a server started with --enable-lora")
        spec = lora.parse_spec(body)
        lora.check_rank(spec, manager)
        declared = lora.declared_tensors(spec, self.model_config.hf_config, self.model_config.dtype)
        lora.install_load_hook(manager, self)
        self._lora_manager = manager
        self._lora_next = (spec, declared)
        return len(declared)

    def open_lora_session(self, worker):
        """wsync_lora_start with "start": opens vLLM's session on `worker` (its
        start_weight_update, which reaches start_weight_update here) for the adapter just
        named, in the same call; if vLLM refuses, nothing stays named for a later start."""
        try:
            worker.start_weight_update()
        except BaseException:
            self._lora_next = None
            raise

    def lora_finish(self, body, worker):
        """wsync_lora_finish: a lora session's in-line check and vLLM's finish in one call.
        The workers of the server agree (over vLLM's TP group) before any installs: if
        any landed a tensor that differs from the trainer's or lacks a declared one, every
        one drops its staging and the previous version keeps serving. vLLM's session is
        closed either way. Returns check_inline's reply with "finished"; raises for a
        missing tensor (check_inline's reply names differing ones in full). With
        ``{"abort": true}`` (a trainer ending a failed sync): drops what was staged and
        closes vLLM's session, if one is open."""
        if isinstance(body, dict) and body.get("abort") is True:
            self._abort_reload()
            self._lora_next = None
            self._differing = []
            if getattr(worker, "_weight_update_active", True):
                _finish_keeping_adapters(worker)
            return {"finished": False, "aborted": True}
        if self._lora is None:
            raise RuntimeError("wsync_lora_finish outside a lora session (after wsync_lora_start and "
                               "/update_weights, before /finish_weight_update)")
        spec = self._lora.spec
        result = self.check_inline(body)
        missing = self._lora.missing()
        if not _tp_all(not result["differing"] and not missing):
            held = self.adapters.get(spec["name"])
            keeps = (f"version {held['spec']['version']} of adapter {spec['name']} keeps serving" if held
                     else f"adapter {spec['name']} is not installed")
            self._lora_spare[spec["name"]] = self._lora.buffer
            self._lora = None
            self._differing = []
            _finish_keeping_adapters(worker)  # closes vLLM's session; nothing to install
            if missing:
                raise RuntimeError(
                    f"adapter {spec['name']} version {spec['version']}: {len(missing)} declared tensor(s) did not "
                    f"land on vLLM worker {self.worker_rank}: {', '.join(missing[:MAX_NAMED])}"
                    + (f" and {len(missing) - MAX_NAMED} more" if len(missing) > MAX_NAMED else "") + f"; {keeps}")
            logger.warning("wsync in-line verification: adapter %s version %s refused on vLLM worker %d (%d tensor(s) "
                           "differ here: %s); %s", spec["name"], spec["version"], self.worker_rank,
                           len(result["differ"]), "; ".join(result["differ"]) or "none", keeps)
            return {**result, "finished": False}
        _finish_keeping_adapters(worker)
        return {**result, "finished": True}

    def _start_lora(self):
        from wsync.vllm.lora import Staging
        spec, declared = self._lora_next
        self._lora_next = None
        if self._rx is not None and self._rx.backend not in _LORA:
            raise ValueError(f"backend {self._rx.backend} does not carry LoRA adapters "
                             f"({', '.join(sorted(_LORA))} do)")
        self._lora = Staging(spec, declared, self._lora_spare.pop(spec["name"], None))
        self._landing = {}
        self._differing = []
        self.stats = UpdateStats()

    def _receive_lora(self, update_info):
        staging, stats, landed = self._lora, self.stats, self._landing

        def load(chunk):
            t0 = time.perf_counter()
            self._inject_fault(chunk)
            for (name, tensor), digest in zip(chunk, staging.land(chunk)):
                landed[name] = digest
                stats.bytes += tensor.numel() * tensor.element_size()
            stats.copy_seconds += time.perf_counter() - t0
            stats.chunks += 1
            stats.tensors += len(chunk)

        t0 = time.perf_counter()
        try:
            self._rx.receive_weights(update_info.fields, load, None)
        except BaseException:
            self._lora = None  # vLLM ends the session: the held version keeps serving
            raise
        finally:
            stats.receive_seconds += time.perf_counter() - t0

    def _finish_lora(self):
        staging, self._lora = self._lora, None
        spec = staging.spec
        held = self.adapters.get(spec["name"])
        keeps = (f"version {held['spec']['version']} of adapter {spec['name']} keeps serving" if held
                 else f"adapter {spec['name']} is not installed")
        if self._differing or staging.missing():
            self._lora_spare[spec["name"]] = staging.buffer
        if self._differing:
            differing, self._differing = self._differing, []
            raise RuntimeError(
                f"wsync in-line verification: {len(differing)} tensor(s) of adapter {spec['name']} landed on vLLM "
                f"worker {self.worker_rank} differ from what the trainer read: {'; '.join(differing[:MAX_NAMED])}. "
                f"The update is not finished; {keeps}")
        missing = staging.missing()
        if missing:
            raise RuntimeError(
                f"adapter {spec['name']} version {spec['version']}: {len(missing)} declared tensor(s) did not land "
                f"on vLLM worker {self.worker_rank}: {', '.join(missing[:MAX_NAMED])}"
                + (f" and {len(missing) - MAX_NAMED} more" if len(missing) > MAX_NAMED else "") + f"; {keeps}")
        t0 = time.perf_counter()
        ids = held["ids"] if held else set()
        self.adapters[spec["name"]] = {"spec": spec, "tensors": staging.tensors, "digests": self._landing,
                                       "ids": ids, "buffer": staging.buffer}
        if held:
            self._lora_spare[spec["name"]] = held["buffer"]
        self._landing = {}
        # The next step naming the adapter builds the new version (wsync.vllm.lora).
        for lora_int_id in ids:
            self._lora_manager.remove_adapter(lora_int_id)
        self.stats.finish_seconds = time.perf_counter() - t0
        self.lora_syncs += 1

    def lora_model(self, name, lora_request, manager):
        """vLLM's LoRAModel of the held version of adapter `name` (the load hook's)."""
        from vllm.exceptions import LoRAAdapterNotFoundError
        from wsync.vllm.lora import build
        held = self.adapters.get(name)
        if held is None:
            raise LoRAAdapterNotFoundError(lora_request.lora_name, lora_request.lora_path)
        held["ids"].add(lora_request.lora_int_id)
        return build(held, lora_request.lora_int_id, manager)

    def lora_adapters(self):
        """{name: {"version", "r", "alpha", "use_rslora", "target_modules", "tensors",
        "bytes"}} of the versions this worker holds."""
        return {name: {**{k: a["spec"][k] for k in ("version", "r", "alpha", "use_rslora", "target_modules")},
                       "tensors": len(a["tensors"]),
                       "bytes": sum(t.numel() * t.element_size() for t in a["tensors"].values())}
                for name, a in self.adapters.items()}

    def lora_digests(self, name, algorithm=None):
        """wsync's /weight_checker reply for adapter `name`, by PEFT name: without
        `algorithm`, the xxh3-128 of the bytes that landed; with one ('xxh3_128' or
        'sha256'), digests read back from the held tensors now (a trainer's verify=)."""
        held = self.adapters.get(name)
        if held is None:
            raise ValueError(f"no LoRA adapter {name!r} on vLLM worker {self.worker_rank} "
                             f"(held: {sorted(self.adapters)})")
        if algorithm is None:
            return {"lora": name, "version": held["spec"]["version"], "algorithm": "xxh3_128",
                    "checksums": dict(held["digests"])}
        if algorithm not in ("xxh3_128", "sha256"):
            raise ValueError(f"algorithm {algorithm!r}: xxh3_128 or sha256")
        return {"lora": name, "version": held["spec"]["version"], "algorithm": algorithm,
                "checksums": {k: tensor_digest(t, algorithm) for k, t in held["tensors"].items()},
                "not_held": []}

    def _take_fault(self):
        """Whether a corrupt_next_landing is pending; it is then spent."""
        pending, self._corrupt_next = self._corrupt_next, False
        return pending

    def _inject_fault(self, chunk):
        """Applies a pending corrupt_next_landing to the first tensor of `chunk`."""
        if chunk and self._take_fault():
            _flip_first_byte(chunk[0][1])

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


@dataclass
class _CoTarget:
    """A model reloaded beside the session's target from the same stream."""

    model: Any
    model_config: Any
    prefixes: tuple  # the HF name prefixes of the tensors it loads


def _mtp_drafter(engine):
    """The worker's MTP drafter and its MTP layers' HF prefixes, when the server runs one;
    None without. RuntimeError when the server runs one the engine cannot reach."""
    spec = engine.vllm_config.speculative_config
    if spec is None or spec.method != "mtp":
        return None
    drafter = None
    import gc
    for ref in gc.get_referrers(engine):
        owner = ref if isinstance(ref, dict) else getattr(ref, "__dict__", None)
        if isinstance(owner, dict) and owner.get("weight_transfer_engine") is engine:
            get = getattr(owner.get("model_runner"), "get_draft_model", None)
            drafter = get() if callable(get) else None
            break
    if drafter is None:
        raise RuntimeError("this server runs an MTP drafter (--speculative-config method mtp) that the wsync engine "
                           "cannot reach through its vLLM worker: the drafter would keep its old weights")
    hf = engine.model_config.hf_config
    first, count = hf.num_hidden_layers, getattr(hf, "num_nextn_predict_layers", 0) or 0
    return _CoTarget(drafter, spec.draft_model_config,
                     tuple(f"model.layers.{i}." for i in range(first, first + count)))


def _xxh3_hex(tensor):
    """The xxh3-128 hex of a landed tensor's bytes, the digest in-line verification compares."""
    return tensor_digest(tensor, "xxh3_128")


def _rows_of(want):
    """[(begin, end, hex), ...] of a trainer's row-range digest ({"rows": [...]}); None
    when it is malformed (it then matches nothing)."""
    rows = want.get("rows") if isinstance(want, dict) else None
    if not isinstance(rows, list):
        return None
    out = []
    for r in rows:
        if not (isinstance(r, list) and len(r) == 3 and all(isinstance(x, int) and not isinstance(x, bool)
                                                              for x in r[:2]) and isinstance(r[2], str)):
            return None
        out.append((r[0], r[1], r[2]))
    return out


def _tiling_ranges(want, rows):
    """[(begin, end), ...] of a trainer's row-range digest when its ranges tile [0, rows)
    in order; None otherwise."""
    got = _rows_of(want)
    if not got:
        return None
    ranges, at = [], 0
    for begin, end, _ in got:
        if begin != at or end <= begin or end > rows:
            return None
        ranges.append((begin, end))
        at = end
    return ranges if at == rows else None


def _digest_text(digest):
    """A digest as an error names it: the hex, or the row ranges' hexes, cut short."""
    if isinstance(digest, str):
        return digest[:64]
    rows = _rows_of(digest) if isinstance(digest, dict) else [tuple(r) for r in digest]
    if rows is None:
        return "a malformed row digest"
    return "rows " + ", ".join(f"[{b}, {e}) {h[:16]}" for b, e, h in rows[:3]) + (" ..." if len(rows) > 3 else "")


def _finish_keeping_adapters(worker):
    """vLLM's finish_weight_update on `worker`, for a lora session: without the reset of
    every loaded adapter that follows a full-weight update there (a lora session leaves the
    base weights as they were; finish_weight_update here drops what was built of the
    adapter it replaced). vLLM skips that reset for a drafter's session, so the session is
    finished as one."""
    draft = getattr(worker, "_weight_update_is_draft", None)
    if draft is None:
        worker.finish_weight_update()
        return
    worker._weight_update_is_draft = True
    try:
        worker.finish_weight_update()
    finally:
        worker._weight_update_is_draft = draft


def _tp_all(ok):
    """Whether `ok` holds on every worker of this server's TP group (a collective: every
    worker of the group calls it)."""
    from vllm.distributed import get_tp_group
    group = get_tp_group()
    if group.world_size == 1:
        return bool(ok)
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
    torch.distributed.all_reduce(flag, group=group.cpu_group)
    return int(flag.item()) == 0


def _config_dir(model_config):
    """A directory holding the served model's config.json: vLLM's model directory, or one
    written from vLLM's hf_config for a model vLLM found elsewhere (a hub name)."""
    path = str(model_config.model)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import tempfile
    directory = tempfile.mkdtemp(prefix="wsync-vllm-config-")
    with open(os.path.join(directory, "config.json"), "w") as f:
        f.write(model_config.hf_config.to_json_string())
    return directory


def _flip_first_byte(tensor):
    """Inverts the first byte of `tensor` in place (corrupt_next_landing)."""
    if tensor.numel() > 0:
        raw = tensor.reshape(-1).view(torch.uint8)
        raw[0] = raw[0] ^ 0xFF
