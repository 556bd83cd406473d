#!/bin/bash
# Run from the repository root as `bash DIR/script.sh` where DIR holds the stripped binaries
# (wsync, wsync_base, wsync_predelta), their shared libraries, python/ and scripts/
# (tools/scripts/delta_trainer_memory.sh): the bundle the device tool carries.
# Call 8, in order of need, each part while time is left: (A) issue 32's sharded in-line
# verification on/off, three rounds; (B) issue 36's delta trainer before the state file
# (e863bd3) against main, two rounds; (C) issue 34's Python DTensor ranks against C++;
# (D) issue 33's receiver core before (3b46112) and after, one round per backend.
here=$(cd "$(dirname "$0")" && pwd)
res=${OUT:-/tmp/res}; mkdir -p "$res"
nccl=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "nccl", "lib"))' 2>/dev/null)
export LD_LIBRARY_PATH="$here:$nccl"
root=$(pwd)
start=$SECONDS
left() { echo $((540 - (SECONDS - start))); }
cd /tmp
{ nproc; uptime; python3 -c 'import torch; print(torch.__version__)'; } > "$res/machine.txt" 2>&1
for rep in 1 2 3; do for mode in off on; do
  echo "== A rep $rep sharded $mode $(cut -d' ' -f1-3 /proc/loadavg) t=$((SECONDS-start))"
  timeout 90 "$here/wsync" bench sharded --model qwen3-0.6b --servers 2 --tp 2 --trainer-ranks 4 --trainer-layout fsdp --iters 3 --baseline off --concurrent-stages on --inline-verify $mode > "$res/a_${rep}_$mode.txt" 2>&1
  grep -v "^\[" "$res/a_${rep}_$mode.txt" | tail -3
done; done > "$res/A_sharded_onoff.txt" 2>&1
cat "$res/A_sharded_onoff.txt"
echo "== B at t=$((SECONDS-start))"
timeout $(( $(left) > 150 ? 150 : $(left) )) bash "$here/scripts/delta_trainer_memory.sh" "$here/wsync_predelta" "$here/wsync" "$res/delta" 2 > "$res/B_delta.txt" 2>&1
cat "$res/B_delta.txt"; rm -rf "$res/delta/tmp"
echo "== C at t=$((SECONDS-start))"
cd "$root"
if [ "$(left)" -gt 60 ]; then
  PYTHONUNBUFFERED=1 PYTHONPATH="$here/python" WSYNC_BIN="$here/wsync" timeout $(( $(left) > 200 ? 200 : $(left) )) python3 bench/python_distributed.py --model qwen3-0.6b --ranks 4 --servers 2 --tp 2 --iters 3 > "$res/C_python_distributed.txt" 2>&1
  echo "python bench rc=$?"; grep -v "^\[" "$res/C_python_distributed.txt" | tail -25
fi
cd /tmp
echo "== D at t=$((SECONDS-start))"
for what in ipc nccl delta sharded; do for b in wsync_base wsync; do
  [ "$(left)" -lt 40 ] && break 2
  w="$here/$b"
  echo "== D $b $what $(cut -d' ' -f1-3 /proc/loadavg)"
  case $what in
    ipc) timeout 40 $w bench ipc --model qwen3-0.6b --servers 1 --iters 5 > "$res/d_${b}_$what.txt" 2>&1 ;;
    nccl) timeout 40 $w bench broadcast --model qwen3-0.6b --servers 2 --iters 5 > "$res/d_${b}_$what.txt" 2>&1 ;;
    delta) timeout 40 $w bench delta --model qwen3-0.6b --servers 1 --steps 3 > "$res/d_${b}_$what.txt" 2>&1 ;;
    sharded) timeout 40 $w bench sharded --model qwen3-0.6b --servers 2 --tp 2 --trainer-ranks 4 --trainer-layout fsdp --iters 3 --baseline off --concurrent-stages on > "$res/d_${b}_$what.txt" 2>&1 ;;
  esac
  grep -v "^\[" "$res/d_${b}_$what.txt" | tail -4
done; done > "$res/D_core.txt" 2>&1
cat "$res/D_core.txt"
echo "all done at $((SECONDS-start)) s $(cut -d' ' -f1-3 /proc/loadavg)"
