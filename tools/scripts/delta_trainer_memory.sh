#!/bin/bash
# Usage: tools/scripts/delta_trainer_memory.sh BASE_WSYNC NEW_WSYNC OUT [REPS]
# Same-run before/after of `wsync bench delta` (qwen3-0.6b, one server, 3 steps): the two
# binaries alternate REPS times (default 3). Each run's output goes to OUT/<base|new>-<rep>.txt
# with the trainer process's resident set sampled every 0.1 s ("sampled_peak_rss_mb"; the
# bench process is the trainer, its servers are other processes), then one line per run.
set -u
base=$1 new=$2 out=$3 reps=${4:-3}
mkdir -p "$out/tmp"
export TMPDIR="$out/tmp"
for r in $(seq 1 "$reps"); do
  for v in base new; do
    bin=$base; [ "$v" = new ] && bin=$new
    f=$out/$v-$r.txt
    "$bin" bench delta --model qwen3-0.6b --servers 1 --steps 3 > "$f" 2>&1 &
    pid=$! max=0
    while kill -0 "$pid" 2>/dev/null; do
      kb=$(awk '/VmRSS/{print $2}' "/proc/$pid/status" 2>/dev/null)
      [ "${kb:-0}" -gt "$max" ] && max=$kb
      sleep 0.1
    done
    wait "$pid"
    echo "sampled_peak_rss_mb $((max / 1024))" >> "$f"
  done
done
for f in "$out"/*-*.txt; do
  printf '%s: sync %s s, publish %s GB/s per core, end RSS %s MB, sampled peak %s MB\n' "$(basename "$f" .txt)" \
    "$(awk '/whole sync/{print $3}' "$f")" "$(awk '/^  publish /{print $12}' "$f")" \
    "$(awk '/trainer memory/{print $4}' "$f")" "$(awk '/sampled_peak/{print $2}' "$f")"
done
