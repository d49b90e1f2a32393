#!/usr/bin/env bash
# make demo: our plugin over tcp (loopback) next to the stock UCX backend, same data.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PY:-$root/.venv/bin/python}
site=$("$py" -c 'import site; print(site.getsitepackages()[0])')
export FI_TCP_IFACE=lo NIXL_FABRIC_IFACE=lo NIXL_FABRIC_PROVIDER=${NIXL_FABRIC_PROVIDER:-tcp}
ours=$(NIXL_FABRIC_SAME_HOST_SHM=false NIXL_PLUGIN_DIR=$root/build/plugins timeout 300 "$py" "$root/demo/kv_demo.py" --backend LIBFABRIC | tail -1)
# The shipped default: same-host peers use the shm rail beside tcp.
dflt=$(NIXL_FABRIC_SAME_HOST_SHM=true NIXL_PLUGIN_DIR=$root/build/plugins timeout 300 "$py" "$root/demo/kv_demo.py" --backend LIBFABRIC | tail -1)
ucx=$(env -u NIXL_PLUGIN_DIR UCX_MODULES='^ib' timeout 300 "$py" "$root/demo/kv_demo.py" --backend UCX | tail -1 || echo '{}')
"$py" - "$ours" "$dflt" "$ucx" <<'PY'
import json, sys
ours, dflt, ucx = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3] or "{}")
print(f"\n{'pattern':<16} {'nixl-fabric tcp':>16} {'+ same-host shm':>16} {'stock UCX':>12} {'ratios':>12}  verified")
ok = True
for name, r in ours["results"].items():
    d = dflt["results"][name]
    u = ucx.get("results", {}).get(name, {}).get("gbps")
    ratio = f"{r['gbps'] / u:.2f} {d['gbps'] / u:.2f}" if u else "-"
    ok &= r["verified"] and d["verified"]
    print(f"{name:<16} {r['gbps']:>11.2f} GB/s {d['gbps']:>11.2f} GB/s {u or 0:>7.2f} GB/s {ratio:>12}  {'yes' if r['verified'] and d['verified'] else 'NO'}")
print("\ndemo", "passed: every byte verified" if ok else "FAILED")
sys.exit(0 if ok else 1)
PY
