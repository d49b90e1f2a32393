#!/usr/bin/env bash
# The device call planned for what the 2026-12-06 calls (H100) left open, batched into one call
# of the device tool (~330 s). Build the bundle here (`make gpu-bundle`), then on the device,
# from the repository root, with .gpu carried:
#   OUT=$OUT bash tests/gpu/next-call.sh
#  1. #23: the vLLM pattern at 256 and 1024 blocks with UCX in the same run (the 72-byte segment
#     of 2026-12-06 was not measured there: create was 2.0x / 0.92x UCX before it).
#  2. #23: same-host DRAM small-transfer latency, progress off (0.94-0.98x UCX on 2026-12-06).
#  3. #24: packed staging over eight rails with UCX tcp+cuda_copy beside it (UCX was not re-run
#     with eight rails), DRAM over the same rails.
# Everything goes into $OUT/next-call.tar.xz and the summaries to stdout.
set -u
B=${B:-$(pwd)/.gpu}
: "${OUT:?set OUT}"
W=$(mktemp -d)
run() {  # name, seconds, environment...: one run-gpu.sh section, its output kept and shown
  local name=$1 t=$2; shift 2
  echo "=== $name"
  env "$@" OUT="$W" timeout -k 5 "$t" bash "$B/run-gpu.sh" > "$W/$name.txt" 2>&1
  echo "exit $?" >> "$W/$name.txt"
  grep -v "NIXL INFO" "$W/$name.txt" | tail -30
}
run vllm 110 RUN_GPU_ONLY=vllm VLLM_BUDGET=80 VLLM_ARGS="--requests 256,1024 --variants random --no-gather"
run latsmall 60 RUN_GPU_ONLY=latsmall LATSMALL_N=20000
run staging 160 RUN_GPU_ONLY=staging STAGING_SWEEP="0:4" STAGING_DRAM_KV=1 STAGING_UCX=1 STAGING_TAG=-r8 NIXL_FABRIC_RAILS=8 \
  STAGING_ONLY="VRAM->VRAM 1x64MiB,VRAM->VRAM 4096x4KiB,DRAM->VRAM 1x64MiB,VRAM->DRAM 1x64MiB,DRAM->DRAM 1x64MiB"
tar -C "$W" -cJf "$OUT/next-call.tar.xz" .
ls -la "$OUT"
