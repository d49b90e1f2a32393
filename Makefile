# nixl-fabric: `make demo` and `make test` work on a fresh Debian/Ubuntu machine; every
# dependency is installed here (apt + a local venv), nothing by hand.
SHELL := /bin/bash
.DEFAULT_GOAL := build

ROOT      := $(abspath .)
CARGO     ?= cargo
PROFILE   ?= release
TARGET    := $(ROOT)/target/$(PROFILE)
LIB       := $(TARGET)/libnixl_fabric.so
BUILD     := $(ROOT)/build
PLUGINS   := $(BUILD)/plugins
BACKEND   ?= LIBFABRIC
VENV      := $(ROOT)/.venv
PY        := $(VENV)/bin/python
NIXL_PKG  ?= nixl-cu12==1.5.1
APT_PKGS  := libfabric-dev libfabric-bin libclang-dev clang pkg-config iproute2 gcc g++ make python3-venv
STAMP     := $(BUILD)/.stamps

export FI_TCP_IFACE ?= lo
export FI_SOCKETS_IFACE ?= lo
export NIXL_FABRIC_IFACE ?= lo
# Tests name the provider they test; same-host shm would route around it (tested on its own).
export NIXL_FABRIC_SAME_HOST_SHM ?= false

.PHONY: build deps venv test demo bench install wheel check-header unit-test clean

$(STAMP):
	@mkdir -p $@

# apt packages: installed only when missing (root on CI and fresh machines).
deps: | $(STAMP)
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi
	@command -v $(CARGO) >/dev/null || { echo "cargo not found: install Rust (https://rustup.rs)"; exit 1; }

# The stock NIXL agent from PyPI, the real client of our plugin in tests and benchmarks.
$(VENV)/.ok:
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --no-deps "$(NIXL_PKG)"
	$(VENV)/bin/pip install -q numpy pytest
	@touch $@
venv: deps $(VENV)/.ok

build: deps
	$(CARGO) build --$(PROFILE) --lib --bins
	@mkdir -p $(PLUGINS)
	@cp -f $(LIB) $(PLUGINS)/.libplugin_$(BACKEND).so.tmp && mv -f $(PLUGINS)/.libplugin_$(BACKEND).so.tmp $(PLUGINS)/libplugin_$(BACKEND).so
	@echo "plugin: $(PLUGINS)/libplugin_$(BACKEND).so"

# The committed header must equal what cbindgen generates from src/capi.
check-header: build
	@git diff --quiet -- include/nixl_fabric.h || { echo "include/nixl_fabric.h is stale: commit the regenerated header"; git --no-pager diff --stat -- include/nixl_fabric.h; exit 1; }

unit-test: deps | $(STAMP)
	$(CARGO) test --$(PROFILE) 2>&1 | tee $(BUILD)/unit-test.log; exit $${PIPESTATUS[0]}

# Lints are part of the tests: every warning is an error (the clippy component is added
# where the toolchain lacks it).
clippy: deps
	@$(CARGO) clippy --version >/dev/null 2>&1 || rustup component add clippy
	$(CARGO) clippy --$(PROFILE) --all-targets -- -D warnings

-include plugin_tests/harness.mk
-include plugin_tests/agent.mk
-include tests/python/python.mk
-include plugin_tests/gpu.mk
-include plugin_tests/faults.mk
-include plugin_tests/reliability.mk
-include examples/examples.mk
-include bench/bench.mk
-include tests/netns/netns.mk
-include tests/lf2/lf2.mk
-include tests/versions/versions.mk
-include tests/versions/wheel.mk

TEST_TARGETS ?=
test: build check-header clippy unit-test $(TEST_TARGETS)
	@echo "make test: all suites passed ($(TEST_TARGETS))"

demo: build venv
	PY=$(PY) bash demo/run_demo.sh

# Into the active NIXL's own plugin folder (found by python/nixl_fabric/locate.py through
# NIXL_PYTHON: its nixl_cu13/nixl_cu12 package, else a libnixl.so with a plugins folder), so
# the stock UCX/POSIX plugins stay usable beside ours; NIXL_PLUGIN_DIR=<dir> installs there.
NIXL_PYTHON ?= python3
install: build
	@if [ -n "$(NIXL_PLUGIN_DIR)" ]; then \
	  install -d "$(NIXL_PLUGIN_DIR)" && install -m 0755 $(LIB) "$(NIXL_PLUGIN_DIR)/libplugin_$(BACKEND).so" && \
	  echo "installed $(NIXL_PLUGIN_DIR)/libplugin_$(BACKEND).so"; \
	else \
	  PYTHONPATH=$(ROOT)/python $(NIXL_PYTHON) -m nixl_fabric install --so $(LIB) --name $(BACKEND); \
	fi

# A manylinux wheel: the plugin and nixl-fabric-info as data of the nixl_fabric package
# (python -m nixl_fabric install | info); libfabric stays a system library.
WHEEL_DIR := $(BUILD)/wheel
WHEEL_VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' $(ROOT)/Cargo.toml | head -n1)
wheel: build
	@rm -f $(WHEEL_DIR)/nixl_fabric-*.whl
	python3 $(ROOT)/python/build_wheel.py --so $(LIB) --info $(TARGET)/nixl-fabric-info \
	  --version $(WHEEL_VERSION) --out $(WHEEL_DIR)

clean:
	$(CARGO) clean
	rm -rf $(BUILD)
