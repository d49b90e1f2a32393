#!/usr/bin/env bash
# Runs the benchmark (make bench calls this). Arguments go to bench/bench.py:
#   bench/run.sh [--quick | --gpu-host] [--configs LABEL,...|default|dram|all]
#                [--plugin PATH/TO/libplugin.so] [--out DIR] [--budget SECONDS]
#   (labels: ours-tcp, ours-tcp-r2/r4/r8, ours-shm, ours-tcp-default, ours-1p, ucx, ucx-tcp,
#    ucx-1p, stock-libfabric; bench.py --help)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PY:-$root/.venv/bin/python}
# Loopback only (bench.py sets these again for every child; UCX_MODULES=^ib keeps UCX processes
# from segfaulting at exit in this environment).
export FI_TCP_IFACE=lo FI_SOCKETS_IFACE=lo NIXL_FABRIC_IFACE=lo UCX_NET_DEVICES=lo UCX_MODULES='^ib'
exec "$py" "$root/bench/bench.py" "$@"
