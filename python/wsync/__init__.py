"""wsync: move freshly trained weights from RL trainers into running inference servers.

A trainer process builds a ``TrainerEngine`` and calls ``send_weights`` after each step; an
inference worker written in Python builds a ``ReceiverEngine`` and lands each update
through its own ``load_weights``. See the README's "Python" section.

Trainer side: ``TrainerEngine``, ``SyncStats``, ``StateDictSource``, ``TensorListSource``,
``DTensorSource``, ``MegatronSource`` (distributed trainers), ``LoraSource`` (LoRA adapters),
``model_metadata``. Receive side: ``ReceiverEngine``, and ``wsync.worker_server`` (a
vLLM-shaped HTTP front over receivers). Errors: ``wsync.Error`` and one subclass per status (``wsync.errors``).
"""

# torch, where installed, loads before the extension: a CUDA build of torch brings its own
# NCCL, newer than the system one the extension links, and the first library loaded under
# the name libnccl.so.2 serves both.
try:
    import torch  # noqa: F401
except ImportError:
    pass

from wsync import errors
from wsync._wsync import trainer_backends
from wsync.errors import *  # noqa: F401,F403  (the exception classes)

# ---- trainer side --------------------------------------------------------------------
from wsync.sources import (StateDictSource, TensorListSource, dtype_name, model_metadata,
                           registered_models)
from wsync.trainer import SyncStats, TrainerEngine
from wsync.distributed import DTensorSource, MegatronSource
from wsync.lora import LoraSource

_trainer_exports = ["TrainerEngine", "SyncStats", "StateDictSource", "TensorListSource",
                    "DTensorSource", "MegatronSource", "LoraSource",
                    "dtype_name", "model_metadata", "registered_models"]

# ---- receiver side -------------------------------------------------------------------
from wsync.receiver import ReceiverEngine

_receiver_exports = ["ReceiverEngine"]

__all__ = (["errors", "trainer_backends"] + _trainer_exports + _receiver_exports
           + errors.__all__)
