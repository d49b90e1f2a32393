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
