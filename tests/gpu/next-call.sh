#!/usr/bin/env bash
# The device calls planned for what the 2026-12-06 sessions left open, batched into two calls of
# the device tool. Build the bundle here (`make gpu-bundle`), then on the device, from the
# repository root, with .gpu carried:
#   OUT=$OUT bash tests/gpu/next-call.sh a     (~200 s on the H100, 2026-12-06)
#   OUT=$OUT bash tests/gpu/next-call.sh b     (~140 s)
#   OUT=$OUT bash tests/gpu/next-call.sh c     (~180 s on the H100; 2026-12-06 afternoon)
#   OUT=$OUT bash tests/gpu/next-call.sh d     (~300 s)
#   OUT=$OUT bash tests/gpu/next-call.sh e     (~360 s; 2026-12-07)
#   OUT=$OUT bash tests/gpu/next-call.sh f     (~150 s on the H100, 2026-12-07)
#   OUT=$OUT bash tests/gpu/next-call.sh g     (~250 s)
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
# c (after the plan moved to the first post, plan_at_post):
#  6. #23: the vLLM pattern at 256 and 1024 blocks, UCX in the same run.
#  7. #23: the create-only loop (DRAM, one process), ours and UCX alternating three times.
#  8. #23: same-host DRAM between two processes, default configurations with progress threads
#     on and off, ours and UCX (bench.py --gpu-host), every bw and kv point.
# d (the same, repeated, to see the spread of c's results):
#  9. #23: the vLLM pattern at 256 blocks, 15 fresh requests per backend (c had 5), and ours
#     again with plan_at_post=false (the plan in prepXfer: create and post as before).
# 10. #23: same-host DRAM with progress threads off, ours and UCX, twice as the host places
#     the processes, and once with every process of both backends pinned to cores 2-5.
# e (#24 on the H200 again, the same build of staging as af9d739's night run, where 20 of 24
#    cases held 0.8x of DRAM): automatic rails with UCX tcp+cuda_copy beside it, then eight
#    rails; both with the DRAM KV patterns over the same rails, all six staging patterns.
# f (the new default of 6e98107, six rails with host memory off rail 0, which the A/B of
#    2026-12-07 measured without UCX): automatic rails, all seven staging patterns, the DRAM KV
#    patterns over the same rails and UCX tcp+cuda_copy in the same run; the vLLM pattern with
#    UCX; small transfers over tcp against UCX tcp (notif_latency.py).
# g (f again for the H200, where the issues ask for it: three staging runs in a row, since the
#    first run after a machine starts was the one that missed 0.8x on the H100, UCX after them;
#    the vLLM pattern with UCX).
# h (#24's FI_HMEM on the CUDA-enabled libfabric 2.1's shm, DRAM->VRAM now moved by the owner's
#    RMA (hmem_owner_rma), against shm's DRAM rate; then
#    #23's tcp small transfers against the stock LIBFABRIC plugin on the 16-core host, which
#    this VM's two cores could not settle: RUN_GPU_ONLY=stocknotif, a namespace with a veth,
#    libfabric main for the stock plugin, six alternating rounds of ours, the stock plugin and
#    UCX tcp, progress threads off). i: the first part alone, j: the second alone.
# k (#23's tcp small transfers against the stock LIBFABRIC plugin again, ours also with its
#    progress thread on and the agent's off, the defaults a C++ user gets, and with every pass
#    on that thread; 2026-12-07 night it also ran a build that owed eager writes' answers,
#    not kept), then, where the bundle has the CUDA-enabled libfabric 2.1, #24's FI_HMEM on
#    shm with 1024 x 16 KiB.
# l (g in one run, for a call that may be the last of a session's device time: one staging
#    run with the DRAM KV patterns and UCX, then the vLLM pattern with UCX; ~250 s).
# m (#24: staging_balance, which evens a staged request's chunks out over the rails, against the
#    default, two alternating rounds with the DRAM KV patterns in each, UCX in the first; its
#    default arm is also the first GPU run of copies.rs, the per-stream order of staged copies;
#    ~550 s).
# Everything goes into $OUT/next-call-<a|b|c|d>.tar.xz (each section's results under its own
# name) and the summaries to stdout.
set -u
B=${B:-$(pwd)/.gpu}
: "${OUT:?set OUT}"
W=$(mktemp -d)
run() {  # name, seconds, environment...: one run-gpu.sh section, its output kept and shown
  local name=$1 t=$2; shift 2
  echo "=== $name"
  env "$@" OUT="$W/$name" timeout -k 5 "$t" ${PIN:-} bash "$B/run-gpu.sh" > "$W/$name.txt" 2>&1
  echo "exit $?" >> "$W/$name.txt"
  grep -v "NIXL INFO" "$W/$name.txt" | tail -40
  # each section's results come back on their own, should a later one run past the limit
  tar -C "$W" -cJf "$OUT/section-$name.tar.xz" "$name.txt" $( [ -d "$W/$name" ] && echo "$name" )
}
# The staging patterns of sections e, f, g and l.
P="VRAM->VRAM 1x64MiB,VRAM->VRAM 1024x16KiB,VRAM->VRAM 4096x4KiB,VRAM->VRAM 256x256KiB,DRAM->VRAM 1x64MiB,VRAM->DRAM 1x64MiB,DRAM->DRAM 1x64MiB"
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
c)
  run vllm 120 RUN_GPU_ONLY=vllm VLLM_BUDGET=85 VLLM_ARGS="--requests 256,1024 --variants random --no-gather"
  (
    echo "=== create_loop (DRAM, one process, 4096 and 16384 descriptors)"
    for layers in 8 32; do for r in 1 2 3; do for bk in LIBFABRIC UCX; do
      if [ $bk = LIBFABRIC ]; then e="NIXL_PLUGIN_DIR=$B/plugins"; else e="UCX_MODULES=^ib UCX_NET_DEVICES=lo"; fi
      env $e BK=$bk LAYERS=$layers BLOCKS=256 N=1500 PYTHONPATH=/tmp/nixl/site timeout 60 python3 "$B/create_loop.py" 2>&1 | grep -v INFO | tail -1
    done; done; done
  ) 2>&1 | tee "$W/create_loop.txt"
  run dram 360 RUN_GPU_ONLY=dram DRAM_CONFIGS=ours-tcp-default,ucx,ours-dflt-np,ucx-np DRAM_BUDGET=280
  ;;
d)
  V="--requests 256 --variants random --no-gather --reps 15 --reposts 1"
  run vllm 130 RUN_GPU_ONLY=vllm VLLM_BUDGET=100 VLLM_ARGS="$V --point-s 35"
  run vllm-prep 50 RUN_GPU_ONLY=vllm VLLM_BUDGET=35 NIXL_FABRIC_PLAN_AT_POST=false VLLM_ARGS="$V --backends LIBFABRIC"
  run dram-np1 100 RUN_GPU_ONLY=dram DRAM_CONFIGS=ours-dflt-np,ucx-np DRAM_BUDGET=80
  run dram-np2 100 RUN_GPU_ONLY=dram DRAM_CONFIGS=ours-dflt-np,ucx-np DRAM_BUDGET=80
  PIN="taskset -c 2-5" run dram-pin 100 RUN_GPU_ONLY=dram DRAM_CONFIGS=ours-dflt-np,ucx-np DRAM_BUDGET=80
  ;;
e)
  run staging-auto 200 RUN_GPU_ONLY=staging STAGING_SWEEP="0:4" STAGING_DRAM_KV=1 STAGING_UCX=1 STAGING_ONLY="$P"
  run staging-r8 150 RUN_GPU_ONLY=staging STAGING_SWEEP="0:4" STAGING_DRAM_KV=1 STAGING_TAG=-r8 NIXL_FABRIC_RAILS=8 STAGING_ONLY="$P"
  ;;
f)
  run staging-auto 220 RUN_GPU_ONLY=staging STAGING_SWEEP="0:4" STAGING_DRAM_KV=1 STAGING_UCX=1 STAGING_ONLY="$P"
  run vllm 120 RUN_GPU_ONLY=vllm VLLM_BUDGET=85 VLLM_ARGS="--requests 256,1024 --variants random --no-gather"
  run notif 130 RUN_GPU_ONLY=notif NOTIF_BUDGET=110
  ;;
g|l)
  # g: three staging runs in a row; l: one
  if [ "$1" = g ]; then sweep="0:4 0:4 0:4" t=300; else sweep=0:4 t=200; fi
  run staging-auto $t RUN_GPU_ONLY=staging STAGING_SWEEP="$sweep" STAGING_DRAM_KV=1 STAGING_UCX=1 STAGING_ONLY="$P"
  run vllm 120 RUN_GPU_ONLY=vllm VLLM_BUDGET=85 VLLM_ARGS="--requests 256,1024 --variants random --no-gather"
  ;;
h|i|j)
  if [ "$1" != j ]; then
    run hmem 150 RUN_GPU_ONLY=hmem HMEM_PROVIDERS=shm HMEM_TOTAL_S=55 HMEM_ONLY="VRAM->VRAM 1x64MiB,DRAM->VRAM 1x64MiB,VRAM->DRAM 1x64MiB,VRAM->VRAM 256x256KiB"
    grep -h -E "peer moves it|straight between them" "$B"/hmem_shm_*.log 2>/dev/null | sed 's/^.*\] //' | sort | uniq -c
  fi
  [ "$1" = i ] || run stocknotif 150 RUN_GPU_ONLY=stocknotif NOTIF_BUDGET=135 NOTIF_ROUNDS=4 NOTIF_ITERS=4000
  ;;
m)
  # staging_balance A/B, alternating, each run with the DRAM KV patterns over the same rails first;
  # UCX tcp+cuda_copy once, in the first run
  run staging-dflt1 220 RUN_GPU_ONLY=staging STAGING_SWEEP=0:4 STAGING_DRAM_KV=1 STAGING_UCX=1 STAGING_TAG=-dflt1 STAGING_ONLY="$P"
  run staging-bal1 110 RUN_GPU_ONLY=staging STAGING_SWEEP=0:4 STAGING_DRAM_KV=1 STAGING_TAG=-bal1 STAGING_ONLY="$P" NIXL_FABRIC_STAGING_BALANCE=true
  run staging-dflt2 110 RUN_GPU_ONLY=staging STAGING_SWEEP=0:4 STAGING_DRAM_KV=1 STAGING_TAG=-dflt2 STAGING_ONLY="$P"
  run staging-bal2 110 RUN_GPU_ONLY=staging STAGING_SWEEP=0:4 STAGING_DRAM_KV=1 STAGING_TAG=-bal2 STAGING_ONLY="$P" NIXL_FABRIC_STAGING_BALANCE=true
  ;;
k)
  run stocknotif 230 RUN_GPU_ONLY=stocknotif NOTIF_BUDGET=215 NOTIF_ROUNDS=4 NOTIF_ITERS=4000 \
    STOCKNOTIF_CONFIGS=ours-tcp-noprog,ours-tcp-thread,ours-tcp-thread-only,ucx-tcp-noprog
  if [ -f "$B/libfabric2-cuda.tar.xz" ]; then
    run hmem 170 RUN_GPU_ONLY=hmem HMEM_PROVIDERS=shm HMEM_TOTAL_S=60 \
      HMEM_ONLY="VRAM->VRAM 1x64MiB,VRAM->VRAM 1024x16KiB,DRAM->VRAM 1x64MiB,VRAM->DRAM 1x64MiB,VRAM->VRAM 256x256KiB"
  fi
  ;;
esac
tar -C "$W" -cJf "$OUT/next-call-${1:-a}.tar.xz" .
ls -la "$OUT"
