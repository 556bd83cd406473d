"""wsync.DTensorSource without servers: 2 spawned ranks (gloo, CPU) hold DTensors of several
placements (Shard(0) with a short tail, Shard(1), Replicate, a 2-D mesh sharding two dims,
plain tensors). The held pass yields each rank's own rows of the dim-0 sharded tensors
(held_rows()) and the replicated and plain tensors whole, with no gather; the tensors
sharded along another dim are gathered whole onto one owner each. Together the ranks' held
tensors cover every row of every tensor. The broadcast pass yields the full tensors on
rank 0."""

import os
import socket

import torch
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import wsync
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (1, world))
    g = torch.Generator().manual_seed(7)
    full = {
        "model.embed_tokens.weight": torch.randn(5, 3, generator=g),            # 3 + 2 rows
        "model.layers.0.mlp.down_proj.weight": torch.randn(4, 7, generator=g),  # Shard(1): 4 + 3 columns
        "model.layers.0.input_layernorm.weight": torch.randn(6, generator=g),   # replicated
        "model.layers.1.self_attn.q_proj.weight": torch.randn(6, 4, generator=g),  # 2-D mesh
        "model.layers.1.rotary.inv_freq": torch.arange(4.0),                    # a plain buffer
        "model.norm.weight": torch.randn(1, generator=g),                       # 1 row: rank 1 empty
    }
    state = {
        "model.embed_tokens.weight": distribute_tensor(full["model.embed_tokens.weight"], mesh, [Shard(0)]),
        "model.layers.0.mlp.down_proj.weight": distribute_tensor(full["model.layers.0.mlp.down_proj.weight"], mesh,
                                                                  [Shard(1)]),
        "model.layers.0.input_layernorm.weight": distribute_tensor(full["model.layers.0.input_layernorm.weight"],
                                                                    mesh, [Replicate()]),
        "model.layers.1.self_attn.q_proj.weight": distribute_tensor(
            full["model.layers.1.self_attn.q_proj.weight"], mesh2, [Shard(0), Shard(1)]),
        "model.layers.1.rotary.inv_freq": full["model.layers.1.rotary.inv_freq"],
        "model.norm.weight": distribute_tensor(full["model.norm.weight"], mesh, [Shard(0)]),
    }
    source = wsync.DTensorSource(state, dtype=torch.bfloat16)
    # numpy copies (bf16 widened to float32, which is exact): the queue pickles them by value.
    def arrays(pairs):
        return {n: t.float().numpy().copy() for n, t in pairs}

    held = arrays(source.iter_held())
    broadcast = arrays(source)
    # Without the tensors sharded along dim 1, the held pass gathers nothing.
    rows_only = wsync.DTensorSource({n: t for n, t in state.items()
                                     if n not in ("model.layers.0.mlp.down_proj.weight",
                                                  "model.layers.1.self_attn.q_proj.weight")})
    list(rows_only.iter_held())
    out.put((rank, source.metadata(), source.owners(), held, broadcast if rank == 0 else None,
             arrays((n, t.to(torch.bfloat16)) for n, t in full.items()), source.held_names(), source.held_rows(),
             rows_only.peak_gather_bytes))
    dist.destroy_process_group()


def test_held_pass_yields_each_ranks_rows_and_broadcast_the_full_tensors():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted([out.get(timeout=120) for _ in procs], key=lambda r: r[0])
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    metadata, owners, full = results[0][1], results[0][2], results[0][5]
    assert [m[0] for m in metadata] == list(full)
    assert all(m[1] == "bfloat16" for m in metadata)
    gathered = {"model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight"}
    assert results[1][2] == owners
    assert {o for m, o in zip(metadata, owners) if m[0] in gathered} == {0, 1}
    assert all(o is None for m, o in zip(metadata, owners) if m[0] not in gathered)
    rows_of = {
        0: {"model.embed_tokens.weight": (0, 3)},
        1: {"model.embed_tokens.weight": (3, 5)},
    }
    covered = {name: set() for name in full}
    for rank, _, _, held, _, _, held_names, held_rows, rows_only_peak in results:
        assert rows_only_peak == 0
        assert list(held) == held_names
        assert {n: (b, e) for n, b, e in held_rows} == rows_of[rank]
        assert ("model.norm.weight" in held_names) == (rank == 0)  # 1 row: rank 1 holds none
        for name in held_names:
            begin, end = rows_of[rank].get(name, (0, full[name].shape[0]))
            want = full[name][begin:end]
            assert held[name].shape == want.shape and (held[name] == want).all(), (rank, name)
            covered[name] |= set(range(begin, end))
    for name, t in full.items():
        assert covered[name] == set(range(t.shape[0])), name
    broadcast = results[0][4]
    assert list(broadcast) == list(full)
    for name, t in full.items():
        assert (broadcast[name] == t).all() and broadcast[name].shape == t.shape, name
