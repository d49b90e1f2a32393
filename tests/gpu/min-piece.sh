#!/usr/bin/env bash
# One device call: same-host 1 MiB WRITE/READ (lat_small, 2 MiB-aligned 64 MiB buffers) with
# cma_min_piece 1 MiB (one process_vm_writev/readv on the posting thread), 512 KiB and 256 KiB
# (pieces spread over the copy threads), progress off and on, UCX alternating in every round.
set -u
B=$(pwd)/.gpu
export PYTHONPATH=/tmp/nixl/site FI_TCP_IFACE=lo NIXL_FABRIC_IFACE=lo
RUN_GPU_ONLY=latsmall LATSMALL_N=10 LATSMALL_SIZES=4096 bash $B/run-gpu.sh >/dev/null 2>&1  # unpacks the runtime
lat() {  # tag env...
  local tag=$1; shift
  env "$@" BUF=67108864 TARGET_SPIN=1 SZ=${SZ:-1048576} N=${N:-3000} TAG=$tag timeout 60 python3 $B/lat_small.py 2>/dev/null \
    | grep median || echo "$tag failed"
}
for r in $(seq ${ROUNDS:-3}); do for prog in 0 1; do for op in WRITE READ; do
  for pc in ${PIECES:-1048576 524288 262144}; do
    lat "ours-$pc" NIXL_PLUGIN_DIR=$B/plugins NIXL_FABRIC_CMA_MIN_PIECE=$pc OP=$op PROG=$prog BK=LIBFABRIC
  done
  lat ucx UCX_MODULES=^ib UCX_NET_DEVICES=lo OP=$op PROG=$prog BK=UCX
done; done; done | tee $OUT/min-piece.txt | python3 -c '
import sys, statistics, collections
d = collections.defaultdict(list)
for l in sys.stdin:
    w = l.split()
    if "median" in w:
        d[(w[1], w[3], w[0])].append(float(w[5]))
for k, v in sorted(d.items()):
    print(*k, "runs", v, "median", statistics.median(v))
'
