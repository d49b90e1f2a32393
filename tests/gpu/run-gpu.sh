#!/usr/bin/env bash
# Runs on the GPU host, from the bundle that `make gpu-bundle` packed (.gpu/). Prints every
# suite's pass counts and the numbers for the closing note; exits non-zero on a failure.
#   RUN_GPU_ONLY=ipc bash .gpu/run-gpu.sh     only the listed sections (comma-separated:
#                                             unit, harness, agent, ipc, vmm, dram, lf2); the
#                                             host line is always printed. With only ipc,
#                                             agent_ipc.py runs --quick unless IPC_ARGS says
#                                             otherwise.
#   IPC_ARGS="--quick --only 64MiB"           extra arguments for agent_ipc.py
#   VMM_ARGS="--only VRAM->VRAM"              arguments for the vmm section's agent_ipc.py --vmm
#                                             runs (default --quick)
#   RUN_GPU_ONLY=dram bash .gpu/run-gpu.sh    the two-process DRAM benchmark (bench.py
#                                             --gpu-host, ~5-7 min): ours tcp rails 1/2/4/8,
#                                             default and one-process against UCX tcp, default
#                                             and one-process; raw TCP streams, memcpy.
#   DRAM_CONFIGS=ours-tcp,ucx-tcp DRAM_BUDGET=420 DRAM_ARGS=--quick   (its knobs)
#   RUN_GPU_ONLY=vllm bash .gpu/run-gpu.sh    the vLLM KV pattern (vllm_kv.py, ~5-7 min): torch
#                                             VRAM caches (32 layers x [2, 2048, 16, 8, 128]
#                                             bf16) in two processes on GPU 0, decode READs
#                                             16/64/256/1024 blocks with make_prepped_xfer,
#                                             ours vs UCX, and a torch gather of the same blocks.
#                                             Needs a torch Python of the bundle's version
#                                             (3.12): TORCH_PY (default /opt/torch/.venv/bin/python3).
#   VLLM_BUDGET=420 VLLM_ARGS="--requests 256,1024 --variants random"   (its knobs)
#   RUN_GPU_ONLY=descs bash .gpu/run-gpu.sh   descriptor-heavy DRAM requests (descs.py, ~5-7 min):
#                                             make_prepped_xfer ns/descriptor, first vs steady
#                                             post, ours vs UCX. DESCS_BUDGET=420 DESCS_ARGS=...
#   RUN_GPU_ONLY=staging bash .gpu/run-gpu.sh packed staging between two processes with the
#                                             same-host paths off (tcp, automatic rails), one run
#                                             of agent_ipc.py per staging configuration, DRAM->DRAM
#                                             over the same rails in each: VRAM/DRAM and GB/s.
#   STAGING_SWEEP="0:4 4M:4 4M:8"             chunk:depth pairs (0 = automatic chunk)
#   STAGING_ONLY="VRAM->VRAM 1x64MiB,..."     the cases (agent_ipc.py --only)
#   STAGING_TAG=-norail0                      a suffix for this sweep's result names (with an
#                                             exported NIXL_FABRIC_* knob, an A/B of it)
#   STAGING_PLUGINS=$B/plugins-old            the plugin directory (an A/B against another build)
#   STAGING_DRAM_KV=1                         after the sweep, the KV patterns DRAM->DRAM over the
#                                             same rails (agent_ipc.py --dram-only)
#   STAGING_UCX=1                             after the sweep, UCX (UCX_TLS=tcp,cuda_copy,self)
#                                             on the same cases in the same run: GPU memory
#                                             between hosts as UCX moves it over tcp
#   RUN_GPU_ONLY=notif bash .gpu/run-gpu.sh   small transfers over tcp on lo (notif_latency.py):
#                                             NOTIF_CONFIGS, NOTIF_ITERS, NOTIF_BUDGET (200 s)
#   RUN_GPU_ONLY=stocknotif bash .gpu/run-gpu.sh  the same in a network namespace of its own
#                                             (notif_netns.sh, root) with the wheel's stock
#                                             LIBFABRIC plugin beside ours and UCX, rounds
#                                             alternating: NOTIF_ROUNDS, NOTIF_ITERS, NOTIF_BUDGET
#   RUN_GPU_ONLY=latsmall bash .gpu/run-gpu.sh  same-host DRAM small-transfer latency, ours
#                                             (default config) vs UCX, progress off and on
#                                             (lat_small.py): LATSMALL_SIZES, LATSMALL_N
#   RUN_GPU_ONLY=hmem bash .gpu/run-gpu.sh    FI_HMEM between two processes on the CUDA-enabled
#                                             libfabric 2.x (shm, tcp where listed): VRAM vs DRAM
#                                             over the same provider; HMEM_PROVIDERS, HMEM_ONLY
#   vllm, descs, staging, notif, stocknotif, latsmall and hmem run only when named in
#   RUN_GPU_ONLY (benchmarks, not part of a full run).
# Results of the ipc, vmm and dram sections (JSON, PNG, logs) go to $OUT when it is set, else
# to the bundle (dram: $OUT/dram, vllm: $OUT/vllm, descs: $OUT/descs).
set -u
B=$(cd "$(dirname "$0")" && pwd)
export FI_TCP_IFACE=lo NIXL_FABRIC_IFACE=lo NIXL_FABRIC_PROVIDER=tcp
# Measure the tcp provider itself; the same-host shm rail gets its own run below.
export NIXL_FABRIC_SAME_HOST_SHM=false
rc=0
section() { echo; echo "===== $*"; }
want() { [ -z "${RUN_GPU_ONLY:-}" ] || [[ ",$RUN_GPU_ONLY," == *",$1,"* ]]; }
named() { [[ ",${RUN_GPU_ONLY:-}," == *",$1,"* ]]; }
SITE=/tmp/nixl/site
nixl_runtime() {   # the stock agent (nixl-cu13) and numpy, unpacked once
  [ -d "$SITE/nixl_cu13" ] && return 0
  mkdir -p /tmp/nixl && tar xJf "$B/nixl-cu13.tar.xz" -C /tmp/nixl
  python3 - "$B"/numpy-*.whl <<'PY'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall("/tmp/nixl/site")
PY
}
export PYTHONPATH=$SITE
vs_dram() {   # label, agent_ipc.py JSON, optional JSON of DRAM KV patterns: one line per case,
  # a GPU case against DRAM->DRAM of the same pattern in the same run (from either file)
  python3 - "$@" <<'PY'
import json, sys
tag, path = sys.argv[1], sys.argv[2]
try:
    res = {r["name"]: r for r in json.load(open(path))["results"]}
except Exception as e:
    print(f"{tag}: no result ({e})"); sys.exit(0)
dram = {n: r.get("gbps") for n, r in res.items() if "DRAM->DRAM" in n}
if len(sys.argv) > 3:
    try:
        dram.update({r["name"]: r.get("gbps") for r in json.load(open(sys.argv[3]))["results"]})
    except Exception:
        pass
for n, r in res.items():
    op, pat = n.split()[0], n.split()[-1]
    g, base = r.get("gbps"), dram.get(f"{op} DRAM->DRAM {pat}")
    ratio = f"{g / base:.2f}x DRAM" if g and base and "VRAM" in n else ""
    print(f"{tag:<10} {n:<34} {g or 0:8.2f} GB/s {ratio:>12} {'exact' if r['verified'] else 'BAD'}")
PY
}
lf2_unpack() {   # the bundle's CUDA-enabled libfabric 2.x into /tmp/lf2: sets D (its prefix) and LF
  rm -rf /tmp/lf2 && mkdir -p /tmp/lf2 && tar xJf "$B/libfabric2-cuda.tar.xz" -C /tmp/lf2
  D=$(dirname "$(dirname "$(find /tmp/lf2 -name 'libfabric.so.1' | head -1)")")
  LF="$D/lib:$D/cudart"
}
section "host"
nvidia-smi -L 2>&1 | head -4
if want unit && [ -x "$B/bin/unit-tests" ]; then
  section "cuda module unit tests (real driver)"
  "$B/bin/unit-tests" cuda:: --include-ignored --nocapture --test-threads=1 2>&1 | grep -vE "^\s*$" | tail -40 || rc=1
fi
if want harness; then
section "GPU C harness (staging path, system libfabric)"
LD_LIBRARY_PATH=$B/bin timeout 400 "$B/bin/gpu_harness" > "$B/gpu_harness.log" 2>&1 || rc=1
grep -E "^(FAIL|bw|reapply)|passed" "$B/gpu_harness.log" | head -80
echo "GPU harness with the system libfabric: see above"
fi
if want agent; then
section "stock agent (nixl-cu13) with VRAM: ours vs UCX"
nixl_runtime
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
fi
if want ipc; then
  section "two processes on one host, stock agent (agent_ipc.py): ours (shm rail on) vs UCX"
  nixl_runtime
  R=${OUT:-$B}; mkdir -p "$R"
  IA=${IPC_ARGS-}
  T=280
  if [ "${RUN_GPU_ONLY:-}" = ipc ]; then T=130; [ -n "${IPC_ARGS+x}" ] || IA=--quick; fi
  export AGENT_IPC_TOTAL_S=$((T - 20))
  NIXL_FABRIC_SAME_HOST_SHM=true NIXL_PLUGIN_DIR=$B/plugins timeout $T python3 "$B/agent_ipc.py" \
    --backend LIBFABRIC $IA --json "$R/ipc_ours.json" > "$B/ipc_ours.log" 2>&1 || rc=1
  grep -E "^(LIBFABRIC|baseline|harness)" "$B/ipc_ours.log"
  [ -s "$R/ipc_ours.json" ] || { echo "-- no JSON from ours; log tail:"; grep -v "NIXL INFO" "$B/ipc_ours.log" | tail -30; }
  # UCX_PROTO_INFO prints which transport UCX picked for each put/get (cuda_ipc for VRAM)
  env -u NIXL_PLUGIN_DIR UCX_MODULES='^ib' UCX_PROTO_INFO=y timeout $T python3 "$B/agent_ipc.py" \
    --backend UCX $IA --json "$R/ipc_ucx.json" > "$B/ipc_ucx.log" 2>&1
  grep -E "^(UCX |harness)" "$B/ipc_ucx.log"
  [ -s "$R/ipc_ucx.json" ] || { echo "-- no JSON from UCX; log tail:"; grep -v "NIXL INFO" "$B/ipc_ucx.log" | tail -30; }
  echo "-- UCX's choice of transport between the two processes (UCX_PROTO_INFO):"
  python3 "$B/agent_ipc.py" --ucx-protos "$B/ipc_ucx.log" | head -24
  U=$R/ipc_ucx.json
  # UCX may refuse VRAM from a thread with no CUDA context: measure it with one as well
  if python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if any(not r["verified"] and "VRAM" in (r["local"], r["remote"]) for r in d["results"]) else 1)' "$U" 2>/dev/null; then
    echo "-- UCX failed VRAM cases posting with no context current; again with the primary context current on the posting thread:"
    env -u NIXL_PLUGIN_DIR UCX_MODULES='^ib' timeout $T python3 "$B/agent_ipc.py" \
      --backend UCX --post-ctx primary $IA --json "$R/ipc_ucx_primary.json" > "$B/ipc_ucx_primary.log" 2>&1
    grep -E "^(UCX |harness)" "$B/ipc_ucx_primary.log"
    [ -s "$R/ipc_ucx_primary.json" ] && U=$R/ipc_ucx_primary.json
  fi
  python3 "$B/agent_ipc.py" --compare "$R/ipc_ours.json" "$U"
  # the numpy DRAM above is pageable; the issue's DRAM<->VRAM target is a pinned copy's speed
  if [[ " $IA " != *" --dram-only "* ]]; then
    echo; echo "-- ours, DRAM<->VRAM with pinned DRAM (cuMemHostAlloc) on both sides:"
    NIXL_FABRIC_SAME_HOST_SHM=true NIXL_PLUGIN_DIR=$B/plugins timeout $T python3 "$B/agent_ipc.py" \
      --backend LIBFABRIC $IA --pinned-dram --only "DRAM->VRAM,VRAM->DRAM" --json "$R/ipc_ours_pinned.json" \
      > "$B/ipc_ours_pinned.log" 2>&1 || rc=1
    grep -E "^harness" "$B/ipc_ours_pinned.log"
    python3 "$B/agent_ipc.py" --compare "$R/ipc_ours_pinned.json" "$U" | grep -vE "^(baselines|case X)"
  fi
  # two agents in one process (direct copies between engines of one process; UCX: its own)
  echo; echo "-- one process, two agents (--one-process): ours vs UCX"
  NIXL_FABRIC_SAME_HOST_SHM=true NIXL_PLUGIN_DIR=$B/plugins timeout $T python3 "$B/agent_ipc.py" \
    --backend LIBFABRIC --one-process $IA --json "$R/ipc_ours_1p.json" > "$B/ipc_ours_1p.log" 2>&1 || rc=1
  grep -E "^harness" "$B/ipc_ours_1p.log"
  env -u NIXL_PLUGIN_DIR UCX_MODULES='^ib' timeout $T python3 "$B/agent_ipc.py" \
    --backend UCX --one-process $IA --json "$R/ipc_ucx_1p.json" > "$B/ipc_ucx_1p.log" 2>&1
  grep -E "^harness" "$B/ipc_ucx_1p.log"
  python3 "$B/agent_ipc.py" --compare "$R/ipc_ours_1p.json" "$R/ipc_ucx_1p.json" | grep -vE "^(baselines|case X)"
  if [ -n "${OUT:-}" ]; then
    for f in ipc_ours ipc_ucx ipc_ucx_primary ipc_ours_pinned ipc_ours_1p ipc_ucx_1p; do
      [ -f "$B/$f.log" ] && grep -v "NIXL INFO" "$B/$f.log" | tail -c 4000000 > "$OUT/$f.log"
    done
  fi
fi
if want vmm; then
  # The target's VRAM is VMM memory (cuMemCreate chunks in one reserved range, like PyTorch's
  # expandable segments): no legacy IPC handle; ours passes the chunks' fds over a Unix socket.
  section "two processes, target VRAM from the VMM API (agent_ipc.py --vmm): ours vs UCX"
  nixl_runtime
  R=${OUT:-$B}; mkdir -p "$R"
  VA=${VMM_ARGS---quick}
  T=150
  export AGENT_IPC_TOTAL_S=$((T - 20))
  NIXL_FABRIC_LOG=info NIXL_FABRIC_SAME_HOST_SHM=true NIXL_PLUGIN_DIR=$B/plugins timeout $T python3 "$B/agent_ipc.py" \
    --backend LIBFABRIC --vmm $VA --json "$R/ipc_vmm_ours.json" > "$B/ipc_vmm_ours.log" 2>&1 || rc=1
  grep -E "^(LIBFABRIC|harness)" "$B/ipc_vmm_ours.log"
  [ -s "$R/ipc_vmm_ours.json" ] || { echo "-- no JSON from ours; log tail:"; grep -v "NIXL INFO" "$B/ipc_vmm_ours.log" | tail -30; }
  echo "-- fallbacks of the VMM route (none expected; each would say why):"
  grep -E "cannot be (opened|shared)|staged through host memory" "$B/ipc_vmm_ours.log" | sed 's/^.*\] //' | sort | uniq -c | head -10
  env -u NIXL_PLUGIN_DIR UCX_MODULES='^ib' timeout $T python3 "$B/agent_ipc.py" \
    --backend UCX --post-ctx primary --vmm $VA --json "$R/ipc_vmm_ucx.json" > "$B/ipc_vmm_ucx.log" 2>&1
  grep -E "^(UCX |harness)" "$B/ipc_vmm_ucx.log"
  [ -s "$R/ipc_vmm_ours.json" ] && [ -s "$R/ipc_vmm_ucx.json" ] && python3 "$B/agent_ipc.py" --compare "$R/ipc_vmm_ours.json" "$R/ipc_vmm_ucx.json"
  if [ -n "${OUT:-}" ]; then
    for f in ipc_vmm_ours ipc_vmm_ucx; do
      [ -f "$B/$f.log" ] && grep -v "NIXL INFO" "$B/$f.log" | tail -c 4000000 > "$OUT/$f.log"
    done
  fi
fi
if want dram && [ -f "$B/bench.py" ]; then
  section "DRAM, two processes through the stock agent (bench.py --gpu-host): ours vs UCX, raw TCP, memcpy"
  nixl_runtime
  R=${OUT:-$B}/dram; mkdir -p "$R/logs"
  BUDGET=${DRAM_BUDGET:-400}
  # bench.py sets every configuration's environment itself (loopback, provider, same-host shm
  # rail on or off, NIXL_FABRIC_LOG=info for the same-host path); the exports above must not
  # leak into the configurations that leave them unset. Every child has its own timeout
  # inside bench.py; this one bounds the whole run.
  env -u NIXL_FABRIC_SAME_HOST_SHM -u NIXL_FABRIC_PROVIDER -u NIXL_PLUGIN_DIR \
    timeout -k 10 $((BUDGET + 70)) python3 "$B/bench.py" --gpu-host --configs "${DRAM_CONFIGS:-dram}" \
    --budget "$BUDGET" --plugin "$B/plugins/libplugin_LIBFABRIC.so" --out "$R" --logdir "$R/logs" \
    --suffix=-gpu-dram ${DRAM_ARGS:-} > "$R/dram.log" 2>&1 || rc=1
  cat "$R/dram.log"
  ls "$R"
fi
if named vllm; then
  section "vLLM KV pattern, two processes on one GPU (vllm_kv.py): ours vs UCX, torch gather"
  nixl_runtime
  R=${OUT:-$B}/vllm; mkdir -p "$R/logs"
  TP=${TORCH_PY:-/opt/torch/.venv/bin/python3}
  BUDGET=${VLLM_BUDGET:-420}
  # the Python version the bundle's nixl-cu13 was built for (its _bindings.cpython-3XX-...so)
  NV=$(ls "$SITE"/nixl_cu13/_bindings*.so 2>/dev/null | sed -n 's/.*cpython-\([0-9]\)\([0-9]*\)-.*/\1.\2/p' | head -1)
  TV=$("$TP" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
  if [ ! -x "$TP" ]; then
    echo "vllm: no torch Python at $TP (set TORCH_PY)"; rc=1
  elif [ -n "$NV" ] && [ "$TV" != "$NV" ]; then
    echo "vllm: $TP is Python $TV, the bundle's nixl-cu13 is built for $NV"; rc=1
  else
    # The torch venv may bring its own numpy: then give it the stock agent without the
    # bundle's numpy (one numpy per process, the one torch was built with).
    PP=$SITE
    if env -u PYTHONPATH "$TP" -c 'import numpy' 2>/dev/null; then
      PP=/tmp/nixl/site-torch
      if [ ! -d "$PP" ]; then
        mkdir -p "$PP"
        for e in "$SITE"/* "$SITE"/.[!.]*; do
          case $(basename "$e") in numpy|numpy-*|numpy.libs) ;; *) ln -s "$e" "$PP/" ;; esac
        done
      fi
    fi
    PYTHONPATH="$PP" "$TP" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())' 2>&1 | tail -1
    # same-host paths on (the default): the exports above are for the other sections
    env -u NIXL_FABRIC_SAME_HOST_SHM -u NIXL_FABRIC_PROVIDER -u NIXL_PLUGIN_DIR PYTHONPATH="$PP" \
      timeout -k 10 $((BUDGET + 90)) "$TP" "$B/vllm_kv.py" --mem vram --budget "$BUDGET" \
      --plugin "$B/plugins/libplugin_LIBFABRIC.so" --out "$R" --logdir "$R/logs" ${VLLM_ARGS:-} \
      > "$R/vllm.log" 2>&1 || rc=1
    grep -v "NIXL INFO" "$R/vllm.log" | tail -60
    ls "$R"
  fi
fi
if named descs && [ -f "$B/descs.py" ]; then
  section "descriptor-heavy DRAM requests (descs.py): make_prepped_xfer per descriptor, first vs steady, ours vs UCX"
  nixl_runtime
  R=${OUT:-$B}/descs; mkdir -p "$R/logs"
  BUDGET=${DESCS_BUDGET:-420}
  env -u NIXL_FABRIC_SAME_HOST_SHM -u NIXL_FABRIC_PROVIDER -u NIXL_PLUGIN_DIR UCX_NET_DEVICES=lo \
    timeout -k 10 $((BUDGET + 60)) python3 "$B/descs.py" --budget "$BUDGET" \
    --plugin "$B/plugins/libplugin_LIBFABRIC.so" --out "$R" --logdir "$R/logs" --suffix=-gpu-host \
    ${DESCS_ARGS:-} > "$R/descs.log" 2>&1 || rc=1
  grep -v "NIXL INFO" "$R/descs.log" | tail -80
  ls "$R"
fi
if named staging; then
  section "packed staging over tcp rails, same-host paths off (agent_ipc.py per chunk:depth): VRAM vs DRAM"
  nixl_runtime
  R=${OUT:-$B}/staging; mkdir -p "$R"
  ONLY=${STAGING_ONLY:-"VRAM->VRAM 1x64MiB,VRAM->VRAM 4096x4KiB,VRAM->VRAM 256x256KiB,DRAM->DRAM 1x64MiB"}
  if [ "${STAGING_DRAM_KV:-0}" = 1 ]; then
    # The KV patterns DRAM->DRAM over the same rails, first: each VRAM pattern below is then
    # set against the same pattern's DRAM rate (the sweep's own DRAM row is 64 MiB only)
    NIXL_FABRIC_LOG=info NIXL_PLUGIN_DIR=${STAGING_PLUGINS:-$B/plugins} AGENT_IPC_TOTAL_S=100 \
      timeout 120 python3 "$B/agent_ipc.py" --backend LIBFABRIC --quick --dram-only \
      --only "1024x16KiB,4096x4KiB,256x256KiB" --json "$R/staging_dram_kv${STAGING_TAG:-}.json" > "$B/staging_dram_kv.log" 2>&1 || rc=1
    vs_dram dram-kv "$R/staging_dram_kv${STAGING_TAG:-}.json"
  fi
  declare -A seen=()
  for cd in ${STAGING_SWEEP:-0:4 4M:4 4M:8 2M:16}; do
    c=${cd%%:*}; d=${cd##*:}
    tag=c${c}-d${d}${STAGING_TAG:-}
    # a pair named again is a repeat: its results get their own names (-r2, -r3, ...)
    seen[$tag]=$(( ${seen[$tag]:-0} + 1 ))
    [ "${seen[$tag]}" -gt 1 ] && tag=$tag-r${seen[$tag]}
    NIXL_FABRIC_LOG=info NIXL_FABRIC_STAGING_CHUNK_SIZE=$c NIXL_FABRIC_STAGING_DEPTH=$d NIXL_PLUGIN_DIR=${STAGING_PLUGINS:-$B/plugins} AGENT_IPC_TOTAL_S=100 \
      timeout 120 python3 "$B/agent_ipc.py" --backend LIBFABRIC --quick --only "$ONLY" --json "$R/staging_$tag.json" \
      > "$B/staging_$tag.log" 2>&1 || rc=1
    vs_dram "$tag" "$R/staging_$tag.json" "$R/staging_dram_kv${STAGING_TAG:-}.json"
    grep -m1 "staging pool" "$B/staging_$tag.log" | sed 's/^.*\] //'
    # (staging_balance: the first request it planned again, where one was)
    grep -m1 "busiest rail" "$B/staging_$tag.log" | sed 's/^.*\] //'
    # where the chunks' time went (timing.rs), one line per engine that staged
    grep "staging times" "$B/staging_$tag.log" | sed "s/^.*\] //" | head -12
  done
  if [ "${STAGING_UCX:-0}" = 1 ]; then
    env -u NIXL_PLUGIN_DIR UCX_TLS=tcp,cuda_copy,self UCX_NET_DEVICES=lo UCX_MODULES='^ib' AGENT_IPC_TOTAL_S=150 \
      timeout 180 python3 "$B/agent_ipc.py" --backend UCX --quick --only "$ONLY" --json "$R/staging_ucx.json" \
      > "$B/staging_ucx.log" 2>&1 || echo "UCX staging comparison: exit $? (see staging_ucx.log)"
    vs_dram ucx-tcp "$R/staging_ucx.json"
  fi
fi
if named notif && [ -f "$B/notif_latency.py" ]; then
  section "small transfers over tcp on lo (notif_latency.py): ours vs UCX tcp, progress threads on and off"
  nixl_runtime
  R=${OUT:-$B}/notif; mkdir -p "$R/logs"
  # (NIXL's UCX backend refuses UCX_TLS without a CUDA transport on a host with GPUs)
  env -u NIXL_PLUGIN_DIR NOTIF_UCX_TLS=tcp,cuda_copy,self timeout -k 10 ${NOTIF_BUDGET:-200} python3 "$B/notif_latency.py" \
    --configs ${NOTIF_CONFIGS:-ours-tcp-noprog,ucx-tcp-noprog,ours-tcp} --iters ${NOTIF_ITERS:-1000} \
    --plugin-dir "$B/plugins" --logs "$R/logs" --out "$R/notif-gpu-host.json" > "$R/notif.log" 2>&1 || rc=1
  tail -12 "$R/notif.log"
fi
if named stocknotif && [ -f "$B/notif_netns.sh" ] && [ -f "$B/lfmain.tar.xz" ]; then
  section "small transfers over tcp in a namespace (notif_netns.sh): ours vs the stock LIBFABRIC plugin and UCX tcp"
  nixl_runtime
  R=${OUT:-$B}/stocknotif; mkdir -p "$R/logs"
  S=/tmp/stockrt; mkdir -p "$S"
  [ -f "$S/lfmain/lib/libfabric.so.1" ] || tar -C "$S" -xJf "$B/lfmain.tar.xz"
  [ -x "$S/iproute/ip" ] || tar -C "$S" -xJf "$B/iproute.tar.xz"
  # the wheel's stock plugin (nixl-cu13) links libcudart.so.13: the host's CUDA toolkit has it
  CUDART=$( (ldconfig -p | sed -n 's/.*libcudart\.so\.13 .*=> //p'; find /usr /opt -name 'libcudart.so.13' 2>/dev/null) | head -1)
  echo "libcudart: ${CUDART:-none}; id: $(id -u)"
  if command -v ip > /dev/null; then IPX=ip; else IPX="env LD_LIBRARY_PATH=$S/iproute/lib $S/iproute/ip"; fi
  env -u NIXL_PLUGIN_DIR PY=python3 NOTIF_IP="$IPX" NOTIF_UCX_TLS=tcp,cuda_copy,self \
    STOCK_LD_PATH="$S/lfmain/lib:$(dirname "${CUDART:-/nonexistent/x}")" \
    NOTIF_BASE_CONFIGS=${STOCKNOTIF_CONFIGS:-ours-tcp-noprog,ucx-tcp-noprog} NOTIF_STOCK_CONFIGS=stock-libfabric-noprog \
    timeout -k 10 ${NOTIF_BUDGET:-200} bash "$B/notif_netns.sh" --iters ${NOTIF_ITERS:-5000} --rounds ${NOTIF_ROUNDS:-6} \
    --sizes 4096,65536 --plugin-dir "$B/plugins" --logs "$R/logs" --out "$R/notif-netns-gpu-host.json" > "$R/notif.log" 2>&1 || rc=1
  tail -25 "$R/notif.log"
fi
if named latsmall && [ -f "$B/lat_small.py" ]; then
  section "same-host DRAM, one small transfer at a time (lat_small.py): ours (default config) vs UCX, progress off and on"
  nixl_runtime
  R=${OUT:-$B}/latsmall; mkdir -p "$R"
  for prog in 0 1; do
    for op in WRITE READ; do
      for sz in ${LATSMALL_SIZES:-4096 65536 1048576}; do
        env -u NIXL_FABRIC_SAME_HOST_SHM -u NIXL_FABRIC_PROVIDER NIXL_PLUGIN_DIR="$B/plugins" SZ=$sz N=${LATSMALL_N:-5000} \
          PROG=$prog OP=$op BK=LIBFABRIC TAG=ours timeout 60 python3 "$B/lat_small.py" 2>/dev/null \
          | grep -v "NIXL INFO" | tail -1 | tee -a "$R/latsmall.txt"
        env -u NIXL_PLUGIN_DIR UCX_MODULES='^ib' UCX_NET_DEVICES=lo SZ=$sz N=${LATSMALL_N:-5000} PROG=$prog OP=$op BK=UCX \
          TAG=ucx timeout 60 python3 "$B/lat_small.py" 2>/dev/null \
          | grep -v "NIXL INFO" | tail -1 | tee -a "$R/latsmall.txt"
      done
    done
  done
fi
if named hmem && [ -f "$B/libfabric2-cuda.tar.xz" ]; then
  # Provider-registered GPU memory between two processes through the stock agent, on the
  # CUDA-enabled libfabric 2.x: for each provider that lists FI_HMEM, VRAM registered with it
  # (vram_registration=hmem: a fallback to staging fails the case) against DRAM over the same
  # provider in the same run. Same-host paths off, so the bytes take the provider's own path.
  section "provider-registered GPU memory (FI_HMEM, libfabric 2.x with CUDA), two processes"
  nixl_runtime
  lf2_unpack
  R=${OUT:-$B}/hmem; mkdir -p "$R"
  for p in ${HMEM_PROVIDERS:-shm tcp}; do
    if ! LD_LIBRARY_PATH=$LF "$D/bin/fi_info" -p $p -c FI_HMEM -t FI_EP_RDM 2>&1 | grep -q "provider: $p"; then
      echo "$p: no FI_HMEM on this libfabric"; continue
    fi
    for kind in hmem dram; do
      only=${HMEM_ONLY:-"VRAM->VRAM 1x64MiB,VRAM->VRAM 1024x16KiB,VRAM->VRAM 256x256KiB,DRAM->VRAM 1x64MiB,VRAM->DRAM 1x64MiB"}
      extra=; [ $kind = dram ] && { extra=--dram-only; only="1x64MiB,1024x16KiB,256x256KiB"; }
      LD_LIBRARY_PATH=$LF NIXL_FABRIC_PROVIDER=$p NIXL_FABRIC_RAILS=1 NIXL_FABRIC_VRAM_REGISTRATION=hmem NIXL_FABRIC_LOG=info \
        NIXL_PLUGIN_DIR=$B/plugins AGENT_IPC_TOTAL_S=${HMEM_TOTAL_S:-70} timeout $((${HMEM_TOTAL_S:-70} + 20)) python3 "$B/agent_ipc.py" --backend LIBFABRIC --quick \
        $extra --only "$only" --json "$R/hmem_${p}_$kind.json" > "$B/hmem_${p}_$kind.log" 2>&1 || rc=1
    done
    grep -h -m1 -E "GPU memory (is registered|is staged)" "$B/hmem_${p}_hmem.log" | sed 's/^.*\] [a-z0-9-]*: //'
    vs_dram "$p-hmem" "$R/hmem_${p}_hmem.json" "$R/hmem_${p}_dram.json"
    vs_dram "$p-dram" "$R/hmem_${p}_dram.json"
  done
fi
if want lf2 && [ -f "$B/libfabric2-cuda.tar.xz" ]; then
  section "zero-copy path: CUDA-enabled libfabric 2.x"
  lf2_unpack
  LD_LIBRARY_PATH=$LF "$D/bin/fi_info" --version | head -2
  for p in tcp shm; do
    echo "-- $p with FI_HMEM:"; LD_LIBRARY_PATH=$LF "$D/bin/fi_info" -p $p -c FI_HMEM -t FI_EP_RDM 2>&1 | grep -E "provider|fabric|domain|No data" | head -3
  done
  if [ -x "$B/bin/unit-tests" ]; then
    echo "-- dma-buf export of the real driver, and dma-buf registration on this libfabric's shm:"
    LD_LIBRARY_PATH=$LF "$B/bin/unit-tests" --exact cuda::tests::gpu_dmabuf_export fabric::rail::dmabuf_tests::dmabuf_registration_on_shm \
      --nocapture --test-threads=1 2>&1 | grep -E "^(gpu dmabuf|libfabric|test result)" || rc=1
  fi
  echo "-- shm, FI_HMEM pinned (NIXL_FABRIC_VRAM_REGISTRATION=hmem: a fallback to staging would fail the run):"
  LD_LIBRARY_PATH=$LF:$B/bin NIXL_FABRIC_LOG=info NIXL_FABRIC_VRAM_REGISTRATION=hmem GPU_HARNESS_SKIP_REGRESSION=1 GPU_HARNESS_PROVIDER=shm \
    timeout 300 "$B/bin/gpu_harness" > "$B/gpu_harness_lf2_shm_hmem.log" 2>&1 || rc=1
  grep -E "^(FAIL|bw)|passed" "$B/gpu_harness_lf2_shm_hmem.log" | head -40
  for p in tcp shm; do
    echo "-- GPU harness over $p with libfabric 2.x (hmem= shows whether VRAM went zero-copy)"
    skip=; [ $p = shm ] && skip=1   # shm has FI_HMEM: nothing is staged, so no regression run
    LD_LIBRARY_PATH=$LF:$B/bin NIXL_FABRIC_LOG=info GPU_HARNESS_SKIP_REGRESSION=$skip GPU_HARNESS_PROVIDER=$p timeout 300 "$B/bin/gpu_harness" > "$B/gpu_harness_lf2_$p.log" 2>&1 || rc=1
    grep -m2 "hmem=" "$B/gpu_harness_lf2_$p.log"
    echo "   registration kinds taken (one INFO line per engine and kind):"
    grep -E "GPU memory (is registered|is staged)" "$B/gpu_harness_lf2_$p.log" | sed 's/^.*\] [a-z0-9]*: //' | sort | uniq -c
    grep -E "^(FAIL|bw|reapply)|passed" "$B/gpu_harness_lf2_$p.log" | head -40
  done
fi
section "result: rc=$rc"
exit $rc
