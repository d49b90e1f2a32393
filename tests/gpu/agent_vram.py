#!/usr/bin/env python3
"""VRAM through the stock NIXL agent (nixl_cu13), two agents in one process, one backend.

    agent_vram.py --backend LIBFABRIC     (NIXL_PLUGIN_DIR holding our plugin)
    agent_vram.py --backend UCX           (the wheel's own plugin directory)

Device memory comes from cuMemAlloc through ctypes (no torch on the GPU host); the agent
sees it exactly as it sees a torch tensor: (address, length, GPU ordinal) as VRAM. Every
transfer is verified byte for byte; prints one JSON line with GB/s per case.
"""
import argparse
import ctypes
import json
import os
import sys
import time

import numpy as np

cuda = ctypes.CDLL("libcuda.so.1")


def ck(r, what):
    if r != 0:
        raise RuntimeError(f"{what} failed with CUDA error {r}")


def cuda_init():
    ck(cuda.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    ck(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    ck(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ck(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


class Buf:
    def __init__(self, vram, n):
        self.vram, self.n = vram, n
        if vram:
            p = ctypes.c_uint64()
            ck(cuda.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)), "cuMemAlloc")
            self.addr = p.value
        else:
            self.host = np.zeros(n, dtype=np.uint8)
            self.addr = self.host.ctypes.data

    def write(self, data):
        if self.vram:
            ck(cuda.cuMemcpyHtoD_v2(ctypes.c_uint64(self.addr), data.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(self.n)), "HtoD")
        else:
            self.host[:] = data

    def read(self):
        if not self.vram:
            return self.host.copy()
        out = np.empty(self.n, dtype=np.uint8)
        ck(cuda.cuMemcpyDtoH_v2(out.ctypes.data_as(ctypes.c_void_p), ctypes.c_uint64(self.addr), ctypes.c_size_t(self.n)), "DtoH")
        return out

    @property
    def kind(self):
        return "VRAM" if self.vram else "DRAM"


def run(backend, sizes, iters):
    from nixl_cu13._api import nixl_agent, nixl_agent_config
    cuda_init()
    a = nixl_agent("initiator", nixl_agent_config(enable_prog_thread=True, backends=[backend]))
    b = nixl_agent("target", nixl_agent_config(enable_prog_thread=True, backends=[backend]))
    top = max(sizes)
    # One buffer of each kind on each side, all registered before the metadata exchange
    # (1.5.1 refuses loading an agent's metadata twice); cases use prefixes of them.
    bufs = {(side, v): Buf(v, top) for side in ("l", "r") for v in (True, False)}
    regs = []
    for (side, v), buf in bufs.items():
        agent = a if side == "l" else b
        regs.append((agent, agent.register_memory([(buf.addr, top, 0, "")], buf.kind)))
    a.add_remote_agent(b.get_agent_metadata())
    results = []
    rng = np.random.default_rng(7)
    for op in ("WRITE", "READ"):
        for lv, rv in ((True, True), (False, True), (True, False), (False, False)):
            loc, rem = bufs[("l", lv)], bufs[("r", rv)]
            for n in sizes:
                data = rng.integers(0, 256, top, dtype=np.uint8)
                src, dst = (loc, rem) if op == "WRITE" else (rem, loc)
                src.write(data)
                dst.write(np.zeros(top, dtype=np.uint8))
                ld = a.get_xfer_descs([(loc.addr, n, 0)], loc.kind)
                rd = a.get_xfer_descs([(rem.addr, n, 0)], rem.kind)
                t, ok, x = None, False, None
                try:
                    x = a.initialize_xfer(op, ld, rd, "target")
                    state = a.transfer(x)
                    deadline = time.time() + 60
                    while state == "PROC" and time.time() < deadline:
                        state = a.check_xfer_state(x)
                    got = dst.read()
                    ok = state == "DONE" and np.array_equal(got[:n], data[:n]) and not got[n:].any()
                    t0 = time.perf_counter()
                    for _ in range(iters(n)):
                        state = a.transfer(x)
                        while state == "PROC":
                            state = a.check_xfer_state(x)
                    t = time.perf_counter() - t0
                except Exception as e:  # a backend that cannot do this case: record it
                    print(f"{backend} {op} {loc.kind}->{rem.kind} {n}: {e}", file=sys.stderr)
                gbps = n * iters(n) / t / 1e9 if (t and ok) else None
                results.append({"op": op, "local": loc.kind, "remote": rem.kind, "bytes": n, "verified": ok, "gbps": gbps})
                print(f"{backend:10} {op:5} local {loc.kind} remote {rem.kind} {n >> 10:>6} KiB: "
                      f"{'exact' if ok else 'MISMATCH'} {gbps or 0:.2f} GB/s", flush=True)
                if x is not None:
                    a.release_xfer_handle(x)
    a.remove_remote_agent("target")
    for agent, reg in regs:
        agent.deregister_memory(reg)
    for buf in bufs.values():
        if buf.vram:
            cuda.cuMemFree_v2(ctypes.c_uint64(buf.addr))
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", required=True)
    ap.add_argument("--sizes", default="65536,1048576,16777216,67108864")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    res = run(a.backend, sizes, lambda n: 20 if n <= (1 << 20) else 5)
    print("JSON " + json.dumps({"backend": a.backend, "results": res}), flush=True)
    # UCX's bundled libraries crash in exit-time destructors in these environments (ABI
    # notes); all objects were released above.
    os._exit(0 if all(r["verified"] for r in res) else 1)


if __name__ == "__main__":
    main()
