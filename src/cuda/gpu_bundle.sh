#!/bin/sh
# Gathers the GPU test and benchmark binaries of a build, with the shared libraries they
# need beyond glibc, into one folder to carry to the GPU machine, plus run.sh to run them
# there. Usage: src/cuda/gpu_bundle.sh BUILD_DIR OUT_DIR
#   then, on the GPU machine, from the repository root: sh OUT_DIR/run.sh [RESULTS_DIR]
set -eu
build=$1
out=$2
mkdir -p "$out"
for b in src/cuda/cuda_device_memory_test src/cuda/cuda_ipc_benchmark tools/wsync tests/e2e/e2e_gpu_ipc_test; do
  [ -f "$build/$b" ] || { echo "skipping $b (not built)"; continue; }
  cp "$build/$b" "$out/"
  ldd "$build/$b" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|ld-linux*|libgcc_s.so*|libstdc++.so*) ;;
      libnccl.so*) ;;  # 200+ MB: run.sh uses the GPU machine's own (torch's)
      *) cp -L "$lib" "$out/" ;;
    esac
  done
done
cat > "$out/run.sh" <<'RUN'
#!/bin/sh
# The ipc backend's GPU checks on one GPU: the gpu-labelled tests, then the data-plane
# benchmark (packed and zero-copy, both export kinds, 100 extra syncs of leak accounting),
# the engines end to end (e2e_gpu_ipc_test, `wsync bench ipc --device cuda:0`), then the
# PyTorch baseline when the probe is there. Results go to ${1:-.}.
here=$(cd "$(dirname "$0")" && pwd)
res=${1:-.}
mkdir -p "$res"
nccl=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "nccl", "lib"))' 2>/dev/null || true)
export LD_LIBRARY_PATH="$here${nccl:+:$nccl}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv,noheader | tee "$res/gpu.txt"
"$here/cuda_device_memory_test" 2>&1 | tee "$res/cuda_device_memory_test.txt" | tail -30
for kind in cuda_ipc cuda_fd; do
  "$here/cuda_ipc_benchmark" --model qwen3-8b --iters 10 --bucket-gb 1.24 --kind "$kind" --leak-syncs 100 \
    >"$res/bench_$kind.jsonl" 2>"$res/bench_$kind.log"
  echo "rc=$? kind=$kind"; cat "$res/bench_$kind.log" "$res/bench_$kind.jsonl"
done
"$here/cuda_ipc_benchmark" --model qwen3-8b --iters 10 --bucket-gb 1.24 --mode packed --copy memcpy \
  >"$res/bench_memcpy.jsonl" 2>"$res/bench_memcpy.log"
cat "$res/bench_memcpy.log"
if [ -x "$here/wsync" ] && [ -x "$here/e2e_gpu_ipc_test" ]; then
  WSYNC_BIN="$here/wsync" "$here/e2e_gpu_ipc_test" 2>&1 | tee "$res/e2e_gpu_ipc_test.txt" | tail -30
fi
if [ -x "$here/wsync" ]; then
  "$here/wsync" bench ipc --device cuda:0 --model qwen3-8b --iters 10 --bucket-gb 1.155 \
    >"$res/wsync_bench_ipc.txt" 2>"$res/wsync_bench_ipc.log"
  echo "rc=$? wsync bench ipc"; cat "$res/wsync_bench_ipc.txt"; tail -5 "$res/wsync_bench_ipc.log"
fi
for probe in shared/probes/torch_ipc_baseline.py ../shared/probes/torch_ipc_baseline.py; do
  if [ -f "$probe" ]; then
    env -u LD_LIBRARY_PATH python3 "$probe" 36 | tee "$res/torch_baseline.jsonl"
    break
  fi
done
RUN
chmod +x "$out/run.sh"
ls -la "$out"
