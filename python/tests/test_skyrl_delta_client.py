"""A SkyRL-shaped delta client against a real `wsync serve --backend delta`: wsync's own
delta publisher (a TrainerEngine with no servers only publishes) writes each version to the
sync dir, and the test drives the server with plain HTTP in SkyRL's order
(reference/skyrl_weight_sync.md §5.3), with SkyRL's exact payloads:

    init {base_model_path, local_checkpoint_dir}
    fetch_weights {target_version, sync_dir, uri}     (before the pause)
    pause?mode=keep&clear_cache=false
    reset_prefix_cache?reset_running_requests=true
    start_weight_update
    update_weights {update_info: {target_version, version, sync_dir, uri}}
    finish_weight_update {weight_version}
    resume

Each reply's shape is checked, and after each version the server's sha256 of every HF
tensor equals the test's own hashlib digest of the arrays it published.
"""

import numpy as np

import wsync
from wsync.toy_model import write_config
from conftest import DeltaSetup, http_json, sha256_digests
from test_sources_numpy import random_arrays


def post(server, path, body=None):
    status, reply = http_json(server.url, path, {} if body is None else body, timeout=60)
    assert status == 200, f"POST {path} -> {status}: {reply}\n{server.logs()}"
    return reply


def test_skyrl_client_syncs_two_versions_bit_exact(wsync_server, tmp_path):
    model = write_config(tmp_path / "model", dtype="float32")
    metadata = wsync.model_metadata(model)
    base = random_arrays(metadata, seed=1)
    delta = DeltaSetup(tmp_path, [(n, d, a) for n, a, d in base])
    server = wsync_server(backend="delta", model=model, args=delta.server_args(), name="delta0")
    sync_dir = str(delta.sync_dir)

    # SkyRL's DeltaTransferInitInfo, exactly: no sync_dir (it comes with each fetch).
    reply = post(server, "/init_weight_transfer_engine",
                 {"init_info": {"base_model_path": str(delta.base),
                                "local_checkpoint_dir": str(tmp_path / "skyrl-local")}})
    assert reply == {"message": "Weight transfer initialized"}

    with wsync.TrainerEngine(backend="delta", servers=[], timeout=60, **delta.trainer_options()) as publisher:
        for version in (1, 2):
            arrays = random_arrays(metadata, seed=version + 1)
            publisher.send_weights(wsync.TensorListSource(arrays), weight_version=f"v{version}")
            uri = f"{sync_dir}/delta-{version:08d}"
            assert (delta.sync_dir / f"delta-{version:08d}" / "manifest.json").is_file()

            fetched = post(server, "/fetch_weights", {"target_version": version, "sync_dir": sync_dir, "uri": uri})
            assert fetched["status"] == "ok" and fetched["target_version"] == version, fetched
            assert isinstance(fetched["stats"], dict) and fetched["stats"]["total_s"] >= 0, fetched
            assert post(server, "/pause?mode=keep&clear_cache=false") == {"status": "paused"}
            assert http_json(server.url, "/is_paused")[1] == {"is_paused": True}
            assert post(server, "/reset_prefix_cache?reset_running_requests=true") == {"success": True}
            assert post(server, "/start_weight_update") == {"message": "Weight update started"}
            update_info = {"target_version": version, "version": version, "sync_dir": sync_dir, "uri": uri}
            assert post(server, "/update_weights", {"update_info": update_info}) == {"message": "Weights updated"}
            assert post(server, "/finish_weight_update", {"weight_version": f"v{version}"}) == {
                "message": "Weight update finished"}
            assert post(server, "/resume") == {"status": "resumed"}

            assert http_json(server.url, "/weight_info")[1] == {"weight_version": f"v{version}"}
            health = server.health()
            assert health["weights_consistent"] is True and health["syncs"] == version, health
            want = sha256_digests((n, a) for n, a, _ in arrays)
            got = server.checksums("sha256")
            assert got == want, sorted(n for n in want if got.get(n) != want[n])[:3]
            assert any(not np.array_equal(a, b) for (_, a, _), (_, b, _) in zip(arrays, base))
