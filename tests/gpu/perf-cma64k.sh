#!/usr/bin/env bash
# one device call: where a same-host 64 KiB / 1 MiB WRITE's time goes, ours vs UCX (progress off)
set -u
B=$(pwd)/.gpu
export PYTHONPATH=/tmp/nixl/site FI_TCP_IFACE=lo NIXL_FABRIC_IFACE=lo UCX_MODULES=^ib UCX_NET_DEVICES=lo
RUN_GPU_ONLY=latsmall LATSMALL_N=10 LATSMALL_SIZES=4096 bash $B/run-gpu.sh >/dev/null 2>&1
tar -xJf $B/perf.tar.xz -C /tmp
P="env LD_LIBRARY_PATH=/tmp/perfpack/lib /tmp/perfpack/perf"
envof() { if [ $1 = LIBFABRIC ]; then echo "NIXL_PLUGIN_DIR=$B/plugins"; else echo "X=1"; fi; }
lat() { # backend, extra env...
  local bk=$1; shift
  env $(envof $bk) "$@" OP=WRITE PROG=0 BK=$bk TAG=$bk python3 $B/lat_small.py 2>/dev/null | grep median
}
lscpu | grep -E 'Model name|^CPU\(s\)|Thread|NUMA|L2|L3'
cat /sys/kernel/mm/transparent_hugepage/enabled
for r in 1 2; do for sz in 65536 1048576; do for buf in 1048576 67108864; do for bk in LIBFABRIC UCX; do
  echo -n "sz=$sz buf=$buf spin=1 "; lat $bk BUF=$buf TARGET_SPIN=1 SZ=$sz N=10000
done; done; done; done
echo -n "shm rail (cma_copy off) 64K: "; lat LIBFABRIC NIXL_FABRIC_CMA_COPY=false BUF=67108864 TARGET_SPIN=1 SZ=65536 N=10000
for sz in 65536 1048576; do for bk in LIBFABRIC UCX; do
  echo "== perf stat $bk sz=$sz"
  env $(envof $bk) BUF=67108864 TARGET_SPIN=1 SZ=$sz N=20000 OP=WRITE PROG=0 BK=$bk $P stat -e task-clock,context-switches,cpu-migrations,page-faults,cycles,instructions,cache-misses,dTLB-load-misses python3 $B/lat_small.py 2>&1 | grep -E 'median|task-clock|context|migr|faults|cycles|instr|miss'
done; done
for sz in 65536 1048576; do for bk in LIBFABRIC UCX; do
  env $(envof $bk) BUF=67108864 TARGET_SPIN=1 SZ=$sz N=30000 OP=WRITE PROG=0 BK=$bk $P record -F 4999 -g -o $OUT/$bk.data python3 $B/lat_small.py 2>&1 | grep median
  $P report -i $OUT/$bk.data --no-children --sort pid,dso,sym -g none --stdio 2>/dev/null | grep -v '^#' | grep -v '^$' | head -60 > $OUT/$bk-$sz-flat.txt
  $P report -i $OUT/$bk.data --no-children --sort pid,sym -g caller,0.5,callee --stdio 2>/dev/null | head -600 > $OUT/$bk-$sz-graph.txt
  echo "== $bk $sz"; head -30 $OUT/$bk-$sz-flat.txt
done; done
rm -f $OUT/*.data
