#!/usr/bin/env bash
# Test of the nixl-fabric-info diagnostic binary (built by `make build`).
#
#   tests/info/test_info.sh [path/to/nixl-fabric-info]     (default: target/release/nixl-fabric-info)
#
# Checks: the provider table lists tcp;ofi_rxm and shm with their RMA and FI_HMEM columns; the
# libfabric version is shown (and matches fi_info's, where fi_info is installed); the CUDA line
# says "not available" on a host without libcuda.so.1 (and something else where it exists);
# the rails for provider=tcp iface=lo; --self-test provider=tcp iface=lo passes and prints GB/s
# lines for both sizes and both directions; --config-table prints one row per key (each key
# accepted back with its default; the same keys and defaults as the plugin reports to the
# agent, when PY names a Python with the stock wheel); a bad key (nosuchkey=1), a malformed
# value and a malformed environment variable exit non-zero with a message naming them; --help.
#
# Environment: PY (optional; a python with nixl_cu12, for the cross-check with the plugin),
# NIXL_PLUGIN_DIR (optional; default build/plugins), NF_EXPECT_CUDA=yes|no (optional; overrides
# the detection of libcuda.so.1), NF_INFO_STRICT=1 (unknown options must fail, see below).
# Traffic stays on loopback (FI_TCP_IFACE=lo and friends). Every run is bounded by `timeout`.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${1:-$ROOT/target/release/nixl-fabric-info}
export FI_TCP_IFACE=lo FI_SOCKETS_IFACE=lo NIXL_FABRIC_IFACE=lo NIXL_FABRIC_PROVIDER=tcp
unset NIXL_FABRIC_LOG
T=${NF_INFO_TIMEOUT:-60}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

failures=0 passed=0
ok() { passed=$((passed + 1)); printf '  ok    %s\n' "$1"; }
bad() { failures=$((failures + 1)); printf '  FAIL  %s\n' "$1"; [ -n "${2:-}" ] && sed 's/^/        | /' <<<"$2" | head -n 40; }
warn() { printf '  WARN  %s\n' "$1"; }

# run NAME ARGS...: runs the binary; stdout in $TMP/NAME.out, stderr in $TMP/NAME.err, rc in $rc
run() {
    local name=$1; shift
    timeout -k 5 "$T" "$BIN" "$@" >"$TMP/$name.out" 2>"$TMP/$name.err"
    rc=$?
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && bad "$name: still running after ${T} s (killed)" "$(tail -n 20 "$TMP/$name.out")"
    return 0
}
out() { cat "$TMP/$1.out"; }
err() { cat "$TMP/$1.err"; }
has() { grep -Eq -- "$2" "$TMP/$1.out"; }

echo "info-test: $BIN"
[ -x "$BIN" ] || { echo "info-test: $BIN missing (make build)"; exit 1; }

# ---- --help ---------------------------------------------------------------------------------
run help --help
if [ "$rc" = 0 ] && has help '^usage: nixl-fabric-info' && has help -- '--self-test' && has help -- '--config-table'; then
    ok "--help: usage with --self-test and --config-table, exit 0"
else
    bad "--help (rc $rc)" "$(out help; err help)"
fi

# ---- the listing ----------------------------------------------------------------------------
run list provider=tcp iface=lo
if [ "$rc" = 0 ]; then ok "provider=tcp iface=lo: exit 0"; else bad "provider=tcp iface=lo: exit $rc" "$(out list; err list)"; fi

ver=$(sed -n 's/^version = "\(.*\)"/\1/p' "$ROOT/Cargo.toml" | head -n1)
if has list "^nixl-fabric ${ver//./\\.}\$"; then ok "own version: nixl-fabric $ver"; else bad "own version line (Cargo.toml: $ver)" "$(head -n 3 "$TMP/list.out")"; fi

fab=$(sed -n 's/^libfabric runtime: \([0-9][0-9.]*\)$/\1/p' "$TMP/list.out")
if [ -z "$fab" ]; then
    bad "libfabric version line ('libfabric runtime: X.Y')" "$(head -n 4 "$TMP/list.out")"
elif command -v fi_info >/dev/null; then
    want=$(timeout 10 fi_info --version 2>/dev/null | sed -n 's/^libfabric: \([0-9]*\.[0-9]*\).*/\1/p')
    if [ -n "$want" ] && [ "$(cut -d. -f1,2 <<<"$fab")" = "$want" ]; then
        ok "libfabric runtime $fab (fi_info: $want)"
    else
        bad "libfabric runtime $fab, fi_info says ${want:-nothing}"
    fi
else
    ok "libfabric runtime $fab (fi_info not installed: not cross-checked)"
fi

# CUDA: "not available" exactly where the driver library cannot be loaded.
expect_cuda=${NF_EXPECT_CUDA:-}
if [ -z "$expect_cuda" ]; then
    expect_cuda=no
    if ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1'; then expect_cuda=yes; fi
    IFS=: read -ra dirs <<<"${LD_LIBRARY_PATH:-}"
    for d in "${dirs[@]}"; do [ -n "$d" ] && [ -e "$d/libcuda.so.1" ] && expect_cuda=yes; done
fi
cuda_line=$(grep -m1 '^cuda: ' "$TMP/list.out")
if [ -z "$cuda_line" ]; then
    bad "no 'cuda:' line" "$(head -n 4 "$TMP/list.out")"
elif [ "$expect_cuda" = no ] && [[ $cuda_line == "cuda: not available"* ]]; then
    ok "CUDA reported not available (no libcuda.so.1 on this host)"
elif [ "$expect_cuda" = yes ] && [[ $cuda_line != "cuda: not available"* ]]; then
    ok "CUDA reported present: ${cuda_line#cuda: }"
else
    bad "CUDA line does not match the host (libcuda.so.1 present: $expect_cuda)" "$cuda_line"
fi

# Provider table: header with the capability columns, then rows
#   provider domain fabric rma(yes|no) hmem(yes|no) cq_data(number)
if has list '^  provider +domain +fabric +rma +hmem +cq_data$'; then
    ok "provider table header: provider domain fabric rma hmem cq_data"
else
    bad "provider table header" "$(sed -n '/^providers/,/^$/p' "$TMP/list.out" | head -n 3)"
fi
row_re() { printf '^  %s +%s +[^ ]+ +(yes|no) +(yes|no) +[0-9]+$' "$1" "$2"; }
for p in 'tcp;ofi_rxm' shm; do
    dom='[^ ]+'; [ "$p" = 'tcp;ofi_rxm' ] && dom=lo   # FI_TCP_IFACE=lo: tcp only on lo
    rows=$(grep -Ec -- "$(row_re "$p" "$dom")" "$TMP/list.out")
    if [ "$rows" -gt 0 ]; then
        ok "$p listed ($rows row(s)), e.g.: $(grep -E -m1 -- "$(row_re "$p" "$dom")" "$TMP/list.out" | tr -s ' ')"
    else
        bad "$p missing from the provider table, or its rma/hmem/cq_data columns malformed" \
            "$(sed -n '/^providers/,/^$/p' "$TMP/list.out")"
    fi
    if command -v fi_info >/dev/null && ! timeout 10 fi_info -p "$p" -t FI_EP_RDM >/dev/null 2>&1; then
        bad "fi_info -p '$p' finds nothing, yet the table lists it"
    fi
done
if grep -E -- "$(row_re 'tcp;ofi_rxm' lo)" "$TMP/list.out" | grep -Eq ' yes +(yes|no) +[0-9]+$'; then
    ok "tcp;ofi_rxm on lo has RMA"
else
    bad "tcp;ofi_rxm on lo lacks RMA"
fi
if grep -Eq '^  tcp;ofi_rxm +eth|^  tcp;ofi_rxm +en' "$TMP/list.out"; then
    bad "tcp;ofi_rxm rows beyond lo although FI_TCP_IFACE=lo"
fi

# Rails for provider=tcp iface=lo.
rails=$(sed -n "/^rails for provider=tcp iface='lo' rails=0:\$/,/^\$/p" "$TMP/list.out")
if [ -n "$rails" ] && grep -Eq '^  tcp;ofi_rxm domain lo fabric [^ ]+' <<<"$rails" && ! grep -q 'none:' <<<"$rails"; then
    ok "rails for provider=tcp iface=lo: $(grep -c '^  tcp;ofi_rxm domain lo' <<<"$rails") rail(s) on tcp;ofi_rxm domain lo"
else
    bad "rails for provider=tcp iface=lo" "$(sed -n '/^rails for/,$p' "$TMP/list.out")"
fi

# ---- --self-test ----------------------------------------------------------------------------
t0=$(date +%s.%N)
run self --self-test provider=tcp iface=lo
dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
if [ "$rc" = 0 ] && has self '^self-test passed$'; then
    ok "--self-test provider=tcp iface=lo passed (${dt} s)"
else
    bad "--self-test provider=tcp iface=lo: exit $rc" "$(sed -n '/^self-test/,$p' "$TMP/self.out"; err self)"
fi
gbps_re='^  (Write|Read) +[0-9]+ KiB: [0-9]+\.[0-9]+ GB/s$'
n=$(grep -Ec "$gbps_re" "$TMP/self.out")
missing=""
for op in Write Read; do for kib in 1024 65536; do
    grep -Eq "^  $op +$kib KiB: [0-9]+\.[0-9]+ GB/s\$" "$TMP/self.out" || missing="$missing $op/$kib"
done; done
zero=$(grep -E "$gbps_re" "$TMP/self.out" | awk '{ if ($(NF-1) + 0 <= 0) print }')
if [ "$n" = 4 ] && [ -z "$missing" ] && [ -z "$zero" ]; then
    ok "self-test GB/s lines: $(grep -E "$gbps_re" "$TMP/self.out" | sed 's/^ *//' | paste -sd ';' | sed 's/;/; /g')"
else
    bad "self-test GB/s lines ($n found; missing:${missing:- none}${zero:+; zero: $zero})" "$(sed -n '/^self-test/,$p' "$TMP/self.out")"
fi

# ---- --config-table -------------------------------------------------------------------------
run table --config-table
hdr='| key | environment variable | default | meaning |'
row='^\| `([a-z0-9_]+)` \| `(NIXL_FABRIC_[A-Z0-9_]+)` \| `([^`]*)` \| (.+) \|$'
if [ "$rc" = 0 ] && [ "$(sed -n 1p "$TMP/table.out")" = "$hdr" ] && [ "$(sed -n 2p "$TMP/table.out")" = '|---|---|---|---|' ]; then
    ok "--config-table: header and separator, exit 0"
else
    bad "--config-table header (rc $rc)" "$(head -n 3 "$TMP/table.out"; err table)"
fi
tail -n +3 "$TMP/table.out" >"$TMP/rows"
nrows=$(wc -l <"$TMP/rows")
nonrows=$(grep -Evc "$row" "$TMP/rows")
keys=$(sed -E "s/$row/\\1/" "$TMP/rows")
dups=$(sort <<<"$keys" | uniq -d)
envmis=$(sed -E "s/$row/\\1 \\2/" "$TMP/rows" | awk '{ k = toupper($1); if ("NIXL_FABRIC_" k != $2) print $1 " -> " $2 }')
if [ "$nrows" -gt 0 ] && [ "$nonrows" = 0 ] && [ -z "$dups" ] && [ -z "$envmis" ]; then
    ok "--config-table: $nrows rows, one per key, each with NIXL_FABRIC_<KEY>, default and meaning"
else
    bad "--config-table rows ($nrows rows, $nonrows malformed, duplicates: ${dups:-none}, env mismatches: ${envmis:-none})" "$(cat "$TMP/rows")"
fi
# Every key is accepted back with its own default.
rejected=""
while IFS=$'\t' read -r k def; do
    timeout -k 5 "$T" "$BIN" "$k=$def" >/dev/null 2>"$TMP/kv.err" || rejected="$rejected $k=$def ($(head -c 200 "$TMP/kv.err"))"
done < <(sed -E "s/$row/\\1\t\\3/" "$TMP/rows")
if [ -z "$rejected" ]; then ok "every key accepted with its default value ($nrows runs)"; else bad "keys rejected with their defaults:$rejected"; fi
# The same keys and defaults as the plugin reports to the agent (get_backend_options).
# The plugin reports the effective defaults (environment applied), so compare with no
# NIXL_FABRIC_* variables set.
if [ -n "${PY:-}" ] && [ -x "$PY" ]; then
    plugdir=${NIXL_PLUGIN_DIR:-$ROOT/build/plugins}
    if [ -f "$plugdir/libplugin_${NF_BACKEND:-LIBFABRIC}.so" ]; then
        env $(env | sed -n 's/^\(NIXL_FABRIC_[A-Z0-9_]*\)=.*/-u \1/p') NIXL_PLUGIN_DIR=$plugdir timeout -k 5 "$T" "$PY" - "${NF_BACKEND:-LIBFABRIC}" >"$TMP/plug.txt" 2>"$TMP/plug.err" <<'EOF'
import sys
from nixl_cu12._api import nixl_agent, nixl_agent_config
a = nixl_agent("info-test", nixl_agent_config(backends=[]))
params = a.get_plugin_params(sys.argv[1])
params = params[0] if isinstance(params, tuple) else params
for k in sorted(params):
    print(f"KV\t{k}\t{params[k]}")  # the agent logs to stdout too
EOF
        prc=$?
        mine=$(sed -E "s/$row/\\1\t\\3/" "$TMP/rows" | sort)
        theirs=$(sed -n 's/^KV\t//p' "$TMP/plug.txt")
        if [ "$prc" = 0 ] && [ "$theirs" = "$mine" ]; then
            ok "the plugin's get_backend_options (through the stock agent) reports the same keys and defaults"
        else
            bad "plugin parameters (stock agent, rc $prc) differ from --config-table" "$(diff <(echo "$theirs") <(echo "$mine"); tail -n 5 "$TMP/plug.err")"
        fi
    else
        warn "no $plugdir/libplugin_${NF_BACKEND:-LIBFABRIC}.so: plugin parameters not cross-checked"
    fi
fi

# ---- bad input --------------------------------------------------------------------------------
run badkey nosuchkey=1
if [ "$rc" != 0 ] && grep -q 'nosuchkey' "$TMP/badkey.err" && ! has badkey '^providers'; then
    ok "nosuchkey=1: exit $rc, message: $(head -n1 "$TMP/badkey.err")"
else
    bad "nosuchkey=1 (rc $rc)" "$(out badkey; err badkey)"
fi
run badval timeout_ms=soon
if [ "$rc" != 0 ] && grep -q 'timeout_ms' "$TMP/badval.err" && grep -q 'soon' "$TMP/badval.err"; then
    ok "timeout_ms=soon: exit $rc, message: $(head -n1 "$TMP/badval.err")"
else
    bad "timeout_ms=soon (rc $rc)" "$(out badval; err badval)"
fi
NIXL_FABRIC_TIMEOUT_MS=soon run badenv
if [ "$rc" != 0 ] && grep -q 'NIXL_FABRIC_TIMEOUT_MS' "$TMP/badenv.err"; then
    ok "NIXL_FABRIC_TIMEOUT_MS=soon: exit $rc, message names the variable"
else
    bad "NIXL_FABRIC_TIMEOUT_MS=soon (rc $rc)" "$(out badenv; err badenv)"
fi
# An unknown option (a typo such as --selftest) should not silently do something else.
run badopt --no-such-option
if [ "$rc" != 0 ]; then
    ok "--no-such-option: exit $rc"
elif [ "${NF_INFO_STRICT:-0}" = 1 ]; then
    bad "--no-such-option is ignored (exit 0): a typo like --selftest silently skips the self-test"
else
    warn "--no-such-option is ignored (exit 0): a typo like --selftest silently skips the self-test (NF_INFO_STRICT=1 makes this a failure)"
fi

echo "info-test: $passed passed, $failures failed"
[ "$failures" = 0 ]
