"""The trainer side: vLLM's ``TrainerWeightTransferEngine`` for backend ``wsync``.

Code written against vLLM's trainer abstraction (SkyRL's is) selects wsync by name::

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from wsync.vllm.trainer_engine import WsyncTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        WsyncTrainerInitInfo(rank=0, wsync_backend="nccl"),
        client=HTTPVLLMWeightSyncClient("http://127.0.0.1:8000"),
        source=ModuleSource(policy))
    engine.send_weights()      # every step, on every trainer rank

The engine is a ``wsync.TrainerEngine``: wsync runs the control plane itself (every call
fanned out to every server with a deadline, a failed sync closed everywhere), so vLLM's
client supplies the servers' URLs (an ``HTTPVLLMWeightSyncClient``'s ``base_url``, or the
``base_urls`` of an object that lists several) and is not called. ``init_info.servers``
names the servers instead when the client is not an HTTP one.
"""

from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

import wsync


@dataclass
class WsyncTrainerInitInfo(TrainerInitInfo):
    """What a wsync trainer engine is built with.

    wsync_backend: ``"nccl"`` (Gloo broadcast on CPU, NCCL on GPU), ``"ipc"`` (shared
        memory or CUDA IPC on one host) or ``"delta"`` (``options["sync_dir"]`` needed).
    servers: the servers' base URLs; empty: the client's.
    weight_version: a prefix; each send is tagged ``f"{weight_version}{n}"`` (n counts
        from 1), which the servers report as their weight version.
    verify: read every sync back from the servers (``send_weights(verify=True)``).
    options: the other keyword arguments of ``wsync.TrainerEngine`` (``device``,
        ``bucket_gb``, ``timeout``, ``world_size``, backend options, ...).
    """

    backend: ClassVar[str] = "wsync"

    wsync_backend: str = wsync._wsync.DEFAULT_BACKEND
    servers: list[str] = field(default_factory=list)
    weight_version: str = "wsync-"
    verify: bool = False
    options: dict[str, Any] = field(default_factory=dict)


def _urls_of(client):
    for attr in ("base_urls", "urls", "servers"):
        urls = getattr(client, attr, None)
        if urls:
            return [str(u) for u in urls]
    url = getattr(client, "base_url", None)
    return [str(url)] if url else []


class _Source:
    """A vLLM WeightSource seen as a wsync source (dtype names, contiguous tensors)."""

    def __init__(self, source):
        self._source = source

    def metadata(self):
        return [(m.name, wsync.dtype_name(m.dtype), [int(x) for x in m.shape]) for m in self._source.metadata()]

    def __iter__(self):
        for name, tensor in self._source:
            yield name, tensor if tensor.is_contiguous() else tensor.contiguous()


class WsyncTrainerWeightTransferEngine(TrainerWeightTransferEngine[WsyncTrainerInitInfo]):
    """vLLM's trainer engine interface over ``wsync.TrainerEngine`` (module doc)."""

    init_info_cls = WsyncTrainerInitInfo

    def __init__(self, engine, init_info, *, client, source):
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.engine = engine
        self.init_info = init_info
        self.sends = 0
        self.last_stats = None

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        if source is None:
            raise ValueError("the wsync trainer engine resyncs a WeightSource each round: pass source=")
        servers = list(init_info.servers) or _urls_of(client)
        if init_info.is_sender and not servers:
            raise ValueError(f"no server URLs: {type(client).__name__} has no base_url; give "
                             "WsyncTrainerInitInfo(servers=[...])")
        options = dict(init_info.options)
        options.setdefault("rank", init_info.rank)
        engine = wsync.TrainerEngine(backend=init_info.wsync_backend, servers=servers, **options)
        try:
            engine.init(_Source(source))
        except BaseException:
            engine.shutdown()
            raise
        return cls(engine, init_info, client=client, source=source)

    def send_weights(self) -> None:
        self.sends += 1
        version = f"{self.init_info.weight_version}{self.sends}"
        self.last_stats = self.engine.send_weights(_Source(self.source), weight_version=version,
                                                   verify=self.init_info.verify)

    def shutdown(self) -> None:
        self.engine.shutdown()
