# GPU tests. On this (CPU) machine `make test` runs the GPU harness four times: without a CUDA
# driver (DRAM served, VRAM refused with NOT_SUPPORTED) and against the strict stand-in
# driver src/cuda/mock_cuda.c (the whole staging path and the seed-bug regression), that
# one again with four tcp rails (rail threads on the staging path, rail 0 left to control), and
# once more with staged chunks evened out over those rails (staging_balance).
# `make gpu-bundle` packs everything a GPU host needs into .gpu/ (bench/bench.py included, for
# the DRAM benchmark: RUN_GPU_ONLY=dram; bench/vllm_kv.py and bench/descs.py for the
# descriptor-heavy benchmarks of issue #23: RUN_GPU_ONLY=vllm / descs, run only when named);
# there `bash .gpu/run-gpu.sh` (or `make test-gpu`) runs the real thing.
GPU_HARNESS := $(BUILD)/gpu_harness
MOCK_CUDA   := $(BUILD)/libmockcuda.so
GPU_BUNDLE  := $(ROOT)/.gpu

$(GPU_HARNESS): plugin_tests/gpu_harness.c plugin_tests/harness_util.c plugin_tests/harness.h include/nixl_fabric.h $(LIB) | $(STAMP)
	$(CC) -std=gnu11 -O2 -g -Wall -Wextra -Wno-unused-parameter -Iinclude -Iplugin_tests \
	  plugin_tests/gpu_harness.c plugin_tests/harness_util.c -o $@ -L$(TARGET) -lnixl_fabric -ldl \
	  -Wl,-rpath,'$$ORIGIN' -Wl,-rpath,$(TARGET)

$(MOCK_CUDA): src/cuda/mock_cuda.c | $(STAMP)
	$(CC) -shared -fPIC -O2 -o $@ $<

.PHONY: gpu-cpu-test gpu-bundle test-gpu check-needed
gpu-cpu-test: build $(GPU_HARNESS) $(MOCK_CUDA)
	@echo "== GPU harness, no CUDA driver"
	NIXL_FABRIC_CUDA_LIB=/nonexistent/libcuda.so.1 $(GPU_HARNESS)
	@echo "== GPU harness, stand-in CUDA driver"
	NIXL_FABRIC_CUDA_LIB=$(MOCK_CUDA) GPU_HARNESS_NO_BW=1 timeout 300 $(GPU_HARNESS)
	@# close to what a 16-core host gets by default (rails=0 gives five tcp rails there): staged
	@# VRAM on threaded rails with rail 0 left to control messages, and flush reads on threaded
	@# rails, which a 2-core host never opens
	@echo "== GPU harness, stand-in CUDA driver, four tcp rails"
	NIXL_FABRIC_RAILS=4 NIXL_FABRIC_CUDA_LIB=$(MOCK_CUDA) GPU_HARNESS_NO_BW=1 timeout 300 $(GPU_HARNESS)
	@# staging_balance (off by default until a GPU host has measured it): the same run with staged
	@# requests planned again where their chunks leave one rail pair over the mean
	@echo "== GPU harness, stand-in CUDA driver, four tcp rails, staged chunks evened out"
	NIXL_FABRIC_STAGING_BALANCE=true NIXL_FABRIC_RAILS=4 NIXL_FABRIC_CUDA_LIB=$(MOCK_CUDA) GPU_HARNESS_NO_BW=1 timeout 300 $(GPU_HARNESS)

# The plugin must load where there is no CUDA and no NIXL: neither may be NEEDED.
check-needed: build
	@if readelf -d $(LIB) | grep NEEDED | grep -E 'libcuda|libcudart|libnixl'; then \
	  echo "the plugin must not link CUDA or NIXL"; exit 1; fi
	@echo "NEEDED: $$(readelf -d $(LIB) | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' | tr '\n' ' ')"

gpu-bundle: build $(GPU_HARNESS)
	rm -rf $(GPU_BUNDLE)/bin && mkdir -p $(GPU_BUNDLE)/bin $(GPU_BUNDLE)/plugins
	cp $(LIB) $(GPU_HARNESS) $(GPU_BUNDLE)/bin/
	cp "$$($(CARGO) test --$(PROFILE) --lib --no-run 2>&1 | sed -n 's/.*(\(.*target\/$(PROFILE)\/deps\/nixl_fabric-[0-9a-f]*\)).*/\1/p' | head -1)" $(GPU_BUNDLE)/bin/unit-tests
	cp $(LIB) $(GPU_BUNDLE)/plugins/libplugin_LIBFABRIC.so
	strip --strip-debug $(GPU_BUNDLE)/bin/* $(GPU_BUNDLE)/plugins/*
	cp tests/gpu/*.py tests/gpu/*.sh $(GPU_BUNDLE)/
	cp bench/bench.py $(GPU_BUNDLE)/bench.py
	cp bench/kvcommon.py bench/descs.py bench/vllm_kv.py bench/notif_latency.py bench/lat_small.py bench/create_loop.py $(GPU_BUNDLE)/
	cp bench/notif_netns.sh $(GPU_BUNDLE)/
	@# libfabric main and an `ip` for the stock LIBFABRIC plugin's runs (RUN_GPU_ONLY=stocknotif)
	for t in lfmain iproute; do test ! -f ../shared/tools/$$t.tar.xz || cp ../shared/tools/$$t.tar.xz $(GPU_BUNDLE)/; done
	git -C $(ROOT) rev-parse HEAD > $(GPU_BUNDLE)/GIT_REV 2>/dev/null || true
	test -f $(GPU_BUNDLE)/nixl-cu13.tar.xz || bash ../shared/tools/nixl-runtime.sh $(GPU_BUNDLE)/nixl-cu13.tar.xz 3.12 1.5.1 nixl-cu13
	test -n "$$(ls $(GPU_BUNDLE)/numpy-*.whl 2>/dev/null)" || python3 -m pip download -q --no-deps --only-binary=:all: \
	  --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 -d $(GPU_BUNDLE) numpy
	@du -sh $(GPU_BUNDLE)

test-gpu:
	@if [ -x $(GPU_BUNDLE)/run-gpu.sh ] || [ -f $(GPU_BUNDLE)/run-gpu.sh ]; then bash $(GPU_BUNDLE)/run-gpu.sh; \
	else echo "run 'make gpu-bundle' on the build machine first, then carry .gpu/ here"; exit 1; fi

TEST_TARGETS += check-needed gpu-cpu-test
