#!/usr/bin/env bash
# one device call: same-host 4 KiB WRITE/READ (buffers 2 MiB-aligned), ours vs UCX, progress
# off, then where ours spends a 4 KiB WRITE's postXfer (perf, dwarf call graphs); then bench.py's
# same-host configurations (DRAM_CONFIGS) unless SKIP_DRAM=1.
set -u
B=$(pwd)/.gpu; T=$(pwd)/tests/gpu
export PYTHONPATH=/tmp/nixl/site FI_TCP_IFACE=lo NIXL_FABRIC_IFACE=lo UCX_MODULES=^ib UCX_NET_DEVICES=lo
RUN_GPU_ONLY=latsmall LATSMALL_N=10 LATSMALL_SIZES=4096 bash $B/run-gpu.sh >/dev/null 2>&1
tar -xJf $B/perf.tar.xz -C /tmp
P="env LD_LIBRARY_PATH=/tmp/perfpack/lib /tmp/perfpack/perf"
envof() { if [ $1 = LIBFABRIC ]; then echo "NIXL_PLUGIN_DIR=$B/plugins"; else echo "X=1"; fi; }
cat /sys/devices/system/clocksource/clocksource0/current_clocksource
for r in 1 2; do for op in WRITE READ; do for bk in LIBFABRIC UCX; do
  env $(envof $bk) BUF=67108864 TARGET_SPIN=1 SZ=4096 N=30000 OP=$op PROG=0 BK=$bk TAG=$bk \
    timeout 60 python3 $B/lat_small.py 2>/dev/null | grep median || echo "$bk $op failed"
done; done; done | tee $OUT/lat4k.txt
env $(envof LIBFABRIC) BUF=67108864 TARGET_SPIN=1 SZ=4096 N=1500000 OP=WRITE PROG=0 BK=LIBFABRIC TAG=perf \
  $P record -D 3000 -e cpu-clock -F 1999 --call-graph dwarf,32768 -o /tmp/w4.data python3 $B/lat_small.py 2>&1 | grep median
$P script -i /tmp/w4.data -F comm,pid,tid,ip,sym 2>/dev/null > /tmp/w4.txt
python3 $T/perf-fold.py /tmp/w4.txt postXfer > $OUT/perf-4k-fold.txt; head -50 $OUT/perf-4k-fold.txt
[ "${SKIP_DRAM:-0}" = 1 ] || RUN_GPU_ONLY=dram DRAM_CONFIGS=${DRAM_CONFIGS:-ours-dflt-np,ucx-np,ours-tcp-default,ucx} \
  DRAM_BUDGET=${DRAM_BUDGET:-300} bash $B/run-gpu.sh 2>&1 | grep -A45 '^ratios'
