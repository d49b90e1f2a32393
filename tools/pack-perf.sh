#!/usr/bin/env bash
# Packs this machine's perf and the libraries it needs (not glibc's, which the GPU host has
# newer) into .gpu/perf.tar.xz, so that a device call can profile there, where no perf is
# installed (issue #23's create time was split this way, 2026-12-06):
#   tar -xJf .gpu/perf.tar.xz -C /tmp
#   LD_LIBRARY_PATH=/tmp/perfpack/lib /tmp/perfpack/perf record -F 2999 -o OUT -- COMMAND
# The host must allow it (perf_event_paranoid; the H100 hosts did).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PERF=$(command -v perf) || { echo "pack-perf: no perf here (apt-get install linux-perf)" >&2; exit 1; }
W=$(mktemp -d)
mkdir -p "$W/perfpack/lib" "$ROOT/.gpu"
cp "$PERF" "$W/perfpack/"
ldd "$PERF" | awk '/=>/ {print $3}' | grep -vE '/(libc|libm|libgcc_s|libstdc\+\+)\.so|ld-linux' | while read -r l; do cp -L "$l" "$W/perfpack/lib/"; done
tar -C "$W" -cJf "$ROOT/.gpu/perf.tar.xz" perfpack
rm -rf "$W"
ls -la "$ROOT/.gpu/perf.tar.xz"
