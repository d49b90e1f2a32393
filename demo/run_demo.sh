#!/usr/bin/env bash
# make demo: our plugin over tcp (loopback) next to the stock UCX backend, same data.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PY:-$root/.venv/bin/python}
site=$("$py" -c 'import site; print(site.getsitepackages()[0])')
export FI_TCP_IFACE=lo NIXL_FABRIC_IFACE=lo NIXL_FABRIC_PROVIDER=${NIXL_FABRIC_PROVIDER:-tcp}
ours=$(NIXL_PLUGIN_DIR=$root/build/plugins timeout 300 "$py" "$root/demo/kv_demo.py" --backend LIBFABRIC | tail -1)
ucx=$(env -u NIXL_PLUGIN_DIR UCX_MODULES='^ib' timeout 300 "$py" "$root/demo/kv_demo.py" --backend UCX | tail -1 || echo '{}')
"$py" - "$ours" "$ucx" <<'PY'
import json, sys
ours, ucx = json.loads(sys.argv[1]), json.loads(sys.argv[2] or "{}")
print(f"\n{'pattern':<16} {'nixl-fabric (tcp)':>18} {'stock UCX':>12} {'ratio':>7}  verified")
ok = True
for name, r in ours["results"].items():
    u = ucx.get("results", {}).get(name, {}).get("gbps")
    ratio = f"{r['gbps'] / u:.2f}" if u else "-"
    ok &= r["verified"]
    print(f"{name:<16} {r['gbps']:>13.2f} GB/s {u or 0:>7.2f} GB/s {ratio:>7}  {'yes' if r['verified'] else 'NO'}")
print("\ndemo", "passed: every byte verified" if ok else "FAILED")
sys.exit(0 if ok else 1)
PY
