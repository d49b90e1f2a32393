#!/usr/bin/env bash
# One device call (2026-12-07): staged READs several ways (the arms), alternating, each run with the
# DRAM KV patterns over the same rails first: min2 (the default: chunks of several blocks are
# lent, into our slot or straight into our host memory), min1 (every chunk lent,
# staging_lend_min_blocks=1), push (staging_lend_reads=false), depth8 (the default with
# staging_depth=8), rail0 (the default with chunks on rail 0 too, staging_rail0=true). Then the
# GPU harness. d8min1: depth8 with every chunk lent; d8m1r0: d8min1 with chunks on rail 0 too.
# c2m and c4m: the default with 2 MiB / 4 MiB chunks (staging_chunk_size); c512k and c256k:
# 512 KiB / 256 KiB chunks, twice / four times as deep, so that as many bytes are in flight.
# r5off: five rails, host memory's RMA off rail 0 too (rma_rail0=false: it then stripes over the
# four rails the chunks take); r6off: the same with six rails (five for either); r6: six rails
# with host memory on all six. Each of these names both settings, so it means the same whatever
# the defaults are. Since 2026-12-07 evening r6off is the default (min2 and the others then run
# with it): old is the defaults before it (five rails, bulk host RMA on every rail); r8: eight
# rails at the default rma_rail0. bal: the default with staging_balance=true (a staged request
# planned again with smaller chunks where 1 MiB chunks dealt round-robin leave one rail pair over
# the mean: 16 MiB over five pairs as 20 chunks of 832 KiB instead of 16, four on one pair). For hosts of 8-15 cores (automatic tcp rails: two), with
# AB_PIN="taskset -c 0-7" (every process of the run on eight cores): p2 (two rails, the
# automatic count there), p3off / p4off (three / four rails, host memory off rail 0), p3 (three
# rails, host memory on all three).
# From the repository root with .gpu carried:
#   OUT=$OUT bash tests/gpu/read-ab.sh       (AB_ROUNDS, AB_ARMS, AB_ONLY, AB_BUDGET, AB_HARNESS=0,
#                                             AB_GREP: the lines shown, default READ; AB_PIN: a
#                                             command prefix for every run, e.g. taskset -c 0-7)
# Results in $OUT/read-ab.tar.xz, the lines AB_GREP picks (READ) on stdout.
set -u
B=$(pwd)/.gpu
OUT0=$OUT
P="${AB_ONLY:-VRAM->VRAM 1x64MiB,VRAM->DRAM 1x64MiB,VRAM->VRAM 1024x16KiB,VRAM->VRAM 256x256KiB,DRAM->DRAM 1x64MiB}"
start=$SECONDS
for r in $(seq "${AB_ROUNDS:-2}"); do
  for arm in ${AB_ARMS:-min2 min1 push rail0 depth8}; do
    # (Runs past AB_BUDGET seconds are skipped, so the results are packed before the call's limit.)
    [ $((SECONDS - start)) -lt "${AB_BUDGET:-400}" ] || { echo "skip $arm$r: budget"; continue; }
    # (Each arm's settings; the default arms set none.)
    sweep=0:4; e=()
    case $arm in
      min2) ;;
      min1) e=(NIXL_FABRIC_STAGING_LEND_MIN_BLOCKS=1) ;;
      push) e=(NIXL_FABRIC_STAGING_LEND_READS=false) ;;
      depth8) sweep=0:8 ;;
      d8min1) e=(NIXL_FABRIC_STAGING_LEND_MIN_BLOCKS=1); sweep=0:8 ;;
      d8m1r0) e=(NIXL_FABRIC_STAGING_LEND_MIN_BLOCKS=1 NIXL_FABRIC_STAGING_RAIL0=true); sweep=0:8 ;;
      rail0) e=(NIXL_FABRIC_STAGING_RAIL0=true) ;;
      r5off) e=(NIXL_FABRIC_RAILS=5 NIXL_FABRIC_RMA_RAIL0=false) ;;
      r6off) e=(NIXL_FABRIC_RAILS=6 NIXL_FABRIC_RMA_RAIL0=false) ;;
      r6) e=(NIXL_FABRIC_RAILS=6 NIXL_FABRIC_RMA_RAIL0=true) ;;
      old) e=(NIXL_FABRIC_RAILS=5 NIXL_FABRIC_RMA_RAIL0=true) ;;
      r8) e=(NIXL_FABRIC_RAILS=8) ;;
      p2) e=(NIXL_FABRIC_RAILS=2 NIXL_FABRIC_RMA_RAIL0=false) ;;
      p3off) e=(NIXL_FABRIC_RAILS=3 NIXL_FABRIC_RMA_RAIL0=false) ;;
      p3) e=(NIXL_FABRIC_RAILS=3 NIXL_FABRIC_RMA_RAIL0=true) ;;
      p4off) e=(NIXL_FABRIC_RAILS=4 NIXL_FABRIC_RMA_RAIL0=false) ;;
      bal) e=(NIXL_FABRIC_STAGING_BALANCE=true) ;;
      c2m) sweep=2M:4 ;;
      c4m) sweep=4M:4 ;;
      c512k) sweep=512K:8 ;;
      c256k) sweep=256K:16 ;;
      *) echo "unknown arm $arm"; continue ;;
    esac
    t=-$arm$r
    echo "=== $t"
    env "${e[@]}" OUT="$OUT0/ab" RUN_GPU_ONLY=staging STAGING_SWEEP=$sweep STAGING_DRAM_KV=1 STAGING_TAG=$t STAGING_ONLY="$P" \
      ${AB_PIN:-} timeout 150 bash "$B/run-gpu.sh" > "$OUT0/staging$t.log" 2>&1
    grep -E "GB/s" "$OUT0/staging$t.log" | grep -E "${AB_GREP:-READ}"
  done
done
if [ "${AB_HARNESS:-1}" = 1 ]; then
  OUT=$OUT0/harness RUN_GPU_ONLY=harness timeout 120 bash "$B/run-gpu.sh" > "$OUT0/harness.log" 2>&1
  grep -E "passed|^FAIL" "$OUT0/harness.log" | head
fi
# (The names are expanded inside $OUT0: from here the log names matched nothing, tar failed and
# every log came back on its own, past the device tool's count of files.)
(cd "$OUT0" && tar -cJf read-ab.tar.xz $(ls -d ab harness staging-*.log harness.log 2>/dev/null) && rm -rf ab harness staging-*.log harness.log)
