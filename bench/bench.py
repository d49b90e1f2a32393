#!/usr/bin/env python3
"""make bench: nixl-fabric next to stock UCX and the stock LIBFABRIC plugin, all driven by the
stock NIXL agent (Python API of nixl-cu12 here, nixl-cu13 on the GPU host: the first of
$NIXL_PY_MODULE / --module, nixl_cu13, nixl_cu12 that imports) in two processes on one host.

    bench.py [--out DIR] [--logdir DIR] [--quick | --gpu-host] [--plugin SO] [--module M]
             [--budget SECONDS] [--configs LABEL,...|default|dram|all]

Configurations (CONFIGS below; `--configs default` is what `make bench` runs, `dram` is the
GPU host's DRAM set, `all` everything):
  ours-tcp            provider tcp on lo, one rail, same-host shm rail off (data really over tcp)
  ours-tcp-r2/r4/r8   the same with backend parameter rails=2/4/8 (striped over 2-8 endpoints)
  ours-shm            provider shm
  ours-tcp-default    provider tcp as shipped: same-host peers go over the extra shm rail
  ours-1p             ours-tcp-default with both agents in ONE process (direct copies)
  ucx                 the wheel's UCX as shipped (UCX_NET_DEVICES=lo)
  ucx-tcp             UCX with UCX_TLS=tcp,self (no shared-memory transport: the tcp anchor)
  ucx-1p              ucx with both agents in one process
  stock-libfabric     the wheel's LIBFABRIC plugin (NIXL_PLUGIN_DIR unset)
Our configurations run with NIXL_FABRIC_LOG=info; the connect lines of the per-process logs
say which same-host path was taken (shm rail or tcp rails, CMA reachable or not, direct copies
in one process) and are reported per configuration.

The orchestrator (this process, no NIXL agent) measures the baselines (single-thread memcpy,
raw loopback TCP between two processes with 1 stream, and with 1/2/4/8 parallel streams, one
sender and one receiver process per stream), then for each backend configuration
  1. probes in a throw-away process whether the backend can be created (NIXL_LOG_LEVEL=DEBUG,
     so a plugin that fails to load leaves its dlopen error in the log), and
  2. starts an initiator process, which starts its target process (or, one-process
     configurations, a target thread). The target sends its metadata and buffer address over
     its stdout pipe; afterwards the pipe pair (initiator -> target stdin, target stdout ->
     initiator) carries ZERO/FILL/CRC/QUIT commands, so the control path never goes through
     the backend being measured.
Each backend gets its own processes: NIXL_PLUGIN_DIR is read once per process.

Every bandwidth point: prepare one handle (local block i -> remote block blocks-1-i, so a
backend that mixes descriptors up fails the check), warm up, clear the destination, time
`iters` posts (transfer() until check_xfer_state() says DONE; median), then compare a CRC-32
of the whole destination with the expected one. Only the timed posts can have produced the
checked bytes. "DONE" is the initiator's view; for nixl-fabric DONE means delivered.

The 8-byte latency point times single posts (post -> DONE, ~2000 of them; median, p99); the
CPU point times transfer() alone on the prepared WRITE 4096 x 4 KiB handle (calling thread's
CPU time and wall time, median, per descriptor). Every point is bounded in posts and seconds
(POLICY) so a pathological backend cannot stretch the run; such points are marked "*".
--budget bounds the whole run: a configuration that would start too late is skipped, and
each one is killed (its finished points kept) when the budget runs out.

Prints a table of GB/s and one of ratios, writes DIR/<YYYY-MM-DD>.json and .png (if
matplotlib is there). Exit status 1 if a loaded backend returned wrong bytes or one of our
configurations failed; a stock backend that cannot be loaded is reported, not failed.
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import re
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import zlib

import numpy as np

KiB, MiB = 1 << 10, 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# bench/bench.py of a checkout, else the copy in the GPU bundle (.gpu/bench.py)
IN_REPO = os.path.basename(HERE) == "bench" and os.path.isfile(os.path.join(ROOT, "Cargo.toml"))
SPAN = 64 * MiB                      # registered buffer per side (largest point)
SINGLE = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB]
KV = [(4096, 4 * KiB), (1024, 16 * KiB), (256, 256 * KiB)]
OPS = ["WRITE", "READ"]
CPU_BLOCKS = 4096                    # transfer() CPU time is measured on WRITE 4096 x 4 KiB
XFER_TIMEOUT_S = 30.0                # one post that takes longer than this aborts the config
STREAMS = [1, 2, 4, 8]               # raw TCP baselines with this many parallel streams
# Registered buffers start on a 2 MiB boundary. Where malloc's mapping of a 64 MiB array lands
# depends on what the process mapped before (each backend maps its own), and a copy from or to
# a range that lies before the mapping's first whole 2 MiB frame runs on 4 KiB pages: the same
# 64 KiB process_vm_writev took 5.3 us there and 4.3 us on huge pages (2-core VM, 2026-12-06),
# which made one backend look faster than the other by where its buffers fell.
HUGE = 2 * MiB

# Iteration policy per profile: enough posts per point for a median, bounded in bytes and in
# seconds so a slow backend cannot stretch the run. Small points take up to max_iters posts
# (a 4 KiB post is microseconds: the median of 50 moved by 10 % between runs of the same
# build). idle_s: idle-CPU measurement of one engine (issue: "measure idle CPU for 10 s");
# config_s: bound on one configuration's processes.
POLICY = {"byte_budget": 256 * MiB, "min_iters": 5, "max_iters": 1000, "max_point_s": 3.0,
          "warmup": 2, "lat_iters": 2000, "lat_warmup": 100,
          "memcpy_runs": 10, "tcp_runs": 5, "idle_s": 10.0, "config_s": 300}
QUICK = {"byte_budget": 32 * MiB, "min_iters": 3, "max_iters": 200, "max_point_s": 1.0,
         "warmup": 1, "lat_iters": 300, "lat_warmup": 20,
         "memcpy_runs": 4, "tcp_runs": 2, "idle_s": 3.0, "config_s": 150}
# The GPU host (16 cores): every point of every DRAM configuration within ~7 minutes.
GPUHOST = {"byte_budget": 128 * MiB, "min_iters": 5, "max_iters": 1000, "max_point_s": 1.0,
           "warmup": 2, "lat_iters": 1000, "lat_warmup": 50,
           "memcpy_runs": 10, "tcp_runs": 5, "idle_s": 3.0, "config_s": 90}
PROFILES = {"full": POLICY, "quick": QUICK, "gpu-host": GPUHOST}
IDLE_S = POLICY["idle_s"]


def aligned_zeros(n):
    """n zero bytes starting on a HUGE boundary, every page touched."""
    raw = np.zeros(n + 2 * HUGE, dtype=np.uint8)
    start = -raw.ctypes.data % HUGE
    raw[:] = 0
    return raw[start:start + n]


def ours_tcp(rails):
    # Data over tcp;ofi_rxm on lo: the same-host shm rail (on by default) is switched off, else
    # a peer on this host would be served by shm and this would not measure tcp. Rails are a
    # backend parameter (createBackend's map), iface and provider too.
    return {"backend": "LIBFABRIC", "kind": "ours", "limit": f"tcp:{rails}", "rails": rails,
            "env": {"NIXL_PLUGIN_DIR": "@plugins", "NIXL_FABRIC_PROVIDER": "tcp",
                    "NIXL_FABRIC_SAME_HOST_SHM": "false"},
            "params": {"provider": "tcp", "iface": "lo", "same_host_shm": "false",
                       "rails": str(rails)},
            "title": "nf tcp" + (f" r{rails}" if rails > 1 else ""),
            "short": "tcp" if rails == 1 else f"r{rails}"}


# backend; kind (ours/stock); environment changes ("@plugins": the private copy of our plugin,
# None: unset); backend parameters; physical limit for its fractions ("memcpy", "tcp:N" = raw
# TCP with N streams); one_process: both agents in one process.
CONFIGS = {
    "ours-tcp": ours_tcp(1),
    "ours-tcp-r2": ours_tcp(2),
    "ours-tcp-r4": ours_tcp(4),
    "ours-tcp-r8": ours_tcp(8),
    # shm is not a network provider: iface=lo names no shm domain and backend creation fails
    # ("provider shm has no domain matching iface 'lo'"), so the iface is left unset here.
    "ours-shm": {"backend": "LIBFABRIC", "kind": "ours", "limit": "memcpy",
                 "env": {"NIXL_PLUGIN_DIR": "@plugins", "NIXL_FABRIC_PROVIDER": "shm",
                         "NIXL_FABRIC_IFACE": None},
                 "title": "nf shm", "short": "shm"},
    # What a user gets with provider tcp: same-host peers go over the extra shm rail.
    "ours-tcp-default": {"backend": "LIBFABRIC", "kind": "ours", "limit": "memcpy",
                         "env": {"NIXL_PLUGIN_DIR": "@plugins", "NIXL_FABRIC_PROVIDER": "tcp",
                                 "NIXL_FABRIC_SAME_HOST_SHM": None},
                         "title": "nf default", "short": "dflt"},
    # The same with both agents in one process (engines of one process copy directly).
    "ours-1p": {"backend": "LIBFABRIC", "kind": "ours", "limit": "memcpy", "one_process": True,
                "env": {"NIXL_PLUGIN_DIR": "@plugins", "NIXL_FABRIC_PROVIDER": "tcp",
                        "NIXL_FABRIC_SAME_HOST_SHM": None},
                "title": "nf dflt 1proc", "short": "1p"},
    # UCX_LOG_LEVEL=info makes UCX log the transports it picked (reported).
    "ucx": {"backend": "UCX", "kind": "stock", "limit": "memcpy",
            "env": {"NIXL_PLUGIN_DIR": None, "UCX_LOG_LEVEL": "info"},
            "title": "stock UCX", "short": "UCX"},
    # The tcp anchor: no shared-memory transport (cma, sysv, posix), so UCX moves the data
    # over tcp/lo like ours-tcp. self is UCX's loopback for a worker's own endpoint and
    # carries nothing between the two agents; with UCX_NET_DEVICES=lo and UCX_MODULES=^ib
    # UCX_TLS=tcp alone also created and transferred here (nixl-cu12 1.5.1, UCX 1.23).
    "ucx-tcp": {"backend": "UCX", "kind": "stock", "limit": "tcp:1",
                "env": {"NIXL_PLUGIN_DIR": None, "UCX_LOG_LEVEL": "info",
                        "UCX_TLS": "tcp,self"},
                # tried in turn when the backend cannot be created (a CUDA build of UCX may
                # want its memory-type transport; neither moves host memory between processes)
                "alternatives": [{"UCX_TLS": "tcp,self,cuda_copy"}, {"UCX_TLS": "tcp"}],
                "title": "UCX tcp", "short": "UCXt"},
    "ucx-1p": {"backend": "UCX", "kind": "stock", "limit": "memcpy", "one_process": True,
               "env": {"NIXL_PLUGIN_DIR": None, "UCX_LOG_LEVEL": "info"},
               "title": "UCX 1proc", "short": "UCX1p"},
    # Progress threads off (the C++ API's default), as the two above.
    "ours-dflt-np": {"backend": "LIBFABRIC", "kind": "ours", "limit": "memcpy",
                     "env": {"NIXL_PLUGIN_DIR": "@plugins", "NIXL_FABRIC_PROVIDER": "tcp",
                             "NIXL_FABRIC_SAME_HOST_SHM": None, "BENCH_PROG_THREAD": "0"},
                     "title": "nf default, no progress thread", "short": "dfltNP"},
    "ucx-np": {"backend": "UCX", "kind": "stock", "limit": "memcpy",
               "env": {"NIXL_PLUGIN_DIR": None, "UCX_LOG_LEVEL": "info", "BENCH_PROG_THREAD": "0"},
               "title": "stock UCX, no progress thread", "short": "UCXnp"},
    # NIXL_PLUGIN_DIR unset: LIBFABRIC is the wheel's own plugin.
    "stock-libfabric": {"backend": "LIBFABRIC", "kind": "stock", "limit": "tcp:1",
                        "env": {"NIXL_PLUGIN_DIR": None},
                        "title": "stock LIBFABRIC", "short": "stLF"},
}
GROUPS = {
    "default": ["ours-tcp", "ours-shm", "ours-tcp-default", "ucx", "stock-libfabric"],
    # most important first: --budget skips from the end
    "dram": ["ours-tcp", "ucx-tcp", "ours-tcp-default", "ucx", "ours-1p", "ucx-1p", "ours-dflt-np", "ucx-np",
             "ours-tcp-r2", "ours-tcp-r4", "ours-tcp-r8", "ours-shm", "stock-libfabric"],
    "all": list(CONFIGS),
}
TITLES = {k: v["title"] for k, v in CONFIGS.items()}
SHORT = {k: v["short"] for k, v in CONFIGS.items()}
OURS = tuple(k for k, v in CONFIGS.items() if v["kind"] == "ours")
STOCK = tuple(k for k, v in CONFIGS.items() if v["kind"] == "stock")
# Ratio columns: (numerator, denominator); a denominator "tcp:N" is raw TCP with N streams.
RATIOS = ([(f"ours-tcp{'' if k == 1 else f'-r{k}'}", "ucx-tcp") for k in STREAMS]
          + [(f"ours-tcp{'' if k == 1 else f'-r{k}'}", f"tcp:{k}") for k in STREAMS]
          + [("ours-tcp-default", "ucx"), ("ours-dflt-np", "ucx-np"), ("ours-1p", "ucx-1p"), ("ours-shm", "ucx"),
             ("ours-tcp", "stock-libfabric")])


def base_env():
    env = dict(os.environ)
    # Loopback only: libfabric tcp/sockets, our rails, UCX's network devices.
    env.update(FI_TCP_IFACE="lo", FI_SOCKETS_IFACE="lo", NIXL_FABRIC_IFACE="lo",
               UCX_NET_DEVICES="lo",
               # Keeps UCX's InfiniBand module (and the bundled libnl-route-3 it pulls in,
               # which segfaults in exit-time destructors here) from loading.
               UCX_MODULES="^ib",
               OPENBLAS_NUM_THREADS="1")  # numpy's idle BLAS threads: fewer threads on 2 cores
    env.pop("NIXL_LOG_LEVEL", None)
    env.pop("UCX_TLS", None)
    return env


def num(v):
    """2 decimals from 1 up, else 3 significant digits (0.00238, not 0.00)."""
    return f"{v:.2f}" if abs(v) >= 1 else f"{v:.3g}"


def fmt_size(n):
    for unit, div in (("MiB", MiB), ("KiB", KiB)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def point_key(op, blocks, size):
    return f"{op} {blocks} x {fmt_size(size)}"


def say(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def log(msg):
    sys.stderr.write(f"[bench] {msg}\n")
    sys.stderr.flush()


def crc(a):
    return zlib.crc32(np.ascontiguousarray(a))


def reversed_blocks(a, blocks, size):
    return a[: blocks * size].reshape(blocks, size)[::-1]


# ---------------------------------------------------------------------------------------------
# NIXL processes

def pick_module(want=None):
    """The stock agent's Python module: nixl_cu13 on the GPU host, nixl_cu12 here."""
    want = want or os.environ.get("NIXL_PY_MODULE")
    for m in ([want] if want else ["nixl_cu13", "nixl_cu12"]):
        try:
            __import__(f"{m}._api")
            return m
        except ImportError:
            continue
    raise SystemExit(f"no NIXL python module among {want or 'nixl_cu13, nixl_cu12'} "
                     f"(PYTHONPATH={os.environ.get('PYTHONPATH', '')})")


def make_agent(name, backend):
    api = __import__(f"{pick_module()}._api", fromlist=["nixl_agent", "nixl_agent_config"])
    # No backend in the config (the constructor would only warn about a missing plugin);
    # create_backend raises when the plugin cannot be loaded or created.
    # BENCH_PROG_THREAD=0: the C++ API's default (no agent progress thread; the backend
    # is told enableProgTh=false, so ours runs no progress thread and progresses in checks).
    prog = os.environ.get("BENCH_PROG_THREAD", "1") != "0"
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=prog, backends=[]))
    params = json.loads(os.environ.get("BENCH_BACKEND_PARAMS") or "{}")
    agent.create_backend(backend, params)
    return agent


def finish(backend, rc):
    sys.stdout.flush()
    sys.stderr.flush()
    # A process that loaded the wheel's UCX plugin can still segfault in exit-time
    # destructors (bundled libnl-route-3, _dl_fini; ABI notes 9.1) even though everything was
    # torn down above; skip them for UCX only. Our plugin must exit normally.
    if backend == "UCX":
        os._exit(rc)
    return rc


def role_probe(backend):
    mod = pick_module()
    m = __import__(mod)
    plugdir = os.path.join(os.path.dirname(m.__file__), "..", f".{mod}.mesonpy.libs", "plugins")
    say(f"PLUGDIR {os.path.realpath(plugdir)}")
    say(f"MODULE {mod}")
    try:
        agent = make_agent("bench-probe", backend)
        del agent
        say("PROBE ok")
    except Exception as e:  # noqa: BLE001 - reported, not handled
        say(f"PROBE fail {type(e).__name__}: {e}")
    return finish(backend, 0)


def role_idle(backend, policy):
    """One agent with a registered region and nothing to do: the CPU time its process
    spends over idle_s seconds (progress threads included)."""
    import resource
    agent = make_agent("bench-idle", backend)
    buf = np.zeros(64 * MiB, dtype=np.uint8)
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    time.sleep(1.0)
    secs = policy["idle_s"]
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    time.sleep(secs)
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    say("IDLE " + json.dumps({"seconds": round(t1 - t0, 2), "cpu_s": round(cpu, 4),
                              "cpu_pct": round(100 * cpu / (t1 - t0), 3)}))
    agent.deregister_memory(reg)
    del agent
    return finish(backend, 0)


def target_lines(agent, fin):
    """The command lines from fin. With progress threads off (BENCH_PROG_THREAD=0) nothing
    progresses the target unless it calls into the agent, as a C++ application waiting for
    notifications does: it polls get_new_notifs() until a command arrives."""
    if os.environ.get("BENCH_PROG_THREAD", "1") != "0":
        yield from fin
        return
    import select
    while True:
        while not select.select([fin], [], [], 0)[0]:
            agent.get_new_notifs()
        line = fin.readline()
        if not line:
            return
        yield line


def serve_target(backend, fin, fout):
    """The target's side: an agent with one registered SPAN, driven by commands read from
    fin; replies (tagged lines) go to fout. A process (stdin/stdout) or a thread (pipes)."""
    def emit(line):
        fout.write(line + "\n")
        fout.flush()
    agent = make_agent("bench-target", backend)
    buf = aligned_zeros(SPAN)
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    src = np.random.default_rng(2).integers(0, 256, SPAN + 4 * KiB, dtype=np.uint8)
    emit(f"META {agent.get_agent_metadata().hex()} {buf.ctypes.data}")
    for line in target_lines(agent, fin):  # EOF (initiator gone) ends the target too
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "QUIT":
            break
        if cmd[0] == "ZERO":
            buf[: int(cmd[1])] = 0
            emit("OK")
        elif cmd[0] == "CRC":
            emit(f"CRC {crc(buf[: int(cmd[1])])}")
        elif cmd[0] == "FILL":  # content for a READ; reply: CRC the initiator must end up with
            seed, blocks, size = (int(x) for x in cmd[1:4])
            n = blocks * size
            off = seed % (4 * KiB)
            buf[:n] = src[off: off + n]
            emit(f"CRC {crc(reversed_blocks(buf, blocks, size))}")
    agent.deregister_memory(reg)
    del agent


def role_target(backend):
    serve_target(backend, sys.stdin, sys.stdout)
    return finish(backend, 0)


class ThreadTarget:
    """The target as a thread of the initiator's process (two agents in one process), with
    the Popen surface the Initiator uses: stdin, stdout, wait()."""

    def __init__(self, backend):
        r1, w1 = os.pipe()   # initiator -> target
        r2, w2 = os.pipe()   # target -> initiator
        self.stdin = os.fdopen(w1, "w", buffering=1)
        self.stdout = os.fdopen(r2, "r")
        self._fin, self._fout = os.fdopen(r1, "r"), os.fdopen(w2, "w", buffering=1)
        self.rc = None
        self.thread = threading.Thread(target=self._main, args=(backend,), name="target",
                                       daemon=True)
        self.thread.start()

    def _main(self, backend):
        try:
            serve_target(backend, self._fin, self._fout)
            self.rc = 0
        except Exception as e:  # noqa: BLE001 - reported through the pipe's EOF and the log
            log(f"target thread: {type(e).__name__}: {e}")
            self.rc = 1
        finally:
            self._fout.close()

    def wait(self, timeout=None):
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise subprocess.TimeoutExpired("target thread", timeout)
        return self.rc


class Initiator:
    def __init__(self, backend, policy, one_process=False):
        self.backend, self.p = backend, policy
        if one_process:
            self.child = ThreadTarget(backend)
        else:
            self.child = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--role", "target",
                 "--backend", backend],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        meta_hex, addr = self.hear("META").split()
        self.rbase = int(addr)
        self.agent = make_agent("bench-init", backend)
        self.loc = aligned_zeros(SPAN)
        self.reg = self.agent.register_memory([(self.loc.ctypes.data, SPAN, 0, "")], "DRAM")
        self.src = np.random.default_rng(1).integers(0, 256, SPAN + 4 * KiB, dtype=np.uint8)
        self.agent.add_remote_agent(bytes.fromhex(meta_hex))
        self.seed = 0

    # control pipe ------------------------------------------------------------------------
    def hear(self, tag):
        for line in self.child.stdout:  # the agent may print too; our lines carry a tag
            word, _, rest = line.rstrip("\n").partition(" ")
            if word == tag:
                return rest.strip()
        raise RuntimeError(f"target exited before sending {tag} (rc {self.child.wait()})")

    def ctl(self, cmd, tag):
        self.child.stdin.write(cmd + "\n")
        self.child.stdin.flush()
        return self.hear(tag)

    # transfers ---------------------------------------------------------------------------
    def handle(self, op, blocks, size):
        a, lb, rb = self.agent, self.loc.ctypes.data, self.rbase
        local = a.get_xfer_descs([(lb + i * size, size, 0) for i in range(blocks)], "DRAM")
        remote = a.get_xfer_descs([(rb + (blocks - 1 - i) * size, size, 0) for i in range(blocks)],
                                  "DRAM")
        return a.initialize_xfer(op, local, remote, "bench-target")

    def run(self, h, cpu=False):
        """One post until DONE; returns (seconds until DONE, seconds inside transfer(), CPU
        seconds of this thread inside transfer() or None)."""
        a = self.agent
        if cpu:
            c0 = time.thread_time()
            t0 = time.perf_counter()
            st = a.transfer(h)
            t1 = time.perf_counter()
            c = time.thread_time() - c0
        else:
            c = None
            t0 = time.perf_counter()
            st = a.transfer(h)
            t1 = time.perf_counter()
        deadline = t0 + XFER_TIMEOUT_S
        while st == "PROC":
            st = a.check_xfer_state(h)
            if st == "PROC" and time.perf_counter() > deadline:
                raise TimeoutError(f"transfer not DONE after {XFER_TIMEOUT_S:.0f} s")
        t2 = time.perf_counter()
        if st != "DONE":
            raise RuntimeError(f"transfer state {st}")
        return t2 - t0, t1 - t0, c

    def prepare_data(self, op, blocks, size):
        """Fill the source, clear nothing yet; returns the CRC the destination must end with."""
        self.seed += 1
        n = blocks * size
        if op == "WRITE":
            off = (self.seed * 977) % (4 * KiB)
            self.loc[:n] = self.src[off: off + n]
            return crc(reversed_blocks(self.loc, blocks, size))
        return int(self.ctl(f"FILL {self.seed} {blocks} {size}", "CRC"))

    def clear_dest(self, op, n):
        if op == "WRITE":
            self.ctl(f"ZERO {n}", "OK")
        else:
            self.loc[:n] = 0

    def dest_crc(self, op, n):
        return int(self.ctl(f"CRC {n}", "CRC")) if op == "WRITE" else crc(self.loc[:n])

    def bandwidth(self, op, blocks, size, cpu=False):
        """One point. With cpu, also the calling thread's CPU time inside transfer()."""
        p, n, cap = self.p, blocks * size, self.p["max_point_s"]
        iters = max(p["min_iters"], min(p["max_iters"], p["byte_budget"] // n))
        h = self.handle(op, blocks, size)
        want = self.prepare_data(op, blocks, size)
        t_start = time.perf_counter()
        for _ in range(p["warmup"]):  # a slow first post is warm-up enough
            self.run(h)
            if time.perf_counter() - t_start > cap / 4:
                break
        self.clear_dest(op, n)
        times, posts, cpus = [], [], []
        t_start = time.perf_counter()
        while len(times) < iters:
            el = time.perf_counter() - t_start
            # at least 3 posts in `cap` seconds, and never more than 2 * cap unless one post
            # alone takes longer (then that one is the figure, marked by iters < min_iters)
            if times and (el > 2 * cap or (len(times) >= 3 and el > cap)):
                break
            t, tp, c = self.run(h, cpu)
            times.append(t)
            posts.append(tp)
            cpus.append(c)
        got = self.dest_crc(op, n)
        self.agent.release_xfer_handle(h)
        med = statistics.median(times)
        r = {"op": op, "blocks": blocks, "size": size, "bytes": n, "iters": len(times),
             "capped": len(times) < p["min_iters"],
             "median_s": med, "gbps": n / med / 1e9, "best_gbps": n / min(times) / 1e9,
             "post_us_median": statistics.median(posts) * 1e6, "verified": got == want}
        if cpu:
            r["post_cpu_us_median"] = statistics.median(cpus) * 1e6
        return r

    def latency(self):
        p = self.p
        h = self.handle("WRITE", 1, 8)
        want = self.prepare_data("WRITE", 1, 8)
        t_start = time.perf_counter()
        for _ in range(p["lat_warmup"]):
            self.run(h)
            if time.perf_counter() - t_start > p["max_point_s"] / 4:
                break
        self.clear_dest("WRITE", 8)
        lat, t_end = [], time.perf_counter() + 4 * p["max_point_s"]  # ~2000 posts unless slow
        while len(lat) < p["lat_iters"] and (len(lat) < 100 or time.perf_counter() < t_end):
            lat.append(self.run(h)[0])
        lat.sort()
        got = self.dest_crc("WRITE", 8)
        self.agent.release_xfer_handle(h)
        return {"op": "WRITE", "bytes": 8, "iters": len(lat),
                "median_us": statistics.median(lat) * 1e6,
                "p99_us": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e6,
                "min_us": lat[0] * 1e6, "verified": got == want}

    def close(self):
        self.agent.remove_remote_agent("bench-target")
        self.child.stdin.write("QUIT\n")
        self.child.stdin.flush()
        rc = self.child.wait(timeout=60)
        self.agent.deregister_memory(self.reg)
        del self.agent
        return rc


def points_to_run():
    """Every point in the table's order, or those BENCH_POINTS names (comma-separated point
    keys as the table prints them, e.g. "WRITE 1 x 4 KiB,READ 1 x 4 KiB"), in its order."""
    every = all_points()
    only = os.environ.get("BENCH_POINTS")
    if not only:
        return every
    return [p for w in only.split(",") for p in every if point_key(*p) == w.strip()]


def role_initiator(backend, policy, one_process):
    ini = Initiator(backend, policy, one_process)
    try:
        for op, blocks, size in points_to_run():
            log(f"{backend}: {point_key(op, blocks, size)}")
            # CPU time of transfer() is taken on the prepared 4096-descriptor WRITE handle
            cpu = (op, blocks) == ("WRITE", CPU_BLOCKS)
            r = ini.bandwidth(op, blocks, size, cpu=cpu)
            say("POINT " + json.dumps(r))
            log(f"{backend}: {point_key(op, blocks, size)}: median {r['median_s'] * 1e6:.2f} us")
            if cpu:
                say("CPU " + json.dumps({
                    "op": op, "blocks": blocks, "size": size, "iters": r["iters"],
                    "cpu_ns_per_desc": r["post_cpu_us_median"] * 1e3 / blocks,
                    "wall_ns_per_desc": r["post_us_median"] * 1e3 / blocks,
                    "verified": r["verified"]}))
        log(f"{backend}: latency")
        say("LATENCY " + json.dumps(ini.latency()))
    except Exception as e:  # noqa: BLE001
        # A stuck or failed transfer: report and leave without cleanup (releasing an in-flight
        # handle could block); the target sees EOF on its stdin and exits.
        say("ERROR " + json.dumps(f"{type(e).__name__}: {e}"))
        sys.stdout.flush()
        os._exit(1)
    rc = ini.close()
    say(f"TARGETRC {rc}")
    return finish(backend, 0 if rc == 0 else 1)


# ---------------------------------------------------------------------------------------------
# Baselines

def memcpy_baseline(p):
    a = np.random.default_rng(3).integers(0, 256, SPAN, dtype=np.uint8)
    b = np.empty_like(a)
    for _ in range(2):
        np.copyto(b, a)
    ts = []
    for _ in range(p["memcpy_runs"]):
        t0 = time.perf_counter()
        np.copyto(b, a)
        ts.append(time.perf_counter() - t0)
    assert crc(a) == crc(b)
    med = statistics.median(ts)
    return {"bytes": SPAN, "runs": len(ts), "median_s": med, "gbps": SPAN / med / 1e9}


def recv_exact(sock, view):
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:], min(len(view) - got, 4 * MiB))
        if k == 0:
            raise ConnectionError("peer closed")
        got += k


SOCKBUF = int(os.environ.get("BENCH_TCP_SOCKBUF", 8 * MiB))  # 0: leave autotuning alone


def tune_socket(s):
    """Large socket buffers where the kernel lets us (SO_*BUFFORCE needs CAP_NET_ADMIN; plain
    SO_*BUF is capped by net.core.[rw]mem_max, and a cap below the autotuning maximum would
    make things worse, so then autotuning is left alone). Returns what was done."""
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    how = "autotuned"
    if SOCKBUF <= 0:
        return f"autotuned: snd {s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)}"
    for force, plain in ((33, socket.SO_RCVBUF), (32, socket.SO_SNDBUF)):  # SO_*BUFFORCE
        try:
            s.setsockopt(socket.SOL_SOCKET, force, SOCKBUF)
            how = "forced"
        except OSError:
            try:
                lim = int(open("/proc/sys/net/core/" + ("rmem_max" if plain == socket.SO_RCVBUF
                                                        else "wmem_max")).read())
            except (OSError, ValueError):
                lim = 0
            if lim >= SOCKBUF:
                s.setsockopt(socket.SOL_SOCKET, plain, SOCKBUF)
                how = "set"
    return (f"{how}: snd {s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)} "
            f"rcv {s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)}")


def role_tcp_sink(nbytes):
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    say(f"PORT {ls.getsockname()[1]}")
    s, _ = ls.accept()
    tune_socket(s)
    buf = bytearray(nbytes)
    hdr = bytearray(9)
    while True:
        recv_exact(s, memoryview(hdr))
        cmd, n = hdr[:1], struct.unpack("<Q", hdr[1:])[0]
        if cmd == b"B":    # bulk: receive n bytes, ack at once, then send their CRC (untimed)
            recv_exact(s, memoryview(buf)[:n])
            s.sendall(b"A")
            s.sendall(struct.pack("<I", zlib.crc32(memoryview(buf)[:n])))
        elif cmd == b"P":  # ping-pong n times, 8 bytes each way
            m = memoryview(bytearray(8))
            for _ in range(n):
                recv_exact(s, m)
                s.sendall(m)
        else:
            break
    s.close()
    return 0


def start_sink(nbytes):
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "tcp-sink",
                              "--bytes", str(nbytes)], stdout=subprocess.PIPE, text=True)
    line = child.stdout.readline().split()
    if len(line) != 2 or line[0] != "PORT":
        child.kill()
        raise RuntimeError(f"tcp sink did not start: {line}")
    return child, int(line[1])


def bulk(s, data, ack):
    """One timed bulk send (until the receiver's 1-byte ack); returns (t0, t1, crc ok)."""
    t0 = time.perf_counter()
    s.sendall(b"B" + struct.pack("<Q", len(data)))
    s.sendall(data)
    recv_exact(s, ack[:1])
    t1 = time.perf_counter()
    recv_exact(s, ack)
    return t0, t1, struct.unpack("<I", ack)[0] == zlib.crc32(data)


def tcp_baseline(p):
    """Raw loopback TCP between two processes: 64 MiB per run (until the receiver's ack), and
    an 8-byte ping-pong round trip (the latency a delivered write needs at least)."""
    child, port = start_sink(SPAN)
    try:
        s = socket.create_connection(("127.0.0.1", port))
        sockbuf = tune_socket(s)
        data = memoryview(np.random.default_rng(4).integers(0, 256, SPAN, dtype=np.uint8))
        ack = memoryview(bytearray(4))
        ts, ok = [], True
        for i in range(p["tcp_runs"] + 1):
            t0, t1, good = bulk(s, data, ack)
            if i:  # first run is warm-up
                ts.append(t1 - t0)
            ok &= good
        n = p["lat_iters"]
        s.sendall(b"P" + struct.pack("<Q", n + 50))
        m, lat = memoryview(bytearray(8)), []
        for i in range(n + 50):
            t0 = time.perf_counter()
            s.sendall(m)
            recv_exact(s, m)
            if i >= 50:
                lat.append(time.perf_counter() - t0)
        s.sendall(b"Q" + struct.pack("<Q", 0))
        s.close()
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    lat.sort()
    med = statistics.median(ts)
    return {"bytes": SPAN, "runs": len(ts), "median_s": med, "gbps": SPAN / med / 1e9,
            "verified": ok, "rtt_median_us": statistics.median(lat) * 1e6,
            "rtt_p99_us": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e6,
            "sockbuf": sockbuf}


def role_tcp_src(port, nbytes):
    """One stream of the parallel-stream baseline: connect, then one bulk send of nbytes per
    GO line on stdin, answering `T t0 t1 ok` (perf_counter is CLOCK_MONOTONIC: comparable
    between the processes)."""
    s = socket.create_connection(("127.0.0.1", port))
    sockbuf = tune_socket(s)
    data = memoryview(np.random.default_rng(5 + port).integers(0, 256, nbytes, dtype=np.uint8))
    ack = memoryview(bytearray(4))
    say(f"READY {sockbuf}")
    for line in sys.stdin:
        if line.strip() != "GO":
            break
        t0, t1, ok = bulk(s, data, ack)
        say(f"T {t0!r} {t1!r} {int(ok)}")
    s.sendall(b"Q" + struct.pack("<Q", 0))
    s.close()
    return 0


def tcp_streams_baseline(p, n):
    """n parallel loopback TCP streams, one sender and one receiver process per stream (no
    GIL in common): each run sends SPAN / n bytes on every stream at once; the figure is
    SPAN / (last ack - first send) over the runs' median."""
    each = SPAN // n
    procs, ok, ts, sockbuf = [], True, [], ""
    try:
        for _ in range(n):
            sink, port = start_sink(each)
            procs.append(sink)
            src = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "tcp-src",
                                    "--port", str(port), "--bytes", str(each)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                   bufsize=1)
            procs.append(src)
        srcs = procs[1::2]
        for s in srcs:
            line = s.stdout.readline()
            if not line.startswith("READY"):
                raise RuntimeError(f"tcp stream sender did not start: {line!r}")
            sockbuf = line.split(" ", 1)[1].strip()
        for i in range(p["tcp_runs"] + 1):
            for s in srcs:
                s.stdin.write("GO\n")
                s.stdin.flush()
            t0s, t1s = [], []
            for s in srcs:
                _, a, b, good = s.stdout.readline().split()
                t0s.append(float(a))
                t1s.append(float(b))
                ok &= good == "1"
            if i:
                ts.append(max(t1s) - min(t0s))
        for s in srcs:
            s.stdin.close()
        for c in procs:
            c.wait(timeout=30)
    finally:
        for c in procs:
            if c.poll() is None:
                c.kill()
    med = statistics.median(ts)
    return {"streams": n, "bytes": each * n, "bytes_per_stream": each, "runs": len(ts),
            "median_s": med, "gbps": each * n / med / 1e9, "best_gbps": each * n / min(ts) / 1e9,
            "verified": ok, "sockbuf": sockbuf}


# ---------------------------------------------------------------------------------------------
# Orchestrator

def run_child(args, env, timeout, logf):
    """Run one of our child processes in its own process group; returns (rc, stdout)."""
    proc = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=logf, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group we created: initiator and its target
        out, _ = proc.communicate()
        return "timeout", out


def ldd_problems(path):
    try:
        out = subprocess.run(["ldd", path], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"ldd failed: {e}"]
    probs = []
    for line in (out.stdout + out.stderr).splitlines():
        line = line.strip()
        m = re.match(r"(\S+) => not found", line)
        if m:
            probs.append(f"{m.group(1)} not found")
        m = re.search(r"(\S+): version `([^']+)' not found", line)
        if m:
            probs.append(f"{os.path.basename(m.group(1))} lacks {m.group(2)}")
    return sorted(set(probs))


def probe(label, env, logdir, timeout=120):
    backend = CONFIGS[label]["backend"]
    env = dict(env, NIXL_LOG_LEVEL="DEBUG")
    logpath = os.path.join(logdir, f"{label}.probe.log")
    with open(logpath, "w") as logf:
        rc, out = run_child([sys.executable, os.path.abspath(__file__), "--role", "probe",
                             "--backend", backend], env, timeout, logf)
    res = dict(re.findall(r"^(PROBE|PLUGDIR) (.*)$", out, re.M))
    if res.get("PROBE") == "ok":
        return None
    text = open(logpath, errors="replace").read()
    m = re.findall(r"Failed to load plugin from (\S+): (.*)", text)
    if m:
        path, why = m[0]
        reason = why.strip()
        extra = [x for x in ldd_problems(path) if x.split()[0] not in reason]
        if extra:
            reason += " (ldd: " + "; ".join(extra) + ")"
        return "not loadable: " + reason
    if "PROBE" in res:
        # Loaded, but createBackend failed: our plugin says why in an error line.
        why = [ln.split("] ", 1)[-1] for ln in text.splitlines() if "[nixl-fabric E" in ln]
        return ("backend creation failed: " + res["PROBE"][len("fail "):]
                + (" (" + "; ".join(why[:2]) + ")" if why else ""))
    return f"probe process ended with rc {rc}; see {logpath}"


RAIL_RE = re.compile(r"(bench-\w+): rail (\d+): provider (\S+) domain (\S+)")
PEER_RE = re.compile(r"(bench-\w+): agent '([^']+)' (is on this host|is remote) via rail pairs "
                     r"(\[[^\]]*\])(?:, its memory (reachable|not reachable) by CMA)?")
SAMEPROC_RE = re.compile(r"(bench-\w+): agent '([^']+)' is an engine of this process")


def same_host_path(text):
    """Which path our plugin took between the bench's agents, from their NIXL_FABRIC_LOG=info
    connect lines: rails (provider per rail), rail pairs, CMA reachability, direct copies."""
    rails = {}
    for owner, idx, prov, dom in RAIL_RE.findall(text):
        rails.setdefault(owner, {})[int(idx)] = f"{prov}/{dom}"
    seen, out = set(), []
    for owner, peer, where, pairs, cma in PEER_RE.findall(text):
        if (owner, peer) in seen or owner == "bench-probe":
            continue
        seen.add((owner, peer))
        try:
            used = sorted({int(a) for a, _ in re.findall(r"\((\d+), (\d+)\)", pairs)})
        except ValueError:
            used = []
        provs = sorted({rails.get(owner, {}).get(i, "?").split("/")[0] for i in used})
        out.append({"agent": owner, "peer": peer, "same_host": where == "is on this host",
                    "rail_pairs": pairs, "providers": provs,
                    "cma": None if not cma else cma == "reachable",
                    "same_process": False})
    for owner, peer in SAMEPROC_RE.findall(text):
        for e in out:
            if (e["agent"], e["peer"]) == (owner, peer):
                e["same_process"] = True
    return out


def describe_path(entries):
    if not entries:
        return "no connect line in the log (NIXL_FABRIC_LOG=info)"
    parts = []
    for e in entries:
        if e["same_process"]:
            how = "engines of one process: direct copies"
        else:
            how = "+".join(e["providers"]) + " rails " + e["rail_pairs"]
        if e["same_host"]:
            how += ", CMA " + ("reachable" if e["cma"] else "NOT reachable")
        else:
            how += ", not same host"
        parts.append(f"{e['agent'].replace('bench-', '')}->{e['peer'].replace('bench-', '')}: "
                     + how)
    return "; ".join(parts)


def config_env(label, plugdir, alt=None):
    c = CONFIGS[label]
    env = base_env()
    changes = {k: (plugdir if v == "@plugins" else v) for k, v in c["env"].items()}
    changes.update(alt or {})
    if c["kind"] == "ours":
        changes["NIXL_FABRIC_LOG"] = "info"   # connect lines: which same-host path was taken
    for k, v in changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    env["BENCH_BACKEND_PARAMS"] = json.dumps(c.get("params", {}))
    return env, changes


def run_config(label, profile, policy, logdir, plugdir, timeout):
    c = CONFIGS[label]
    backend, limit = c["backend"], c["limit"]
    env, changes = config_env(label, plugdir)
    res = {"label": label, "title": TITLES[label], "backend": backend, "limit": limit,
           "env": changes, "params": c.get("params", {}),
           "one_process": bool(c.get("one_process")), "points": {},
           "loadavg_before": os.getloadavg()}
    why = probe(label, env, logdir, timeout=min(120, max(10, timeout)))
    for alt in c.get("alternatives", []) if why else []:
        log(f"{TITLES[label]}: {why}; trying {alt}")
        res.setdefault("probe_failures", []).append({"env": changes, "error": why})
        env, changes = config_env(label, plugdir, alt)
        res["env"] = changes
        why = probe(label, env, logdir, timeout=min(120, max(10, timeout)))
        if not why:
            break
    if why:
        res["error"] = why
        return res
    logpath = os.path.join(logdir, f"{label}.log")
    t0 = time.time()
    args = [sys.executable, os.path.abspath(__file__), "--role", "initiator", "--backend", backend,
            "--profile", profile]
    if c.get("one_process"):
        args.append("--one-process")
    with open(logpath, "w") as logf:
        rc, out = run_child(args, env, timeout, logf)
    res["seconds"] = round(time.time() - t0, 1)
    res["loadavg_after"] = os.getloadavg()
    for tag, body in re.findall(r"^(POINT|LATENCY|CPU|ERROR|TARGETRC) (.*)$", out, re.M):
        if tag == "POINT":
            pt = json.loads(body)
            res["points"][point_key(pt["op"], pt["blocks"], pt["size"])] = pt
        elif tag == "LATENCY":
            res["latency"] = json.loads(body)
        elif tag == "CPU":
            res["cpu"] = json.loads(body)
        elif tag == "ERROR":
            res["error"] = json.loads(body)
        else:
            res["target_rc"] = int(body)
    logtext = open(logpath, errors="replace").read()
    if rc != 0 and "error" not in res:
        tail = logtext.strip().splitlines()[-3:]
        res["error"] = (f"killed after {timeout:.0f} s (time budget)" if rc == "timeout"
                        else f"initiator rc {rc}") + ": " + " | ".join(tail)
    if res.get("target_rc", 0) != 0:
        res.setdefault("error", f"target rc {res['target_rc']}")
    if c["kind"] == "ours":
        res["same_host_path"] = same_host_path(logtext)
        res["same_host_path_text"] = describe_path(res["same_host_path"])
    if "error" not in res and not c.get("one_process") and policy["idle_s"] > 0:
        args = [sys.executable, os.path.abspath(__file__), "--role", "idle", "--backend", backend,
                "--profile", profile]
        with open(os.path.join(logdir, f"{label}.idle.log"), "w") as logf:
            _, iout = run_child(args, env, policy["idle_s"] + 60, logf)
        m = re.search(r"^IDLE (.*)$", iout, re.M)
        if m:
            res["idle"] = json.loads(m.group(1))
    if backend == "UCX":  # which UCX transports carried it (UCX_LOG_LEVEL=info; logs to stdout)
        cfg = re.findall(r"(?:intra|inter)-node cfg#\d+ (.*)", out + logtext)
        if cfg:
            res["ucx_transports"] = cfg[0].strip()
    return res


def all_points():
    """(op, blocks, size) of every point, in the table's order."""
    return [(op, b, s) for op in OPS for b, s in [(1, s) for s in SINGLE] + KV]


def point_order():
    return [point_key(*p) for p in all_points()]


def all_verified(r):
    vals = [p["verified"] for p in r["points"].values()]
    vals += [r[k]["verified"] for k in ("latency", "cpu") if k in r]
    return all(vals)


def limit_gbps(base, limit):
    """The physical limit a configuration's fractions refer to."""
    if limit == "memcpy":
        return base["memcpy"]["gbps"]
    if limit.startswith("tcp:"):
        st = base.get("tcp_streams", {}).get(limit[4:])
        if st:
            return st["gbps"]
    return base["tcp"]["gbps"]   # "tcp" (older JSON) or no stream figure


def ratio_den(report, den):
    """A ratio's denominator: a configuration label, or "tcp:N" (raw TCP with N streams)."""
    if den.startswith("tcp:"):
        return report["baselines"].get("tcp_streams", {}).get(den[4:])
    return report["configs"].get(den)


def ratio_title(num_, den):
    d = f"TCP{den[4:]}" if den.startswith("tcp:") else SHORT.get(den, den)
    return f"{SHORT.get(num_, num_)}/{d}"


def print_table(report):
    base, cfgs = report["baselines"], report["configs"]
    loaded = [c for c in cfgs if cfgs[c]["points"]]
    ratios = [(n, d) for n, d in RATIOS if n in loaded
              and (d.startswith("tcp:") and ratio_den(report, d) or d in loaded)]
    if not any(d == "ucx-tcp" for _, d in ratios):   # old default set: ours vs each stock one
        ratios += [(o, s) for o in OURS for s in STOCK if o in loaded and s in loaded
                   and (o, s) not in ratios]
    w, rw = 10, 10
    streams = base.get("tcp_streams", {})
    lines = ["", f"memcpy (1 thread, 64 MiB): {base['memcpy']['gbps']:.2f} GB/s   raw loopback "
             f"TCP (64 MiB, 2 processes): {base['tcp']['gbps']:.2f} GB/s   TCP 8 B round trip: "
             f"{base['tcp']['rtt_median_us']:.1f} us median, {base['tcp']['rtt_p99_us']:.1f} us p99"]
    if streams:
        lines.append("raw loopback TCP, 64 MiB over N parallel streams (one process per end "
                     "and stream): " + ", ".join(f"{k}: {v['gbps']:.2f}" for k, v in streams.items())
                     + " GB/s")
    lines += ["bandwidth in GB/s (median); * = fewer posts than the minimum", ""]
    head = f"{'point':<22}" + "".join(f"{SHORT[c]:>{w}}" for c in loaded) + "  check"
    lines += [head, "-" * len(head)]
    rhead = f"{'point':<22}" + "".join(f"{ratio_title(n, d):>{rw}}" for n, d in ratios)
    rlines = ["", "ratios (higher is better for bandwidth; for the latency and ns/desc rows lower "
              "is better); TCPn = raw loopback TCP with n streams", "", rhead, "-" * len(rhead)]

    def rows(name, vals, fmt, capped=(), check=""):
        s = f"{name:<22}"
        for c in loaded:
            v = vals.get(c)
            s += f"{'-':>{w}}" if v is None else f"{fmt(v) + ('*' if c in capped else ' '):>{w}}"
        lines.append(s + check)
        r = f"{name:<22}"
        for n, d in ratios:
            a = vals.get(n)
            b = vals.get(d) if not d.startswith("tcp:") else (
                ratio_den(report, d)["gbps"] if name.startswith(("WRITE", "READ")) else None)
            r += f"{num(a / b):>{rw}}" if a and b else f"{'-':>{rw}}"
        rlines.append(r)

    for key in point_order():
        vals, bad, capped = {}, [], set()
        for c in loaded:
            p = cfgs[c]["points"].get(key)
            if p:
                vals[c] = p["gbps"]
                if p.get("capped"):
                    capped.add(c)
                if not p["verified"]:
                    bad.append(TITLES[c])
        rows(key, vals, num, capped, "  ok" if not bad else "  WRONG BYTES: " + ", ".join(bad))
    for what, field in (("8 B WRITE lat med us", "median_us"), ("8 B WRITE lat p99 us", "p99_us")):
        vals = {c: cfgs[c]["latency"][field] for c in loaded if "latency" in cfgs[c]}
        ok = all(cfgs[c]["latency"]["verified"] for c in vals)
        rows(what, vals, lambda v: f"{v:.1f}", check="  ok" if ok else "  WRONG")
    for what, field in (("post 4096: CPU ns/desc", "cpu_ns_per_desc"),
                        ("post 4096: wall ns/desc", "wall_ns_per_desc")):
        vals = {c: cfgs[c]["cpu"][field] for c in loaded if "cpu" in cfgs[c]}
        ok = all(cfgs[c]["cpu"]["verified"] for c in vals)
        rows(what, vals, lambda v: f"{v:.0f}", check="  ok" if ok else "  WRONG")
    if ratios:
        lines += rlines
    lines.append("")
    lines.append("columns: " + ", ".join(f"{SHORT[c]} = {TITLES[c]}" for c in cfgs)
                 + ". post 4096 rows: transfer() alone on the prepared WRITE 4096 x 4 KiB handle "
                 "(CPU = calling thread's CPU time).")
    for c, r in cfgs.items():
        if r.get("same_host_path_text"):
            lines.append(f"same-host path, {TITLES[c]}: {r['same_host_path_text']}")
    if "ptrace_scope" in report:
        lines.append(f"kernel.yama.ptrace_scope: {report['ptrace_scope']}")
    for c, r in cfgs.items():
        if r.get("ucx_transports"):
            tls = (r.get("env") or {}).get("UCX_TLS") or "default"
            lines.append(f"{TITLES[c]} transports (UCX_TLS={tls}): {r['ucx_transports']}")
    for c, r in cfgs.items():
        if r.get("error"):
            lines.append(f"{TITLES[c]}: {r['error']}")
    return "\n".join(lines)


def plot(report, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no PNG (make bench installs it)")
        return False
    cfgs, base = report["configs"], report["baselines"]
    streams = base.get("tcp_streams", {})
    railed = [c for c in cfgs if CONFIGS.get(c, {}).get("rails") and cfgs[c]["points"]]
    extra = bool(streams or len(railed) > 1)
    fig, axes = plt.subplots(3 if extra else 2, 2, figsize=(13, 14 if extra else 9))
    for col, op in enumerate(OPS):
        for row, (title, xs, keyf) in enumerate((
                (f"{op}, one descriptor", SINGLE, lambda s: point_key(op, 1, s)),
                (f"{op}, KV batch (16-64 MiB per request)", [s for _, s in KV],
                 lambda s: point_key(op, dict((sz, b) for b, sz in KV)[s], s)))):
            ax = axes[row][col]
            for c, r in cfgs.items():
                pts = [(x, r["points"][keyf(x)]["gbps"]) for x in xs if keyf(x) in r["points"]]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                            label=TITLES.get(c, c), ls="--" if c in STOCK else "-")
            ax.axhline(base["memcpy"]["gbps"], ls="--", color="gray", label="memcpy (1 thread)")
            ax.axhline(base["tcp"]["gbps"], ls=":", color="black", label="raw loopback TCP")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(xs, [fmt_size(x) for x in xs])
            ax.set_xlabel("descriptor size" if row == 0 else "block size (blocks x size)")
            ax.set_ylabel("GB/s (median)")
            ax.set_title(title)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    if extra:  # rails against parallel TCP streams, per op, at 64 MiB and 1024 x 16 KiB
        for col, op in enumerate(OPS):
            ax = axes[2][col]
            for key in (point_key(op, 1, 64 * MiB), point_key(op, 1024, 16 * KiB)):
                pts = [(CONFIGS[c]["rails"], cfgs[c]["points"][key]["gbps"]) for c in railed
                       if key in cfgs[c]["points"]]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                            label=f"nf tcp, {key[len(op) + 1:]}")
                if "ucx-tcp" in cfgs and key in cfgs["ucx-tcp"]["points"]:
                    ax.axhline(cfgs["ucx-tcp"]["points"][key]["gbps"], ls="--", lw=1,
                               color=ax.lines[-1].get_color() if pts else None,
                               label=f"UCX tcp, {key[len(op) + 1:]}")
            if streams:
                ks = sorted(int(k) for k in streams)
                ax.plot(ks, [streams[str(k)]["gbps"] for k in ks], marker="s", color="black",
                        ls=":", label="raw TCP, 64 MiB over N streams")
            ax.set_xscale("log", base=2)
            ax.set_xticks(STREAMS, [str(k) for k in STREAMS])
            ax.set_xlabel("rails (ours) / parallel streams (raw TCP)")
            ax.set_ylabel("GB/s (median)")
            ax.set_title(f"{op}: tcp rails vs parallel TCP streams")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"nixl-fabric vs stock NIXL backends, DRAM, two processes on {report['host']} "
                 f"({report['date']}; {report['nproc']} cores; {report.get('profile', '')})")
    fig.tight_layout()
    fig.savefig(path + ".tmp", dpi=100, format="png")  # *.tmp is git-ignored
    os.replace(path + ".tmp", path)
    return True


def private_plugin(src, logdir):
    """Copy our plugin into a directory of our own: `make build` elsewhere rewrites
    build/plugins/libplugin_LIBFABRIC.so in place (cp -f), and a process that has the old file
    mapped then dies of SIGBUS. Returns (facts about the copy, directory for NIXL_PLUGIN_DIR)."""
    import hashlib
    plugdir = os.path.join(logdir, "plugins")
    os.makedirs(plugdir, exist_ok=True)
    dst = os.path.join(plugdir, "libplugin_LIBFABRIC.so")
    data = open(src, "rb").read()
    with open(dst + ".tmp", "wb") as f:
        f.write(data)
    os.chmod(dst + ".tmp", 0o755)
    os.replace(dst + ".tmp", dst)  # rename: a process still mapping the old copy keeps it
    st = os.stat(src)
    return ({"source": os.path.abspath(src), "sha256": hashlib.sha256(data).hexdigest(),
             "bytes": len(data), "mtime": datetime.datetime.fromtimestamp(st.st_mtime)
             .isoformat(timespec="seconds")}, plugdir)


def git_rev():
    """HEAD of the checkout; in the GPU bundle, the GIT_REV file `make gpu-bundle` wrote."""
    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip() if IN_REPO else ""
    except (OSError, subprocess.TimeoutExpired):
        rev = ""
    if not rev:
        try:
            rev = open(os.path.join(HERE, "GIT_REV")).read().strip()
        except OSError:
            pass
    return rev


def read_text(path):
    try:
        return open(path).read().strip()
    except OSError:
        return None


def expand_configs(spec):
    labels = []
    for c in spec.split(","):
        for x in GROUPS.get(c, [c]):
            if x not in CONFIGS:
                sys.exit(f"unknown config {x}; known: {','.join(CONFIGS)} or a group: "
                         f"{','.join(GROUPS)}")
            if x not in labels:
                labels.append(x)
    return labels


def orchestrate(a):
    profile = a.profile
    policy = PROFILES[profile]
    labels = expand_configs(a.configs)
    os.makedirs(a.out, exist_ok=True)
    logdir = a.logdir or (os.path.join(ROOT, "build", "bench") if IN_REPO
                          else os.path.join(a.out, "logs"))
    os.makedirs(logdir, exist_ok=True)
    # the private copy of the plugin: beside the logs in a checkout; elsewhere (GPU bundle,
    # logs under $OUT) in /tmp, so that it does not travel back with the results
    plugin, plugdir = private_plugin(a.plugin, logdir if IN_REPO else os.path.join(
        "/tmp", f"nixl-bench-{os.getuid()}"))
    module = pick_module(a.module)
    os.environ["NIXL_PY_MODULE"] = module   # every child uses the same module
    t0 = time.time()
    deadline = t0 + a.budget if a.budget else None
    date = datetime.date.today().isoformat()
    report = {"date": date, "started": datetime.datetime.now().isoformat(timespec="seconds"),
              "host": socket.gethostname(), "nproc": os.cpu_count(), "git_rev": git_rev(),
              "plugin": plugin, "nixl_module": module, "python": sys.version.split()[0],
              "quick": profile == "quick", "profile": profile, "policy": policy,
              "budget_s": a.budget, "loadavg_start": os.getloadavg(),
              "ptrace_scope": read_text("/proc/sys/kernel/yama/ptrace_scope"),
              "kernel": os.uname().release,
              "baselines": {}, "configs": {}}
    try:
        from importlib.metadata import version
        report["nixl_version"] = version(module.replace("_", "-"))
    except Exception:  # noqa: BLE001
        pass
    log(f"module {module}, profile {profile}, configs {','.join(labels)}, logs in {logdir}")
    log("baseline: memcpy")
    report["baselines"]["memcpy"] = memcpy_baseline(policy)
    log("baseline: raw loopback TCP")
    report["baselines"]["tcp"] = tcp_baseline(policy)
    if not a.no_streams:
        report["baselines"]["tcp_streams"] = {}
        for n in STREAMS:
            log(f"baseline: raw loopback TCP, {n} parallel streams")
            try:
                report["baselines"]["tcp_streams"][str(n)] = tcp_streams_baseline(policy, n)
            except Exception as e:  # noqa: BLE001 - reported; the configurations still run
                log(f"  failed: {type(e).__name__}: {e}")
    for i, c in enumerate(labels):
        timeout = policy["config_s"]
        if deadline:
            left = deadline - time.time() - 5
            if left < min(30, timeout):
                report["configs"][c] = {"label": c, "title": TITLES[c], "points": {},
                                        "backend": CONFIGS[c]["backend"],
                                        "limit": CONFIGS[c]["limit"],
                                        "skipped": True, "error": "skipped: time budget spent"}
                log(f"{TITLES[c]}: skipped (time budget)")
                continue
            # share what is left among the configurations still to run, not below 30 s
            timeout = min(timeout, max(30, left / (len(labels) - i) * 2), left)
        log(f"{TITLES[c]} ...")
        r = run_config(c, profile, policy, logdir, plugdir, timeout)
        report["configs"][c] = r
        log(f"{TITLES[c]}: " + (r.get("error") or f"{len(r['points'])} points, {r.get('seconds')} s")
            + (f" [{r['same_host_path_text']}]" if r.get("same_host_path_text") else ""))
    report["seconds"] = round(time.time() - t0, 1)
    table = print_table(report)
    idle = [f"{TITLES[c]} {r['idle']['cpu_s'] * 1000:.1f} ms ({r['idle']['cpu_pct']:.2f} %)"
            for c, r in report["configs"].items() if r.get("idle")]
    if idle:
        secs = next(r["idle"]["seconds"] for r in report["configs"].values() if r.get("idle"))
        table += f"\nidle CPU of one engine (agent + 64 MiB registered, {secs:.0f} s): " + ", ".join(idle)
    print(table)
    report["table"] = table
    out_json = os.path.join(a.out, f"{date}{a.suffix}.json")
    with open(out_json + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(out_json + ".tmp", out_json)
    png = os.path.join(a.out, f"{date}{a.suffix}.png")
    try:
        made = plot(report, png)
    except Exception as e:  # noqa: BLE001 - the JSON is written; a plot bug must not fail the run
        log(f"plot failed: {type(e).__name__}: {e}")
        made = False
    if not made and os.environ.get("PYTHONPATH"):
        # The GPU host's system matplotlib may be built against the system numpy, not the
        # bundle's (PYTHONPATH): plot from the JSON in a process without PYTHONPATH.
        env = dict(os.environ)
        env.pop("PYTHONPATH")
        try:
            made = subprocess.run([sys.executable, os.path.abspath(__file__), "--plot", out_json,
                                   "--out", png], env=env, timeout=120).returncode == 0
        except (OSError, subprocess.TimeoutExpired) as e:
            log(f"plot without PYTHONPATH failed: {e}")
    print(f"\nwrote {out_json}" + (f" and {png}" if made else "") + f" in {report['seconds']} s; "
          f"logs in {logdir}")
    failed = []
    for c, r in report["configs"].items():
        if r["points"] and not all_verified(r):
            failed.append(f"{TITLES[c]} returned wrong bytes")
        if c in OURS and r.get("error") and not r.get("skipped"):
            failed.append(f"{TITLES[c]}: {r['error']}")
    if not report["baselines"]["tcp"]["verified"]:
        failed.append("raw TCP baseline returned wrong bytes")
    for n, st in report["baselines"].get("tcp_streams", {}).items():
        if not st["verified"]:
            failed.append(f"raw TCP baseline ({n} streams) returned wrong bytes")
    for f in failed:
        print("bench FAILED:", f)
    return 1 if failed else 0


def main():
    # kill -USR1 <pid> prints every thread's Python stack into the log (hang diagnosis).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", default="orchestrate",
                    choices=["orchestrate", "initiator", "target", "probe", "tcp-sink", "tcp-src",
                             "idle"])
    ap.add_argument("--backend")
    ap.add_argument("--quick", action="store_true", help="few iterations (smoke run)")
    ap.add_argument("--gpu-host", action="store_true",
                    help="the GPU host's profile: every DRAM configuration in ~7 minutes")
    ap.add_argument("--profile", choices=list(PROFILES), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results"),
                    help="where the JSON and PNG go")
    ap.add_argument("--suffix", default="", help="appended to the date in the file names")
    ap.add_argument("--logdir", help="per-process logs (default: build/bench in the repository, "
                    "OUT/logs elsewhere)")
    ap.add_argument("--configs", default="default",
                    help=f"labels or groups ({', '.join(f'{k}' for k in GROUPS)}); "
                         f"labels: {','.join(CONFIGS)}")
    ap.add_argument("--module", help="nixl_cu13 or nixl_cu12 (default: $NIXL_PY_MODULE, else "
                    "the first that imports)")
    ap.add_argument("--budget", type=float, default=0,
                    help="seconds for the whole run (configurations past it are skipped)")
    ap.add_argument("--no-streams", action="store_true", help="no parallel-stream TCP baselines")
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG (--out FILE) of a report")
    ap.add_argument("--one-process", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, default=SPAN, help=argparse.SUPPRESS)
    ap.add_argument("--plugin", default=os.path.join(ROOT, "build", "plugins",
                                                     "libplugin_LIBFABRIC.so"),
                    help="our plugin (copied privately before the run)")
    a = ap.parse_args()
    if not a.profile:
        a.profile = "quick" if a.quick else "gpu-host" if a.gpu_host else "full"
    policy = PROFILES[a.profile]
    if a.plot:
        png = a.out if a.out.endswith(".png") else os.path.splitext(a.plot)[0] + ".png"
        return 0 if plot(json.load(open(a.plot)), png) else 1
    if a.role == "initiator":
        return role_initiator(a.backend, policy, a.one_process)
    if a.role == "target":
        return role_target(a.backend)
    if a.role == "probe":
        return role_probe(a.backend)
    if a.role == "tcp-sink":
        return role_tcp_sink(a.bytes)
    if a.role == "tcp-src":
        return role_tcp_src(a.port, a.bytes)
    if a.role == "idle":
        return role_idle(a.backend, policy)
    return orchestrate(a)


if __name__ == "__main__":
    sys.exit(main())
