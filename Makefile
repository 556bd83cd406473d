# wsync: `make test` (what CI runs), `make demo`, `make bench`.
# Each target installs missing Debian packages first, then builds with CMake.

BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=RelWithDebInfo
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

DEB_PACKAGES := build-essential cmake pkg-config libgloo-dev libcpp-httplib-dev \
  nlohmann-json3-dev libspdlog-dev libfmt-dev libcli11-dev libxxhash-dev libzstd-dev \
  libssl-dev libgtest-dev libgmock-dev libbenchmark-dev

.PHONY: all deps build test demo bench clean

all: build

deps:
	@missing=$$(for p in $(DEB_PACKAGES); do dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q "install ok installed" || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing: $$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi

build: deps
	cmake -S . -B $(BUILD) $(CMAKE_FLAGS)
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) --timeout 900

demo: build
	$(BUILD)/tools/wsync demo

bench: build
	$(BUILD)/tools/wsync bench broadcast --model qwen3-0.6b --servers 2

clean:
	rm -rf $(BUILD)
