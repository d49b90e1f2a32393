#!/usr/bin/env bash
# Small-transfer latency (bench/notif_latency.py) of ours next to stock UCX tcp and the wheel's
# stock LIBFABRIC plugin, in a network namespace of this script's own (no traffic leaves the
# machine). The stock plugin needs libfabric main (it imports fi_getinfo@FABRIC_1.10),
# libhwloc, libcudart and a libcuda, and a non-loopback interface: the namespace gets a veth
# pair whose end v0 carries 127.0.0.2/32, and every backend is pinned to it (UCX to lo).
# libfabric main comes from LFMAIN (default ../shared/tools/lfmain.tar.xz; without it the stock
# configurations are left out), libcudart from PyPI (nvidia-cuda-runtime-cu12), libcuda is the
# stand-in of tests/versions (no device: DRAM only). Needs root (unshare -n); without it, ours
# and UCX run on lo alone.
#   bench/notif_netns.sh [notif_latency.py options]     e.g. --iters 1000 --out FILE.json
# On a host that has its own libcuda and libcudart (the GPU host: run-gpu.sh's stocknotif), set
# STOCK_LD_PATH to the folders of libfabric main and libcudart and nothing is fetched or built;
# NOTIF_IP names an `ip` to use where the host has none (the tools' iproute.tar.xz).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)   # beside notif_latency.py (bench/, or the GPU bundle)
ROOT=$(dirname "$HERE")
BUILD=$ROOT/build/stock
PY=${PY:-$ROOT/.venv/bin/python}
LFMAIN=${LFMAIN:-$ROOT/../shared/tools/lfmain.tar.xz}
CONFIGS=${NOTIF_BASE_CONFIGS:-ours-tcp-noprog,ucx-tcp-noprog,ours-tcp,ucx-tcp}
STOCK=${NOTIF_STOCK_CONFIGS-stock-libfabric-noprog,stock-libfabric}  # set empty: ours and UCX only

if [ "${NOTIF_IN_NS:-}" != 1 ]; then
  mkdir -p "$BUILD"
  if [ -n "${STOCK_LD_PATH:-}" ]; then
    [ -z "$STOCK" ] || CONFIGS=$STOCK,$CONFIGS
  elif [ -f "$LFMAIN" ]; then
    [ -f "$BUILD/lfmain/lib/libfabric.so.1" ] || tar -C "$BUILD" -xf "$LFMAIN"
    CUDART=$BUILD/cudart/nvidia/cuda_runtime/lib
    if [ ! -f "$CUDART/libcudart.so.12" ]; then
      rm -rf "$BUILD/whl" "$BUILD/cudart"
      "$PY" -m pip download -q --no-deps -d "$BUILD/whl" "nvidia-cuda-runtime-cu12==12.9.79"
      "$PY" -m zipfile -e "$BUILD"/whl/nvidia_cuda_runtime_cu12-*.whl "$BUILD/cudart"
    fi
    mkdir -p "$BUILD/stub"
    cc -shared -fPIC -O2 -o "$BUILD/stub/libcuda.so.1" "$ROOT/tests/versions/cuda_stub.c"
    export STOCK_LD_PATH=$BUILD/lfmain/lib:$CUDART:$BUILD/stub
    [ -z "$STOCK" ] || CONFIGS=$STOCK,$CONFIGS
  else
    echo "notif_netns: no $LFMAIN: the stock LIBFABRIC plugin is left out" >&2
  fi
  if ! unshare -n true 2>/dev/null; then
    # Not root (or no user namespaces): ours and UCX on lo only.
    echo "notif_netns: cannot make a network namespace here; ours and UCX on lo, without the stock plugin" >&2
    exec "$PY" "$HERE/notif_latency.py" --configs "${CONFIGS#"$STOCK",}" "$@"
  fi
  exec unshare -n env NOTIF_IN_NS=1 NOTIF_CONFIGS="$CONFIGS" "$0" "$@"
fi

ipc() { ${NOTIF_IP:-ip} "$@"; }
ipc link set lo up
ipc link add v0 type veth peer name v1
ipc addr add 127.0.0.2/32 dev v0
ipc link set v0 up
ipc link set v1 up
# tcp skips an interface without carrier
for _ in $(seq 100); do ipc -br link | grep -q '^v0@.* UP ' && break; sleep 0.05; done
NOTIF_IFACE=v0 exec "$PY" "$HERE/notif_latency.py" --configs "$NOTIF_CONFIGS" "$@"
