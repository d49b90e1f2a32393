#!/usr/bin/env bash
# The device calls planned for what the 2026-12-06 sessions left open, batched into two calls of
# the device tool. Build the bundle here (`make gpu-bundle`), then on the device, from the
# repository root, with .gpu carried:
#   OUT=$OUT bash tests/gpu/next-call.sh a     (~200 s on the H100, 2026-12-06)
#   OUT=$OUT bash tests/gpu/next-call.sh b     (~140 s)
# a:
#  1. #24: FI_HMEM between two processes on shm, now registered FI_HMEM_DEVICE_ONLY (shm's
#     device-to-device IPC protocol; 0.14-0.60x shm's DRAM rate before), and the one-process
#     GPU harness on shm with FI_HMEM pinned (both engines in one process: shm's IPC to itself).
#  2. #23: same-host DRAM small-transfer latency, progress off and on (0.94-0.98x UCX before the
#     allocation-free CMA post).
#  3. #23: the vLLM pattern at 256 and 1024 blocks with UCX in the same run.
# b:
#  4. #24: packed staging over eight rails with UCX tcp+cuda_copy beside it, DRAM over the same
#     rails.
#  5. #23: small transfers over tcp on lo against UCX (notif_latency.py).
# Everything goes into $OUT/next-call-<a|b>.tar.xz and the summaries to stdout.
set -u
B=${B:-$(pwd)/.gpu}
: "${OUT:?set OUT}"
W=$(mktemp -d)
run() {  # name, seconds, environment...: one run-gpu.sh section, its output kept and shown
  local name=$1 t=$2; shift 2
  echo "=== $name"
  env "$@" OUT="$W" timeout -k 5 "$t" bash "$B/run-gpu.sh" > "$W/$name.txt" 2>&1
  echo "exit $?" >> "$W/$name.txt"
  grep -v "NIXL INFO" "$W/$name.txt" | tail -40
}
case "${1:-a}" in
a)
  run hmem 170 RUN_GPU_ONLY=hmem HMEM_PROVIDERS=shm
  (
    echo "=== lf2 harness: shm, FI_HMEM pinned, one process"
    mkdir -p /tmp/lf2 && tar xJf "$B/libfabric2-cuda.tar.xz" -C /tmp/lf2
    D=$(dirname "$(dirname "$(find /tmp/lf2 -name 'libfabric.so.1' | head -1)")")
    LD_LIBRARY_PATH=$D/lib:$D/cudart:$B/bin FI_TCP_IFACE=lo NIXL_FABRIC_IFACE=lo NIXL_FABRIC_LOG=info \
      NIXL_FABRIC_VRAM_REGISTRATION=hmem GPU_HARNESS_SKIP_REGRESSION=1 GPU_HARNESS_PROVIDER=shm \
      timeout 120 "$B/bin/gpu_harness" > "$W/lf2_shm_hmem.log" 2>&1
    echo "exit $?"
    grep -E "^(FAIL|bw)|passed" "$W/lf2_shm_hmem.log" | head -30
  )
  run latsmall 130 RUN_GPU_ONLY=latsmall LATSMALL_N=20000
  run vllm 110 RUN_GPU_ONLY=vllm VLLM_BUDGET=80 VLLM_ARGS="--requests 256,1024 --variants random --no-gather"
  ;;
b)
  run staging 170 RUN_GPU_ONLY=staging STAGING_SWEEP="0:4" STAGING_DRAM_KV=1 STAGING_UCX=1 STAGING_TAG=-r8 NIXL_FABRIC_RAILS=8 \
    STAGING_ONLY="VRAM->VRAM 1x64MiB,VRAM->VRAM 4096x4KiB,VRAM->VRAM 1024x16KiB,DRAM->VRAM 1x64MiB,VRAM->DRAM 1x64MiB,DRAM->DRAM 1x64MiB"
  run notif 140 RUN_GPU_ONLY=notif NOTIF_BUDGET=120
  ;;
esac
tar -C "$W" -cJf "$OUT/next-call-${1:-a}.tar.xz" .
ls -la "$OUT"
