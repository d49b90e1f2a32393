#!/usr/bin/env bash
# The wheel from a fresh venv: install the stock agent (nixl-cu12, no dependencies) and our
# wheel, put the plugin into the agent's own plugin folder with `python -m nixl_fabric
# install`, move bytes through the stock agent with ours and with stock UCX from that one
# folder (NIXL_PLUGIN_DIR unset), run the diagnostic, uninstall (the stock plugin of that
# name comes back), and check the no-NIXL fallback message.
#   usage: wheel_test.sh WHEEL VENV_DIR NIXL_PKG
set -euo pipefail
wheel=$(realpath "$1")
venv=$2
pkg=$3
here=$(cd "$(dirname "$0")" && pwd)
step() { echo "== wheel: $*"; }
fail() { echo "wheel-test FAILED: $*"; exit 1; }

rm -rf "$venv"
python3 -m venv "$venv"
py="$venv/bin/python"
step "fresh venv: $pkg, numpy, $(basename "$wheel")"
"$py" -m pip install -q --no-deps "$pkg"
"$py" -m pip install -q numpy
"$py" -m pip install -q --no-deps "$wheel"
unset NIXL_PLUGIN_DIR PYTHONPATH

step "python -m nixl_fabric install --name LIBFABRIC"
rc=0; out=$("$py" -m nixl_fabric install --name LIBFABRIC) || rc=$?
[ $rc -eq 0 ] || fail "install exited $rc"
echo "$out"
dest=$(echo "$out" | sed -n 's/^installed \(.*\) (from .*/\1/p')
[ -f "$dest" ] || fail "no installed file reported"
case "$dest" in */.nixl_cu1[23].mesonpy.libs/plugins/libplugin_LIBFABRIC.so) ;; *) fail "installed into $dest, not the wheel's plugin folder";; esac
[ -f "$dest.stock" ] || fail "the stock LIBFABRIC plugin was not kept as $dest.stock"
"$py" -m nixl_fabric where > "$venv/where.log" || fail "where exited non-zero"
cat "$venv/where.log"
grep -q "^active .*nixl-fabric as: libplugin_LIBFABRIC.so" "$venv/where.log" || fail "where does not show the install"

for mode in one two; do
  for backend in LIBFABRIC UCX; do
    step "stock agent, $backend, $mode process(es)"
    UCX_MODULES=^ib "$py" "$here/case.py" $mode $backend 2>"$venv/case-$backend-$mode.log" || { tail -5 "$venv/case-$backend-$mode.log"; fail "$backend $mode"; }
  done
done

step "python -m nixl_fabric info"
rc=0; "$py" -m nixl_fabric info > "$venv/info.log" 2>&1 || rc=$?
[ $rc -eq 0 ] || { cat "$venv/info.log"; fail "info exited $rc"; }
grep -q "layout: NIXL .*engine layout .* -> served" "$venv/info.log" || fail "info did not report the layout it would serve"
grep -q "^nixl-fabric " "$venv/info.log" || fail "info printed no version line"
grep "NIXL" "$venv/info.log" || true

step "uninstall puts the stock plugin back"
"$py" -m nixl_fabric uninstall --name LIBFABRIC
[ -f "$dest" ] && [ ! -e "$dest.stock" ] || fail "stock plugin not restored"
! grep -q nf_engine_create "$dest" || fail "our plugin is still installed"

step "no NIXL in sight: install prints the NIXL_PLUGIN_DIR to use"
site=$("$py" -c 'import nixl_fabric, os; print(os.path.dirname(os.path.dirname(nixl_fabric.__file__)))')
iso=$(mktemp -d); cp -r "$site/nixl_fabric" "$iso/"
rc=0; msg=$(cd "$iso" && "$py" -S -c 'import sys; sys.path.insert(0, "."); from nixl_fabric.__main__ import main; sys.exit(main(["install"]))' 2>&1) || rc=$?
rm -rf "$iso"
echo "$msg"
[ $rc -eq 3 ] || fail "expected exit status 3 without a NIXL, got $rc"
echo "$msg" | grep -q "export NIXL_PLUGIN_DIR=.*/nixl_fabric/plugins" || fail "no NIXL_PLUGIN_DIR advice"
echo "wheel-test: passed"
