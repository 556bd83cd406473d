"""wsync inside vLLM: a weight-transfer engine plugin.

vLLM (0.28 and later) picks its weight-transfer engine by name from a registry
(``vllm.distributed.weight_transfer.factory``). This package registers wsync under the
name ``wsync`` in both of vLLM's registries, through the ``vllm.general_plugins`` entry
point that vLLM runs in every process (API server, engine core, each worker):

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "wsync"}'

- Worker side (``wsync.vllm.worker_engine.WsyncWeightTransferEngine``): each worker opens
  wsync's receiving core (``wsync.ReceiverEngine``) for the wsync backend its
  ``init_info`` names (nccl: Gloo on CPU; ipc: shared memory on CPU; delta), and lands
  each received chunk through the model's ``load_weights`` inside vLLM's layerwise-reload
  bracket (``start_weight_update`` .. ``finish_weight_update``).
- Trainer side (``wsync.vllm.trainer_engine.WsyncTrainerWeightTransferEngine``): vLLM's
  ``TrainerWeightTransferEngine`` for backend ``wsync``, wrapping ``wsync.TrainerEngine``.
- Verification: ``wsync.TrainerEngine.send_weights(..., verify=True)`` reads the workers'
  digests by Hugging Face name through vLLM's ``/collective_rpc``
  (``wsync_weight_digests``, see ``wsync.vllm.digests``).

Settings a server needs (which hosts a worker may dial for the Gloo store, the ipc
shared-memory directory, the delta roots) cannot travel in vLLM's
``--weight-transfer-config`` (it takes no extra keys); they come from the environment
variable ``WSYNC_VLLM_OPTIONS``, a JSON object with the keys of ``wsync.ReceiverEngine``'s
backend options (``allowed_store_hosts``, ``ipc_shm_dir``, ``base_checkpoint``,
``local_checkpoint_dir``, ``sync_root``).
"""

BACKEND = "wsync"

__all__ = ["BACKEND", "register"]


def register():
    """The ``vllm.general_plugins`` entry point: registers the engines under ``wsync``.

    vLLM may call it more than once per process; a name already registered is left alone.
    Imports nothing heavier than vLLM's factory module (the engines load lazily).
    """
    from vllm.distributed.weight_transfer.factory import (WeightTransferEngineFactory,
                                                          WeightTransferTrainerFactory)
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "wsync.vllm.worker_engine", "WsyncWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            BACKEND, "wsync.vllm.trainer_engine", "WsyncTrainerWeightTransferEngine")
