#!/usr/bin/env bash
# One device call (2026-12-07 afternoon): staged READs with 1, 2 and 4 MiB chunks, alternating
# (read-ab.sh arms min2 c2m c4m), then the vLLM pattern with UCX beside ours (the plan in parts
# on the H200), then one run of the same-host DRAM small points. From the repository root
# with .gpu carried: OUT=$OUT bash tests/gpu/call-p.sh
set -u
OUT0=$OUT
mkdir -p "$OUT0/ab" "$OUT0/pp"
OUT=$OUT0/ab AB_ARMS="${P_ARMS:-min2 c2m c4m}" AB_ROUNDS=2 AB_BUDGET=${P_AB_BUDGET:-130} AB_HARNESS=0 \
  timeout 200 bash tests/gpu/read-ab.sh
OUT=$OUT0/pp PLAN_ROUNDS=0 RUNS=${P_RUNS:-1} DRAM_BUDGET=${P_DRAM_BUDGET:-150} PLAN_BUDGET=100 \
  timeout 330 bash tests/gpu/plan-parts.sh
