# C harness: tests the engine through include/nixl_fabric.h only (no NIXL). Included by
# the top-level Makefile, which defines ROOT, TARGET, LIB and BUILD.
#   make harness-test                              every provider
#   make harness-test HARNESS_PROVIDERS=tcp,shm    a subset
HARNESS_BIN    := $(BUILD)/nf_harness
HARNESS_SRC    := $(wildcard $(ROOT)/plugin_tests/harness*.c)
HARNESS_HDR    := $(wildcard $(ROOT)/plugin_tests/*.h) $(ROOT)/include/nixl_fabric.h
HARNESS_CC     ?= cc
HARNESS_CFLAGS ?= -std=c11 -O2 -g -Wall -Wextra
HARNESS_LOG    := $(BUILD)/harness.log

.PHONY: harness-build harness-test

harness-build: build
	@mkdir -p $(BUILD)
	$(HARNESS_CC) $(HARNESS_CFLAGS) -I$(ROOT)/include -I$(ROOT)/plugin_tests -o $(HARNESS_BIN) \
	  $(HARNESS_SRC) -L$(TARGET) -lnixl_fabric -Wl,-rpath,$(TARGET) -lpthread

harness-test: build harness-build
	@set -o pipefail; $(HARNESS_BIN) 2>&1 | tee $(HARNESS_LOG)

TEST_TARGETS += harness-test
