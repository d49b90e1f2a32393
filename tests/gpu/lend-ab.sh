#!/usr/bin/env bash
# One device call: staged READs by lent slots (the owner packs, we RMA-read: staging_lend_reads,
# the default) against the owner's RMA write into our slot (PUSH), alternating twice over the
# same rails, with the DRAM KV patterns over those rails first; then the GPU harness. Results
# in $OUT/lend-ab.tar.xz.
set -u
B=$(pwd)/.gpu
OUT0=$OUT
P="${LEND_ONLY:-VRAM->VRAM 1x64MiB,VRAM->VRAM 1024x16KiB,VRAM->VRAM 256x256KiB,DRAM->VRAM 1x64MiB,VRAM->DRAM 1x64MiB,DRAM->DRAM 1x64MiB}"
kv=1
for r in $(seq ${LEND_ROUNDS:-2}); do
  for lend in true false; do
    t=-$([ $lend = true ] && echo lend || echo push)$r
    OUT=$OUT0/ab NIXL_FABRIC_STAGING_LEND_READS=$lend RUN_GPU_ONLY=staging STAGING_SWEEP="0:4" STAGING_DRAM_KV=$kv \
      STAGING_TAG=$t STAGING_ONLY="$P" timeout 200 bash $B/run-gpu.sh > $OUT0/staging$t.log 2>&1
    kv=1
    grep -E "GB/s" $OUT0/staging$t.log | grep -E "READ|dram-kv"
  done
done
if [ "${LEND_HARNESS:-1}" = 1 ]; then
  OUT=$OUT0/harness RUN_GPU_ONLY=harness timeout 120 bash $B/run-gpu.sh > $OUT0/harness.log 2>&1
  grep -E "passed|^FAIL" $OUT0/harness.log | head
fi
tar -C "$OUT0" -cJf "$OUT0/lend-ab.tar.xz" ab harness staging-*.log harness.log 2>/dev/null && rm -rf "$OUT0/ab" "$OUT0/harness" "$OUT0"/staging-*.log "$OUT0/harness.log"
