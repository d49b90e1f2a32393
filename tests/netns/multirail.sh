#!/usr/bin/env bash
# Multi-rail over real separate links: two network namespaces joined by two veth pairs,
# one engine per namespace. Checks byte-exact transfers, that both rails carried data, that a
# 1-rail peer and a 2-rail peer work together, and that engines without an interface list
# connect across namespaces of two interfaces each (one automatic rail on this 2-core VM; the
# layout of several automatic connections on one interface is engine.rs's rail_layout test).
# Needs root (ip netns).
set -euo pipefail
BIN=${1:?usage: multirail.sh PAIRTEST_BIN}
A=nfA$$ B=nfB$$ DIR=$(mktemp -d)
cleanup() { ip netns del "$A" 2>/dev/null || true; ip netns del "$B" 2>/dev/null || true; rm -rf "$DIR"; }
trap cleanup EXIT
ip netns add "$A"; ip netns add "$B"
for i in 0 1; do
  ip link add "r${i}a" netns "$A" type veth peer name "r${i}b" netns "$B"
  ip -n "$A" addr add "10.201.$i.1/24" dev "r${i}a"; ip -n "$B" addr add "10.201.$i.2/24" dev "r${i}b"
  ip -n "$A" link set "r${i}a" up; ip -n "$B" link set "r${i}b" up
done
ip -n "$A" link set lo up; ip -n "$B" link set lo up
# Providers skip interfaces without carrier: wait until all four ends report it.
for _ in $(seq 100); do
  n=$( (ip -n "$A" -br link; ip -n "$B" -br link) | grep -c "^r[01][ab]@.* UP ")
  [ "$n" -eq 4 ] && break; sleep 0.05
done
pass=0 fail=0
run() {  # name, target ifaces, initiator ifaces, expected rails carrying data
  local name=$1 tif=$2 iif=$3 want=$4
  rm -f "$DIR"/*
  env -u FI_TCP_IFACE -u FI_SOCKETS_IFACE ip netns exec "$B" timeout 120 "$BIN" target "$DIR" provider=tcp iface="$tif" &
  local tpid=$!
  local out
  if out=$(env -u FI_TCP_IFACE -u FI_SOCKETS_IFACE ip netns exec "$A" timeout 120 "$BIN" initiator "$DIR" provider=tcp iface="$iif" 2>&1); then
    local busy
    busy=$(echo "$out" | awk '/^rail [0-9]+ bytes/ && $4 > 0' | wc -l)
    if [ "$busy" -ge "$want" ]; then
      echo "PASS $name: $(echo "$out" | grep pairtest:) ; rails with data: $busy"; pass=$((pass+1))
    else
      echo "FAIL $name: only $busy rail(s) carried data"; echo "$out"; fail=$((fail+1))
    fi
  else
    echo "FAIL $name"; echo "$out"; fail=$((fail+1))
  fi
  touch "$DIR/quit"; wait "$tpid" || true
}
run "2 rails <-> 2 rails" r0b,r1b r0a,r1a 2
run "1 rail -> 2 rails" r0b,r1b r0a 1
run "2 rails -> 1 rail" r0b r0a,r1a 2
# No interface list: tcp stays on the first interface found (with several automatic
# connections, on larger hosts, all of them there too).
run "no iface list: the first interface" "" "" 1
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
