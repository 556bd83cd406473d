"""``sharded`` inside vLLM: landing pre-sliced TP shards in a worker's parameters.

wsync's ``sharded`` backend sends each worker only the slices it holds, planned from wsync's
sharding table of the model (``wsync.receiver.sharding_table``): for each vLLM parameter of
worker ``tp_rank`` of ``tp_size``, the pieces that fill it, "rows ``[hf_start,
hf_start+length)`` along ``dim`` of HF tensor X land at ``dst_start`` along ``dim`` of the
parameter". A slice goes straight into the parameter the table names, by vLLM parameter
name; nothing passes through ``load_weights``, whose loaders would slice again.

The mapping, checked against the installed vLLM's model at ``init_transfer_engine`` (Qwen3,
vLLM 0.32; every name below is vLLM's, a shape is this rank's shard):

- ``model.embed_tokens.weight`` and ``lm_head.weight`` (``VocabParallelEmbedding``,
  ``ParallelLMHead``): rows ``[r*V/tp, (r+1)*V/tp)`` of the vocabulary padded to a multiple
  of 64 (``V``); padding rows are zero.
- ``self_attn.qkv_proj.weight`` (``QKVParallelLinear``, ``packed_modules_mapping``
  ``qkv_proj: [q_proj, k_proj, v_proj]``): this rank's q heads, then its KV heads of k, then
  of v, along dim 0 (the layer's ``output_sizes`` divided by tp); with tp above the KV head
  count each KV head lives on tp/Hkv ranks (one copy is primary).
- ``mlp.gate_up_proj.weight`` (``MergedColumnParallelLinear``, ``gate_up_proj: [gate_proj,
  up_proj]``): this rank's rows of gate_proj, then of up_proj.
- ``self_attn.o_proj.weight``, ``mlp.down_proj.weight`` (``RowParallelLinear``): columns
  ``[r*n/tp, (r+1)*n/tp)``, dim 1.
- ``input_layernorm``, ``post_attention_layernorm``, ``self_attn.q_norm``,
  ``self_attn.k_norm``, ``model.norm``: whole on every rank (rank 0's copy is primary).

A vLLM parameter no table entry fills, a table parameter vLLM lacks, or a shape or dtype
that differs refuses ``init_transfer_engine``, naming the tensor.

vLLM's layerwise reload (``start_weight_update``) puts every layer back on the meta
device; the first slice of a layer materializes it, its slices are copied in, and once
every piece the table lists for the layer has landed the layer is processed as vLLM's own
reload processes it (``process_weights_after_loading``: CPU GEMM prepacking, quantization)
and copied into the tensors the kernels hold.

In-line verification: the trainer digests whole HF tensors. A worker digests a tensor it
lands whole (replicated norms; every tensor at tp 1) as it lands; the primary slices of a
tensor split across the TP group are copied aside and, at the first of the in-line check
and ``finish_weight_update`` (both run on every worker), gathered to TP rank 0 over vLLM's
CPU group, reassembled and digested there. Non-primary copies of a split tensor (KV heads
replicated across ranks) are landed, not digested.
"""

import dataclasses
import time

import torch

from wsync import _wsync

# The torch dtype of a sharding table's dtype name.
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class _Target:
    """One table parameter: the vLLM module holding it, its attribute, its pieces."""

    name: str
    layer: torch.nn.Module
    attr: str
    dtype: torch.dtype
    pieces: list
    zero: bool  # its pieces leave elements unfilled (vocabulary padding): zeroed first


def _meta_of(layer, attr):
    """The model-format parameter `attr` of `layer`: as vLLM's reload metadata recorded it
    (CPU prepacking empties the live one), else the live one; None when it has none."""
    from vllm.model_executor.model_loader.reload import layerwise
    info = layerwise.LAYERWISE_INFO.get(layer)
    if info is not None and attr in info.restore_metadata[0]:
        return info.restore_metadata[0][attr]
    return layer._parameters.get(attr)


def plan_targets(model, table, label):
    """The table's parameters bound to `model`'s modules; ValueError naming every tensor
    that cannot be mapped (see the module's doc)."""
    problems, targets = [], []
    for param in table:
        name = param["name"]
        module_name, _, attr = name.rpartition(".")
        try:
            layer = model.get_submodule(module_name)
        except AttributeError:
            problems.append(f"{name}: vLLM's model has no module {module_name}")
            continue
        meta = _meta_of(layer, attr)
        if meta is None:
            problems.append(f"{name}: vLLM's {type(layer).__name__} has no parameter {attr}")
            continue
        if tuple(meta.shape) != tuple(param["shape"]):
            problems.append(f"{name}: vLLM holds shape {list(meta.shape)}, wsync's sharding table says "
                            f"{list(param['shape'])}")
            continue
        dtype = _DTYPES.get(param["dtype"])
        if dtype != meta.dtype:
            problems.append(f"{name}: vLLM holds {meta.dtype}, wsync's sharding table says {param['dtype']}")
            continue
        numel = 1
        for n in param["shape"]:
            numel *= n
        filled = sum(p["numel"] for p in param["pieces"])
        targets.append(_Target(name, layer, attr, dtype, param["pieces"], filled < numel))
    mapped = {p["name"] for p in table}
    for name, _ in model.named_parameters():
        if name not in mapped:
            problems.append(f"{name}: no entry of wsync's sharding table fills this vLLM parameter")
    if problems:
        raise ValueError(f"backend sharded cannot land in {label}'s model: {len(problems)} tensor(s) are not mapped: "
                         + "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else ""))
    return targets


def device_rows(tensor):
    """The row ranges [(begin, end), ...] of dim 0 by which a trainer digesting on its GPU
    (init_info ``wsync_device_digests``) digests the whole HF tensor `tensor`: its own rule
    (src/engine/device_digests.h); [] when it digests it whole."""
    if tensor.dim() == 0:
        return []
    return _wsync.device_digest_rows(tensor.shape[0], tensor.numel() * tensor.element_size())


def digest_by_rows(tensor, ranges, digest):
    """``digest(tensor)``, or [(begin, end, digest of those rows), ...] by `ranges`."""
    if not ranges:
        return digest(tensor)
    return [(b, e, digest(tensor.narrow(0, b, e - b).contiguous())) for b, e in ranges]


class SliceLanding:
    """Lands one worker's slices, update after update (see the module's doc). Runs on the
    worker's thread only."""

    def __init__(self, targets, digest):
        self._targets = targets
        self._digest = digest  # tensor -> xxh3-128 hex
        self._layer_numel = {}
        self._hf = {}  # hf_name -> (shape, dtype) of the tensors this worker gets slices of
        for t in targets:
            self._layer_numel[t.layer] = self._layer_numel.get(t.layer, 0) + sum(p["numel"] for p in t.pieces)
            for p in t.pieces:
                self._hf[p["hf_name"]] = (tuple(p["hf_shape"]), t.dtype)
        self._open = {}    # layer -> elements still to land in this update
        self._split = None  # hf_name -> [(dim, start, copy)] of split primary slices; None: gathered
        self._rows = {}     # hf_name -> [(begin, end)]: digested by those row ranges (begin())
        self._device_rows = False  # others by device_rows() (begin())
        self.names = set()  # HF tensors this update landed slices of
        self.bytes = 0
        # Seconds of this update: digesting, copying slices in, vLLM's processing of layers.
        self.digest_seconds = self.copy_seconds = self.process_seconds = 0.0

    def begin(self, rows=None, device_rows=False):
        """A new update; `rows` ({hf_name: [(begin, end), ...]}, the receiver's
        row_digest_ranges()) names the tensors digested by row ranges; with `device_rows`
        (the trainer ranks digest on their GPUs) any other tensor is digested by the ranges
        of ``device_rows()``."""
        self._open = {}
        self._split = {}
        self._rows = dict(rows or {})
        self._device_rows = device_rows
        self.names = set()
        self.bytes = 0
        self.digest_seconds = self.copy_seconds = self.process_seconds = 0.0

    def land(self, items, landing, corrupt=None):
        """Lands one chunk's [(param, piece, tensor), ...]; records whole tensors' digests
        in `landing`. `corrupt(tensor)` (a test fault) runs on the first slice."""
        from vllm.model_executor.model_loader.reload import layerwise
        from vllm.model_executor.model_loader.reload.meta import materialize_layer
        if self._split is None:
            raise RuntimeError("sharded slices arrived outside a weight update (POST /start_weight_update first)")
        for param, piece, tensor in items:
            if corrupt is not None:
                corrupt(tensor)
                corrupt = None
            t = self._targets[param]
            p = t.pieces[piece]
            layer = t.layer
            left = self._open.get(layer)
            if left is None:
                materialize_layer(layer, layerwise.LAYERWISE_INFO[layer])
                for other in self._targets:
                    if other.layer is layer and other.zero:
                        getattr(layer, other.attr).data.zero_()
                left = self._layer_numel[layer]
            name, dim = p["hf_name"], p["dim"]
            t0 = time.perf_counter()
            if p["length"] == p["hf_shape"][dim]:
                landing[name] = self._digest_of(name, tensor)
            t1 = time.perf_counter()
            if p["length"] != p["hf_shape"][dim] and p["primary"]:
                self._split.setdefault(name, []).append((dim, p["hf_start"], tensor.clone()))
            dst = getattr(layer, t.attr).data
            if p["dst_index"] >= 0:
                dst = dst[p["dst_index"]]
            dst.narrow(dim, p["dst_start"], p["length"]).copy_(tensor)
            t2 = time.perf_counter()
            self.names.add(name)
            self.bytes += tensor.numel() * tensor.element_size()
            left -= p["numel"]
            if left == 0:
                layerwise._layerwise_process(layer, layerwise.LAYERWISE_INFO[layer])
                self._open.pop(layer, None)
            else:
                self._open[layer] = left
            self.digest_seconds += t1 - t0
            self.copy_seconds += t2 - t1
            self.process_seconds += time.perf_counter() - t2

    def unfinished(self):
        """Names of the parameters of layers this update began and did not complete."""
        return [t.name for t in self._targets if t.layer in self._open]

    def abort(self):
        self._open = {}
        self._split = None

    def digest_split(self, landing):
        """Gathers the split tensors' primary slices to TP rank 0 and digests them there
        into `landing` (a collective of the TP group; a no-op once done for this update)."""
        if self._split is None:
            return
        mine, self._split = self._split, None
        from vllm.distributed import get_tp_group
        group = get_tp_group()
        parts = [mine]
        if group.world_size > 1:
            parts = [None] * group.world_size if group.rank_in_group == 0 else None
            torch.distributed.gather_object(mine, parts, dst=group.ranks[0], group=group.cpu_group)
        if group.rank_in_group != 0:
            return
        merged = {}
        for part in parts:
            for name, slices in part.items():
                merged.setdefault(name, []).extend(slices)
        for name, slices in merged.items():
            shape, dtype = self._hf[name]
            whole = torch.empty(shape, dtype=dtype)
            filled = 0
            for dim, start, t in slices:
                whole.narrow(dim, start, t.shape[dim]).copy_(t)
                filled += t.numel()
            if filled != whole.numel():
                raise RuntimeError(f"in-line verification of {name}: the TP group's primary slices fill {filled} of "
                                   f"its {whole.numel()} elements")
            landing[name] = self._digest_of(name, whole)

    def _digest_of(self, name, whole):
        """The xxh3-128 hex of a whole HF tensor, or [(begin, end, hex), ...] of its rows by
        the ranges begin() named for it."""
        ranges = self._rows.get(name)
        if not ranges and self._device_rows:
            ranges = device_rows(whole)
        return digest_by_rows(whole, ranges, self._digest)

