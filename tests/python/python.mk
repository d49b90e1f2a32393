# Python integration suite: the stock NIXL agent (PyPI nixl-cu12, in $(VENV)) drives our plugin
# through its Python API. Included by the top-level Makefile.
#   make python-test                         our plugin ($(BACKEND)) from $(PLUGINS)
#   make python-test NF_TEST_BACKEND=UCX     the same tests against stock UCX (checks the tests)
#   make python-test PYTEST_ARGS='-m "not large" -k notif'
NF_TEST_BACKEND ?= $(BACKEND)
PYTEST_ARGS     ?=
PYTHON_TEST_TIMEOUT ?= 900

# For our backend the plugin directory is the build's; for stock UCX the wheel's default.
PYTHON_TEST_ENV := NF_TEST_BACKEND=$(NF_TEST_BACKEND) NF_TEST_PLUGIN_DIR=$(PLUGINS) \
	$(if $(filter UCX,$(NF_TEST_BACKEND)),,NIXL_PLUGIN_DIR=$(PLUGINS)) \
	UCX_MODULES=^ib FI_TCP_IFACE=lo FI_SOCKETS_IFACE=lo NIXL_FABRIC_IFACE=lo \
	NIXL_FABRIC_PROVIDER=tcp NF_TEST_HANG_REPORT=$(BUILD)/python-test-hang.txt

.PHONY: python-test

# pytest was installed with --no-deps by the venv target; make sure it can import.
$(VENV)/.pytest.ok: $(VENV)/.ok
	@$(PY) -c 'import pytest' 2>/dev/null || $(VENV)/bin/pip install -q pytest
	@touch $@

python-test: build venv $(VENV)/.pytest.ok
	@mkdir -p $(BUILD); rm -f $(BUILD)/python-test-hang.txt
	cd $(ROOT) && timeout -k 10 $(PYTHON_TEST_TIMEOUT) env $(PYTHON_TEST_ENV) \
	  $(PY) -m pytest tests/python $(PYTEST_ARGS) 2>&1 | tee $(BUILD)/python-test.log; \
	  rc=$${PIPESTATUS[0]}; \
	  if [ $$rc = 5 ]; then echo "python-test: pytest collected no tests"; fi; \
	  if [ -f $(BUILD)/python-test-hang.txt ]; then \
	    echo "python-test: pytest did not end normally (crash, or the per-test watchdog fired):"; \
	    cat $(BUILD)/python-test-hang.txt; fi; \
	  exit $$rc

TEST_TARGETS += python-test
