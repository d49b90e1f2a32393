# make test-versions: one plugin binary against every stock NIXL release it supports, and the
# layout detector against NIXLs no release has shipped. Included by the top-level Makefile
# (ROOT, BUILD, PLUGINS, VENV, PY, build/venv).
#   make versions-matrix     each nixl-cu12 release in NIXL_VERSIONS, unpacked once into
#                            build/versions/cache (a second run downloads nothing): two agents
#                            in one process and in two processes, WRITE+notification, repost,
#                            genNotif, READ, every byte checked, through our plugin and through
#                            the stock UCX plugin in the same folder (tests/versions/matrix.py)
#   make versions-refusal    planted unknown layouts are refused with a clear error, shipped
#                            ones accepted (tests/versions/refusal.sh)
#   make test-versions       both
#   make versions-matrix NIXL_VERSIONS="1.5.1 0.7.1" VERSIONS_JOBS=4
# Logs: build/versions/logs/, table: build/versions/matrix.md.
NIXL_VERSIONS ?= 0.7.1 0.8.0 0.9.0 0.10.0 0.10.1 1.0.0 1.0.1 1.1.0 1.2.0 1.3.0 1.3.1 1.3.2 1.4.0 1.4.1 1.5.0 1.5.1
VERSIONS_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)
VERSIONS_DIR  := $(BUILD)/versions
VERSIONS_CACHE := $(VERSIONS_DIR)/cache
CUDA_STUB_DIR := $(VERSIONS_DIR)/cudastub

.PHONY: versions-cache versions-matrix versions-refusal test-versions

# Unpacks what is missing (runtime.py skips releases whose .ok stamp exists).
versions-cache: venv
	@mkdir -p $(VERSIONS_CACHE)
	$(PY) $(ROOT)/tests/versions/runtime.py $(VERSIONS_CACHE) $(NIXL_VERSIONS)

# 0.7-0.9's stock UCX plugin links libcuda.so.1; this stands in for it on CPU-only hosts.
$(CUDA_STUB_DIR)/libcuda.so.1: $(ROOT)/tests/versions/cuda_stub.c
	@mkdir -p $(CUDA_STUB_DIR)
	$(CC) -shared -fPIC -O2 -Wall -Wextra -Wl,-soname,libcuda.so.1 -o $@ $<

versions-matrix: build venv versions-cache $(CUDA_STUB_DIR)/libcuda.so.1
	cd $(ROOT) && $(PY) tests/versions/matrix.py --cache $(VERSIONS_CACHE) \
	  --plugin $(PLUGINS)/libplugin_$(BACKEND).so --cuda-stub $(CUDA_STUB_DIR) \
	  --jobs $(VERSIONS_JOBS) --report $(VERSIONS_DIR)/matrix.md $(NIXL_VERSIONS)

versions-refusal: build
	bash $(ROOT)/tests/versions/refusal.sh $(PLUGINS)/libplugin_$(BACKEND).so $(VERSIONS_DIR)/refusal

test-versions: versions-refusal versions-matrix

TEST_TARGETS += test-versions
