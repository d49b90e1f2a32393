# The stock NIXL agent (libnixl_capi.so from the pip wheel in $(VENV)) driving our plugin
# through its C API: plugin_tests/agent_capi.c. Included by the top-level Makefile, which
# defines ROOT, BUILD, PLUGINS, VENV and the build/venv targets, and exports the loopback
# interface variables (FI_TCP_IFACE, NIXL_FABRIC_IFACE).

AGENT_CAPI_SRC := $(ROOT)/plugin_tests/agent_capi.c
AGENT_CAPI_BIN := $(BUILD)/agent_capi
AGENT_CAPI_LOG := $(BUILD)/agent-capi-test.log
# The wheel's libraries (libnixl_capi.so and what it needs, found through its own RPATH).
AGENT_CAPI_LIBS = $$(ls -d $(VENV)/lib/python3*/site-packages/.nixl_cu12.mesonpy.libs 2>/dev/null | head -n1)

.PHONY: agent-capi-test
agent-capi-test: build venv
	@mkdir -p $(BUILD)
	@libs=$(AGENT_CAPI_LIBS); \
	test -f "$$libs/libnixl_capi.so" || { echo "agent-capi-test: libnixl_capi.so not found in $(VENV) (make venv)"; exit 1; }; \
	$(CC) -std=c11 -O2 -g -Wall -Wextra -Werror -o $(AGENT_CAPI_BIN) $(AGENT_CAPI_SRC) \
	  -L"$$libs" -lnixl_capi -Wl,-rpath,"$$libs"
	@test -f $(PLUGINS)/libplugin_$(BACKEND).so || { echo "agent-capi-test: $(PLUGINS)/libplugin_$(BACKEND).so missing (make build)"; exit 1; }
	@# Only the two plugin entry points and the nf_* C ABI may leave the plugin (no C++ or
	@# libstdc++ template symbols that another image could interpose).
	@extra=$$(nm -D --defined-only $(PLUGINS)/libplugin_$(BACKEND).so | \
	  awk 'NF == 3 && $$2 != "A" && $$3 !~ /^(nixl_plugin_init|nixl_plugin_fini|nf_[A-Za-z0-9_]+)$$/ { print $$3 }'); \
	test -z "$$extra" || { echo "agent-capi-test: unexpected exported symbols:"; echo "$$extra"; exit 1; }
	NIXL_PLUGIN_DIR=$(PLUGINS) NIXL_FABRIC_BACKEND=$(BACKEND) NIXL_FABRIC_PROVIDER=tcp \
	  timeout 300 $(AGENT_CAPI_BIN) 2>&1 | tee $(AGENT_CAPI_LOG); exit $${PIPESTATUS[0]}

TEST_TARGETS += agent-capi-test
