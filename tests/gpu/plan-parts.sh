#!/usr/bin/env bash
# One device call: the vLLM pattern with the plan in parts (plan_threads, the default: half
# the cores, at most 8) against one planning thread, alternating LIBFABRIC-only runs so that
# the host's drift falls on both; one run with UCX beside ours for the ratios. Then the
# same-host DRAM small points (small-points.sh) RUNS times. Everything comes back in one
# archive ($OUT/plan-parts.tar.xz).
set -u
B=$(pwd)/.gpu
export PYTHONPATH=/tmp/nixl/site
OUT0=$OUT
V="--requests ${PLAN_REQUESTS:-256,1024} --reps ${PLAN_REPS:-5} --no-gather"
if [ "${PLAN_FULL:-1}" = 1 ]; then  # PLAN_FULL=0: ours alone (a short call)
  OUT=$OUT0/full RUN_GPU_ONLY=vllm VLLM_BUDGET=${PLAN_BUDGET:-100} VLLM_ARGS="--requests 256,1024 --reps 3" \
    bash $B/run-gpu.sh > $OUT0/full.log 2>&1
  grep -E "create per|blocks end to end|random|contiguous" $OUT0/full.log | tail -14
fi
for r in $(seq ${PLAN_ROUNDS:-2}); do
  for t in 1 0; do
    # (round 2 logs each request's create line: its plan time and threads)
    dbg=; [ $r = 2 ] && dbg=debug
    OUT=$OUT0/t$t-r$r NIXL_FABRIC_LOG=${dbg:-${NIXL_FABRIC_LOG:-}} NIXL_FABRIC_PLAN_THREADS=$t RUN_GPU_ONLY=vllm VLLM_BUDGET=60 VLLM_ARGS="$V --backends LIBFABRIC" \
      bash $B/run-gpu.sh > $OUT0/t$t-r$r.log 2>&1
    echo "== plan_threads=$t round $r"; grep -E "^ *(256|1024) random" $OUT0/t$t-r$r.log
    grep -rhoE "created a request of (16384|65536) descriptors.*" $OUT0/t$t-r$r 2>/dev/null | sed -E 's/ \(.*registration pairs/ (/' | sort | uniq -c | sort -rn | head -4
  done
done
if [ "${RUNS:-0}" -gt 0 ]; then
  mkdir -p $OUT0/sp; OUT=$OUT0/sp bash tests/gpu/small-points.sh > $OUT0/small-points.log 2>&1
  tail -40 $OUT0/small-points.log
fi
tar -C "$OUT0" -cJf "$OUT0/plan-parts.tar.xz" $(cd "$OUT0" && ls -d full* t* sp small-points.log 2>/dev/null) \
  && (cd "$OUT0" && rm -rf full* t[01]-* sp small-points.log)
