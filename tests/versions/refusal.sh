#!/usr/bin/env bash
# The layout detector against planted NIXLs: each case builds a stand-in libnixl.so
# (fake_libnixl.c) exporting one symbol set, puts it where a wheel keeps it
# (site/.nixl_cu12.mesonpy.libs/, with a site/nixl_cu12-<version>.dist-info beside it), and
# asks our plugin for an engine (refusal_driver.cpp). Shipped layouts must get an engine;
# unreleased or unknown ones must get NULL and one error line naming the NIXL release seen
# and the releases supported; nothing may crash.
#   usage: refusal.sh PLUGIN.so OUTDIR
set -uo pipefail
plugin=$(realpath "$1")
out=$2
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
mkdir -p "$out"
g++ -std=c++20 -O1 -Wall -Wextra -I"$root/src/adapter" -o "$out/driver" "$here/refusal_driver.cpp" -ldl || exit 1

supported="This plugin supports NIXL 0.7.x-0.9.x (28-slot engine), 0.10.x (31 slots) and 1.0-1.5.x (27 slots)"
passed=0
failed=0

# case NAME "CFLAGS" VERSION accept|refuse [ENV=VALUE] -- expected stderr substrings...
case_() {
  local name=$1 defs=$2 version=$3 expect=$4
  shift 4
  local envs=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  local site="$out/$name/site" lib
  rm -rf "$out/$name"
  mkdir -p "$site/.nixl_cu12.mesonpy.libs"
  [ -n "$version" ] && mkdir -p "$site/nixl_cu12-$version.dist-info"
  lib="$site/.nixl_cu12.mesonpy.libs/libnixl.so"
  # shellcheck disable=SC2086
  gcc -shared -fPIC -O1 -w $defs -o "$lib" "$here/fake_libnixl.c" || { echo "FAIL $name: fake libnixl did not build"; failed=$((failed + 1)); return; }
  [ "$name" = no-libnixl ] && lib=none
  env "${envs[@]}" "$out/driver" "$lib" "$plugin" "$expect" >"$out/$name.log" 2>&1
  local rc=$? why=""
  if [ $rc -gt 1 ]; then
    why="driver exited with $rc (crash or setup error)"
  elif [ $rc -ne 0 ]; then
    why="expected $expect, got the other"
  fi
  for s in "$@"; do
    [ -z "$why" ] && ! grep -qF -- "$s" "$out/$name.log" && why="stderr lacks: $s"
  done
  if [ "$expect" = accept ] && [ -z "$why" ] && grep -q "cannot create backend" "$out/$name.log"; then
    why="accepted but printed a refusal"
  fi
  if [ -z "$why" ]; then
    echo "  ok   $name ($expect)"
    passed=$((passed + 1))
  else
    echo "FAIL $name: $why"
    sed 's/^/       /' "$out/$name.log" | tail -5
    failed=$((failed + 1))
  fi
}

echo "== layout detector: planted NIXLs"
case_ shipped-1.x    "-DSET_V1"                       1.5.1  accept -- "create_engine: engine"
case_ shipped-0.10   "-DSET_V010 -DDLIST_VT_WORDS=8"  0.10.1 accept -- "create_engine: engine"
case_ shipped-0.7    "-DSET_V07 -DDLIST_VT_WORDS=8"   0.8.0  accept -- "create_engine: engine"
case_ no-release     "-DSET_V1"                       ""     accept -- "create_engine: engine"
case_ proxy          "-DSET_V1 -DEXTRA_PROXY"         1.6.0  refuse -- "NIXL 1.6.0" "supportsProxy() after supportsNotif" "$supported"
case_ notif-inject   "-DSET_V1 -DEXTRA_INJECT"        1.6.0  refuse -- "NIXL 1.6.0" "supportsNotifInjection()" "$supported"
case_ tracer         "-DSET_V1 -DEXTRA_TRACER"        1.6.0  refuse -- "NIXL 1.6.0" "tracer" "$supported"
case_ unknown-method "-DSET_V1 -DEXTRA_UNKNOWN"       2.0.0  refuse -- "NIXL 2.0.0" "unknown: getEndpointId" "$supported"
case_ mixed-views    "-DSET_V010 -DEXTRA_VIEWS1 -DDLIST_VT_WORDS=8" 0.10.2 refuse -- "NIXL 0.10.2" "match no release" "$supported"
case_ dlist-vtable   "-DSET_V1 -DDLIST_VT_WORDS=8"    1.5.1  refuse -- "NIXL 1.5.1" "descriptor-list vtable is 64 bytes" "$supported"
case_ dlist-data     "-DSET_V1 -DTYPE_OFF=12"         1.5.1  refuse -- "NIXL 1.5.1" "laid out differently" "$supported"
case_ newer-release  "-DSET_V1"                       1.6.0  refuse -- "NIXL 1.6.0" "NIXL_FABRIC_ACCEPT_NIXL=1.6.0" "$supported"
case_ newer-accepted "-DSET_V1"                       1.6.0  accept NIXL_FABRIC_ACCEPT_NIXL=1.6.0 -- "create_engine: engine"
case_ wrong-release  "-DSET_V07 -DDLIST_VT_WORDS=8"   1.2.0  refuse -- "NIXL 1.2.0" "not one that shipped it" "$supported"
case_ no-libnixl     "-DSET_V1"                       ""     refuse -- "no NIXL library" "$supported"
echo "layout detector: $passed passed, $failed failed"
[ $failed -eq 0 ]
