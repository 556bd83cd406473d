#!/bin/sh
# Usage: OUT=results sh tools/scripts/before_after_cpu.sh, with gpubundle/wsync and gpubundle/wsync-base
# (the binary to compare against) and their shared libraries.
# Same-run before/after of the CPU benchmarks on the GPU host's 16 cores (base = main before issue 14).
B=gpubundle
export LD_LIBRARY_PATH="$PWD/$B"
R=${OUT:?set OUT to a results folder}; mkdir -p "$R"
export TMPDIR=/tmp
for i in 1 2; do for w in wsync-base wsync; do
  echo "== $w run $i" | tee -a $R/bench_broadcast.txt >> $R/bench_sources.txt
  timeout 100 $B/$w bench broadcast --model qwen3-0.6b --servers 2 --iters 5 >> $R/bench_broadcast.txt 2>&1; echo "broadcast $w $i rc=$?" >> $R/summary.txt
  timeout 60 $B/$w bench sources --model qwen3-0.6b --trainer-layout tp2pp2ep1 --iters 2 >> $R/bench_sources.txt 2>&1; echo "sources $w $i rc=$?" >> $R/summary.txt
done; done
for w in wsync-base wsync; do
  echo "== $w" >> $R/bench_delta.txt
  timeout 150 $B/$w bench delta --model qwen3-0.6b --steps 5 >> $R/bench_delta.txt 2>&1; echo "delta $w rc=$?" >> $R/summary.txt
done
cat $R/summary.txt
