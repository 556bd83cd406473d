"""Weight sources: what a trainer hands to ``TrainerEngine.send_weights``.

A source is any object with

* ``metadata()`` -> ``[(name, dtype_name, shape), ...]``: the whole model in iteration
  order. Dtype names are torch's as vLLM uses them (``"bfloat16"``, ``"float32"``, ...);
  ``"torch.bfloat16"``, ``torch.dtype`` and numpy dtype objects are accepted too.
* ``__iter__`` -> ``(name, tensor)`` pairs in exactly that order, iterated once per sync.
  A tensor is a torch tensor (CPU or CUDA), a numpy array, or anything with
  ``__dlpack__``; it is read in place through DLPack (no copy), so it must be contiguous.
* optionally ``yields_ready_tensors`` (an attribute, default False): True when the work
  that produced every tensor of a pass is finished before the pass yields its first one
  (the source synchronized the CUDA streams itself); otherwise the engine synchronizes
  torch's current stream once per CUDA tensor.
* optionally ``storage()`` -> one tensor whose memory holds every yielded tensor at fixed
  offsets for the life of the source (the ``ipc`` backend can then export it without
  staging), or ``None``.
* optionally ``yields_stable_tensors`` (an attribute, default False): True when every
  tensor a pass yields stays alive and unchanged until the pass ends (the source keeps
  them; it yields no temporaries). The ``delta`` backend then reads host tensors in place
  rather than copying each one before it asks for the next.

numpy has no bfloat16: give a ``uint16`` (or ``int16``) array holding the bf16 bits and
say ``"bfloat16"`` in the metadata. The same holds for float8 (``uint8`` bits). numpy
cannot export a read-only array through DLPack: pass a writable one. A torch CUDA tensor
is read after torch's current stream on its device has finished; it must be on the
engine's device. Every backend has finished reading a tensor before it asks the iterator
for the next one (tensors inside ``storage()`` aside), so a source may yield temporaries
(an all-gathered shard, a dtype cast) and let them go.

The engine checks every tensor against the metadata as it streams: a tensor whose name,
dtype or shape differs, an extra or a missing one fails the sync with
``wsync.InvalidArgumentError`` naming it, and the servers keep their previous weights.
"""

from wsync._wsync import model_metadata, registered_models

__all__ = ["StateDictSource", "TensorListSource", "dtype_name", "model_metadata",
           "registered_models"]


def dtype_name(dtype):
    """The vLLM/torch name of ``dtype`` ("bfloat16"): a name, a torch.dtype or a numpy dtype."""
    if isinstance(dtype, str):
        return dtype[len("torch."):] if dtype.startswith("torch.") else dtype
    name = getattr(dtype, "name", None)  # numpy.dtype
    if isinstance(name, str) and hasattr(dtype, "itemsize"):
        return name
    if isinstance(dtype, type):  # numpy scalar types such as numpy.float32
        return dtype.__name__
    return dtype_name(str(dtype))  # torch.dtype prints as "torch.bfloat16"


def _contiguous(tensor):
    """``tensor`` itself when contiguous, else a contiguous copy (torch or numpy)."""
    is_contiguous = getattr(tensor, "is_contiguous", None)
    if callable(is_contiguous):
        return tensor if is_contiguous() else tensor.contiguous()
    flags = getattr(tensor, "flags", None)
    if flags is not None and not flags["C_CONTIGUOUS"]:
        import numpy
        return numpy.ascontiguousarray(tensor)
    return tensor


def _synchronize_cuda(tensors):
    """Waits once per CUDA device for torch's current stream there, where ``tensors`` live."""
    devices = {t.device for t in tensors if getattr(t, "is_cuda", False)}
    if devices:
        import torch
        for device in devices:
            torch.cuda.current_stream(device).synchronize()


def _named_state(target, name_map):
    """(name, detached tensor) of a module's state_dict() or a mapping, names through
    `name_map` (a name it maps to None is left out)."""
    state = target.state_dict() if hasattr(target, "state_dict") else target
    for name, tensor in state.items():
        if name_map is not None:
            name = name_map(name)
            if name is None:
                continue
        yield name, _detached(tensor)


def _detached(tensor):
    detach = getattr(tensor, "detach", None)
    return detach() if callable(detach) else tensor


def _is_floating(tensor):
    is_floating_point = getattr(tensor, "is_floating_point", None)
    if callable(is_floating_point):
        return is_floating_point()
    return getattr(getattr(tensor, "dtype", None), "kind", None) == "f"  # numpy


def _cast(tensor, name):
    """A new tensor holding ``tensor`` cast to dtype ``name`` ("bfloat16"), or ``tensor``
    itself when it is already of that dtype. torch casts torch tensors; numpy casts numpy
    arrays, except to bfloat16, which numpy lacks (torch casts those and yields a torch
    tensor)."""
    if dtype_name(tensor.dtype) == name:
        return tensor
    if hasattr(tensor, "to") and hasattr(tensor, "is_floating_point"):
        import torch
        return tensor.to(getattr(torch, name))
    if name == "bfloat16":
        import torch
        return torch.from_numpy(tensor).to(torch.bfloat16)
    return tensor.astype(name)


_CAST_TARGETS = ("bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")


def _cast_target(dtype, name=None):
    target = dtype_name(dtype)
    if target not in _CAST_TARGETS:
        where = f" (for {name})" if name else ""
        raise ValueError(f"dtype={dtype!r}{where}: a source casts to one of {', '.join(_CAST_TARGETS)}")
    return target


def _cast_rule(dtype):
    """``dtype=`` as a function ``(name, tensor) -> dtype name or None`` (None: as it is)."""
    if dtype is None:
        return None
    if callable(dtype) and not isinstance(dtype, type):
        def rule(name, tensor):
            target = dtype(name)
            return None if target is None else _cast_target(target, name)
        return rule
    target = _cast_target(dtype)
    return lambda name, tensor: target if _is_floating(tensor) else None


class _Source:
    """What the shipped sources share: metadata, storage and one pass over ``_pairs()``.

    A subclass sets ``_metadata``, ``_copy`` and ``_storage`` and defines ``_pairs()``, the
    (name, tensor) list of one pass.
    """

    def metadata(self):
        """``[(name, dtype_name, shape), ...]`` in iteration order."""
        return list(self._metadata)

    def storage(self):
        """The flat tensor given as ``storage=``, or None."""
        return self._storage

    _cast_to = None  # (name, tensor) -> dtype name or None; set by sources that cast

    @property
    def _yields_its_own(self):
        """Whether every tensor yielded is one the source holds: none is copied or cast as
        it is sent."""
        return not (self._copy or self._cast_to)

    @property
    def yields_ready_tensors(self):
        """True when the source yields its own tensors: each pass synchronizes first."""
        return self._yields_its_own

    @property
    def yields_stable_tensors(self):
        """True when the source yields its own tensors: it keeps every one it yields."""
        return self._yields_its_own

    def _target_dtype(self, name, tensor):
        """The dtype name ``tensor`` is sent as."""
        target = self._cast_to(name, tensor) if self._cast_to else None
        return target or dtype_name(tensor.dtype)

    def __iter__(self):
        items = self._pairs()
        if self.yields_ready_tensors:
            _synchronize_cuda([t for _, t in items])
        for name, tensor in items:
            # One new tensor at a time: the engine holds a yielded tensor only until it
            # asks for the next, so a cast or a copy is freed once it is sent.
            if self._cast_to is not None:
                yield name, _contiguous(_cast(tensor, self._target_dtype(name, tensor)))
            else:
                yield name, (_contiguous(tensor) if self._copy else tensor)


class StateDictSource(_Source):
    """The tensors of a ``torch.nn.Module`` (its ``state_dict()``) or of a mapping.

    ``StateDictSource(module_or_state_dict, name_map=None, copy_non_contiguous=False,
    storage=None, dtype=None)``

    * ``module_or_state_dict``: a module (its ``state_dict()`` is read at every pass, so one
      source serves every step) or a mapping ``{name: tensor}`` (torch or numpy).
    * ``name_map``: a callable ``name -> str or None`` that renames each tensor to the name
      the servers know (for example stripping a ``"module."`` prefix); ``None`` drops it.
      Without it names are kept as given.
    * ``copy_non_contiguous``: copy a non-contiguous tensor to a contiguous one as it is
      sent (one tensor at a time) instead of failing the sync with an error naming it.
    * ``storage``: a tensor that holds every parameter at fixed offsets (a flat buffer the
      trainer allocated its parameters in); ``storage()`` returns it for zero-copy export.
    * ``dtype``: the dtype the servers hold (``torch.bfloat16`` or ``"bfloat16"``): every
      floating-point tensor is cast to it as it is sent, one tensor at a time (the source
      never holds a cast copy of the whole model), and ``metadata()`` reports it. Integer
      tensors are sent as they are. A callable ``name -> dtype or None`` chooses per
      tensor (None: as it is), for a model whose servers keep some tensors in another
      dtype (DeepSeek-V3's float32 ``e_score_correction_bias``). The servers then hold
      exactly ``tensor.to(dtype)``. Not with ``storage``.

    Tensors are detached (no autograd) and yielded in the state dict's order.
    """

    def __init__(self, module_or_state_dict, name_map=None, copy_non_contiguous=False, storage=None,
                 dtype=None):
        if dtype is not None and storage is not None:
            raise ValueError("StateDictSource: dtype= casts each tensor as it is sent, so no storage= "
                             "holds them; give one or the other")
        self._target = module_or_state_dict
        self._name_map = name_map
        self._copy = copy_non_contiguous
        self._storage = storage
        self._cast_to = _cast_rule(dtype)
        self._metadata = [(name, self._target_dtype(name, t), tuple(t.shape)) for name, t in self._items()]

    def _items(self):
        return _named_state(self._target, self._name_map)

    def _pairs(self):
        return list(self._items())

    def __len__(self):
        return len(self._metadata)

    def __repr__(self):
        return f"StateDictSource({len(self._metadata)} tensors)"


class TensorListSource(_Source):
    """A fixed list of tensors: ``TensorListSource([(name, tensor), ...])``.

    Each item is ``(name, tensor)`` or ``(name, tensor, dtype_name)``; the third form says
    what the bits are when the array's own dtype cannot (``"bfloat16"`` for a numpy
    ``uint16`` array). ``copy_non_contiguous`` as for ``StateDictSource``.
    """

    def __init__(self, items, copy_non_contiguous=False, storage=None):
        self._items = []
        self._metadata = []
        for item in items:
            name, tensor = item[0], item[1]
            dtype = item[2] if len(item) > 2 else tensor.dtype
            self._items.append((name, _detached(tensor)))
            self._metadata.append((name, dtype_name(dtype), tuple(tensor.shape)))
        self._copy = copy_non_contiguous
        self._storage = storage

    def _pairs(self):
        return self._items

    def __len__(self):
        return len(self._items)

    def __repr__(self):
        return f"TensorListSource({len(self._items)} tensors)"
