# make wheel-test: the wheel of `make wheel` from a fresh venv (tests/versions/wheel_test.sh):
# stock agent + our wheel, `python -m nixl_fabric install`, bytes through the stock agent
# with ours and stock UCX from the agent's own plugin folder, `info`, `uninstall`, and the
# no-NIXL fallback. Included by the top-level Makefile (ROOT, BUILD, NIXL_PKG, wheel).
WHEEL_TEST_VENV := $(BUILD)/wheel-venv

.PHONY: wheel-test
wheel-test: wheel
	bash $(ROOT)/tests/versions/wheel_test.sh $$(ls $(WHEEL_DIR)/nixl_fabric-*.whl | head -n1) \
	  $(WHEEL_TEST_VENV) "$(NIXL_PKG)"

TEST_TARGETS += wheel-test

# make install into the same fresh venv's NIXL (no NIXL_PLUGIN_DIR: found through
# NIXL_PYTHON), bytes through it, then `make install NIXL_PLUGIN_DIR=<dir>` still installs
# into <dir>.
INSTALL_TEST_NAME := NFINSTALL
.PHONY: install-test
install-test: wheel-test
	@set -e; py=$(WHEEL_TEST_VENV)/bin/python; \
	dir=$$($$py $(ROOT)/python/nixl_fabric/locate.py); \
	$(MAKE) --no-print-directory install NIXL_PYTHON=$$py BACKEND=$(INSTALL_TEST_NAME) NIXL_PLUGIN_DIR=; \
	test -f $$dir/libplugin_$(INSTALL_TEST_NAME).so || { echo "install-test: nothing in $$dir"; exit 1; }; \
	env -u NIXL_PLUGIN_DIR UCX_MODULES=^ib $$py $(ROOT)/tests/versions/case.py one $(INSTALL_TEST_NAME) 2>/dev/null; \
	PYTHONPATH=$(ROOT)/python $$py -m nixl_fabric uninstall --name $(INSTALL_TEST_NAME) --dir $$dir; \
	tmp=$$(mktemp -d); $(MAKE) --no-print-directory install NIXL_PLUGIN_DIR=$$tmp BACKEND=$(INSTALL_TEST_NAME); \
	test -f $$tmp/libplugin_$(INSTALL_TEST_NAME).so || { echo "install-test: NIXL_PLUGIN_DIR=$$tmp not honoured"; exit 1; }; \
	rm -rf $$tmp $(PLUGINS)/libplugin_$(INSTALL_TEST_NAME).so; echo "install-test: passed"

TEST_TARGETS += install-test
