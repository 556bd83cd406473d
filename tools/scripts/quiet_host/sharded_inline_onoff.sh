#!/bin/bash
# Issue 32's sharded in-line verification on/off, interleaved rounds of: off, on with
# DIR/wsync_before (a build to compare against), on with DIR/wsync. Run from anywhere as
# `bash sharded_inline_onoff.sh DIR` where DIR holds the stripped binaries and their
# shared libraries (the bundle the device tool carries). ROUNDS (4) rounds; no new run
# starts after BUDGET_S (200) seconds. RUNS overrides a round's runs, as "MODE BINARY"
# pairs separated by commas (default "off wsync,on wsync_before,on wsync"). FLEET overrides
# the fleet flags (default "--servers 2 --tp 2 --trainer-ranks 4").
here=$(cd "$1" && pwd)
res=${OUT:-/tmp/res}; mkdir -p "$res"
nccl=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "nccl", "lib"))' 2>/dev/null)
export LD_LIBRARY_PATH="$here:$nccl"
start=$SECONDS
cd /tmp
echo "cores $(nproc) load $(cut -d' ' -f1-3 /proc/loadavg)"
for rep in $(seq 1 ${ROUNDS:-4}); do
  IFS=, read -ra runs <<< "${RUNS:-off wsync,on wsync_before,on wsync}"
  for run in "${runs[@]}"; do
    set -- $run
    [ $((SECONDS - start)) -gt ${BUDGET_S:-200} ] && break 2
    f="$res/${rep}_$1_$2.txt"
    WSYNC_LOG_LEVEL=debug timeout 60 "$here/$2" bench sharded --model qwen3-0.6b ${FLEET:---servers 2 --tp 2 --trainer-ranks 4} \
      --trainer-layout fsdp --iters 3 --baseline off --concurrent-stages on --inline-verify $1 > "$f" 2>&1
    phases=$(grep "sync of" "$f" | tail -3 | sed 's/.*data \([0-9.]*\) ms, finish \([0-9.]*\) ms.*/\1\/\2/' | tr '\n' ' ')
    echo "rep $rep $1 $2: median $(grep '^sharded-conc' "$f" | tail -1 | awk '{print $2}') s; data/finish ms: $phases load $(cut -d' ' -f1 /proc/loadavg)"
  done
done
echo "done at $((SECONDS - start)) s"
