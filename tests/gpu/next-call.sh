#!/usr/bin/env bash
# The device call planned for the open goals of issues #23 and #24, batched into one call of
# the device tool (its sections are cut at 520 s in all). Build the bundle here
# (`make gpu-bundle`), then on the device, from the repository root, with .gpu carried:
#   OUT=$OUT bash tests/gpu/next-call.sh
#  1. #24: packed staging with automatic rails, two reps in one run, VRAM next to DRAM over the
#     same rails (64 MiB and the three KV patterns), and UCX tcp+cuda_copy on the same cases
#     in the same run.
#  2. #23: the vLLM pattern (256 and 1024 random blocks): create ns per descriptor and end to
#     end against UCX, with NIXL's descriptor lists read in place (nf_request_create_meta).
#  3. #23: small transfers over tcp on lo (ours vs UCX, progress threads on and off, genNotif
#     ping-pong) and same-host DRAM one at a time (lat_small, progress off and on).
# Everything goes into $OUT/next-call.tar.xz (few files come back from a call) and the
# summaries to stdout.
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
run staging 180 RUN_GPU_ONLY=staging STAGING_SWEEP="0:4 0:4" STAGING_DRAM_KV=1 STAGING_UCX=1 \
  STAGING_ONLY="VRAM->VRAM 1x64MiB,VRAM->VRAM 1024x16KiB,VRAM->VRAM 4096x4KiB,VRAM->VRAM 256x256KiB,DRAM->DRAM 1x64MiB"
run vllm 170 RUN_GPU_ONLY=vllm VLLM_BUDGET=130 VLLM_ARGS="--requests 256,1024 --variants random"
run notif 80 RUN_GPU_ONLY=notif NOTIF_BUDGET=70 NOTIF_ITERS=500
run latsmall 90 RUN_GPU_ONLY=latsmall LATSMALL_N=3000
tar -C "$W" -cJf "$OUT/next-call.tar.xz" .
ls -la "$OUT"
