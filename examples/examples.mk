# The serving-framework flows through the stock NIXL agent (pip wheel in $(VENV)) with our
# plugin, and the nixl-fabric-info test. Included by the top-level Makefile, which defines
# ROOT, BUILD, PLUGINS, BACKEND, TARGET, VENV, PY and the build/venv targets.
#   make examples-test   examples/trtllm_flow.c (C API, TRT-LLM's transfer agent) and
#                        examples/vllm_flow.py (Python API, vLLM's NixlConnector), two processes each
#   make info-test       tests/info/test_info.sh on target/release/nixl-fabric-info

TRTLLM_FLOW_SRC := $(ROOT)/examples/trtllm_flow.c
TRTLLM_FLOW_BIN := $(BUILD)/trtllm_flow
EXAMPLES_LOG    := $(BUILD)/examples-test.log
INFO_LOG        := $(BUILD)/info-test.log
EXAMPLES_TIMEOUT ?= 120
# The wheel's libraries (libnixl_capi.so and what it needs, found through its own RPATH).
EXAMPLES_CAPI_LIBS = $$(ls -d $(VENV)/lib/python3*/site-packages/.nixl_cu12.mesonpy.libs 2>/dev/null | head -n1)
# Loopback only; our plugin from the build under the name $(BACKEND).
EXAMPLES_ENV := NIXL_PLUGIN_DIR=$(PLUGINS) NIXL_FABRIC_BACKEND=$(BACKEND) NIXL_FABRIC_PROVIDER=tcp \
	FI_TCP_IFACE=lo FI_SOCKETS_IFACE=lo NIXL_FABRIC_IFACE=lo

.PHONY: examples-test info-test

examples-test: build venv
	@mkdir -p $(BUILD)
	@libs=$(EXAMPLES_CAPI_LIBS); \
	test -f "$$libs/libnixl_capi.so" || { echo "examples-test: libnixl_capi.so not found in $(VENV) (make venv)"; exit 1; }; \
	$(CC) -std=c11 -O2 -g -Wall -Wextra -Werror -I$(ROOT)/plugin_tests -o $(TRTLLM_FLOW_BIN) $(TRTLLM_FLOW_SRC) \
	  -L"$$libs" -lnixl_capi -Wl,-rpath,"$$libs"
	@test -f $(PLUGINS)/libplugin_$(BACKEND).so || { echo "examples-test: $(PLUGINS)/libplugin_$(BACKEND).so missing (make build)"; exit 1; }
	@: > $(EXAMPLES_LOG); rc=0; \
	echo "== trtllm_flow (C API)" | tee -a $(EXAMPLES_LOG); \
	env $(EXAMPLES_ENV) timeout -k 5 $(EXAMPLES_TIMEOUT) $(TRTLLM_FLOW_BIN) 2>&1 | tee -a $(EXAMPLES_LOG); \
	r=$${PIPESTATUS[0]}; [ $$r = 0 ] || { echo "examples-test: trtllm_flow exited $$r"; rc=1; }; \
	echo "== vllm_flow.py (Python API)" | tee -a $(EXAMPLES_LOG); \
	env $(EXAMPLES_ENV) timeout -k 5 $(EXAMPLES_TIMEOUT) $(PY) $(ROOT)/examples/vllm_flow.py --backend $(BACKEND) 2>&1 | tee -a $(EXAMPLES_LOG); \
	r=$${PIPESTATUS[0]}; [ $$r = 0 ] || { echo "examples-test: vllm_flow.py exited $$r"; rc=1; }; \
	[ $$rc = 0 ] && echo "examples-test: both flows passed"; exit $$rc

# PY and the plugin directory let the test compare --config-table with what the plugin
# reports to the stock agent.
info-test: build venv
	@mkdir -p $(BUILD)
	PY=$(PY) NIXL_PLUGIN_DIR=$(PLUGINS) NF_BACKEND=$(BACKEND) timeout -k 5 300 \
	  bash $(ROOT)/tests/info/test_info.sh $(TARGET)/nixl-fabric-info 2>&1 | tee $(INFO_LOG); exit $${PIPESTATUS[0]}

TEST_TARGETS += examples-test info-test
