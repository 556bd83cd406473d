"""Read-back of a vLLM model's weights by Hugging Face name, for verification.

vLLM's ``/weight_checker`` digests each of its own parameters (fused ``qkv_proj``,
``gate_up_proj``, a tensor-parallel shard, a padded vocabulary) with sha256, keyed by
worker and vLLM name; a trainer holds Hugging Face tensors. ``hf_tensors(model)`` undoes
the fusing (by the model's ``packed_modules_mapping`` and the layer's ``output_sizes``),
gathers tensor-parallel shards over vLLM's TP group and cuts vocabulary padding, so the
digests are those of the trainer's tensors.

``install_worker_rpcs()`` adds ``wsync_weight_digests(algorithm)``,
``wsync_drafter_digests(algorithm)`` (the MTP drafter's own parameters by vLLM name, the
empty ones vLLM prepacked listed as empty: ``{"checksums": {vllm_name: hex}, "empty":
[...]}``; ``{}`` without a drafter), ``wsync_stats()``,
``wsync_fetch_weights(body_json)`` (delta: wsync's ``/fetch_weights``, which vLLM lacks)
and ``wsync_inline_digests(body_json)`` (in-line verification, see
``wsync.vllm.worker_engine``), ``wsync_lora_start(body_json[, "start"])``,
``wsync_lora_finish(body_json)``, ``wsync_lora_adapters()`` and
``wsync_lora_digests(name)`` (LoRA adapters, see ``wsync.vllm.lora``) to vLLM's worker
base class, and, where the environment sets
``WSYNC_VLLM_TEST_FAULTS=1``, the test-only ``wsync_corrupt_next_landing([worker])``
(every worker, or the one of that rank), so that ``POST /collective_rpc {"method":
"wsync_weight_digests", "args": ["xxh3_128"]}`` answers, from every worker, the reply
shape of wsync's ``/weight_checker`` checksum action (``{"checksums": {hf_name: hex}}``).
They are collectives across the TP group: every worker of the server runs them (which
collective_rpc does).

vLLM on the CPU prepacks each linear layer's weight for its GEMM kernels after loading
and leaves the parameter empty (``dispatch_cpu_unquantized_gemm(remove_weight=True)``):
those weights cannot be read back. For them the reply gives the xxh3-128 digest of the
bytes the worker handed to ``load_weights`` in the last update, and lists their names
under ``"landed_only"``; asked for another algorithm, they are listed under
``"not_held"`` (which a trainer's verify skips).
"""

import dataclasses

import torch

__all__ = ["hf_tensors", "weight_digests", "install_worker_rpcs"]

ALGORITHMS = ("sha256", "xxh3_128")


def _tp():
    from vllm.distributed import get_tp_group
    return get_tp_group()


def _gather(tensor, dim):
    group = _tp()
    if group.world_size == 1:
        return tensor
    return group.all_gather(tensor.contiguous(), dim=dim)


def _module_of(model, param_name):
    module_name = param_name.rsplit(".", 1)[0]
    return model.get_submodule(module_name)


def hf_tensors(model):
    """(hf_name, full tensor) for every parameter of a vLLM model, on every TP rank; a
    parameter vLLM emptied after loading (CPU GEMM prepacking) comes as an empty tensor."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    tp_size = _tp().world_size
    for name, param in model.named_parameters():
        module = _module_of(model, name)
        leaf = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
        data = param.detach()
        subs = packed.get(leaf) if isinstance(module, ColumnParallelLinear) else None
        if data.numel() == 0:
            for sub in subs or [leaf]:
                yield name.replace(f".{leaf}.", f".{sub}."), data
            continue
        if isinstance(module, VocabParallelEmbedding):
            # The gathered rows are the padded vocabulary, shard after shard.
            data = _gather(data, 0)
            yield name, data[: getattr(module, "org_vocab_size", data.shape[0])]
            continue
        if subs:
            if getattr(module, "num_kv_head_replicas", 1) != 1:
                raise NotImplementedError(f"{name}: KV heads replicated across TP ranks are not read back")
            sizes = [s // tp_size for s in module.output_sizes]
            for sub, part in zip(subs, torch.split(data, sizes, dim=0)):
                yield name.replace(f".{leaf}.", f".{sub}."), _gather(part, 0)
            continue
        if isinstance(module, ColumnParallelLinear) and tp_size > 1:
            data = _gather(data, 0)
        elif isinstance(module, RowParallelLinear) and tp_size > 1 and data.dim() == 2:
            data = _gather(data, 1)
        yield name, data


def _hex(algorithm, tensor):
    from wsync.worker_server import tensor_digest
    return tensor_digest(tensor, algorithm)


def weight_digests(model, algorithm="xxh3_128", landed=None):
    """{"checksums": {hf_name: hex}, "landed_only": [...], "not_held": [...]} of a vLLM
    model (a TP collective); `landed` is {hf_name: xxh3_128 hex} of the last update's
    bytes, for the weights vLLM emptied (module doc)."""
    algorithm = str(algorithm).replace("-", "_")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown digest algorithm {algorithm!r} (use sha256 or xxh3_128)")
    landed = landed or {}
    sums, landed_only, not_held = {}, [], []
    for name, t in hf_tensors(model):
        if t.numel() > 0:
            sums[name] = _hex(algorithm, t)
        elif algorithm == "xxh3_128" and name in landed:
            sums[name] = landed[name]
            landed_only.append(name)
        else:
            not_held.append(name)
    return {"checksums": sums, "landed_only": landed_only, "not_held": not_held}


def _worker_weight_digests(self, algorithm="xxh3_128"):
    engine = getattr(self, "weight_transfer_engine", None)
    return weight_digests(self.model_runner.get_model(), algorithm, getattr(engine, "landed", None))


def _worker_drafter_digests(self, algorithm="sha256"):
    get = getattr(self.model_runner, "get_draft_model", None)
    drafter = get() if callable(get) else None
    if drafter is None:
        return {}
    target = {id(p) for p in self.model_runner.get_model().parameters()}
    sums, empty = {}, []
    for name, param in drafter.named_parameters():
        if id(param) in target:
            continue  # shared with the target (embed_tokens, lm_head)
        if param.numel() == 0:
            empty.append(name)
        else:
            sums[name] = _hex(str(algorithm).replace("-", "_"), param.detach())
    return {"checksums": sums, "empty": empty}


def _worker_stats(self):
    engine = getattr(self, "weight_transfer_engine", None)
    stats = getattr(engine, "stats", None)
    out = dataclasses.asdict(stats) if stats is not None else {}
    out["syncs"] = getattr(engine, "syncs", 0)
    return out


def _worker_fetch_weights(self, body_json):
    import json
    engine = getattr(self, "weight_transfer_engine", None)
    if engine is None or not hasattr(engine, "fetch_weights"):
        raise RuntimeError("wsync_fetch_weights needs the wsync weight-transfer engine")
    return engine.fetch_weights(json.loads(body_json))


def _wsync_engine(self, rpc):
    engine = getattr(self, "weight_transfer_engine", None)
    if engine is None or not hasattr(engine, "check_inline"):
        raise RuntimeError(f"{rpc} needs the wsync weight-transfer engine")
    return engine


def _worker_inline_digests(self, body_json):
    import json
    return _wsync_engine(self, "wsync_inline_digests").check_inline(json.loads(body_json))


def _worker_lora_start(self, body_json, start=None):
    import json
    manager = getattr(self.model_runner, "lora_manager", None)
    engine = _wsync_engine(self, "wsync_lora_start")
    if start not in (None, "start"):
        raise ValueError(f"wsync_lora_start's second argument is 'start' (open the session) or absent, not {start!r}")
    declared = engine.lora_start(json.loads(body_json), manager)
    if start == "start":
        engine.open_lora_session(self)
    return declared


def _worker_lora_finish(self, body_json):
    import json
    return _wsync_engine(self, "wsync_lora_finish").lora_finish(json.loads(body_json), self)


def _worker_lora_adapters(self):
    return _wsync_engine(self, "wsync_lora_adapters").lora_adapters()


def _worker_lora_digests(self, name, algorithm=None):
    return _wsync_engine(self, "wsync_lora_digests").lora_digests(name, algorithm)


def _worker_corrupt_next_landing(self, worker=None):
    engine = _wsync_engine(self, "wsync_corrupt_next_landing")
    if worker is None or int(worker) == engine.worker_rank:
        engine.corrupt_next_landing()
    return True


# The environment variable that adds the test-only fault RPC (wsync env lists it).
TEST_FAULTS_ENV = "WSYNC_VLLM_TEST_FAULTS"


def install_worker_rpcs():
    """Adds the wsync_* collective RPCs to vLLM's worker base class (new names only)."""
    import os
    from vllm.v1.worker.worker_base import WorkerBase
    rpcs = [("wsync_weight_digests", _worker_weight_digests), ("wsync_drafter_digests", _worker_drafter_digests),
            ("wsync_stats", _worker_stats),
            ("wsync_fetch_weights", _worker_fetch_weights), ("wsync_inline_digests", _worker_inline_digests),
            ("wsync_lora_start", _worker_lora_start), ("wsync_lora_finish", _worker_lora_finish),
            ("wsync_lora_adapters", _worker_lora_adapters),
            ("wsync_lora_digests", _worker_lora_digests)]
    if os.environ.get(TEST_FAULTS_ENV) == "1":
        rpcs.append(("wsync_corrupt_next_landing", _worker_corrupt_next_landing))
    for name, fn in rpcs:
        if not hasattr(WorkerBase, name):
            setattr(WorkerBase, name, fn)
