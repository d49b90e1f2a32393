#!/usr/bin/env bash
# one device call: where a same-host 64 KiB WRITE's time goes, ours vs UCX (progress off)
set -u
B=$(pwd)/.gpu
export PYTHONPATH=/tmp/nixl/site FI_TCP_IFACE=lo NIXL_FABRIC_IFACE=lo UCX_MODULES=^ib UCX_NET_DEVICES=lo
RUN_GPU_ONLY=latsmall LATSMALL_N=10 LATSMALL_SIZES=4096 bash $B/run-gpu.sh >/dev/null 2>&1
tar -xJf $B/perf.tar.xz -C /tmp
P="env LD_LIBRARY_PATH=/tmp/perfpack/lib /tmp/perfpack/perf"
lat() { # backend, extra env...
  local bk=$1; shift
  if [ $bk = LIBFABRIC ]; then e="NIXL_PLUGIN_DIR=$B/plugins"; else e="X=1"; fi
  env $e "$@" OP=WRITE PROG=0 BK=$bk TAG=$bk python3 $B/lat_small.py 2>/dev/null | grep median
}
for r in 1 2; do for buf in 1048576 67108864; do for sp in 0 1; do for bk in LIBFABRIC UCX; do
  echo -n "buf=$buf spin=$sp "; lat $bk BUF=$buf TARGET_SPIN=$sp SZ=65536 N=20000
done; done; done; done
for bk in LIBFABRIC UCX; do
  if [ $bk = LIBFABRIC ]; then e="NIXL_PLUGIN_DIR=$B/plugins"; else e="X=1"; fi
  env $e BUF=67108864 TARGET_SPIN=1 SZ=65536 N=60000 OP=WRITE PROG=0 BK=$bk $P record -F 4999 -g -o $OUT/$bk.data python3 $B/lat_small.py 2>&1 | grep median
  $P report -i $OUT/$bk.data --no-children --sort pid,dso,sym -g none --stdio 2>/dev/null | grep -v '^#' | grep -v '^$' | head -45 > $OUT/$bk-flat.txt
  $P report -i $OUT/$bk.data --no-children --sort pid,sym -g caller,0.5,callee --stdio 2>/dev/null | head -400 > $OUT/$bk-graph.txt
  echo "== $bk"; head -30 $OUT/$bk-flat.txt
done
rm -f $OUT/*.data
