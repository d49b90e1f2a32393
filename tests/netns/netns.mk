# Multi-rail over two veth pairs between two network namespaces (needs root and iproute2).
.PHONY: netns-test
netns-test: build
	$(CARGO) build --$(PROFILE) --example pairtest
	@if [ "$$(id -u)" != 0 ]; then echo "netns-test: SKIP (needs root for ip netns)"; \
	else bash tests/netns/multirail.sh $(TARGET)/examples/pairtest; fi

TEST_TARGETS += netns-test
