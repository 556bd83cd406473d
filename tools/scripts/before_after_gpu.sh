#!/bin/sh
# Usage, on the GPU machine from the repository root: OUT=results sh tools/scripts/before_after_gpu.sh
# with gpubundle/ holding src/cuda/gpu_bundle.sh output plus wsync-base (the binary to compare against).
# GPU checks of the merged tree and same-run before/after benchmarks (base = main before issue 14).
B=gpubundle
nccl=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "nccl", "lib"))' 2>/dev/null || true)
export LD_LIBRARY_PATH="$PWD/$B${nccl:+:$nccl}"
R=${OUT:?set OUT to a results folder}; mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > $R/machine.txt; nproc >> $R/machine.txt
$B/cuda_device_memory_test > $R/gpu_tests.txt 2>&1; echo "cuda_device_memory_test rc=$?" >> $R/summary.txt
$B/cuda_device_store_test >> $R/gpu_tests.txt 2>&1; echo "cuda_device_store_test rc=$?" >> $R/summary.txt
WSYNC_BIN=$PWD/$B/wsync $B/e2e_gpu_ipc_test >> $R/gpu_tests.txt 2>&1; echo "e2e_gpu_ipc_test rc=$?" >> $R/summary.txt
for i in 1 2; do for w in wsync-base wsync; do
  echo "== $w run $i" >> $R/bench_ipc.txt
  timeout 120 $B/$w bench ipc --device cuda:0 --model qwen3-8b --iters 10 --bucket-gb 1.155 >> $R/bench_ipc.txt 2>>$R/bench_ipc.log
  echo "bench ipc $w run $i rc=$?" >> $R/summary.txt
done; done
tail -3 $R/gpu_tests.txt >> $R/summary.txt
cat $R/summary.txt
