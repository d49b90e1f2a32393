#!/usr/bin/env bash
# The device call planned for what the last one (2026-12-05, H100) left open, batched into one
# call of the device tool (sections cut at 380 s, 530 s with NEXT_STAGING=1). Build the bundle here
# (`make gpu-bundle`, plus `bash tools/build-libfabric2-cuda.sh` for the hmem section), then
# on the device, from the repository root, with .gpu carried:
#   OUT=$OUT bash tests/gpu/next-call.sh
#  1. #24: provider-registered GPU memory (FI_HMEM) between two processes on the CUDA-enabled
#     libfabric 2.x, shm and (where it lists FI_HMEM) tcp, against DRAM over the same provider.
#  2. #23: small transfers over tcp on lo, UCX now with cuda_copy (NIXL's UCX backend refused
#     tcp,self on a GPU host).
#  3. #23: the vLLM pattern at 256 blocks with the create-time DEBUG line (where our part of
#     make_prepped_xfer goes, against the agent's).
#  4. (NEXT_STAGING=1) #24: packed staging on 8 rails, DRAM<->VRAM beside VRAM<->VRAM, DRAM over the same rails.
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
  grep -v "NIXL INFO" "$W/$name.txt" | tail -40
}
run hmem 200 RUN_GPU_ONLY=hmem HMEM_ONLY="VRAM->VRAM 1x64MiB,VRAM->VRAM 1024x16KiB,DRAM->VRAM 1x64MiB"
run notif 80 RUN_GPU_ONLY=notif NOTIF_BUDGET=70 NOTIF_ITERS=500 NOTIF_CONFIGS=ours-tcp-noprog,ucx-tcp-noprog,ours-tcp,ucx-tcp
run vllm 100 RUN_GPU_ONLY=vllm VLLM_BUDGET=70 NIXL_FABRIC_LOG=debug VLLM_ARGS="--requests 256 --variants random --no-gather"
[ "${NEXT_STAGING:-0}" = 1 ] && run staging 150 RUN_GPU_ONLY=staging STAGING_SWEEP="0:4" STAGING_DRAM_KV=1 STAGING_TAG=-r8 NIXL_FABRIC_RAILS=8 \
  STAGING_ONLY="VRAM->VRAM 1x64MiB,VRAM->VRAM 4096x4KiB,DRAM->VRAM 1x64MiB,VRAM->DRAM 1x64MiB,DRAM->DRAM 1x64MiB"
cp "$B"/hmem_*.log "$W/" 2>/dev/null
grep -h "created a request" "$W"/vllm/logs/*.log > "$W/create-lines.txt" 2>/dev/null
tar -C "$W" -cJf "$OUT/next-call.tar.xz" .
ls -la "$OUT"
