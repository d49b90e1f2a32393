#!/usr/bin/env python3
"""Same-host GPU transfers through the STOCK NIXL agent in two processes (issue 12).

    agent_ipc.py --backend LIBFABRIC|UCX [--quick] [--json OUT] [--dram-only] [--pinned-dram]
                 [--module nixl_cu13|nixl_cu12] [--post-ctx none|primary] [--only SUBSTR,..]
                 [--one-process] [--vmm]
    agent_ipc.py --ucx-protos LOG                 (which UCX transport each put/get used)
    agent_ipc.py --compare OURS.json UCX.json     (prints the side-by-side table)

The initiator (this process) spawns a target (this script again, --role target) and talks to
it over a socketpair (JSON lines). Each process has one stock agent (enable_prog_thread=True)
with one backend. The target allocates VRAM (cuMemAlloc on the primary context) and DRAM
(numpy), registers both, and sends its agent metadata plus serialized descriptor lists for
every case; then it makes the thread that drives its agent (its main thread, which polls
get_new_notifs) run with NO context current or with a FOREIGN context (cuCtxCreate'd, second
context on the same GPU) current; every case is verified once under each. The initiator
posts from a threading.Thread with no context current (checked with cuCtxGetCurrent before
each post); its own buffers come from the main thread under the primary context.

Cases: WRITE/READ x local/remote kinds (VRAM/VRAM, DRAM/VRAM, VRAM/DRAM, DRAM/DRAM) x one
descriptor of 4 MiB and 64 MiB, plus KV patterns VRAM/VRAM in one request: 1024x16 KiB,
4096x4 KiB, 256x256 KiB, 256x64 KiB, scattered (local blocks on even slots in order, remote
blocks on odd slots in a permuted order). Each case: two verified transfers (target context
none, then foreign), each carrying a notification; the target checks its buffer when the
notification arrives (WRITE: the data must already be there). Every byte of the touched span
(+ a guard) is checked by its owner: the destination against the expected image, the source
for being unchanged. Then a handle without notification (initialize_xfer once) is transferred
repeatedly in timed batches (median GB/s), and the destination is checked again.
Baselines without NIXL (plain ctypes): DtoD, pinned HtoD/DtoH, pageable HtoD/DtoH, 64 MiB.

With --vmm the target allocates its VRAM with the VMM API instead (cuMemCreate with the POSIX
fd handle type, 4 physical chunks of a multiple of the granularity mapped back to back into one
cuMemAddressReserve range, cuMemSetAccess read-write): PyTorch's expandable segments. Our
plugin then shares it through fds passed over a Unix socket (no legacy IPC handle exists).

With --one-process the target runs in a thread of this process instead (two agents in one
process, the same cases, checks and timing; the socketpair still carries the commands).

Prints one line per case and a final `JSON {...}` line. Exit status: 0 when every case was
exact, 1 when one was not (MISMATCH or ERROR), 2 when the harness itself failed.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
import traceback

import numpy as np

KiB, MiB = 1 << 10, 1 << 20
GUARD = 64 * KiB               # bytes after the touched span that must keep their prefill
VRAM_BYTES = 128 * MiB + GUARD  # the largest pattern spans 2 x 256 x 256 KiB
DRAM_BYTES = VRAM_BYTES
WAIT_S = float(os.environ.get("AGENT_IPC_WAIT_S", "60"))   # bound on any single wait
SINGLE_SIZES = (4 * MiB, 64 * MiB)
KV_PATTERNS = ((1024, 16 * KiB), (4096, 4 * KiB), (256, 256 * KiB), (256, 64 * KiB))
KINDS = (("VRAM", "VRAM"), ("DRAM", "VRAM"), ("VRAM", "DRAM"), ("DRAM", "DRAM"))
MODES = ("none", "foreign")    # the target's agent-driving thread: no context / foreign one


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------- CUDA (ctypes)
class Cuda:
    """The few driver entry points used here, with explicit argument types."""

    def __init__(self):
        # AGENT_IPC_CUDA_LIB: another driver library (the stand-in driver for CPU tests)
        self.lib = ctypes.CDLL(os.environ.get("AGENT_IPC_CUDA_LIB", "libcuda.so.1"))
        L, P, S, U64, I = self.lib, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int
        PP, PU64 = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint64)
        sig = {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGet": [ctypes.POINTER(I), I],
            "cuDevicePrimaryCtxRetain": [PP, I],
            "cuDevicePrimaryCtxRelease_v2": [I],
            "cuCtxSetCurrent": [P],
            "cuCtxGetCurrent": [PP],
            "cuCtxPushCurrent_v2": [P],
            "cuCtxPopCurrent_v2": [PP],
            "cuCtxSynchronize": [],
            "cuCtxDestroy_v2": [P],
            "cuMemAlloc_v2": [PU64, S],
            "cuMemFree_v2": [U64],
            "cuMemHostAlloc": [PP, S, ctypes.c_uint],
            "cuMemFreeHost": [P],
            "cuMemcpyHtoD_v2": [U64, P, S],
            "cuMemcpyDtoH_v2": [P, U64, S],
            "cuMemcpyDtoD_v2": [U64, U64, S],
            "cuDriverGetVersion": [ctypes.POINTER(I)],
        }
        for name, args in sig.items():
            f = getattr(L, name)
            f.argtypes, f.restype = args, I
        self.ck(L.cuInit(0), "cuInit")
        self.dev = I()
        self.ck(L.cuDeviceGet(ctypes.byref(self.dev), 0), "cuDeviceGet")
        self.primary = P()
        self.ck(L.cuDevicePrimaryCtxRetain(ctypes.byref(self.primary), self.dev), "cuDevicePrimaryCtxRetain")
        v = I()
        L.cuDriverGetVersion(ctypes.byref(v))
        self.driver_version = v.value

    @staticmethod
    def ck(r, what):
        if r != 0:
            raise RuntimeError(f"{what} failed with CUDA error {r}")

    def set_current(self, ctx):
        self.ck(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def current(self):
        c = ctypes.c_void_p()
        self.ck(self.lib.cuCtxGetCurrent(ctypes.byref(c)), "cuCtxGetCurrent")
        return c.value

    def push_primary(self):
        self.ck(self.lib.cuCtxPushCurrent_v2(self.primary), "cuCtxPushCurrent")

    def pop(self):
        c = ctypes.c_void_p()
        self.ck(self.lib.cuCtxPopCurrent_v2(ctypes.byref(c)), "cuCtxPopCurrent")

    def create_foreign(self):
        """A second context on device 0 (not the primary one); returns it NOT current."""
        c = ctypes.c_void_p()
        L = self.lib
        try:                                   # CUDA <= 12 spelling, still exported by 13
            f = L.cuCtxCreate_v2
            f.argtypes, f.restype = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint, ctypes.c_int], ctypes.c_int
            r = f(ctypes.byref(c), 0, self.dev)
        except AttributeError:
            f = L.cuCtxCreate_v4               # CUDA 13: (ctx, CUctxCreateParams*, flags, dev)
            f.argtypes, f.restype = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint, ctypes.c_int], ctypes.c_int
            r = f(ctypes.byref(c), None, 0, self.dev)
        self.ck(r, "cuCtxCreate")
        self.pop()                             # cuCtxCreate pushed it: take it off again
        if c.value == self.primary.value:
            raise RuntimeError("cuCtxCreate returned the primary context")
        return c

    def alloc(self, n):
        p = ctypes.c_uint64()
        self.ck(self.lib.cuMemAlloc_v2(ctypes.byref(p), n), "cuMemAlloc")
        return p.value

    def free(self, addr):
        self.lib.cuMemFree_v2(addr)

    def alloc_vmm(self, n):
        """n bytes (rounded up) of VMM memory the way PyTorch's expandable segments grow: one
        reserved range with several physical chunks (cuMemCreate, POSIX-fd exportable, of a
        multiple of the device's granularity) mapped back to back, read-write for device 0.
        Returns (address, state for free_vmm)."""
        L, S, U64, I, P = self.lib, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p
        for name, args in {
            "cuMemGetAllocationGranularity": [ctypes.POINTER(S), P, I],
            "cuMemCreate": [ctypes.POINTER(U64), S, P, U64],
            "cuMemAddressReserve": [ctypes.POINTER(U64), S, S, U64, U64],
            "cuMemMap": [U64, S, S, U64, U64],
            "cuMemSetAccess": [U64, S, P, S],
            "cuMemUnmap": [U64, S],
            "cuMemRelease": [U64],
            "cuMemAddressFree": [U64, S],
        }.items():
            f = getattr(L, name)
            f.argtypes, f.restype = args, I
        prop = VmmProp(type=1, requested_handle_types=1, loc_type=1, loc_id=self.dev.value)  # PINNED, POSIX fd, device
        g = S()
        self.ck(L.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(prop), 0), "cuMemGetAllocationGranularity")
        g = g.value
        per = -(-n // VMM_CHUNKS)                   # ceil(n / VMM_CHUNKS)
        chunk = max(g, -(-per // g) * g)           # rounded up to the granularity
        count = -(-n // chunk)
        span = chunk * count
        base = U64()
        self.ck(L.cuMemAddressReserve(ctypes.byref(base), span, g, 0, 0), "cuMemAddressReserve")
        handles = []
        for i in range(count):
            h = U64()
            self.ck(L.cuMemCreate(ctypes.byref(h), chunk, ctypes.byref(prop), 0), "cuMemCreate")
            handles.append(h.value)
            self.ck(L.cuMemMap(base.value + i * chunk, chunk, 0, h.value, 0), "cuMemMap")
        acc = VmmAccess(loc_type=1, loc_id=self.dev.value, flags=3)       # read-write
        self.ck(L.cuMemSetAccess(base.value, span, ctypes.byref(acc), 1), "cuMemSetAccess")
        print(f"harness: target VRAM is VMM memory: {count} chunks of {chunk >> 20} MiB (granularity {g >> 10} KiB) "
              f"at {base.value:#x}", flush=True)
        return base.value, (span, chunk, handles)

    def free_vmm(self, addr, state):
        span, chunk, handles = state
        for i, h in enumerate(handles):
            self.lib.cuMemUnmap(addr + i * chunk, chunk)
            self.lib.cuMemRelease(h)
        self.lib.cuMemAddressFree(addr, span)

    def htod(self, dst, host, n):
        self.ck(self.lib.cuMemcpyHtoD_v2(dst, host, n), "cuMemcpyHtoD")

    def dtoh(self, host, src, n):
        self.ck(self.lib.cuMemcpyDtoH_v2(host, src, n), "cuMemcpyDtoH")


CU: Cuda | None = None
VMM_VRAM = False      # --vmm: the target's VRAM is VMM memory (set in the target process)
VMM_CHUNKS = 4


class VmmProp(ctypes.Structure):
    """CUmemAllocationProp (LP64, 32 bytes)."""
    _fields_ = [("type", ctypes.c_int), ("requested_handle_types", ctypes.c_int), ("loc_type", ctypes.c_int),
                ("loc_id", ctypes.c_int), ("win32", ctypes.c_void_p), ("alloc_flags", ctypes.c_uint8 * 8)]


class VmmAccess(ctypes.Structure):
    """CUmemAccessDesc (12 bytes)."""
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]


class with_primary:
    """Makes the primary context current for the block and restores what was current."""

    def __enter__(self):
        CU.push_primary()

    def __exit__(self, *a):
        CU.pop()


# ----------------------------------------------------------------------------- memory
PINNED_DRAM = False   # --pinned-dram: DRAM buffers from cuMemHostAlloc instead of numpy


class Buf:
    """One registered buffer: VRAM (cuMemAlloc) or DRAM (numpy, or pinned with --pinned-dram).
    Byte I/O of a prefix."""

    def __init__(self, kind, n):
        self.kind, self.n, self.pinned = kind, n, False
        self.vmm = None
        if kind == "VRAM" and VMM_VRAM:
            with with_primary():
                self.addr, self.vmm = CU.alloc_vmm(n)
        elif kind == "VRAM":
            self.addr = CU.alloc(n)
        elif PINNED_DRAM:
            hp = ctypes.c_void_p()
            CU.ck(CU.lib.cuMemHostAlloc(ctypes.byref(hp), n, 0), "cuMemHostAlloc")
            self.addr, self.pinned = hp.value, True
            self.host = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(hp.value))
        else:
            self.host = np.zeros(n, dtype=np.uint8)
            self.addr = self.host.ctypes.data

    def write(self, data):
        n = data.nbytes
        if self.kind == "VRAM":
            with with_primary():
                CU.htod(self.addr, data.ctypes.data, n)
        else:
            self.host[:n] = data

    def read(self, n):
        if self.kind != "VRAM":
            return self.host[:n].copy()
        out = np.empty(n, dtype=np.uint8)
        with with_primary():
            CU.dtoh(out.ctypes.data, self.addr, n)
        return out

    def free(self):
        if self.vmm is not None:
            with with_primary():
                CU.free_vmm(self.addr, self.vmm)
        elif self.kind == "VRAM":
            CU.free(self.addr)
        elif self.pinned:
            self.host = None
            CU.lib.cuMemFreeHost(ctypes.c_void_p(self.addr))


def gen(seed, n):
    """n pseudo-random bytes from seed, fast: a random 1 MiB block, each MiB of the output
    XORed with a word derived from its index (every 4 KiB block of a span is distinct)."""
    words = MiB // 8
    chunks = -(-n // MiB)
    base = np.random.default_rng(seed).integers(0, 1 << 63, words, dtype=np.uint64) * np.uint64(3)
    salt = (np.arange(chunks, dtype=np.uint64) + np.uint64(seed)) * np.uint64(0x9E3779B97F4A7C15)
    out = (base[None, :] ^ salt[:, None]).reshape(-1).view(np.uint8)
    return out[:n]


class Layout:
    """Where a case's blocks lie. Single: one block at offset 0. KV: local block i on slot
    2i, remote block i on slot 2*perm[i]+1 (every other slot on both sides, orders differ)."""

    def __init__(self, nblocks, bs):
        self.nblocks, self.bs = nblocks, bs
        if nblocks == 1:
            self.lslots = self.rslots = np.zeros(1, dtype=np.int64)
            self.span = bs + GUARD
        else:
            perm = np.random.default_rng(nblocks * 7919 + bs).permutation(nblocks)
            self.lslots = 2 * np.arange(nblocks, dtype=np.int64)
            self.rslots = 2 * perm.astype(np.int64) + 1
            self.span = 2 * nblocks * bs + GUARD

    @property
    def name(self):
        return pattern_name(self.nblocks, self.bs)

    @property
    def bytes(self):
        return self.nblocks * self.bs

    def descs(self, side, base, dev=0):
        slots = self.lslots if side == "l" else self.rslots
        d = np.zeros((self.nblocks, 3), dtype=np.uint64)
        d[:, 0] = np.uint64(base) + slots.astype(np.uint64) * np.uint64(self.bs)
        d[:, 1] = self.bs
        d[:, 2] = dev
        return d

    def expected_dst(self, op, side, src_seed, dst_seed):
        """The image the destination span (owned by `side`) must hold after the transfer."""
        exp = gen(dst_seed, self.span).copy()
        src = gen(src_seed, self.span)
        # WRITE: local blocks -> remote blocks; READ: remote blocks -> local blocks
        sslots, dslots = (self.lslots, self.rslots) if op == "WRITE" else (self.rslots, self.lslots)
        assert (side == "r") == (op == "WRITE")
        bs, nb = self.bs, self.nblocks
        if nb == 1:
            exp[:bs] = src[:bs]
        else:
            ev = exp[:2 * nb * bs].reshape(2 * nb, bs)
            sv = src[:2 * nb * bs].reshape(2 * nb, bs)
            ev[dslots] = sv[sslots]
        return exp


def pattern_name(nblocks, bs):
    size = f"{bs // MiB}MiB" if bs >= MiB else f"{bs // KiB}KiB"
    return f"{nblocks}x{size}"


def compare(got, exp):
    if np.array_equal(got, exp):
        return True, ""
    bad = np.flatnonzero(got != exp)
    return False, f"{bad.size} bytes differ, first at offset {int(bad[0])}"


def case_list(dram_only):
    cases = []
    for op in ("WRITE", "READ"):
        for lk, rk in KINDS:
            if dram_only and (lk, rk) != ("DRAM", "DRAM"):
                continue
            for n in SINGLE_SIZES:
                cases.append({"op": op, "local": lk, "remote": rk, "nblocks": 1, "bs": n})
        for nb, bs in KV_PATTERNS:
            k = "DRAM" if dram_only else "VRAM"
            cases.append({"op": op, "local": k, "remote": k, "nblocks": nb, "bs": bs})
    for i, c in enumerate(cases):
        c["pattern"] = pattern_name(c["nblocks"], c["bs"])
        c["name"] = f"{c['op']} {c['local']}->{c['remote']} {c['pattern']}"
        c["key"] = f"{c['op']}|{c['local']}|{c['remote']}|{c['pattern']}"
        c["index"] = i
    return cases


def desc_key(side_kind, nblocks, bs):
    return f"{side_kind}|{pattern_name(nblocks, bs)}"


# ----------------------------------------------------------------------------- control channel
class ChanError(Exception):
    """The control channel is gone or out of step: the run cannot go on."""


class Chan:
    def __init__(self, sock: socket.socket, peer: subprocess.Popen | None = None):
        self.sock, self.buf, self.peer = sock, b"", peer

    def send(self, **kw):
        self.sock.sendall((json.dumps(kw) + "\n").encode())

    def poll_cancel(self):
        """True when a {"cmd": "cancel"} arrived (the only message sent while one is pending)."""
        r, _, _ = select.select([self.sock], [], [], 0)
        if r:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ChanError("control channel closed")
            self.buf += chunk
        if b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            return json.loads(line).get("cmd") == "cancel"
        return False

    def recv(self, timeout=WAIT_S, idle=None):
        """One message; `idle` is called between polls (the target drives its agent there)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChanError(f"no control message within {timeout:.0f} s")
            if self.peer is not None and self.peer.poll() is not None:
                raise ChanError(f"the target exited with status {self.peer.returncode}")
            r, _, _ = select.select([self.sock], [], [], min(left, 0.001 if idle else 0.2))
            if r:
                chunk = self.sock.recv(1 << 20)
                if not chunk:
                    raise ChanError("control channel closed")
                self.buf += chunk
            elif idle:
                idle()
        line, self.buf = self.buf.split(b"\n", 1)
        self.last_raw = line
        msg = json.loads(line)
        if msg.get("error"):
            raise RuntimeError(f"target: {msg['error']}")
        return msg


def register_all(agent, bufs, who):
    """Registers each buffer; a kind the backend refuses is left out (its cases report it)."""
    regs, failed = [], {}
    for k, b in bufs.items():
        try:
            regs.append(agent.register_memory([(b.addr, b.n, 0, "")], k))
        except Exception as e:
            failed[k] = f"{who} could not register {k}: {type(e).__name__}: {e}"
            log(failed[k])
    return regs, failed


def new_agent(module, name, backend):
    api = __import__(f"{module}._api", fromlist=["nixl_agent", "nixl_agent_config"])
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=True, backends=[backend]))


def pick_module(want):
    for m in ([want] if want else ["nixl_cu13", "nixl_cu12"]):
        try:
            __import__(f"{m}._api")
            return m
        except ImportError:
            continue
    raise SystemExit(f"no NIXL python module among {want or 'nixl_cu13, nixl_cu12'}")


# ----------------------------------------------------------------------------- target
class ThreadProc:
    """What the initiator needs of a Popen, for a target running in a thread (--one-process)."""

    def __init__(self, thread):
        self.thread, self.returncode = thread, None

    def poll(self):
        if self.returncode is None and not self.thread.is_alive():
            self.returncode = 0
        return self.returncode

    def wait(self, timeout=None):
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise subprocess.TimeoutExpired("target thread", timeout)
        return self.poll()

    def kill(self):
        pass   # a thread cannot be killed; the process exits with os._exit after the report


def target_main(args):
    global CU, VMM_VRAM
    VMM_VRAM = bool(getattr(args, "vmm", False))
    sock = socket.socket(fileno=args.fd)
    ch = Chan(sock)
    if not args.dram_only:
        if CU is None:
            CU = Cuda()
        CU.set_current(CU.primary)
        foreign = CU.create_foreign()
    agent = new_agent(args.module, args.name, args.backend)
    bufs = {"DRAM": Buf("DRAM", DRAM_BYTES)}
    if not args.dram_only:
        bufs["VRAM"] = Buf("VRAM", VRAM_BYTES)
    regs, failed = register_all(agent, bufs, "target")
    descs = {}
    for c in case_list(args.dram_only):
        lay = Layout(c["nblocks"], c["bs"])
        k = desc_key(c["remote"], c["nblocks"], c["bs"])
        if k not in descs and c["remote"] not in failed:
            d = agent.get_xfer_descs(lay.descs("r", bufs[c["remote"]].addr), c["remote"])
            descs[k] = agent.get_serialized_descs(d).hex()
    state = {"mode": None, "stray": []}

    def set_mode(mode):
        if CU is None or mode == state["mode"]:
            return
        CU.set_current(None if mode == "none" else foreign)
        want = None if mode == "none" else foreign.value
        if CU.current() != want:
            raise RuntimeError(f"target thread context is not {mode}")
        state["mode"] = mode

    def drain():
        for who, msgs in agent.get_new_notifs().items():
            state["stray"].extend(m.decode(errors="replace") for m in msgs)

    set_mode("none")
    ch.send(md=agent.get_agent_metadata().hex(), descs=descs, pid=os.getpid(), failed=failed,
            addrs={k: b.addr for k, b in bufs.items()})
    while True:
        try:
            req = ch.recv(timeout=900, idle=drain)
        except ChanError:
            break
        cmd = req["cmd"]
        try:
            if cmd == "exit":
                break
            if cmd == "cancel":                 # late: its transfer's reply was already sent
                continue
            if cmd == "mode":
                set_mode(req["mode"])
                ch.send(ok=True)
            elif cmd == "fill":
                lay = Layout(req["nblocks"], req["bs"])
                bufs[req["kind"]].write(gen(req["src_seed"] if req["role"] == "src" else req["dst_seed"], lay.span))
                set_mode(req["mode"])
                ch.send(ok=True)
            elif cmd in ("prep", "check"):
                lay = Layout(req["nblocks"], req["bs"])
                b = bufs[req["kind"]]
                op, role = req["op"], req["role"]          # role of this side: src or dst
                if cmd == "prep":
                    b.write(gen(req["src_seed"] if role == "src" else req["dst_seed"], lay.span))
                    set_mode(req["mode"])
                    ch.send(ok=True, ready=True)
                if role == "dst":
                    exp = lay.expected_dst(op, "r", req["src_seed"], req["dst_seed"])
                else:
                    exp = gen(req["src_seed"], lay.span)
                notif_ok, waited = None, None
                if cmd == "prep" and req.get("notif"):
                    msg = req["notif"].encode()
                    deadline = time.monotonic() + WAIT_S
                    t0 = time.monotonic()
                    while True:
                        if ch.poll_cancel():
                            raise RuntimeError("cancelled by the initiator")
                        got = agent.get_new_notifs()
                        mine = [m for who, ms in got.items() for m in ms if m == msg]
                        for who, ms in got.items():
                            state["stray"].extend(m.decode(errors="replace") for m in ms if m != msg)
                        if mine:
                            break
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"notification {req['notif']} not received in {WAIT_S:.0f} s")
                        time.sleep(0.0002)
                    waited = time.monotonic() - t0
                ok, detail = compare(b.read(lay.span), exp)   # at notification time
                notif_ok = ok if req.get("notif") else None
                ch.send(ok=True, exact=ok, detail=detail, notif_ok=notif_ok, waited_s=waited,
                        ctx=state["mode"], stray=state["stray"][-5:], nstray=len(state["stray"]))
                state["stray"].clear()
            else:
                ch.send(error=f"unknown command {cmd}")
        except ChanError:
            break
        except Exception as e:
            try:
                ch.send(error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
            except OSError:
                break
    try:
        for r in regs:
            agent.deregister_memory(r)
        if CU is not None:
            CU.set_current(CU.primary)
            for b in bufs.values():
                b.free()
    except Exception as e:
        log(f"[target] cleanup: {e}")
    sys.stdout.flush()
    if getattr(args, "in_thread", False):
        return
    os._exit(0)


# ----------------------------------------------------------------------------- baselines
def time_batches(fn, bytes_per_call, batches, min_s, max_calls=100000):
    rates = []
    for _ in range(batches):
        k, t0 = 0, time.perf_counter()
        while True:
            fn()
            k += 1
            t = time.perf_counter() - t0
            if (t >= min_s and k >= 2) or k >= max_calls:
                break
        rates.append(bytes_per_call * k / t / 1e9)
    return float(np.median(rates)), rates, k


def baselines(batches, min_s):
    n = 64 * MiB
    out = {}
    a, b = CU.alloc(n), CU.alloc(n)
    hp = ctypes.c_void_p()
    CU.ck(CU.lib.cuMemHostAlloc(ctypes.byref(hp), n, 0), "cuMemHostAlloc")
    page = np.ones(n, dtype=np.uint8)
    sync = CU.lib.cuCtxSynchronize

    def dtod():
        CU.ck(CU.lib.cuMemcpyDtoD_v2(b, a, n), "DtoD")
        CU.ck(sync(), "sync")

    tests = {
        "dtod_64MiB": dtod,
        "htod_pinned_64MiB": lambda: (CU.htod(a, hp.value, n), sync()),
        "dtoh_pinned_64MiB": lambda: (CU.dtoh(hp.value, a, n), sync()),
        "htod_pageable_64MiB": lambda: (CU.htod(a, page.ctypes.data, n), sync()),
        "dtoh_pageable_64MiB": lambda: (CU.dtoh(page.ctypes.data, a, n), sync()),
    }
    for name, fn in tests.items():
        fn()
        med, rates, _ = time_batches(fn, n, batches, min_s)
        out[name] = round(med, 2)
        log(f"baseline {name:22} {med:8.2f} GB/s   (batches {', '.join(f'{r:.1f}' for r in rates)})")
    CU.lib.cuMemFreeHost(hp)
    CU.free(a)
    CU.free(b)
    return out


# ----------------------------------------------------------------------------- initiator
def wait_done(agent, h, state, what):
    deadline = time.monotonic() + WAIT_S
    i = 0
    while state == "PROC":
        state = agent.check_xfer_state(h)
        i += 1
        if (i & 255) == 0 and time.monotonic() > deadline:
            raise RuntimeError(f"{what}: still in progress after {WAIT_S:.0f} s")
    if state != "DONE":
        raise RuntimeError(f"{what}: transfer state {state}")


def run_case(c, agent, ch, tname, bufs, rdescs, opts, seeds):
    op, lk, rk = c["op"], c["local"], c["remote"]
    lay = Layout(c["nblocks"], c["bs"])
    lb = bufs[lk]
    lrole, rrole = ("src", "dst") if op == "WRITE" else ("dst", "src")
    ld = agent.get_xfer_descs(lay.descs("l", lb.addr), lk)
    rd = agent.deserialize_descs(bytes.fromhex(rdescs[desc_key(rk, c["nblocks"], c["bs"])]))
    res = {k: c[k] for k in ("name", "key", "op", "local", "remote", "pattern", "nblocks")}
    res.update(block_bytes=c["bs"], bytes=lay.bytes, rounds=[], verified=False, gbps=None)
    handles = []
    base = {"nblocks": c["nblocks"], "bs": c["bs"], "op": op, "kind": rk, "role": rrole}

    def assert_no_ctx():
        if CU is not None and opts.post_ctx == "none" and CU.current() is not None:
            raise RuntimeError("the posting thread has a CUDA context current")

    def check_local(ss, ds):
        exp = lay.expected_dst(op, "l", ss, ds) if lrole == "dst" else gen(ss, lay.span)
        return compare(lb.read(lay.span), exp)

    try:
        # hv: the verified transfers, a notification given with each post; ht: the timed
        # handle, which never carries one (the agent keeps a post's notification in its handle)
        hv = agent.initialize_xfer(op, ld, rd, tname)
        handles.append(hv)
        ht = agent.initialize_xfer(op, ld, rd, tname)
        handles.append(ht)
        ok_all = True
        for mode in MODES if CU is not None else ("none",):
            ss, ds = next(seeds), next(seeds)
            lb.write(gen(ss if lrole == "src" else ds, lay.span))
            msg = f"ipc-{c['index']}-{mode}-{ss}"
            ch.send(cmd="prep", mode=mode, src_seed=ss, dst_seed=ds, notif=msg, **base)
            ch.recv()                                   # target filled its side: ready
            try:
                assert_no_ctx()
                t0 = time.perf_counter()
                wait_done(agent, hv, agent.transfer(hv, msg.encode()), f"{c['name']} verified ({mode})")
                lat = time.perf_counter() - t0
            except Exception:
                ch.send(cmd="cancel")                   # the target stops waiting for the notif
                try:
                    ch.recv(timeout=WAIT_S + 30)
                except RuntimeError:
                    pass
                raise
            lok, ldet = check_local(ss, ds)
            rep = ch.recv(timeout=WAIT_S + 30)          # target's check at notification time
            rnd = {"target_ctx": rep["ctx"], "local_exact": lok, "local_detail": ldet,
                   "target_exact": rep["exact"], "target_detail": rep["detail"],
                   "notif_after_data": rep["notif_ok"], "first_s": round(lat, 6),
                   "notif_wait_s": rep["waited_s"], "stray_notifs": rep["nstray"]}
            res["rounds"].append(rnd)
            ok_all &= lok and rep["exact"]
        res["verified"] = bool(ok_all)
        # timed: fresh contents (destination back to a prefill, so the timed handle has to
        # produce the image itself), the target's agent thread in one of the two modes
        tmode = MODES[c["index"] % 2] if CU is not None else "none"
        ss, ds = next(seeds), next(seeds)
        lb.write(gen(ss if lrole == "src" else ds, lay.span))
        ch.send(cmd="fill", mode=tmode, src_seed=ss, dst_seed=ds, **base)
        ch.recv()
        assert_no_ctx()
        wait_done(agent, ht, agent.transfer(ht), f"{c['name']} warm-up")

        def once():
            wait_done(agent, ht, agent.transfer(ht), f"{c['name']} timed")

        med, rates, k = time_batches(once, lay.bytes, opts.batches, opts.min_s, opts.max_calls)
        res.update(timing_target_ctx=tmode, batch_gbps=[round(r, 2) for r in rates], calls_per_batch=k)
        # after the repeats both owners check every byte again
        lok, ldet = check_local(ss, ds)
        ch.send(cmd="check", src_seed=ss, dst_seed=ds, **base)
        rep = ch.recv(timeout=WAIT_S + 30)
        pok = lok and rep["exact"]
        res["after_timing_exact"] = pok
        res["after_timing_detail"] = "; ".join(x for x in (ldet and f"local {ldet}", rep["detail"] and f"target {rep['detail']}") if x)
        res["stray_notifs_timing"] = rep["nstray"]
        res["verified"] = bool(res["verified"] and pok)
        if res["verified"]:
            res["gbps"] = round(med, 3)
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        if isinstance(e, (ChanError, OSError)):
            raise                                       # the control channel is gone or out of step
        if "REMOTE_DISCONNECT" in str(e) or "RemoteDisconnect" in type(e).__name__:
            raise ChanError(f"{c['name']}: the target is gone ({e})") from e
    finally:
        for h in handles:
            try:
                agent.release_xfer_handle(h)
            except Exception as e:
                res.setdefault("error", f"release: {e}")
    return res


def initiator_main(opts):
    global CU
    env = os.environ
    env.setdefault("FI_TCP_IFACE", "lo")
    env.setdefault("NIXL_FABRIC_IFACE", "lo")
    if opts.backend == "UCX":
        env.setdefault("UCX_MODULES", "^ib")
    module = pick_module(opts.module)
    out = {"backend": opts.backend, "module": module, "quick": opts.quick, "dram_only": opts.dram_only,
           "one_process": opts.one_process,
           "pinned_dram": PINNED_DRAM,
           "post_ctx": opts.post_ctx, "env": {k: v for k, v in env.items()
                                             if k.startswith(("NIXL_FABRIC", "UCX_", "FI_"))},
           "baselines": {}, "results": []}
    if not opts.dram_only:
        CU = Cuda()
        CU.set_current(CU.primary)
        out["driver_version"] = CU.driver_version
        out["baselines"] = baselines(opts.batches, opts.min_s)
    parent, child = socket.socketpair()
    tname, iname = f"ipc-target-{os.getpid()}", f"ipc-init-{os.getpid()}"
    cmd = [sys.executable, os.path.abspath(__file__), "--role", "target", "--fd", str(child.fileno()),
           "--name", tname, "--backend", opts.backend, "--module", module]
    if opts.dram_only:
        cmd.append("--dram-only")
    if opts.pinned_dram:
        cmd.append("--pinned-dram")
    if opts.vmm:
        cmd.append("--vmm")
    if opts.one_process:
        targs = argparse.Namespace(fd=child.detach(), name=tname, backend=opts.backend, module=module,
                                   dram_only=opts.dram_only, pinned_dram=opts.pinned_dram, vmm=opts.vmm, in_thread=True)
        th = threading.Thread(target=target_main, args=(targs,), name="target", daemon=True)
        th.start()
        proc = ThreadProc(th)
    else:
        proc = subprocess.Popen(cmd, pass_fds=[child.fileno()])
        child.close()
    ch = Chan(parent, proc)
    rc = 2
    try:
        agent = new_agent(module, iname, opts.backend)
        bufs = {"DRAM": Buf("DRAM", DRAM_BYTES)}
        if not opts.dram_only:
            bufs["VRAM"] = Buf("VRAM", VRAM_BYTES)
        regs, failed = register_all(agent, bufs, "initiator")
        hello = ch.recv(timeout=120)
        got = agent.add_remote_agent(bytes.fromhex(hello["md"]))
        got = got.decode() if isinstance(got, bytes) else got
        if got != tname:
            raise RuntimeError(f"loaded metadata of {got!r}, expected {tname!r}")
        cases = case_list(opts.dram_only)
        if opts.only:
            cases = [c for c in cases if any(s in c["name"] for s in opts.only.split(","))]
        box = {}

        def poster():
            try:
                if CU is not None:
                    cur = CU.current()
                    out["post_thread_ctx"] = "NULL" if cur is None else hex(cur)
                    if opts.post_ctx == "none" and cur is not None:
                        raise RuntimeError(f"new thread has a context current: {cur:#x}")
                    if opts.post_ctx == "primary":
                        CU.set_current(CU.primary)
                seeds = iter(range(1001, 1 << 30))
                failed.update(hello.get("failed") or {})
                for c in cases:
                    if proc.poll() is not None:
                        raise ChanError(f"the target exited with status {proc.returncode}")
                    miss = [failed[k] for k in {c["local"], c["remote"]} if k in failed]
                    if miss:
                        r = {k: c[k] for k in ("name", "key", "op", "local", "remote", "pattern", "nblocks")}
                        r.update(block_bytes=c["bs"], bytes=c["nblocks"] * c["bs"], rounds=[],
                                 verified=False, gbps=None, error="; ".join(miss))
                    else:
                        r = run_case(c, agent, ch, tname, bufs, hello["descs"], opts, seeds)
                    out["results"].append(r)
                    st = "exact" if r["verified"] else ("ERROR" if r.get("error") else "MISMATCH")
                    extra = ""
                    if not r["verified"]:
                        bad = [x for x in r["rounds"] if not (x["local_exact"] and x["target_exact"])]
                        extra = "  " + (r.get("error") or "; ".join(
                            f"ctx={x['target_ctx']}: local {x['local_detail'] or 'ok'}, target {x['target_detail'] or 'ok'}"
                            for x in bad) or r.get("after_timing_detail", ""))
                    strays = sum(x["stray_notifs"] for x in r["rounds"]) + (r.get("stray_notifs_timing") or 0)
                    if strays:
                        extra += f"  ({strays} unexpected notifications at the target)"
                    log(f"{opts.backend:9} {c['op']:5} {c['local']}->{c['remote']} {c['pattern']:>10}  "
                        f"{st:8} {r['gbps'] or 0:9.2f} GB/s{extra}")
            except BaseException as e:
                box["exc"] = e
                box["trace"] = traceback.format_exc()

        t = threading.Thread(target=poster, name="poster")
        t.start()
        t.join(timeout=opts.total_timeout)
        if t.is_alive():
            raise TimeoutError(f"cases did not finish within {opts.total_timeout:.0f} s")
        if "exc" in box:
            print(box["trace"], file=sys.stderr)
            raise box["exc"]
        rc = 0 if out["results"] and all(r["verified"] for r in out["results"]) else 1
        agent.remove_remote_agent(tname)
        for r in regs:
            agent.deregister_memory(r)
        for b in bufs.values():
            b.free()
    except BaseException as e:
        out["error"] = f"{type(e).__name__}: {e}"
        log(f"harness failure: {out['error']}")
        rc = 2
    finally:
        try:
            ch.send(cmd="exit")
        except OSError:
            pass
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        out["target_status"] = proc.returncode
    out["rc"] = rc
    line = json.dumps(out)
    log("JSON " + line)
    if opts.json:
        with open(opts.json, "w") as f:
            f.write(json.dumps(out, indent=1) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    # UCX's bundled libraries crash in exit-time destructors in these environments.
    os._exit(rc)


# ----------------------------------------------------------------------------- comparison
H2D = {("WRITE", "DRAM", "VRAM"), ("READ", "VRAM", "DRAM")}   # data moves host -> device


def load_json(p):
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        print(f"(no results in {p}: {e})")
        return {"results": [], "baselines": {}}


def compare_main(ours_p, ucx_p):
    ours, ucx = load_json(ours_p), load_json(ucx_p)
    bl = ours.get("baselines") or ucx.get("baselines") or {}
    if bl:
        print("baselines (one process, no NIXL), GB/s: " + ", ".join(f"{k} {v}" for k, v in bl.items()))
    u = {r["key"]: r for r in ucx.get("results", [])}
    if ours.get("pinned_dram") or ucx.get("pinned_dram"):
        print(f"DRAM buffers pinned (cuMemHostAlloc): ours {bool(ours.get('pinned_dram'))}, UCX {bool(ucx.get('pinned_dram'))}")
    print("case X->Y: X the initiator's (local) memory, Y the target's; WRITE moves X to Y, READ Y to X."
          f" Posting thread: ours with {ours.get('post_ctx', '?')} context current, UCX with {ucx.get('post_ctx', '?')}.")
    print(f"\n{'case':<34} {'ours GB/s':>10} {'UCX GB/s':>10} {'ours/UCX':>9} {'ours vs baseline':>38}  check")
    worst = []
    for r in ours.get("results", []):
        g, ur = r.get("gbps"), u.get(r["key"], {})
        ug = ur.get("gbps")
        ratio = f"{g / ug:.2f}x" if g and ug else "-"
        vsb = ""
        if r["local"] != r["remote"] and r["nblocks"] == 1 and r["bytes"] == 64 * MiB:
            d = "htod" if (r["op"], r["local"], r["remote"]) in H2D else "dtoh"
            pin, pag = bl.get(f"{d}_pinned_64MiB"), bl.get(f"{d}_pageable_64MiB")
            if g and pin:
                vsb = f"{g / pin:.2f}x {d} pinned" + (f" ({g / pag:.1f}x pageable)" if pag else "")
        elif r["local"] == r["remote"] == "VRAM" and r["nblocks"] == 1 and r["bytes"] == 64 * MiB:
            if g and bl.get("dtod_64MiB"):
                vsb = f"{g / bl['dtod_64MiB']:.2f}x dtod(1 proc)"
        chk = "exact" if r["verified"] else ("ERROR" if r.get("error") else "MISMATCH")
        uchk = "" if not ur else ("" if ur.get("verified") else (" UCX:" + ("ERROR" if ur.get("error") else "MISMATCH")))
        print(f"{r['name']:<34} {g or 0:>10.2f} {ug or 0:>10.2f} {ratio:>9} {vsb:>38}  {chk}{uchk}")
        if not r["verified"]:
            worst.append(r["name"])
    for k, ur in u.items():
        if ur.get("error"):
            print(f"UCX {ur['name']}: {ur['error']}")
    for r in ours.get("results", []):
        if r.get("error"):
            print(f"ours {r['name']}: {r['error']}")
    for which, d in (("ours", ours), ("UCX", ucx)):
        if d.get("error"):
            print(f"{which} harness failure: {d['error']}")
    print(f"ours: {len(ours.get('results', [])) - len(worst)}/{len(ours.get('results', []))} exact"
          + (f"; not exact: {', '.join(worst)}" if worst else ""))
    return 0


def ucx_protos_main(path):
    """Summarises UCX_PROTO_INFO=y tables in a log: which transport UCX picked for each RMA
    (put/get) between the two agents' processes (the 'intra-node' endpoint config)."""
    seen, title, rows, cur = [], [], [], None
    for raw in open(path, errors="replace"):
        line = raw.rstrip("\n")
        if "] " in line and line.lstrip().startswith("["):
            line = line.rsplit("]", 1)[1]
        line = line.strip()
        if not line.startswith("|"):
            if line.startswith("+") and cur is not None and rows:
                seen.append((cur, tuple(rows)))
                cur, rows = None, []
            continue
        cells = [x.strip() for x in line.strip("|").split("|")]
        if len(cells) == 1:
            title = (title + [cells[0]])[-2:]
            if len(title) == 2 and "remote memory" in title[1]:
                cur, rows = f"{title[0].split()[1] if len(title[0].split()) > 1 else ''} {title[1]}", []
            else:
                cur = None if "remote memory" not in cells[0] else cur
        elif len(cells) == 3 and cur is not None and cells[0] != "Range":
            rows.append(f"{cells[0]}: {cells[1]} {cells[2]}")
    out = {}
    for k, r in seen:
        out.setdefault(k, r)
    if not out:
        print("(no UCX_PROTO_INFO tables for RMA in the log)")
    for k, r in out.items():
        if "self" in k.split()[0]:
            continue
        print(f"{k}:  " + "; ".join(r))
    return 0


# ----------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="LIBFABRIC")
    ap.add_argument("--quick", action="store_true", help="shorter timing (3 batches of >= 30 ms)")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--dram-only", action="store_true", help="DRAM cases only, no CUDA (CPU hosts)")
    ap.add_argument("--pinned-dram", action="store_true", help="DRAM buffers (both sides) from cuMemHostAlloc")
    ap.add_argument("--module", default=os.environ.get("NIXL_PY_MODULE"), help="nixl_cu13 or nixl_cu12 (default: first found)")
    ap.add_argument("--post-ctx", choices=("none", "primary"), default="none",
                    help="context current on the posting thread (default none, as the issue asks)")
    ap.add_argument("--only", help="comma-separated substrings of case names to run")
    ap.add_argument("--vmm", action="store_true",
                    help="the target allocates its VRAM with the VMM API (POSIX-fd exportable chunks in one reserved range)")
    ap.add_argument("--one-process", action="store_true", help="the target is a thread of this process (two agents in one process)")
    ap.add_argument("--compare", nargs=2, metavar=("OURS", "UCX"), help="print the comparison table and exit")
    ap.add_argument("--ucx-protos", metavar="LOG", help="summarise UCX_PROTO_INFO tables of a log and exit")
    ap.add_argument("--role", default="initiator", help=argparse.SUPPRESS)
    ap.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    global PINNED_DRAM
    PINNED_DRAM = opts.pinned_dram and not opts.dram_only
    if opts.compare:
        sys.exit(compare_main(*opts.compare))
    if opts.ucx_protos:
        sys.exit(ucx_protos_main(opts.ucx_protos))
    if opts.role == "target":
        return target_main(opts)
    opts.batches = 3 if opts.quick else 5
    opts.min_s = 0.03 if opts.quick else 0.1
    opts.max_calls = 20000
    opts.total_timeout = float(os.environ.get("AGENT_IPC_TOTAL_S", "280"))
    initiator_main(opts)


if __name__ == "__main__":
    main()
