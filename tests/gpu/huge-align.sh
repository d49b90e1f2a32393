#!/usr/bin/env bash
# one device call: same-host DRAM small and 1 MiB WRITEs with the buffers where malloc puts
# them (HUGE_OFF=none) and on a 2 MiB boundary (0), ours vs UCX, progress off; then bench.py's
# same-host configurations, progress off and on (its buffers are 2 MiB-aligned).
set -u
B=$(pwd)/.gpu
export PYTHONPATH=/tmp/nixl/site FI_TCP_IFACE=lo NIXL_FABRIC_IFACE=lo UCX_MODULES=^ib UCX_NET_DEVICES=lo
RUN_GPU_ONLY=latsmall LATSMALL_N=10 LATSMALL_SIZES=4096 bash $B/run-gpu.sh >/dev/null 2>&1
envof() { if [ $1 = LIBFABRIC ]; then echo "NIXL_PLUGIN_DIR=$B/plugins"; else echo "X=1"; fi; }
for r in $(seq ${REPS:-1}); do for off in none 0; do for sz in ${SIZES:-65536 1048576}; do for op in WRITE READ; do for bk in LIBFABRIC UCX; do
  echo -n "off=$off "
  env $(envof $bk) BUF=67108864 HUGE_OFF=$off TARGET_SPIN=1 SZ=$sz N=10000 OP=$op PROG=0 BK=$bk TAG=$bk \
    timeout 60 python3 $B/lat_small.py 2>/dev/null | grep median || echo "$bk $op $sz failed"
done; done; done; done; done | tee $OUT/latsmall-huge.txt
RUN_GPU_ONLY=dram DRAM_CONFIGS=${DRAM_CONFIGS:-ours-dflt-np,ucx-np,ours-tcp-default,ucx} DRAM_BUDGET=${DRAM_BUDGET:-330} \
  bash $B/run-gpu.sh 2>&1 | tail -60
