"""Sources for distributed trainers: each rank describes the shards it holds.

``DTensorSource(module)``: an FSDP2 (``fully_shard``) or other DTensor model. Every rank
builds one over its own module; the whole model's metadata is the global shapes. For the
``sharded`` backend each rank sends its own local shards, no gather: a tensor whose
placements shard dim 0 only (``Shard(0)``, FSDP2's layout, on any mesh, with
``Replicate`` beside it) is *held* (``held_names()``) by every rank with rows of it, as
rows ``[begin, end)`` of dim 0 (``held_rows()``), and the held pass (``iter_held()``)
yields those rows as they lie in the rank's local tensor (FSDP2's padding left out);
replicated DTensors and plain tensors are held whole by every rank. The engine plans each
worker's slices from those rows, so every rank sends the workers the bytes it has.
Tensors sharded along another dim (``Shard(1)``, or a 2-D mesh sharding two dims) are
gathered instead, each onto one owner rank (whole layer groups, balanced by bytes, the
same on every rank; ``torch.distributed.gather`` to that rank, one tensor at a time);
``peak_gather_bytes`` says whether a pass did. For the broadcast backends (``nccl``,
``ipc``, ``delta``: rank 0 sends the whole model) a pass gathers each tensor onto rank 0
alone, one tensor at a time; the other ranks yield a scratch view of the right shape
(bounded by the largest tensor) that the engine only checks and discards.

``MegatronSource(engine, model, layout, params)``: a Megatron-style rank (TP, PP, EP,
expert TP). The layout is the engine's own table (``src/sources/layout.h``: Megatron-Core
names, interleaved QKV, fused fc1, padded vocabulary); the rank's parameters are copied
into the engine's buffers at every pass, and the held pass (each TP group assembles its
stage's tensors, point to point) runs in C++ on wsync's trainer group.

Both are collectives: every rank of the trainer makes the same passes at the same time.
"""

import itertools
import re

from wsync import _wsync
from wsync.sources import _cast, _cast_rule, _detached, _named_state, dtype_name

__all__ = ["DTensorSource", "MegatronSource", "assign_owners", "checkpoint_tensors"]


def assign_owners(metadata, world_size, inputs=None, every_rank=True):
    """The trainer rank that holds each tensor of ``metadata`` (``[(name, dtype, shape)]``):
    whole layer groups (``wsync``'s, as the ``sharded`` plan cuts them), largest first, each
    to the rank holding the fewest bytes so far (lowest rank on ties). With fewer groups
    than ranks, tensors are assigned one by one the same way. ``inputs`` (per tensor, the
    index of the source tensor it is cut from, non-decreasing) keeps the tensors cut from
    one source tensor on one rank. ``every_rank``: fewer tensors than ranks is an error
    (else some ranks get none). Deterministic: every rank computes the same list."""
    import torch
    names = [m[0] for m in metadata]
    sizes = [torch.Size(m[2]).numel() * torch.empty((), dtype=getattr(torch, dtype_name(m[1]))).element_size()
             for m in metadata]
    units = _wsync.layer_groups(names)
    if len(units) < world_size:
        inputs = inputs or list(range(len(names)))
        units = []
        for i, k in enumerate(inputs):
            if units and inputs[units[-1][0]] == k:
                units[-1] = (units[-1][0], i + 1)
            else:
                units.append((i, i + 1))
    if len(units) < world_size and every_rank:
        raise ValueError(f"the model has {len(names)} tensors, fewer than the {world_size} trainer ranks: every "
                         f"rank of the sharded backend must hold one")
    load = [0] * world_size
    owners = [0] * len(names)
    order = sorted(range(len(units)), key=lambda u: (-sum(sizes[units[u][0]:units[u][1]]), u))
    for u in order:
        r = min(range(world_size), key=lambda k: (load[k], k))
        begin, end = units[u]
        load[r] += sum(sizes[begin:end])
        for i in range(begin, end):
            owners[i] = r
    return owners


def _chunk(extent, parts, index):
    """(start, length) of chunk ``index`` of ``extent`` split ``parts`` ways, as
    ``torch.chunk`` and DTensor's ``Shard`` split it (ceil-sized chunks, the tail short or empty)."""
    size = -(-extent // parts) if extent else 0
    start = min(extent, index * size)
    return start, max(0, min(extent, start + size) - start)


class _Layout:
    """Where each global rank's local shard of one DTensor lies in the global tensor."""

    def __init__(self, name, tensor, world_size):
        from torch.distributed.tensor import Replicate, Shard
        mesh = tensor.device_mesh
        grid = mesh.mesh
        if grid.numel() != world_size or sorted(grid.flatten().tolist()) != list(range(world_size)):
            raise ValueError(f"{name}: its device mesh covers ranks {grid.flatten().tolist()}; DTensorSource "
                             f"needs meshes over every trainer rank (0..{world_size - 1})")
        shape = tuple(tensor.shape)
        self.boxes = [None] * world_size  # per rank: [(start, length)] per dim
        for coord in itertools.product(*[range(n) for n in grid.shape]):
            rank = int(grid[coord])
            box = [(0, n) for n in shape]
            for mesh_dim, placement in enumerate(tensor.placements):
                if isinstance(placement, Shard) and type(placement) is Shard:
                    d = placement.dim
                    start, length = _chunk(box[d][1], grid.shape[mesh_dim], coord[mesh_dim])
                    box[d] = (box[d][0] + start, length)
                elif not isinstance(placement, Replicate):
                    raise ValueError(f"{name}: placement {placement} is not supported by DTensorSource (Shard "
                                     f"and Replicate are; FSDP2 with TP lays a tensor out strided, which it "
                                     f"does not read)")
            self.boxes[rank] = box
        self.numel = [_numel(b) for b in self.boxes]
        self.piece = max(self.numel)
        # Every placement shards dim 0 or replicates: each rank holds rows of the tensor
        # (all of them for a replicated one), which it sends itself.
        self.rows_only = len(shape) > 0 and all(
            isinstance(p, Replicate) or (type(p) is Shard and p.dim == 0) for p in tensor.placements)
        # Shard(0) on a 1-D mesh: the ranks' padded pieces, back to back, are the tensor
        # (chunks are ceil-sized and the short or empty ones come last).
        self.contiguous = (len(grid.shape) == 1 and len(tensor.placements) == 1
                           and type(tensor.placements[0]) is Shard and tensor.placements[0].dim == 0)


def _numel(box):
    n = 1
    for _, length in box:
        n *= length
    return n


class DTensorSource:
    """The weights of a DTensor (FSDP2) model, each rank describing its own shards.

    ``DTensorSource(module_or_state_dict, name_map=None, dtype=None, group=None,
    split_fused_experts=True)``

    * ``module_or_state_dict``: the rank's module (``state_dict()`` is read at every pass,
      so one source serves every step) or a mapping ``{name: tensor}``. Values are DTensors
      (sharded with ``Shard`` / ``Replicate`` placements over a mesh of every trainer
      rank) or plain tensors, which every rank holds whole (buffers).
    * ``name_map``: ``name -> str or None``, the name the servers know (``None`` drops the
      tensor), as for ``StateDictSource``.
    * ``dtype``: the servers' dtype; floating-point tensors are cast as they are gathered
      (each rank casts its own shard first, so the gather moves the cast bytes).
    * ``group``: the ``torch.distributed`` group of the trainer ranks (default: the world).
    * ``split_fused_experts``: transformers 5 keeps a MoE layer's experts fused
      (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``);
      the servers, as vLLM, load the checkpoint's per-expert tensors
      (``mlp.experts.<e>.gate_proj.weight`` ...). Each fused tensor is sent as those
      (views of the gathered tensor, no copy).

    ``held_names()`` / ``held_rows()`` / ``iter_held()`` are the ``sharded`` backend's pass
    (see the module's doc: each rank's own rows, no gather); ``__iter__`` is the broadcast
    backends' (gathered onto rank 0). ``peak_gather_bytes`` is the largest gather buffer a
    pass has held on this rank: 0 for a ``sharded`` pass over tensors that shard dim 0 only.
    """

    def __init__(self, module_or_state_dict, name_map=None, dtype=None, group=None, split_fused_experts=True):
        import torch.distributed as dist
        self._target = module_or_state_dict
        self._name_map = name_map
        self._cast_to = _cast_rule(dtype)
        self._group = group
        self._split = split_fused_experts
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # Per source tensor: (its layout or None, its outputs [(name, cut)]); the metadata
        # lists the outputs in order, each tagged with its source tensor.
        self._inputs, self._metadata, self._input_of = [], [], []
        # Per source tensor sent from its local shard: this rank's rows (start, length) of dim
        # 0; None where it is gathered onto an owner.
        self._rows = []
        self._row_of = []  # per output: the one row of its source tensor it reads, or None
        for name, tensor in self._items():
            dtype_out = self._target_dtype(name, tensor)
            outputs = _cuts(name, tuple(tensor.shape)) if self._split else [(name, None, tuple(tensor.shape), None)]
            layout = _Layout(name, tensor, self.world_size) if _is_dtensor(tensor) else None
            self._inputs.append((name, layout, [(n, cut, row) for n, cut, _, row in outputs]))
            if layout is None:
                self._rows.append((0, tensor.shape[0] if tensor.dim() else 1))
            elif layout.rows_only:
                self._rows.append(layout.boxes[self.rank][0])
            else:
                self._rows.append(None)
            for n, _, shape, row in outputs:
                self._metadata.append((n, dtype_out, shape))
                self._input_of.append(len(self._inputs) - 1)
                self._row_of.append(row)
        self._excluded = frozenset()
        self._owners = self._assign(self._metadata, self._input_of)
        self._peak = [0]  # shared with the copies without() makes
        self._scratch = None

    def metadata(self):
        """The whole model, ``[(name, dtype_name, global shape)]``, in state-dict order."""
        return list(self._metadata)

    def without(self, names):
        """The same source without the tensors ``names`` (never sent; a source tensor none of
        whose outputs is left is not gathered): what the ``sharded`` engine sends of a model
        whose servers drop some of its names."""
        import copy
        names = set(names)
        out = copy.copy(self)
        keep = [i for i, m in enumerate(self._metadata) if m[0] not in names]
        out._excluded = self._excluded | names
        out._metadata = [self._metadata[i] for i in keep]
        out._input_of = [self._input_of[i] for i in keep]
        out._row_of = [self._row_of[i] for i in keep]
        out._owners = out._assign(out._metadata, out._input_of)
        return out

    def _assign(self, metadata, input_of):
        """Owners of the tensors gathered for the held pass (assign_owners over those alone);
        None for the tensors each rank sends from its own rows."""
        gathered = [i for i, k in enumerate(input_of) if self._rows[k] is None]
        owners = [None] * len(metadata)
        if gathered:
            picked = assign_owners([metadata[i] for i in gathered], self.world_size, [input_of[i] for i in gathered],
                                   every_rank=False)
            for i, owner in zip(gathered, picked):
                owners[i] = owner
        return owners

    @property
    def peak_gather_bytes(self):
        """The largest gather buffer a pass of this source (or of its ``without()`` copies)
        has held on this rank, in bytes."""
        return self._peak[0]

    def owners(self):
        """The rank that gathers and sends each tensor the held pass gathers, in metadata
        order; None for a tensor every rank sends its own rows of."""
        return list(self._owners)

    def _held(self):
        """(name, rows or None) of what this rank holds for the ``sharded`` backend, in
        metadata order: rows (begin, end) where it holds part of dim 0 only."""
        for (name, _, shape), k, owner, row in zip(self._metadata, self._input_of, self._owners, self._row_of):
            rows = self._rows[k]
            if rows is None:
                if owner == self.rank:
                    yield name, None
                continue
            start, length = rows
            if row is not None:  # one expert of a fused tensor: whole where its row is
                if start <= row < start + length:
                    yield name, None
            elif length == (shape[0] if shape else 1):
                yield name, None
            elif length:
                yield name, (start, start + length)

    def held_names(self):
        """The names this rank holds (all or rows of) for the ``sharded`` backend."""
        return [name for name, _ in self._held()]

    def held_rows(self):
        """``[(name, begin, end)]``: the held names this rank holds rows ``[begin, end)`` of
        dim 0 of only (its local shard of a ``Shard(0)`` tensor)."""
        return [(name, rows[0], rows[1]) for name, rows in self._held() if rows is not None]

    def _input_owners(self):
        """Per source tensor still sent: its owner (None: nothing of it is sent)."""
        owners = [None] * len(self._inputs)
        for k, owner in zip(self._input_of, self._owners):
            owners[k] = owner
        return owners

    def iter_held(self):
        """The held pass: this rank's own rows of every tensor that shards dim 0 only (or the
        whole tensor, where it holds all of it); every other tensor is gathered onto its
        owner, which yields it."""
        owners = self._input_owners()
        sent = {self._input_of[i] for i in range(len(self._metadata))}
        for k, (name, tensor) in enumerate(self._items()):
            if k not in sent:
                continue
            if self._rows[k] is not None:
                yield from self._local_outputs(k, tensor)
                continue
            full = self._gather(k, tensor, owners[k])
            if full is not None:
                yield from self._outputs(k, full)
                del full

    def _local_outputs(self, k, tensor):
        """This rank's outputs of source tensor ``k`` from its local rows, no copy beyond the cast."""
        start, length = self._rows[k]
        if not length:
            return
        local = tensor.to_local() if _is_dtensor(tensor) else tensor
        if local.dim() and local.shape[0] != length:
            local = local.narrow(0, 0, length)  # FSDP2's padded tail
        local = _cast(local, self._target_dtype(self._inputs[k][0], tensor)).contiguous()
        for out_name, cut, row in self._inputs[k][2]:
            if out_name in self._excluded:
                continue
            if row is None:
                yield out_name, local
            elif start <= row < start + length:
                # cut() indexes dim 0 of the whole tensor: shift it to the local rows.
                yield out_name, cut(_Shifted(local, start)).contiguous()

    def __iter__(self):
        sent = {self._input_of[i] for i in range(len(self._metadata))}
        for k, (name, tensor) in enumerate(self._items()):
            if k not in sent:
                continue
            full = self._gather(k, tensor, 0)
            for out_name, view in self._outputs(k, full):
                yield out_name, view if self.rank == 0 else self._placeholder(out_name)
            del full

    def _outputs(self, k, full):
        for out_name, cut, _ in self._inputs[k][2]:
            if out_name in self._excluded:
                continue
            yield out_name, (full if cut is None or full is None else cut(full))

    def _items(self):
        return _named_state(self._target, self._name_map)

    def _target_dtype(self, name, tensor):
        target = self._cast_to(name, tensor) if self._cast_to else None
        return target or dtype_name(tensor.dtype)

    def _gather(self, k, tensor, dst):
        """Source tensor ``k`` whole on rank ``dst`` (None elsewhere): one gather of the
        local shards."""
        import torch
        import torch.distributed as dist
        target = self._target_dtype(self._inputs[k][0], tensor)
        layout = self._inputs[k][1]
        if layout is None:  # held whole by every rank
            return _cast(tensor, target).contiguous() if self.rank == dst else None
        local = _cast(tensor.to_local(), target).contiguous().reshape(-1)
        piece = layout.piece
        send = local if local.numel() == piece else torch.cat([local, local.new_zeros(piece - local.numel())])
        group_dst = dst if self._group is None else dist.get_global_rank(self._group, dst)
        if self.rank != dst:
            dist.gather(send, None, dst=group_dst, group=self._group)
            return None
        flat = torch.empty(piece * self.world_size, dtype=send.dtype, device=send.device)
        self._peak[0] = max(self._peak[0], flat.numel() * flat.element_size())
        dist.gather(send, list(flat.split(piece)), dst=group_dst, group=self._group)
        shape = tuple(tensor.shape)
        total = 1
        for n in shape:
            total *= n
        if layout.contiguous:
            return flat[:total].view(shape)
        full = torch.empty(shape, dtype=send.dtype, device=send.device)
        for r, box in enumerate(layout.boxes):
            if not layout.numel[r]:
                continue
            view = full
            for d, (start, length) in enumerate(box):
                view = view.narrow(d, start, length)
            view.copy_(flat[r * piece:r * piece + layout.numel[r]].view([length for _, length in box]))
        return full

    def _placeholder(self, name):
        """A tensor of ``name``'s dtype and shape over one reused scratch buffer."""
        import torch
        i = next(j for j, m in enumerate(self._metadata) if m[0] == name)
        _, dtype, shape = self._metadata[i]
        dt = getattr(torch, dtype)
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dt).element_size()
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        return self._scratch[:nbytes].view(dt).view(shape)

    def __len__(self):
        return len(self._metadata)

    def __repr__(self):
        return (f"DTensorSource({len(self._metadata)} tensors, rank {self.rank} of {self.world_size}, "
                f"holds {len(self.held_names())})")


class _Shifted:
    """A tensor's local rows indexed as the whole tensor: ``t[e, ...]`` reads row ``e - start``
    of the local rows (the one indexing ``_cuts`` does)."""

    def __init__(self, local, start):
        self._local, self._start = local, start

    def __getitem__(self, index):
        if isinstance(index, tuple):
            return self._local[(index[0] - self._start,) + index[1:]]
        return self._local[index - self._start]


_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def checkpoint_tensors(state_dict):
    """``(name, tensor)`` of a full model's ``state_dict`` under the checkpoint's names, as
    vLLM loads them: transformers 5's fused MoE experts become per-expert views."""
    for name, tensor in state_dict.items():
        for out_name, cut, _, _ in _cuts(name, tuple(tensor.shape)):
            yield out_name, tensor if cut is None else cut(tensor)


def _cuts(name, shape):
    """The checkpoint tensors a state-dict tensor stands for: [(name, cut, shape, row)],
    where ``cut(full)`` is the view of the whole tensor (None: itself) and ``row`` the one
    row of dim 0 it reads (None: all). transformers 5's fused experts ([E, 2I, H]
    gate_up, gate first; [E, H, I] down) are cut per expert."""
    m = _FUSED_EXPERTS.match(name)
    if not m or len(shape) != 3:
        return [(name, None, shape, None)]
    prefix, kind = m.groups()
    out = []
    if kind == "gate_up_proj":
        half = shape[1] // 2
        for e in range(shape[0]):
            out.append((f"{prefix}.{e}.gate_proj.weight", lambda t, e=e: t[e, :half], (half, shape[2]), e))
            out.append((f"{prefix}.{e}.up_proj.weight", lambda t, e=e: t[e, half:], (half, shape[2]), e))
    else:
        for e in range(shape[0]):
            out.append((f"{prefix}.{e}.down_proj.weight", lambda t, e=e: t[e], (shape[1], shape[2]), e))
    return out


def _is_dtensor(tensor):
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(tensor, DTensor)


class MegatronSource:
    """A Megatron-style trainer rank's own parameters, laid out by wsync's table.

    ``MegatronSource(engine, model, layout=None, params=None, tp=1, pp=1, ep=1, etp=1,
    coords=None, name_map=None)``

    * ``engine``: this rank's ``wsync.TrainerEngine`` (``backend="sharded"`` with
      ``world_size > 1``): the source's passes run on its trainer group.
    * ``model``: the servers' model, a registered name or a config.json directory (Qwen3
      dense or MoE).
    * ``layout``: ``"tpXppYepZ[etpW]"``, or give ``tp``, ``pp``, ``ep``, ``etp``. Ranks are
      numbered tp fastest, then ep, then dp, then pp (Megatron-Core's order).
    * ``coords``: optional ``{"tp": .., "pp": .., "ep": .., "dp": ..}`` of this rank, as the
      trainer's parallel state has them; a mismatch with the layout's numbering is an
      error naming both.
    * ``params``: the rank's parameters, a module, a mapping ``{name: tensor}`` or a
      callable returning one, read at every pass; ``name_map`` (``name -> str or None``)
      turns the trainer's names into Megatron-Core's (``"decoder.layers.0.self_attention.
      linear_qkv.weight"``, ``params_names()`` lists them); ``None`` drops a tensor. Each
      tensor is cast to the layout's dtype as it is copied in.

    Every rank builds its source at the same time (a collective). The HF names the servers
    get come from the table (``metadata()``).
    """

    def __init__(self, engine, model, layout=None, params=None, tp=1, pp=1, ep=1, etp=1, coords=None,
                 name_map=None):
        if layout is None:
            layout = f"tp{tp}pp{pp}ep{ep}" + (f"etp{etp}" if etp != 1 else "")
        self._engine, self._model, self._layout = engine, str(model), layout
        self._params, self._name_map = params, name_map
        self._native = None
        self._native_for()
        if coords is not None:
            self._check_coords(coords)
        self._metadata = _wsync.model_metadata(self._model)

    def _native_for(self):
        """The native source on the engine's current trainer group (built again after a failed
        sync replaced the group)."""
        native_engine = self._engine._engine
        if self._native is None or self._native.generation != native_engine.generation or native_engine.stale:
            self._native = native_engine.megatron_source(self._model, self._layout)
        return self._native

    def _check_coords(self, coords):
        described = self._native.describe()  # "trainer rank 3 (tp1 pp0 ep1 dp0)"
        for key, value in coords.items():
            if f"{key}{int(value)}" not in described.split("(")[-1].rstrip(")").split():
                raise ValueError(f"coords {coords} disagree with layout {self._layout}: this rank is {described}")

    def metadata(self):
        return list(self._metadata)

    def held_names(self):
        return self._native.held_names()

    def params_names(self):
        """``[(megatron_name, dtype_name, shape)]`` this rank holds, in the table's order."""
        return self._native.params()

    @property
    def peak_buffer_bytes(self):
        return self._native.peak_buffer_bytes

    def load_hf(self, state_dict):
        """Lays a full Hugging Face model (``{name: tensor}``, every tensor, CPU; names the
        servers drop, such as a tied ``lm_head.weight``, are skipped, and transformers 5's
        fused experts are cut per expert: ``checkpoint_tensors``) out into this rank's
        parameters, in the engine's buffers: a checkpoint's conversion. With
        ``params=None`` the source sends what the last ``load_hf`` laid out."""
        self._hf_loaded = state_dict
        pairs = list(checkpoint_tensors(state_dict))
        dropped = set(_wsync.dropped_names([n for n, _ in pairs], self._model))
        self._native_for().load_hf([(n, _detached(t).contiguous()) for n, t in pairs if n not in dropped])

    _hf_loaded = None

    def load(self):
        """Copies the rank's parameters into the engine's buffers (what every pass does first)."""
        import torch
        fresh = self._native is None or self._native.generation != self._engine._engine.generation \
            or self._engine._engine.stale
        native = self._native_for()
        if self._params is None:
            if fresh and self._hf_loaded is not None:
                self.load_hf(self._hf_loaded)  # a rebuilt source starts from zeros
            return native
        wanted = {name: (dtype, shape) for name, dtype, shape in native.params()}
        params = self._params() if callable(self._params) and not hasattr(self._params, "state_dict") else self._params
        state = params.state_dict() if hasattr(params, "state_dict") else params
        seen = set()
        for name, tensor in state.items():
            if self._name_map is not None:
                name = self._name_map(name)
                if name is None:
                    continue
            if name not in wanted:
                raise ValueError(f"{name} is not a parameter of {native.describe()} in layout {self._layout}; "
                                 f"params_names() lists them")
            dtype = getattr(torch, wanted[name][0])
            native.load(name, _detached(tensor).to(device="cpu", dtype=dtype).contiguous())
            seen.add(name)
        missing = [n for n in wanted if n not in seen]
        if missing:
            raise ValueError(f"{native.describe()}: params lack {len(missing)} of the layout's parameters, "
                             f"first {missing[0]}")
        return native

    def __iter__(self):
        raise TypeError("a MegatronSource is sent by TrainerEngine.send_weights, not iterated")

    def __repr__(self):
        return f"MegatronSource({self._model!r}, {self._layout}, {self._native.describe()})"
