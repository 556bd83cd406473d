#!/bin/bash
# Run from the repository root as `bash DIR/script.sh` where DIR holds the stripped binaries
# (wsync, wsync_base, wsync_predelta), their shared libraries, python/ and scripts/
# (tools/scripts/delta_trainer_memory.sh): the bundle the device tool carries.
# Call 7: the receiver-core change before/after (issue 33): base (3b46112) against main,
# alternated per backend, three rounds while time allows.
here=$(cd "$(dirname "$0")" && pwd)
res=${OUT:-/tmp/res}; mkdir -p "$res"
nccl=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "nccl", "lib"))' 2>/dev/null)
export LD_LIBRARY_PATH="$here:$nccl"
start=$SECONDS
cd /tmp
for rep in 1 2 3; do for b in wsync_base wsync; do
  w="$here/$b"
  [ $((SECONDS-start)) -gt 380 ] && break 2
  echo "== rep $rep $b ipc $(cut -d' ' -f1-3 /proc/loadavg)"
  timeout 60 $w bench ipc --model qwen3-0.6b --servers 1 --iters 5 > "$res/b_${rep}_${b}_ipc.txt" 2>&1; tail -4 "$res/b_${rep}_${b}_ipc.txt"
  echo "== rep $rep $b nccl $(cut -d' ' -f1-3 /proc/loadavg)"
  timeout 60 $w bench broadcast --model qwen3-0.6b --servers 2 --iters 5 > "$res/b_${rep}_${b}_nccl.txt" 2>&1; tail -6 "$res/b_${rep}_${b}_nccl.txt"
  echo "== rep $rep $b delta $(cut -d' ' -f1-3 /proc/loadavg)"
  timeout 60 $w bench delta --model qwen3-0.6b --servers 1 --steps 3 > "$res/b_${rep}_${b}_delta.txt" 2>&1; grep -v "^\[" "$res/b_${rep}_${b}_delta.txt" | tail -8
  echo "== rep $rep $b sharded $(cut -d' ' -f1-3 /proc/loadavg)"
  timeout 60 $w bench sharded --model qwen3-0.6b --servers 2 --tp 2 --trainer-ranks 4 --trainer-layout fsdp --iters 3 --baseline off --concurrent-stages on > "$res/b_${rep}_${b}_sharded.txt" 2>&1; grep -v "^\[" "$res/b_${rep}_${b}_sharded.txt" | tail -2
done; done > "$res/core_before_after.txt" 2>&1
tail -c 6000 "$res/core_before_after.txt"
echo "all done at $((SECONDS-start)) s"
