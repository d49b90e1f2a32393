#!/usr/bin/env bash
# lat_small, ours and UCX alternating REPS times per point (progress off): the median of the
# runs' medians, since single runs of 1 MiB on the H100 host varied 70-130 us for either.
# PIN="taskset -c 2,3" pins both processes (the target is forked) to two cores.
B=$(pwd)/.gpu; export PYTHONPATH=/tmp/nixl/site FI_TCP_IFACE=lo NIXL_FABRIC_IFACE=lo
RUN_GPU_ONLY=latsmall LATSMALL_N=10 LATSMALL_SIZES=4096 bash $B/run-gpu.sh >/dev/null 2>&1  # unpacks the runtime
for pt in "WRITE 1048576 2000" "READ 1048576 2000" "WRITE 65536 5000" "READ 65536 5000"; do
  set -- $pt
  for r in $(seq ${REPS:-5}); do
    for bk in LIBFABRIC UCX; do
      if [ $bk = LIBFABRIC ]; then e="NIXL_PLUGIN_DIR=$B/plugins"; else e="UCX_MODULES=^ib UCX_NET_DEVICES=lo"; fi
      env $e SZ=$2 N=$3 PROG=0 OP=$1 BK=$bk TAG=$bk ${PIN:-} python3 $B/lat_small.py 2>/dev/null | grep -v INFO | tail -1
    done
  done
done | tee $OUT/latsmall-reps.txt | python3 -c '
import sys,statistics,collections
d=collections.defaultdict(list)
for l in sys.stdin:
    w=l.split(); d[(w[1],w[2],w[0])].append(float(w[5]))
for (op,sz,bk),v in sorted(d.items()): print(op,sz,bk,"runs",v,"median of medians",statistics.median(v))
'
