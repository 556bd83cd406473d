"""LoRA adapters synced into vLLM from memory (docs/lora.md, "Inside vLLM").

vLLM's ``/start_weight_update`` passes no body to the workers, so a lora session's
``wsync_lora`` object reaches them through the collective RPC ``wsync_lora_start`` (args:
the object as JSON, then ``"start"`` to open vLLM's session in the same call, as a wsync
trainer does; without it ``/start_weight_update`` follows). The data comes by
``/update_weights``; a wsync trainer ends the session with the collective RPC
``wsync_lora_finish`` (its in-line digests, checked, then vLLM's finish), or
``wsync_inline_digests`` and ``/finish_weight_update`` do it in two calls. The
workers stage the adapter's tensors beside the version they serve, check each against the
declared list as it lands and digest it, and at finish install the staged version in one
step; a session that fails, is refused or is abandoned leaves the previous version.

vLLM 0.32 loads adapters by path only (``WorkerLoRAManager._load_adapter``). The engine
wraps that method of the worker's LoRA manager: a request whose ``lora_path`` is
``wsync://<name>`` gets a ``LoRAModel`` built with ``LoRAModel.from_lora_tensors`` from
the version of ``<name>`` the worker holds; any other path loads as vLLM does. The API
server learns a name once, after its first version landed:
``POST /v1/load_lora_adapter {"lora_name": NAME, "lora_path": "wsync://NAME"}``. Every
later version replaces the held tensors and drops the built ``LoRAModel``, so the next step
that names the adapter (or a reload after vLLM's LRU evicted it, or after a full-weight
update, whose finish removes every adapter) builds it from the new version.
"""

import re

import torch

from wsync.worker_server import tensors_copy_digest_into

# The lora_path prefix that names an adapter the workers hold in memory.
PLACEHOLDER = "wsync://"
FORMAT = 1
NAME = re.compile(r"^(?!\.)[A-Za-z0-9._-]{1,64}$")
FIELDS = {"format", "name", "version", "r", "alpha", "use_rslora", "target_modules", "dtype"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The decoder modules an adapter may target, with their group (Llama/Qwen3 layout).
MODULE_GROUPS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                 "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def parse_spec(spec):
    """The ``wsync_lora`` object, checked (docs/lora.md's rules); ValueError naming the field."""
    if not isinstance(spec, dict):
        raise ValueError("wsync_lora must be a JSON object")
    unknown = sorted(set(spec) - FIELDS)
    if unknown:
        raise ValueError(f"wsync_lora has unknown fields {unknown} (format {FORMAT} has {sorted(FIELDS)})")
    if spec.get("format") != FORMAT:
        raise ValueError(f"wsync_lora format {spec.get('format')!r}: this server reads format {FORMAT}")
    name, version = spec.get("name"), spec.get("version")
    if not isinstance(name, str) or not NAME.match(name):
        raise ValueError(f"wsync_lora name {name!r}: 1..64 of [A-Za-z0-9._-], not starting with '.'")
    if not isinstance(version, str) or not 1 <= len(version) <= 256 or not version.isprintable() \
            or not version.isascii():
        raise ValueError(f"wsync_lora version {version!r}: 1..256 printable ASCII characters")
    r = spec.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= 1024:
        raise ValueError(f"wsync_lora r {r!r}: an integer in 1..1024")
    alpha = spec.get("alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not 0 < alpha <= 1e6:
        raise ValueError(f"wsync_lora alpha {alpha!r}: a number in (0, 1e6]")
    rslora = spec.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise ValueError("wsync_lora use_rslora must be true or false")
    modules = spec.get("target_modules")
    if not isinstance(modules, list) or not 1 <= len(modules) <= 16 or len(set(modules)) != len(modules):
        raise ValueError("wsync_lora target_modules: 1..16 unique module names")
    for m in modules:
        if m not in MODULE_GROUPS:
            raise ValueError(f"wsync_lora target module {m!r}: the vLLM plugin targets {sorted(MODULE_GROUPS)}")
    dtype = spec.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"wsync_lora dtype {dtype!r}: one of {sorted(DTYPES)}")
    return {"name": name, "version": version, "r": r, "alpha": float(alpha), "use_rslora": rslora,
            "target_modules": list(modules), "dtype": dtype}


def declared_tensors(spec, hf_config, model_dtype):
    """{PEFT name: (torch dtype, shape)} the declaration fixes, in the model's order."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    inter = hf_config.intermediate_size
    base = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv * head_dim, hidden),
            "v_proj": (kv * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    dtype = DTYPES[spec["dtype"]] if spec["dtype"] else model_dtype
    r = spec["r"]
    out = {}
    for layer in range(hf_config.num_hidden_layers):
        for module in MODULE_GROUPS:
            if module not in spec["target_modules"]:
                continue
            out_dim, in_dim = base[module]
            stem = f"base_model.model.model.layers.{layer}.{MODULE_GROUPS[module]}.{module}"
            out[stem + ".lora_A.weight"] = (dtype, (r, in_dim))
            out[stem + ".lora_B.weight"] = (dtype, (out_dim, r))
    return out


class StagingBuffer:
    """Host memory for one version of an adapter: one flat allocation, a view per declared
    tensor. A worker keeps the buffer of the version it replaced for the next session of
    that adapter, so that a steady sync writes into memory already faulted in."""

    ALIGN = 64

    def __init__(self, declared):
        self.layout = tuple((name, str(dtype), tuple(shape)) for name, (dtype, shape) in declared.items())
        offsets, total = [], 0
        for dtype, shape in declared.values():
            offsets.append(total)
            nbytes = torch.empty(0, dtype=dtype).element_size()
            for d in shape:
                nbytes *= d
            total += -(-nbytes // self.ALIGN) * self.ALIGN
        self.flat = torch.empty(total, dtype=torch.uint8)
        self.views = {}
        for (name, (dtype, shape)), off in zip(declared.items(), offsets):
            count = 1
            for d in shape:
                count *= d
            nbytes = count * torch.empty(0, dtype=dtype).element_size()
            self.views[name] = self.flat[off:off + nbytes].view(dtype).view(shape)

    def fits(self, declared):
        return self.layout == tuple((n, str(d), tuple(s)) for n, (d, s) in declared.items())


class Staging:
    """One lora session's tensors on one worker, checked as they land."""

    def __init__(self, spec, declared, buffer=None):
        self.spec = spec
        self.declared = declared
        self.buffer = buffer if buffer is not None and buffer.fits(declared) else StagingBuffer(declared)
        self.tensors = {}

    def land(self, chunk):
        """Copies each (name, tensor) of `chunk` (views of a receive buffer) into its place
        and returns the xxh3-128 of each copy, taken as it is copied; ValueError, before
        anything is copied, for a tensor the declaration does not list as sent, one of
        another dtype or shape, or one sent twice."""
        names = set()
        for name, tensor in chunk:
            want = self.declared.get(name)
            if want is None:
                raise ValueError(f"tensor {name} is not one of adapter {self.spec['name']}'s ({len(self.declared)} "
                                 f"tensors: lora_A and lora_B of {', '.join(self.spec['target_modules'])} in every "
                                 "decoder layer)")
            if tensor.dtype != want[0] or tuple(tensor.shape) != want[1]:
                raise ValueError(f"adapter {self.spec['name']}: tensor {name} is {str(tensor.dtype)[6:]} "
                                 f"{list(tensor.shape)}; declared {str(want[0])[6:]} {list(want[1])}")
            if name in self.tensors or name in names:
                raise ValueError(f"adapter {self.spec['name']}: tensor {name} sent twice in one session")
            names.add(name)
        dsts = [self.buffer.views[name] for name, _ in chunk]
        digests = tensors_copy_digest_into([t for _, t in chunk], dsts, "xxh3_128")
        for (name, _), dst in zip(chunk, dsts):
            self.tensors[name] = dst
        return digests

    def missing(self):
        return [n for n in self.declared if n not in self.tensors]


def peft_config(spec, max_position_embeddings):
    return {"r": spec["r"], "lora_alpha": spec["alpha"], "target_modules": spec["target_modules"],
            "use_rslora": spec["use_rslora"], "bias": "none",
            "vllm_max_position_embeddings": max_position_embeddings}


def check_rank(spec, manager):
    """ValueError when vLLM's LoRA settings refuse the adapter (rank above --max-lora-rank)."""
    from vllm.lora.peft_helper import PEFTHelper
    PEFTHelper.from_dict(peft_config(spec, manager.max_position_embeddings)).validate_legal(manager.lora_config)


def build(adapter, lora_int_id, manager):
    """vLLM's LoRAModel of a held adapter ({"spec", "tensors"}) under `lora_int_id`. The
    tensors are copied: vLLM folds the scaling into lora_b in place when it activates it."""
    from vllm.lora.peft_helper import PEFTHelper
    spec = adapter["spec"]
    helper = PEFTHelper.from_dict(peft_config(spec, manager.max_position_embeddings))
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = mapper.get_rename_mapper()
    return manager._lora_model_cls.from_lora_tensors(
        lora_int_id, {k: v.clone() for k, v in adapter["tensors"].items()}, helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size, weights_mapper=mapper,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))


def install_load_hook(manager, engine):
    """Makes `manager` (a vLLM WorkerLoRAManager) build ``wsync://<name>`` adapters from
    `engine`'s held versions (module doc). Idempotent."""
    if getattr(manager, "_wsync_engine", None) is engine:
        return
    original = getattr(manager, "_wsync_original_load", None) or manager._load_adapter
    manager._wsync_original_load = original
    manager._wsync_engine = engine

    def _load_adapter(lora_request):
        path = lora_request.lora_path
        if isinstance(path, str) and path.startswith(PLACEHOLDER):
            return engine.lora_model(path[len(PLACEHOLDER):], lora_request, manager)
        return original(lora_request)

    manager._load_adapter = _load_adapter
