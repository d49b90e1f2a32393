#!/usr/bin/env bash
# One device call: bench.py's same-host DRAM table (progress off and on, ours and UCX) RUNS
# times, then each run's small points side by side, and lat_small's 4 KiB WRITE/READ as a
# steady-state reference. For the control-send fix of 2026-12-06 (night): bench.py's first
# points (4 KiB, 64 KiB WRITE) fell inside the ~20 ms in which rxm set up the connection, and
# each post paid a refused control send there.
set -u
B=$(pwd)/.gpu
export PYTHONPATH=/tmp/nixl/site
RUN_GPU_ONLY=latsmall LATSMALL_N=10 LATSMALL_SIZES=4096 bash $B/run-gpu.sh >/dev/null 2>&1  # unpacks the runtime
for op in WRITE READ; do for bk in LIBFABRIC UCX; do
  if [ $bk = LIBFABRIC ]; then e="NIXL_PLUGIN_DIR=$B/plugins"; else e="UCX_MODULES=^ib UCX_NET_DEVICES=lo"; fi
  env $e FI_TCP_IFACE=lo NIXL_FABRIC_IFACE=lo BUF=67108864 TARGET_SPIN=1 SZ=4096 N=20000 OP=$op PROG=0 BK=$bk TAG=$bk \
    timeout 60 python3 $B/lat_small.py 2>/dev/null | grep median || echo "$bk $op failed"
done; done | tee $OUT/lat4k.txt
for r in $(seq ${RUNS:-3}); do
  OUT=$OUT/run$r RUN_GPU_ONLY=dram DRAM_CONFIGS=${DRAM_CONFIGS:-ours-dflt-np,ucx-np,ours-tcp-default,ucx} \
    DRAM_BUDGET=${DRAM_BUDGET:-200} bash $B/run-gpu.sh > $OUT/dram-run$r.log 2>&1
  grep -A22 '^ratios' $OUT/dram-run$r.log | head -24
done
python3 - "$OUT" <<'EOF'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/run*/dram/*.json")):
    d = json.load(open(f))
    print(f.split("/")[-3], d.get("git_rev", "")[:8])
    for k, v in d["configs"].items():
        pts = v.get("points") or []
        pts = pts if isinstance(pts, list) else list(pts.values())
        print(f"  {k:18s}", " ".join(f"{p['op'][0]}{p['size'] // 1024}K {p['median_s'] * 1e6:.2f}"
                                      for p in pts if p.get("blocks") == 1 and p["size"] <= 1 << 20))
EOF
# The device brings back only a few files from $OUT: the runs' JSON, tables and logs travel as
# one archive (2026-12-06: the third run's JSON was left behind).
tar -C "$OUT" -cJf "$OUT/small-points.tar.xz" $(cd "$OUT" && ls -d run* dram-run*.log lat4k.txt 2>/dev/null) \
  && rm -rf "$OUT"/run* "$OUT"/dram-run*.log "$OUT"/latsmall
