# Reliability runs that are not part of `make test` (they are slow or need extra tools).
# Included by the top-level Makefile (ROOT, CARGO, TARGET, LIB, BUILD, PLUGINS, BACKEND,
# VENV) after plugin_tests/harness.mk (HARNESS_SRC, HARNESS_CC, HARNESS_CFLAGS, HARNESS_BIN)
# and plugin_tests/agent.mk (AGENT_CAPI_SRC, AGENT_CAPI_LIBS).
#
#   make fuzz          cargo-fuzz targets conn_info, mem_desc, ctrl (fuzz/), FUZZ_RUNS each
#                      (default 100000), from the seeds in tests/corpus/; prints iterations
#                      and crashes per target
#   make fuzz-corpus   regenerates tests/corpus/ (the generator is in tests/corpus_replay.rs,
#                      which `cargo test` runs as the corpus replay)
#   make test-asan     AddressSanitizer: the Rust tests and the C harness against a library
#                      built with -Zsanitizer=address (target/asan), the stock-agent C-API test
#                      with that plugin; then the C harness under valgrind (tcp) against the
#                      normal library, definite leaks counted as errors
#   make soak          tools/soak.c: SOAK_SECONDS (600) of mixed WRITE/READ against a peer
#                      process SIGKILLed and respawned every SOAK_RESTART_S (60)

.PHONY: fuzz fuzz-corpus test-asan asan-build soak soak-build

# ---- fuzzing ----------------------------------------------------------------------------
FUZZ_RUNS  ?= 100000
FUZZ_MAX_S ?= 600
fuzz: | $(STAMP)
	@FUZZ_RUNS=$(FUZZ_RUNS) FUZZ_MAX_S=$(FUZZ_MAX_S) FUZZ_LOGDIR=$(BUILD)/fuzz CARGO=$(CARGO) \
	  bash $(ROOT)/fuzz/run.sh $(FUZZ_TARGETS)

fuzz-corpus:
	rm -rf $(ROOT)/tests/corpus/conn_info $(ROOT)/tests/corpus/mem_desc $(ROOT)/tests/corpus/ctrl
	NF_CORPUS_REGEN=1 $(CARGO) test --$(PROFILE) --test corpus_replay
	@for d in $(ROOT)/tests/corpus/*/; do echo "$$d: $$(ls $$d | wc -l) files, $$(cat $$d* | wc -c) bytes"; done

# ---- AddressSanitizer and valgrind --------------------------------------------------------
# Rust ASAN on the stable toolchain: RUSTC_BOOTSTRAP=1 allows -Zsanitizer=address; with an
# explicit --target the flag reaches only target code (not build scripts). The standard
# library is the prebuilt, uninstrumented one (no -Zbuild-std offline): its own accesses are
# not checked, but every allocation is (malloc/free are intercepted), and all of our code,
# the C++ adapter (NF_ASAN=1 in build.rs) and the C harness (-fsanitize=address) are.
# Rust executables link rustc's ASAN runtime; the C harness and the agent test bring GCC's
# libasan, which the instrumented cdylib binds to (same v8 ASAN ABI).
ASAN_TRIPLE     := $(shell rustc -vV 2>/dev/null | sed -n 's/^host: //p')
ASAN_DIR        := $(ROOT)/target/asan
ASAN_LIBDIR     := $(ASAN_DIR)/$(ASAN_TRIPLE)/release
ASAN_OUT        := $(BUILD)/asan
ASAN_ENV        := RUSTC_BOOTSTRAP=1 RUSTFLAGS="-Zsanitizer=address" CARGO_TARGET_DIR=$(ASAN_DIR) NF_ASAN=1
ASAN_CARGO      := env $(ASAN_ENV) $(CARGO)
ASAN_CARGO_ARGS := --release --target $(ASAN_TRIPLE)
# Rust tests left out under ASAN: 8 threads x 10000 requests takes ~6 min there.
ASAN_SKIP       ?= eight_threads
ASAN_HARNESS_PROVIDERS ?= tcp,sockets,shm,udp
VALGRIND_HARNESS_PROVIDERS ?= tcp
# Leaks that are not ours, seen only when the stock agent dlcloses the plugin (libfabric and
# its provider libraries are unloaded with it): allocations of libpsm2/libibverbs/
# libinfinipath at load time, and nf_version's static string (a OnceLock whose storage goes
# away with the library image).
define ASAN_LSAN_SUPP
leak:libpsm2.so
leak:libibverbs.so
leak:libinfinipath.so
leak:nf_version
endef
export ASAN_LSAN_SUPP

asan-build: deps
	$(ASAN_CARGO) build $(ASAN_CARGO_ARGS) --lib
	$(ASAN_CARGO) test $(ASAN_CARGO_ARGS) --no-run
	@mkdir -p $(ASAN_OUT)/plugins
	@cp -f $(ASAN_LIBDIR)/libnixl_fabric.so $(ASAN_OUT)/plugins/libplugin_$(BACKEND).so
	$(HARNESS_CC) $(HARNESS_CFLAGS) -O1 -fsanitize=address -fno-omit-frame-pointer -I$(ROOT)/include \
	  -I$(ROOT)/plugin_tests -o $(ASAN_OUT)/nf_harness $(HARNESS_SRC) -L$(ASAN_LIBDIR) -lnixl_fabric \
	  -Wl,-rpath,$(ASAN_LIBDIR) -lpthread

# Each step runs whatever the previous ones did; the summary names every step and its result.
test-asan: asan-build harness-build
	@set -u; out=$(ASAN_OUT); rm -rf $$out/reports $$out/valgrind; mkdir -p $$out/reports $$out/valgrind; \
	printf '%s\n' "$$ASAN_LSAN_SUPP" > $$out/lsan.supp; \
	export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:log_path=$$out/reports/asan:log_exe_name=1"; \
	export LSAN_OPTIONS="suppressions=$$out/lsan.supp:print_suppressions=0"; \
	res=(); fail=0; t0=$$(date +%s); \
	step() { local name="$$1" rc="$$2" extra="$$3"; res+=("$$(printf '%-58s %s%s' "$$name" "$$( [ $$rc -eq 0 ] && echo ok || echo "FAILED (exit $$rc)")" "$$extra")"); [ $$rc -eq 0 ] || fail=1; }; \
	echo "== 1/4 Rust unit + integration tests, ASAN library (skipping: $(ASAN_SKIP))"; \
	timeout 600 $(ASAN_CARGO) test $(ASAN_CARGO_ARGS) -- --skip $(ASAN_SKIP) > $$out/cargo-test.log 2>&1; rc=$$?; \
	grep -E '^(test result|     Running)' $$out/cargo-test.log | sed 's/^ *//'; \
	grep -E ' FAILED$$|panicked at' $$out/cargo-test.log | head -6; \
	step "Rust tests (cargo test, -Zsanitizer=address)" $$rc "; $$(grep -h '^test result' $$out/cargo-test.log | awk '{p+=$$4; f+=$$6} END {print p" passed, "f" failed"}')"; \
	echo "== 2/4 C harness -fsanitize=address, ASAN library, providers $(ASAN_HARNESS_PROVIDERS)"; \
	HARNESS_PROVIDERS=$(ASAN_HARNESS_PROVIDERS) timeout 600 $$out/nf_harness > $$out/harness.log 2>&1; rc=$$?; \
	sed -n '/^---- summary/,$$p' $$out/harness.log; \
	step "C harness (ASAN) $(ASAN_HARNESS_PROVIDERS)" $$rc "; $$(tail -1 $$out/harness.log)"; \
	echo "== 3/4 stock NIXL agent C-API test (agent_capi -fsanitize=address), ASAN plugin"; \
	libs=$(AGENT_CAPI_LIBS); \
	if [ -n "$(AGENT_CAPI_SRC)" ] && [ -f "$$libs/libnixl_capi.so" ]; then \
	  $(CC) -std=c11 -O1 -g -fsanitize=address -o $$out/agent_capi $(AGENT_CAPI_SRC) -L"$$libs" -lnixl_capi -Wl,-rpath,"$$libs" && \
	  NIXL_PLUGIN_DIR=$$out/plugins NIXL_FABRIC_BACKEND=$(BACKEND) NIXL_FABRIC_PROVIDER=tcp \
	    timeout 300 $$out/agent_capi > $$out/agent-capi.log 2>&1; rc=$$?; tail -1 $$out/agent-capi.log; \
	  step "stock-agent C-API test (ASAN plugin)" $$rc "; $$(grep -c '^  ok' $$out/agent-capi.log) steps ok, $$(grep -c 'agent-capi-test FAIL' $$out/agent-capi.log) FAIL"; \
	else echo "skipped: no $(VENV) with libnixl_capi.so (make venv)"; res+=("$$(printf '%-58s %s' 'stock-agent C-API test (ASAN plugin)' 'skipped (no venv)')"); fi; \
	echo "== 4/4 C harness under valgrind memcheck, normal library, providers $(VALGRIND_HARNESS_PROVIDERS)"; \
	if command -v valgrind >/dev/null; then \
	  HARNESS_PROVIDERS=$(VALGRIND_HARNESS_PROVIDERS) HARNESS_SUITE_S=400 HARNESS_WAIT_S=60 timeout 540 \
	    env -u ASAN_OPTIONS -u LSAN_OPTIONS valgrind -q --trace-children=yes --leak-check=full --show-leak-kinds=definite \
	    --errors-for-leak-kinds=definite --error-exitcode=99 --log-file=$$out/valgrind/vg.%p.log \
	    $(HARNESS_BIN) > $$out/valgrind.log 2>&1; rc=$$?; \
	  sed -n '/^---- summary/,$$p' $$out/valgrind.log; \
	  vgerr=$$(cat $$out/valgrind/vg.*.log 2>/dev/null | grep -c '^==[0-9]*== .'); \
	  nproc=$$(ls $$out/valgrind | wc -l); \
	  [ $$vgerr -eq 0 ] || { head -40 $$out/valgrind/vg.*.log; rc=99; }; \
	  step "C harness under valgrind $(VALGRIND_HARNESS_PROVIDERS)" $$rc "; $$(tail -1 $$out/valgrind.log); $$nproc processes, $$vgerr report lines (errors or definite leaks)"; \
	else res+=("$$(printf '%-58s %s' 'C harness under valgrind' 'skipped (valgrind not installed)')"); fi; \
	nrep=$$(cat $$out/reports/asan.* 2>/dev/null | grep -c 'ERROR: \(Address\|Leak\)Sanitizer'); \
	if [ $$nrep -gt 0 ]; then echo "== sanitizer reports:"; grep -l 'Sanitizer' $$out/reports/asan.* | head; \
	  grep -h -A12 'ERROR: \(Address\|Leak\)Sanitizer' $$out/reports/asan.* | head -60; fail=1; fi; \
	echo "---- test-asan summary ($$(( $$(date +%s) - t0 )) s; logs in $$out)"; printf '%s\n' "$${res[@]}"; \
	echo "sanitizer reports (AddressSanitizer/LeakSanitizer, all processes): $$nrep"; \
	[ $$fail -eq 0 ] && echo "test-asan: passed" || { echo "test-asan: FAILED"; exit 1; }

# ---- soak ---------------------------------------------------------------------------------
SOAK_BIN     := $(BUILD)/nf_soak
SOAK_SECONDS ?= 600
SOAK_LOG     := $(BUILD)/soak.log

$(SOAK_BIN): $(ROOT)/tools/soak.c $(ROOT)/plugin_tests/harness_util.c $(ROOT)/plugin_tests/harness.h $(ROOT)/include/nixl_fabric.h $(LIB)
	@mkdir -p $(BUILD)
	$(HARNESS_CC) $(HARNESS_CFLAGS) -I$(ROOT)/include -I$(ROOT)/plugin_tests -o $@ $(ROOT)/tools/soak.c \
	  $(ROOT)/plugin_tests/harness_util.c -L$(TARGET) -lnixl_fabric -Wl,-rpath,$(TARGET) -lpthread

soak-build: build $(SOAK_BIN)

soak: soak-build
	@set -o pipefail; SOAK_SECONDS=$(SOAK_SECONDS) timeout $$(( $(SOAK_SECONDS) + 300 )) $(SOAK_BIN) 2>&1 | tee $(SOAK_LOG)
