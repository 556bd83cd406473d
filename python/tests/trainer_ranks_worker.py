"""One trainer rank of test_trainer_ranks_failures.py, run as its own process.

``python3 trainer_ranks_worker.py RANK SPEC_JSON``: joins a 2-rank gloo process group,
builds an FSDP-like source over ToyQwen3's weights (each rank holds half of every tensor's
bytes; ``__iter__`` all-gathers each tensor before yielding it), runs the syncs the spec
asks for and prints one JSON line per sync: {"ok", "type", "message", "cause", "seconds"}.
"""

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import wsync
from wsync.toy_model import ToyQwen3


class AllGatherSource:
    """Each rank holds half the bytes of every tensor; iteration all-gathers them."""

    def __init__(self, state, rank, world, raise_at=None, delay=0.0):
        self.rank, self.world, self.raise_at, self.delay = rank, world, raise_at, delay
        self.entries = []
        for name, t in state.items():
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            per = -(-flat.numel() // world)
            padded = torch.zeros(per * world, dtype=torch.uint8)
            padded[:flat.numel()] = flat
            self.entries.append((name, t.dtype, tuple(t.shape), flat.numel(),
                                 padded[rank * per:(rank + 1) * per].clone()))

    def metadata(self):
        return [(n, dtype, shape) for n, dtype, shape, _, _ in self.entries]

    def __iter__(self):
        for i, (name, dtype, shape, nbytes, shard) in enumerate(self.entries):
            if i == self.raise_at:
                raise RuntimeError(f"rank {self.rank}'s data loader lost its shard of {name}")
            if self.delay:
                time.sleep(self.delay)
            parts = [torch.empty_like(shard) for _ in range(self.world)]
            dist.all_gather(parts, shard)
            yield name, torch.cat(parts)[:nbytes].view(dtype).view(shape)


def main():
    rank = int(sys.argv[1])
    spec = json.loads(sys.argv[2])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['torch_port']}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=spec.get("torch_timeout", 600)))
    model = ToyQwen3(spec["model_dir"], seed=5)
    state = model.state_dict()

    def progress(p):
        if rank == 0 and spec.get("started_file") and p["chunks_done"] == 1:
            open(spec["started_file"], "w").close()

    engine = wsync.TrainerEngine(servers=spec["servers"], timeout=spec["timeout"], rank=rank, world_size=2,
                                 bucket_gb=spec.get("bucket_gb", 0.0005), progress=progress)
    for i, step in enumerate(spec["syncs"]):
        if step.get("wait_file"):
            while not os.path.exists(step["wait_file"]):
                time.sleep(0.02)
        source = AllGatherSource(state, rank, 2, raise_at=step.get("raise_at", {}).get(str(rank)),
                                 delay=step.get("delay", 0.0))
        t0 = time.monotonic()
        try:
            engine.send_weights(source, weight_version=f"v{i}")
            out = {"ok": True}
        except Exception as e:  # reported to the test, which asserts on it
            out = {"ok": False, "type": type(e).__name__, "message": str(e),
                   "cause": repr(e.__cause__) if e.__cause__ is not None else None}
        out["seconds"] = time.monotonic() - t0
        print(json.dumps(out), flush=True)
        if step.get("done_file") and rank == 0:
            open(step["done_file"], "w").close()
    engine.shutdown()
    # Leave together, so that no rank's exit is what unblocks the other.
    if spec.get("barrier_at_end", True):
        dist.barrier()


if __name__ == "__main__":
    main()
