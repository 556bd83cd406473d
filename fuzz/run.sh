#!/usr/bin/env bash
# Runs every libFuzzer target of a WSYNC_FUZZ build for a bounded time.
#   fuzz/run.sh BUILD_DIR SECONDS_PER_TARGET [NAME...]
# New inputs go to BUILD_DIR/fuzz-work/<name>/corpus (the checked-in seeds in
# fuzz/corpus/<name>/ are read, never written); a crash leaves its input in
# BUILD_DIR/fuzz-work/<name>/ and makes the script exit 1 after the other targets ran.
set -uo pipefail
build=${1:?usage: fuzz/run.sh BUILD_DIR SECONDS [NAME...]}
seconds=${2:?usage: fuzz/run.sh BUILD_DIR SECONDS [NAME...]}
shift 2
src=$(cd "$(dirname "$0")/.." && pwd)
list="$build/fuzz_targets.txt"
[ -s "$list" ] || { echo "no fuzz targets listed in $list (configure with -DWSYNC_FUZZ=ON)"; exit 1; }
failed=()
while read -r name bin; do
  if [ $# -gt 0 ] && [[ ! " $* " == *" $name "* ]]; then continue; fi
  work="$build/fuzz-work/$name"
  mkdir -p "$work/corpus"
  echo "== $name: ${seconds} s"
  if ! "$bin" -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
      -artifact_prefix="$work/" "$work/corpus" "$src/fuzz/corpus/$name" >"$work/log" 2>&1; then
    failed+=("$name")
    echo "   CRASH: see $work/log"; tail -n 30 "$work/log"
  else
    grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$work/log" | sed 's/^/   /'
  fi
done <"$list"
if [ ${#failed[@]} -gt 0 ]; then echo "fuzz targets that crashed: ${failed[*]}"; exit 1; fi
echo "no crashes"
