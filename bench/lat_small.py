#!/usr/bin/env python3
"""One small transfer at a time between two processes through the stock agent: transfer()
until check_xfer_state() says DONE, N times, median and 10th percentile in microseconds.
A quick latency probe for one size and one progress mode (bench.py measures the full table).

    SZ=4096 N=20000 PROG=0 OP=WRITE BK=LIBFABRIC TAG=ours python3 bench/lat_small.py

Environment: SZ bytes (default 4096), N posts (default 20000; the first tenth is warm-up), PROG
1 or 0 (the agent's progress thread on or off, and with it the backend's), OP WRITE or READ,
BUF registered bytes per side (1 MiB), TARGET_SPIN=1 the target polls without pausing (as bench.py's
target does with progress threads off),
BK the backend (LIBFABRIC, UCX), TAG a label for the output line. Set NIXL_PLUGIN_DIR for ours
and pin the interface (FI_TCP_IFACE=lo NIXL_FABRIC_IFACE=lo). The target is a forked child that
registers BUF bytes of DRAM and polls its notifications every millisecond (or without pause,
TARGET_SPIN=1) until told to stop.
"""
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

# Registered bytes per side (BUF): 1 MiB by default; bench.py registers 64 MiB, which the kernel
# may back with transparent huge pages.
BUF = int(os.environ.get("BUF", str(1 << 20)))
# Where the buffers start within a 2 MiB frame (HUGE_OFF bytes past a 2 MiB boundary; "none":
# wherever malloc puts them). A copy's speed depends on whether its pages are huge, and where
# malloc's mapping lands depends on what each backend mapped before: an aligned start gives
# both backends the same pages.
HUGE_OFF = os.environ.get("HUGE_OFF", "0")


def buffer(fill):
    """BUF bytes of `fill`, starting HUGE_OFF bytes past a 2 MiB boundary."""
    if HUGE_OFF == "none":
        return np.full(BUF, fill, dtype=np.uint8)
    raw = np.empty(BUF + (4 << 20), dtype=np.uint8)
    start = -raw.ctypes.data % (2 << 20) + int(HUGE_OFF)
    buf = raw[start:start + BUF]
    buf[:] = fill
    return buf


def agent(name, prog):
    try:
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    a = nixl_agent(name, nixl_agent_config(enable_prog_thread=prog, backends=[]))
    a.create_backend(os.environ.get("BK", "LIBFABRIC"), {})
    return a


def target(q, done, prog):
    a = agent("lat-target", prog)
    buf = buffer(0)
    a.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    q.put((a.get_agent_metadata(), buf.ctypes.data))
    spin = os.environ.get("TARGET_SPIN", "0") == "1"
    while not done.is_set():
        a.get_new_notifs()
        if not spin:
            time.sleep(0.001)


def main():
    prog = os.environ.get("PROG", "0") == "1"
    size = int(os.environ.get("SZ", "4096"))
    n = int(os.environ.get("N", "20000"))
    op = os.environ.get("OP", "WRITE")
    mp.set_start_method("fork", force=True)
    q, done = mp.Queue(), mp.Event()
    p = mp.Process(target=target, args=(q, done, prog))
    p.start()
    md, raddr = q.get(timeout=120)  # a target that died never answers
    a = agent("lat-initiator", prog)
    buf = buffer(1)
    a.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    a.add_remote_agent(md)
    h = a.initialize_xfer(op, a.get_xfer_descs([(buf.ctypes.data, size, 0)], "DRAM"),
                          a.get_xfer_descs([(raddr, size, 0)], "DRAM"), "lat-target")
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        st = a.transfer(h)
        while st == "PROC":
            st = a.check_xfer_state(h)
        lat.append(time.perf_counter() - t0)
        if st != "DONE":
            raise RuntimeError(f"transfer ended {st}")
    lat = sorted(lat[n // 10:])
    print(f"{os.environ.get('TAG', '')} {op} {size} prog={int(prog)} median {statistics.median(lat) * 1e6:.2f} us"
          f"  p10 {lat[len(lat) // 10] * 1e6:.2f}")
    a.release_xfer_handle(h)
    done.set()
    p.join()


if __name__ == "__main__":
    main()
