"""LoRA adapters as weight sources: ``LoraSource``.

A LoRA run trains adapters, not the model: ``LoraSource`` hands a trainer engine the
adapter's A and B matrices, named and shaped as PEFT saves them
(``base_model.model.<module>.lora_A.weight`` ``[r, in]``, ``...lora_B.weight``
``[out, r]``), unscaled, plus what a server needs to install it: the adapter's name, ``r``,
``alpha``, ``use_rslora`` and target modules (``spec``). Give that spec to the engine and
every ``send_weights`` is a lora session (docs/lora.md)::

    adapter = wsync.LoraSource(peft_model, name="math")
    engine = wsync.TrainerEngine(backend="nccl", servers=[url], lora=adapter)
    engine.send_weights(adapter, weight_version=f"step-{step}")

The servers stage each version beside the one they serve and install it at finish; a sync
that fails leaves them serving the previous version. Requests name the adapter in
``"model"``.

Scaling follows vLLM's ``PEFTHelper``: ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA),
applied by the server; vLLM folds it into B when it builds the adapter
(``LoRALayerWeights.optimize``). The tensors go unscaled, so the bytes a server holds are
the trainer's and digests compare exactly.

Expert- or data-parallel ranks that each hold a copy of some adapter tensors: gather the
ranks' state dicts and pass them as a list; each tensor is sent once, and copies that
differ between ranks are refused, naming the tensor and the ranks.
"""

import math
import re

from wsync.errors import InvalidArgumentError
from wsync.sources import TensorListSource, dtype_name

__all__ = ["LoraSource", "lora_scaling", "peft_name"]

_PREFIX = "base_model.model."
# "<module>.lora_A[.<adapter>].weight", PEFT's parameter and state-dict names.
_LORA_NAME = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$")


def lora_scaling(r, alpha, use_rslora=False):
    """vLLM's ``PEFTHelper`` scaling: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def peft_name(name):
    """``name`` as PEFT saves it (``base_model.model.<module>.lora_A.weight``), or None when
    it is not a LoRA A/B matrix. Accepts names with or without the ``base_model.model.``
    prefix and with PEFT's adapter segment (``lora_A.default.weight``)."""
    m = _LORA_NAME.match(name)
    if m is None:
        return None
    module = m.group("module")
    if not module.startswith(_PREFIX):
        module = _PREFIX + module
    return f"{module}.lora_{m.group('ab')}.weight"


def _peft_config(model, adapter):
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    if adapter is None:
        adapter = getattr(model, "active_adapter", None)
        if not isinstance(adapter, str):
            adapter = next(iter(configs))
    return configs.get(adapter)


def _state_dict(obj, adapter):
    if isinstance(obj, dict):
        return obj
    if callable(getattr(obj, "state_dict", None)):
        sd = obj.state_dict()
        if adapter is not None:  # keep only this adapter's matrices
            sd = {k: v for k, v in sd.items()
                  if _LORA_NAME.match(k) is None or _LORA_NAME.match(k).group("adapter") in (None, adapter)}
        return sd
    raise TypeError(f"LoraSource takes a PEFT model, a torch module or a state dict, not {type(obj).__name__}")


# The smallest packed buffer of a lora session by default (LoraSource.bucket_gb).
LORA_BUCKET_BYTES = 16 << 20


class LoraSource(TensorListSource):
    """``LoraSource(peft_model_or_state_dict, r=None, alpha=None, target_modules=None,
    name="default", use_rslora=None, adapter=None)``.

    peft_model_or_state_dict
        A PEFT model (its ``peft_config`` fills ``r``, ``alpha``, ``target_modules`` and
        ``use_rslora`` when they are not given), any torch module holding LoRA
        parameters, a state dict, or a list of state dicts (one per rank; see the module
        docstring). Only the LoRA A/B matrices are kept; the base weights are not sent.
    r, alpha, target_modules, use_rslora
        The adapter's rank, PEFT's ``lora_alpha``, its target modules' leaf names
        (``["q_proj", "v_proj"]``; default: those the tensors name).
    name
        What requests name in ``"model"``: 1 to 64 characters of ``[A-Za-z0-9._-]``.
    adapter
        The PEFT adapter whose matrices to take from a model holding several (default:
        the active one).

    The tensors are read in place: a source built once sends the current values at every
    ``send_weights``.
    """

    def __init__(self, peft_model_or_state_dict, r=None, alpha=None, target_modules=None, name="default",
                 use_rslora=None, adapter=None):
        obj = peft_model_or_state_dict
        config = None if isinstance(obj, (dict, list, tuple)) else _peft_config(obj, adapter)
        if config is not None:
            r = int(config.r) if r is None else r
            alpha = float(config.lora_alpha) if alpha is None else alpha
            if use_rslora is None:
                use_rslora = bool(getattr(config, "use_rslora", False))
            if target_modules is None and getattr(config, "target_modules", None):
                target_modules = sorted(config.target_modules)
            if adapter is None:
                adapter = getattr(obj, "active_adapter", None) if isinstance(getattr(obj, "active_adapter", None), str) else None
        if r is None or alpha is None:
            raise ValueError("LoraSource needs r and alpha (or a PEFT model whose peft_config has them)")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidArgumentError(f"name {name!r}: 1 to 64 characters of [A-Za-z0-9._-], not starting with '.'")
        r, alpha = int(r), float(alpha)
        if not 1 <= r <= 1024:
            raise InvalidArgumentError(f"r is {r}, outside [1, 1024]")
        if not (math.isfinite(alpha) and alpha > 0):
            raise InvalidArgumentError(f"alpha is {alpha}, not a positive number")

        state_dicts = list(obj) if isinstance(obj, (list, tuple)) else [_state_dict(obj, adapter)]
        tensors = {}   # PEFT name -> tensor
        holders = {}   # PEFT name -> the first rank that held it
        for rank, sd in enumerate(state_dicts):
            for key, tensor in _state_dict(sd, adapter).items():
                pname = peft_name(key)
                if pname is None:
                    continue
                if pname in tensors:
                    if not _same(tensors[pname], tensor):
                        raise InvalidArgumentError(
                            f"adapter tensor {pname} differs between rank {holders[pname]} and rank {rank}: "
                            "ranks that hold the same adapter tensor must hold the same values")
                    continue
                tensors[pname] = tensor
                holders[pname] = rank
        if not tensors:
            raise InvalidArgumentError("LoraSource found no LoRA A/B matrices (names ending in "
                                       "lora_A[.<adapter>].weight / lora_B[.<adapter>].weight)")
        modules = {}
        for pname, tensor in tensors.items():
            m = _LORA_NAME.match(pname)
            modules.setdefault(m.group("module"), {})[m.group("ab")] = tensor
        named_modules = sorted({m.rsplit(".", 1)[-1] for m in modules})
        if target_modules is None:
            target_modules = named_modules
        target_modules = list(target_modules)
        for module, ab in sorted(modules.items()):
            leaf = module.rsplit(".", 1)[-1]
            if leaf not in target_modules:
                raise InvalidArgumentError(f"{module}: module {leaf} is not in target_modules {target_modules}")
            if set(ab) != {"A", "B"}:
                raise InvalidArgumentError(f"{module} has lora_{''.join(ab)} but not lora_{'B' if 'A' in ab else 'A'}")
            a, b = ab["A"], ab["B"]
            if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != r or b.shape[1] != r:
                raise InvalidArgumentError(f"{module}: lora_A is {list(a.shape)} and lora_B {list(b.shape)}; rank {r} "
                                           "needs A [r, in] and B [out, r]")
        dtypes = {dtype_name(t.dtype) for t in tensors.values()}
        if len(dtypes) != 1:
            raise InvalidArgumentError(f"the adapter's matrices must share one dtype, got {sorted(dtypes)}")
        self.name = name
        self.r = r
        self.alpha = alpha
        self.use_rslora = bool(use_rslora)
        self.target_modules = target_modules
        self.dtype = dtypes.pop()
        super().__init__(sorted(tensors.items(), key=lambda kv: _module_order(kv[0])))

    @property
    def bucket_gb(self):
        """The packed buffer ``TrainerEngine(lora=this)`` uses unless given one: 16 MB, or
        twice the largest matrix, so that an adapter moves in several chunks, each landing
        on the servers while the next is packed."""
        largest = max((t.numel() * t.element_size() for _, t in self._items), default=0)
        return min(1.0, max(LORA_BUCKET_BYTES, 2 * largest) / 2**30)

    @property
    def scaling(self):
        """What the servers (and vLLM) multiply B @ A by."""
        return lora_scaling(self.r, self.alpha, self.use_rslora)

    @property
    def spec(self):
        """The adapter as ``TrainerEngine(lora=...)`` takes it."""
        return {"name": self.name, "r": self.r, "alpha": self.alpha, "use_rslora": self.use_rslora,
                "target_modules": list(self.target_modules), "dtype": self.dtype}

    def __repr__(self):
        return (f"LoraSource({self.name!r}, r={self.r}, alpha={self.alpha:g}, "
                f"target_modules={self.target_modules}, {len(self)} tensors)")


def _same(a, b):
    equal = getattr(a, "equal", None)
    if callable(equal):
        return a.shape == b.shape and a.dtype == b.dtype and bool(equal(b))
    import numpy
    return numpy.array_equal(numpy.asarray(a), numpy.asarray(b))


def _module_order(name):
    """Layer numbers compare as numbers: layers.2 before layers.10."""
    return [int(p) if p.isdigit() else p for p in name.split(".")]
