#!/usr/bin/env bash
# Runs on the GPU host, from the bundle that `make gpu-bundle` packed (.gpu/). Prints every
# suite's pass counts and the numbers for the closing note; exits non-zero on a failure.
set -u
B=$(cd "$(dirname "$0")" && pwd)
export FI_TCP_IFACE=lo NIXL_FABRIC_IFACE=lo NIXL_FABRIC_PROVIDER=tcp
# Measure the tcp provider itself; the same-host shm rail gets its own run below.
export NIXL_FABRIC_SAME_HOST_SHM=false
rc=0
section() { echo; echo "===== $*"; }
section "host"
nvidia-smi -L 2>&1 | head -4
section "cuda module unit tests (real driver)"
if [ -x "$B/bin/unit-tests" ]; then
  "$B/bin/unit-tests" cuda:: --include-ignored --nocapture --test-threads=1 2>&1 | grep -vE "^\s*$" | tail -40 || rc=1
fi
section "GPU C harness (staging path, system libfabric)"
LD_LIBRARY_PATH=$B/bin timeout 400 "$B/bin/gpu_harness" > "$B/gpu_harness.log" 2>&1 || rc=1
grep -E "^(FAIL|bw|reapply)|passed" "$B/gpu_harness.log" | head -80
section "stock agent (nixl-cu13) with VRAM: ours vs UCX"
mkdir -p /tmp/nixl && tar xJf "$B/nixl-cu13.tar.xz" -C /tmp/nixl
python3 - "$B"/numpy-*.whl <<'PY'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall("/tmp/nixl/site")
PY
export PYTHONPATH=/tmp/nixl/site
SITE=/tmp/nixl/site
NIXL_PLUGIN_DIR=$B/plugins timeout 300 python3 "$B/agent_vram.py" --backend LIBFABRIC > "$B/agent_ours.log" 2>&1 || rc=1
grep -vE "NIXL INFO" "$B/agent_ours.log" | grep -v "^JSON" | tail -40
env -u NIXL_PLUGIN_DIR UCX_MODULES='^ib' timeout 300 python3 "$B/agent_vram.py" --backend UCX > "$B/agent_ucx.log" 2>&1
grep -vE "NIXL INFO" "$B/agent_ucx.log" | grep -v "^JSON" | tail -40
NIXL_FABRIC_SAME_HOST_SHM=true NIXL_PLUGIN_DIR=$B/plugins timeout 300 python3 "$B/agent_vram.py" --backend LIBFABRIC > "$B/agent_ours_shm.log" 2>&1 || rc=1
echo "-- ours with the same-host shm rail (default configuration):"
grep -vE "NIXL INFO" "$B/agent_ours_shm.log" | grep -v "^JSON" | tail -40
python3 - "$B/agent_ours.log" "$B/agent_ucx.log" <<'PY'
import json, sys
def load(p):
    for l in open(p, errors="replace"):
        if l.startswith("JSON "):
            return {(r["op"], r["local"], r["remote"], r["bytes"]): r for r in json.loads(l[5:])["results"]}
    return {}
ours, ucx = load(sys.argv[1]), load(sys.argv[2])
print(f"\n{'case':<34} {'ours GB/s':>10} {'UCX GB/s':>10} {'ratio':>7}")
for k, r in ours.items():
    u = ucx.get(k, {}).get("gbps")
    g = r["gbps"]
    ratio = f"{g / u:.1f}x" if g and u else "-"
    print(f"{k[0]:5} {k[1]}->{k[2]} {k[3] >> 10:>7} KiB       {g or 0:>10.2f} {u or 0:>10.2f} {ratio:>7}  {'exact' if r['verified'] else 'MISMATCH'}")
PY
echo "GPU harness with the system libfabric: see above"
if [ -f "$B/libfabric2-cuda.tar.xz" ]; then
  section "zero-copy path: CUDA-enabled libfabric 2.x"
  rm -rf /tmp/lf2 && mkdir -p /tmp/lf2 && tar xJf "$B/libfabric2-cuda.tar.xz" -C /tmp/lf2
  D=$(dirname "$(dirname "$(find /tmp/lf2 -name 'libfabric.so.1' | head -1)")")
  LF="$D/lib:$D/cudart"
  LD_LIBRARY_PATH=$LF "$D/bin/fi_info" --version | head -2
  for p in tcp shm; do
    echo "-- $p with FI_HMEM:"; LD_LIBRARY_PATH=$LF "$D/bin/fi_info" -p $p -c FI_HMEM -t FI_EP_RDM 2>&1 | grep -E "provider|fabric|domain|No data" | head -3
  done
  for p in tcp shm; do
    echo "-- GPU harness over $p with libfabric 2.x (hmem= shows whether VRAM went zero-copy)"
    skip=; [ $p = shm ] && skip=1   # shm has FI_HMEM: nothing is staged, so no regression run
    LD_LIBRARY_PATH=$LF:$B/bin NIXL_FABRIC_LOG=debug GPU_HARNESS_SKIP_REGRESSION=$skip GPU_HARNESS_PROVIDER=$p timeout 300 "$B/bin/gpu_harness" > "$B/gpu_harness_lf2_$p.log" 2>&1 || rc=1
    grep -m2 "hmem=" "$B/gpu_harness_lf2_$p.log"
    grep -m3 -E "FI_HMEM\)|staged\)" "$B/gpu_harness_lf2_$p.log"
    grep -E "^(FAIL|bw|reapply)|passed" "$B/gpu_harness_lf2_$p.log" | head -40
  done
fi
section "result: rc=$rc"
exit $rc
