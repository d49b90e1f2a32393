#!/usr/bin/env bash
# One device call (2026-12-07 afternoon, for the H200): the vLLM pattern with UCX beside ours
# (the plan in parts had run only on the H100), then packed staging at the defaults with the
# DRAM KV patterns and UCX tcp+cuda_copy (issue #24's table, one run), then one run of the
# same-host DRAM small points. Everything comes back as archives.
#   OUT=$OUT bash tests/gpu/call-q.sh      (Q_RUNS: small-point runs, default 1)
set -u
OUT0=$OUT
mkdir -p "$OUT0/pp" "$OUT0/st"
OUT=$OUT0/pp PLAN_ROUNDS=0 RUNS=0 PLAN_BUDGET=100 timeout 140 bash tests/gpu/plan-parts.sh
OUT=$OUT0/st RUN_GPU_ONLY=staging STAGING_SWEEP=0:4 STAGING_DRAM_KV=1 STAGING_UCX=1 \
  STAGING_ONLY="VRAM->VRAM 1x64MiB,DRAM->VRAM 1x64MiB,VRAM->DRAM 1x64MiB,DRAM->DRAM 1x64MiB,VRAM->VRAM 1024x16KiB,VRAM->VRAM 4096x4KiB,VRAM->VRAM 256x256KiB" \
  timeout 220 bash .gpu/run-gpu.sh > "$OUT0/st.log" 2>&1
grep -E "GB/s|staging pool" "$OUT0/st.log"
tar -C "$OUT0" -cJf "$OUT0/st.tar.xz" st st.log && rm -rf "$OUT0/st" "$OUT0/st.log"
if [ "${Q_RUNS:-1}" -gt 0 ]; then
  mkdir -p "$OUT0/sp"; OUT=$OUT0/sp RUNS=${Q_RUNS:-1} DRAM_BUDGET=150 timeout 200 bash tests/gpu/small-points.sh 2>&1 | tail -40
fi
