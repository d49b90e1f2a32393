#!/usr/bin/env python3
"""make_prepped_xfer alone, in a loop: the create time of the vLLM KV pattern with warm caches
(issue #23). Two agents in one process, host memory: LAYERS registrations per side of
[2, 512 blocks, 16 tokens, 8 heads, 128] bf16 (32 KiB blocks), both lists prepared once with
prep_xfer_dlist, then N times make_prepped_xfer("READ", ...) of BLOCKS random blocks per layer
(LAYERS x 2 x BLOCKS descriptors) and release_xfer_handle; the median of the creates after the
first tenth. Nothing is posted: this is the agent's and the backend's per-descriptor work
without the cold caches of a transfer in between (bench/vllm_kv.py measures that flow).

    BK=LIBFABRIC NIXL_PLUGIN_DIR=build/plugins python3 bench/create_loop.py
    BK=UCX python3 bench/create_loop.py                  (without NIXL_PLUGIN_DIR)

Environment: BK (LIBFABRIC, UCX), N creates (2000), LAYERS (8), BLOCKS (256). Pin the
interface (FI_TCP_IFACE=lo NIXL_FABRIC_IFACE=lo, UCX_NET_DEVICES=lo).
"""
import os
import random
import statistics
import time

import numpy as np

try:
    from nixl_cu13._api import nixl_agent, nixl_agent_config
except ImportError:
    from nixl_cu12._api import nixl_agent, nixl_agent_config

TOTAL_BLOCKS = 512
BLOCK = 16 * 8 * 128 * 2


def agent(name, backend, layers):
    a = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    a.create_backend(backend, {})
    bufs = [np.zeros(2 * TOTAL_BLOCKS * BLOCK, dtype=np.uint8) for _ in range(layers)]
    a.register_memory([(b.ctypes.data, b.nbytes, 0, "") for b in bufs], "DRAM")
    return a, bufs


def blocks(bufs):
    return [(b.ctypes.data + (kv * TOTAL_BLOCKS + i) * BLOCK, BLOCK, 0) for b in bufs for kv in range(2) for i in range(TOTAL_BLOCKS)]


def main():
    backend = os.environ.get("BK", "LIBFABRIC")
    n = int(os.environ.get("N", "2000"))
    layers = int(os.environ.get("LAYERS", "8"))
    count = int(os.environ.get("BLOCKS", "256"))
    a, abufs = agent("A", backend, layers)
    b, bbufs = agent("B", backend, layers)
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", blocks(abufs), "DRAM")
    remote = a.prep_xfer_dlist("B", blocks(bbufs), "DRAM")
    ids = random.Random(1).sample(range(TOTAL_BLOCKS), count)
    idx = [layer * 2 * TOTAL_BLOCKS + kv * TOTAL_BLOCKS + i for layer in range(layers) for kv in range(2) for i in ids]
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        h = a.make_prepped_xfer("READ", local, idx, remote, idx, b"n")
        times.append(time.perf_counter() - t0)
        a.release_xfer_handle(h)
    med = statistics.median(sorted(times[n // 10:]))
    print(f"{backend} {len(idx)} descs create median {med * 1e6:.1f} us  {med * 1e9 / len(idx):.1f} ns/desc")


if __name__ == "__main__":
    main()
