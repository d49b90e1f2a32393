# make test-lf2: the same plugin binary (built against the system's libfabric 1.17 headers)
# run on libfabric 2.x, switched in through LD_LIBRARY_PATH (the plugin's NEEDED
# libfabric.so.1). Included by the top-level Makefile (ROOT, BUILD, TARGET, PLUGINS, VENV,
# PY, build/venv and the harness/python/bench targets).
#   make lf2-build        build/lf2/prefix: libfabric 2.x from Debian's trixie source package
#                         (tools/build-libfabric2.sh; built once, reused through its stamp)
#   make test-lf2         on 2.x: load check, C harness, stock-agent Python suite, quick bench
#                         (its JSON stays in build/lf2/bench; make lf2-bench keeps a copy)
#   make lf2-harness | lf2-python | lf2-bench | lf2-gpu    one part
#   make lf2-bench-compare   quick bench on 1.17 and on 2.x, one after the other
# Logs: build/lf2/logs/. Bench JSON: bench/results/<date>-lf2-quick.json (+ .png).
LF2_DEB_VERSION ?= 2.1.0-1.1
LF2_MAJMIN      := $(word 1,$(subst ., ,$(LF2_DEB_VERSION))).$(word 2,$(subst ., ,$(LF2_DEB_VERSION)))
LF2_DIR         := $(BUILD)/lf2
LF2_LIB         := $(LF2_DIR)/prefix/lib
LF2_LOGS        := $(LF2_DIR)/logs
LF2_STAMP       := $(LF2_DIR)/.built-$(LF2_DEB_VERSION)
LF2_ENV         := LD_LIBRARY_PATH=$(LF2_LIB)$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}
# Counted C-harness providers, and the ones only reported ("tried": udp, as on 1.17). shm on
# 2.x keeps departed peers' AV entries (fabric/rail.rs keep_av_entries): with fi_av_remove
# its progress crashed in smr_ep_progress after a peer left. LF2_SHM_COUNTED_GROUPS: extra
# counted shm-only runs of harness groups (none by default).
LF2_HARNESS_PROVIDERS  ?= tcp,sockets,shm,udp
LF2_HARNESS_TRY        ?= udp
LF2_SHM_COUNTED_GROUPS ?=
LF2_PYTEST_ARGS        ?=
LF2_BENCH_ARGS         ?= --quick --configs ours-tcp,ours-shm,ours-tcp-default,ucx
LF2_BENCH_DATE          = $(shell date +%F)

.PHONY: lf2-build lf2-check lf2-harness lf2-python lf2-bench-run lf2-bench lf2-bench-compare lf2-gpu test-lf2

$(LF2_STAMP):
	LF_DEB_VERSION=$(LF2_DEB_VERSION) LF2_DIR=$(LF2_DIR) bash $(ROOT)/tools/build-libfabric2.sh
lf2-build: $(LF2_STAMP)

# Fails unless both our info tool and a stock agent's process really run on $(LF2_LIB).
lf2-check: build venv lf2-build
	@mkdir -p $(LF2_LOGS)
	@v=$$(env $(LF2_ENV) $(TARGET)/nixl-fabric-info 2>&1 | sed -n 's/^libfabric runtime: //p'); \
	echo "lf2-check: nixl-fabric-info reports libfabric runtime $$v"; \
	[ "$$v" = "$(LF2_MAJMIN)" ] || { echo "lf2-check: expected $(LF2_MAJMIN) from $(LF2_LIB)"; exit 1; }
	@cd $(ROOT) && env $(LF2_ENV) $(PYTHON_TEST_ENV) $(PY) tests/lf2/check_loaded.py $(LF2_LIB) $(LF2_MAJMIN) \
	  2>&1 | tee $(LF2_LOGS)/check.log; exit $${PIPESTATUS[0]}

lf2-harness: harness-build lf2-check
	@set -o pipefail; env $(LF2_ENV) HARNESS_PROVIDERS=$(LF2_HARNESS_PROVIDERS) HARNESS_TRY_PROVIDERS=$(LF2_HARNESS_TRY) \
	  $(HARNESS_BIN) 2>&1 | tee $(LF2_LOGS)/harness.log
	@if [ -n "$(LF2_SHM_COUNTED_GROUPS)" ]; then set -o pipefail; echo "== lf2 harness: shm, groups $(LF2_SHM_COUNTED_GROUPS) (counted)"; \
	  env $(LF2_ENV) HARNESS_PROVIDERS=shm HARNESS_TRY_PROVIDERS= HARNESS_ONLY=$(LF2_SHM_COUNTED_GROUPS) \
	  $(HARNESS_BIN) 2>&1 | tee $(LF2_LOGS)/harness-shm-$(LF2_SHM_COUNTED_GROUPS).log | grep -E '^(FAIL|provider |[0-9]+ passed)'; fi

lf2-python: build venv $(VENV)/.pytest.ok lf2-check
	@mkdir -p $(LF2_LOGS); rm -f $(BUILD)/python-test-hang.txt
	cd $(ROOT) && timeout -k 10 $(PYTHON_TEST_TIMEOUT) env $(LF2_ENV) $(PYTHON_TEST_ENV) \
	  $(PY) -m pytest tests/python $(LF2_PYTEST_ARGS) 2>&1 | tee $(LF2_LOGS)/python-test.log; \
	  rc=$${PIPESTATUS[0]}; \
	  if [ -f $(BUILD)/python-test-hang.txt ]; then \
	    echo "lf2-python: pytest did not end normally (crash, or the per-test watchdog fired):"; \
	    cat $(BUILD)/python-test-hang.txt; fi; \
	  exit $$rc

# bench.py names its files by date only: run it into build/lf2/bench (all that test-lf2
# does: `make test` leaves the tree clean), and `make lf2-bench` copies the result under a
# name that says lf2 (and quick, when it was) into bench/results/.
lf2-bench-run: build venv $(VENV)/.matplotlib.ok lf2-check
	@rm -rf $(LF2_DIR)/bench; mkdir -p $(LF2_DIR)/bench
	env $(LF2_ENV) PY=$(PY) timeout -k 10 $(BENCH_TIMEOUT) bash $(ROOT)/bench/run.sh $(LF2_BENCH_ARGS) --out $(LF2_DIR)/bench \
	  2>&1 | tee $(LF2_LOGS)/bench.log; exit $${PIPESTATUS[0]}

lf2-bench: lf2-bench-run
	@sfx=lf2$(if $(findstring --quick,$(LF2_BENCH_ARGS)),-quick); \
	for f in $(LF2_DIR)/bench/*.json $(LF2_DIR)/bench/*.png; do [ -f "$$f" ] || continue; \
	  ext=$${f##*.}; cp -f "$$f" $(ROOT)/bench/results/$(LF2_BENCH_DATE)-$$sfx.$$ext; \
	  echo "lf2-bench: bench/results/$(LF2_BENCH_DATE)-$$sfx.$$ext"; done

# Not part of test-lf2: the same quick run on the system 1.17, for a side-by-side figure.
lf2-bench-compare: lf2-bench
	@rm -rf $(BUILD)/lf117-bench; mkdir -p $(BUILD)/lf117-bench
	PY=$(PY) timeout -k 10 $(BENCH_TIMEOUT) bash $(ROOT)/bench/run.sh $(LF2_BENCH_ARGS) --out $(BUILD)/lf117-bench \
	  2>&1 | tee $(LF2_LOGS)/bench-1.17.log; exit $${PIPESTATUS[0]}
	@for f in $(BUILD)/lf117-bench/*.json; do cp -f "$$f" $(ROOT)/bench/results/$(LF2_BENCH_DATE)-lf117-quick.json; done
	@echo "lf2-bench-compare: bench/results/$(LF2_BENCH_DATE)-lf117-quick.json next to $(LF2_BENCH_DATE)-lf2-quick.json"

# VRAM over shm on 2.x under the stand-in CUDA driver: API 1.20, no dma-buf (shm addresses
# regions by offset), the CUDA interface refused (no CUDA in this build): staged, and said so.
lf2-gpu: build lf2-check $(GPU_HARNESS) $(MOCK_CUDA)
	@mkdir -p $(LF2_LOGS); set -o pipefail; env $(LF2_ENV) NIXL_FABRIC_LOG=info GPU_HARNESS_PROVIDER=shm NIXL_FABRIC_CUDA_LIB=$(MOCK_CUDA) \
	  GPU_HARNESS_NO_BW=1 timeout 300 $(GPU_HARNESS) 2>&1 | tee $(LF2_LOGS)/gpu-shm.log | grep -E '^(FAIL|[0-9]+ passed)'
	@grep -q 'GPU memory is staged through host memory .*no dma-buf registration: shm addresses regions by offset' \
	  $(LF2_LOGS)/gpu-shm.log || { echo "lf2-gpu: no INFO line naming the shm fallback"; exit 1; }

test-lf2: lf2-check lf2-harness lf2-python lf2-bench-run lf2-gpu
	@echo "test-lf2: libfabric $(LF2_MAJMIN) ($(LF2_LIB)): load check, C harness, Python suite and quick bench passed"

TEST_TARGETS += test-lf2
