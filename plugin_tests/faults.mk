# Runs under injected provider faults (config `fault_inject`, README "Fault injection").
# Included by the top-level Makefile after harness.mk, agent.mk and gpu.mk (HARNESS_BIN,
# AGENT_CAPI_BIN, GPU_HARNESS, MOCK_CUDA).
#
# Transparent faults (FI_EAGAIN storms, late and reordered completions) must be invisible:
# the C harness, the stock-agent C-API test and the GPU harness against the stand-in driver
# pass unchanged with them on. Error faults (error completions, failed posts) are tested by
# tests/faults.rs in `make unit-test`: an affected request fails with a NIXL error status,
# never succeeds with wrong bytes, nothing hangs, later requests succeed. (The C harness
# cannot express those: it expects every request to succeed, and its two-process tests
# fall out of step with their child after a failed request, then wait out their timeouts.)
#
#   make faults-test                       all of the runs below
#   FAULTS_SPEC=... make faults-test       another spec (e.g. another seed)
FAULTS_SPEC      ?= eagain=0.3,eagain_burst=8,reorder=0.5,delay=4,hold=16,seed=7
FAULTS_REORDER   ?= reorder=0.7,delay=6,hold=32,seed=7
FAULTS_EAGAIN    ?= eagain=0.3,eagain_burst=8,seed=7
FAULTS_PROVIDERS ?= tcp,sockets,shm
FAULTS_LOG       := $(BUILD)/faults

.PHONY: faults-test faults-harness-test faults-agent-capi-test faults-gpu-cpu-test

faults-test: faults-harness-test faults-agent-capi-test faults-gpu-cpu-test

faults-harness-test: build harness-build
	@mkdir -p $(FAULTS_LOG)
	@echo "== C harness, $(FAULTS_PROVIDERS), fault_inject=$(FAULTS_SPEC)"
	@set -o pipefail; NIXL_FABRIC_FAULT_INJECT='$(FAULTS_SPEC)' HARNESS_PROVIDERS=$(FAULTS_PROVIDERS) \
	  $(HARNESS_BIN) > $(FAULTS_LOG)/harness.log 2>&1; rc=$$?; sed -n '/^---- summary/,$$p' $(FAULTS_LOG)/harness.log; \
	  grep '^FAIL' $(FAULTS_LOG)/harness.log | head -20; exit $$rc
	@echo "== C harness, tcp over four rails (rail threads, outboxes), fault_inject=$(FAULTS_SPEC)"
	@set -o pipefail; NIXL_FABRIC_RAILS=4 NIXL_FABRIC_FAULT_INJECT='$(FAULTS_SPEC)' HARNESS_PROVIDERS=tcp \
	  $(HARNESS_BIN) > $(FAULTS_LOG)/harness-4rails.log 2>&1; rc=$$?; sed -n '/^---- summary/,$$p' $(FAULTS_LOG)/harness-4rails.log; \
	  grep '^FAIL' $(FAULTS_LOG)/harness-4rails.log | head -20; exit $$rc

faults-agent-capi-test: agent-capi-test
	@echo "== stock-agent C-API test, fault_inject=$(FAULTS_SPEC)"
	@set -o pipefail; NIXL_FABRIC_FAULT_INJECT='$(FAULTS_SPEC)' NIXL_PLUGIN_DIR=$(PLUGINS) NIXL_FABRIC_BACKEND=$(BACKEND) \
	  NIXL_FABRIC_PROVIDER=tcp timeout 300 $(AGENT_CAPI_BIN) > $(FAULTS_LOG)/agent-capi.log 2>&1; rc=$$?; \
	  tail -1 $(FAULTS_LOG)/agent-capi.log; grep -i 'FAIL' $(FAULTS_LOG)/agent-capi.log | head -20; exit $$rc

faults-gpu-cpu-test: build $(GPU_HARNESS) $(MOCK_CUDA)
	@mkdir -p $(FAULTS_LOG)
	@echo "== GPU harness, stand-in CUDA driver, fault_inject=$(FAULTS_REORDER)"
	@set -o pipefail; NIXL_FABRIC_FAULT_INJECT='$(FAULTS_REORDER)' NIXL_FABRIC_CUDA_LIB=$(MOCK_CUDA) GPU_HARNESS_NO_BW=1 \
	  timeout 300 $(GPU_HARNESS) > $(FAULTS_LOG)/gpu-reorder.log 2>&1; rc=$$?; tail -1 $(FAULTS_LOG)/gpu-reorder.log; \
	  grep '^FAIL' $(FAULTS_LOG)/gpu-reorder.log | head -20; exit $$rc
	@echo "== GPU harness, stand-in CUDA driver, four tcp rails, fault_inject=$(FAULTS_REORDER)"
	@set -o pipefail; NIXL_FABRIC_RAILS=4 NIXL_FABRIC_FAULT_INJECT='$(FAULTS_REORDER)' NIXL_FABRIC_CUDA_LIB=$(MOCK_CUDA) GPU_HARNESS_NO_BW=1 \
	  timeout 300 $(GPU_HARNESS) > $(FAULTS_LOG)/gpu-reorder-4rails.log 2>&1; rc=$$?; tail -1 $(FAULTS_LOG)/gpu-reorder-4rails.log; \
	  grep '^FAIL' $(FAULTS_LOG)/gpu-reorder-4rails.log | head -20; exit $$rc
	@# Staged GPU transfers under FI_EAGAIN storms: before the transport seam (issue 21) a PULL
	@# serve retried its READ as a WRITE of a stale bounce slot (10-13 checks NIXL_SUCCESS with
	@# wrong bytes here); now every refused step is posted again as the same operation.
	@echo "== GPU harness, stand-in CUDA driver, fault_inject=$(FAULTS_EAGAIN)"
	@set -o pipefail; NIXL_FABRIC_FAULT_INJECT='$(FAULTS_EAGAIN)' NIXL_FABRIC_CUDA_LIB=$(MOCK_CUDA) GPU_HARNESS_NO_BW=1 \
	  timeout 300 $(GPU_HARNESS) > $(FAULTS_LOG)/gpu-eagain.log 2>&1; rc=$$?; tail -1 $(FAULTS_LOG)/gpu-eagain.log; \
	  grep '^FAIL' $(FAULTS_LOG)/gpu-eagain.log | head -20; exit $$rc
	@echo "== GPU harness, stand-in CUDA driver, four tcp rails, fault_inject=$(FAULTS_SPEC)"
	@set -o pipefail; NIXL_FABRIC_RAILS=4 NIXL_FABRIC_FAULT_INJECT='$(FAULTS_SPEC)' NIXL_FABRIC_CUDA_LIB=$(MOCK_CUDA) GPU_HARNESS_NO_BW=1 \
	  timeout 300 $(GPU_HARNESS) > $(FAULTS_LOG)/gpu-all-4rails.log 2>&1; rc=$$?; tail -1 $(FAULTS_LOG)/gpu-all-4rails.log; \
	  grep '^FAIL' $(FAULTS_LOG)/gpu-all-4rails.log | head -20; exit $$rc

TEST_TARGETS += faults-test
