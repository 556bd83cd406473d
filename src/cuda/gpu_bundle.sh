#!/bin/sh
# Gathers the GPU test and benchmark binaries of a build, with the shared libraries they
# need beyond glibc, into one folder to carry to the GPU machine, plus run.sh to run them
# there. Usage: src/cuda/gpu_bundle.sh BUILD_DIR OUT_DIR [PY_BUILD_DIR]
#   then, on the GPU machine, from the repository root: sh OUT_DIR/run.sh [RESULTS_DIR]
# PY_BUILD_DIR: a build of the Python package for the GPU machine's interpreter
# (WSYNC_PYTHON_INCLUDE_DIRS, see CMakeLists.txt); it goes to OUT_DIR/python, and
# OUT_DIR/run_python.sh runs the package's tests and bench/python_vs_cpp.py there.
set -eu
build=$1
out=$2
py_build=${3:-}
mkdir -p "$out"
bins="src/cuda/cuda_device_memory_test src/cuda/cuda_device_store_test src/cuda/cuda_runtime_checker_test
  src/cuda/cuda_ipc_benchmark tools/wsync
  tests/e2e/e2e_gpu_ipc_test"
if [ -n "$py_build" ]; then
  rm -rf "$out/python" && mkdir -p "$out/python" && cp -r "$py_build/python/wsync" "$out/python/"
  bins="$bins $(cd "$py_build" && ls python/wsync/_wsync*.so)"
fi
for b in $bins; do
  src="$build/$b"
  [ -f "$src" ] || src="$py_build/$b"
  [ -f "$src" ] || { echo "skipping $b (not built)"; continue; }
  case "$b" in python/*) ;; *) cp "$src" "$out/" ;; esac
  ldd "$src" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
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
cat > "$out/run_python.sh" <<'RUN'
#!/bin/sh
# The Python package on one GPU, from the repository root: every python/tests file (the
# gpu ones included) with the machine's own python3 and torch, then the Python-vs-C++
# benchmark (CPU broadcast and ipc on the GPU). Results go to ${1:-.}; extra arguments
# go to the benchmark.
here=$(cd "$(dirname "$0")" && pwd)
res=${1:-.}
[ $# -gt 0 ] && shift
mkdir -p "$res"
nccl=$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "nccl", "lib"))' 2>/dev/null || true)
export LD_LIBRARY_PATH="$here${nccl:+:$nccl}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$here/python" WSYNC_BIN="$here/wsync" WSYNC_SOURCE_DIR="$PWD" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
python3 -c 'import wsync, torch; print("wsync from", wsync.__file__, "torch", torch.__version__, "cuda", torch.cuda.is_available())'
python3 -m pytest -q -p no:cacheprovider -rs python/tests 2>&1 | tee "$res/pytest.txt" | tail -40
python3 bench/python_vs_cpp.py --json "$@" >"$res/bench_python.txt" 2>"$res/bench_python.log"
echo "rc=$? bench/python_vs_cpp.py"; cat "$res/bench_python.txt"; tail -5 "$res/bench_python.log"
RUN
chmod +x "$out/run_python.sh"
ls -la "$out"
