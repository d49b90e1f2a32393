#!/usr/bin/env python3
"""make bench: nixl-fabric next to stock UCX and the stock LIBFABRIC plugin, all driven by the
stock NIXL agent (nixl-cu12, Python API) in two processes on this machine.

    bench.py [--out DIR] [--quick] [--plugin SO]
             [--configs ours-tcp,ours-shm,ours-tcp-default,ucx,stock-libfabric]

Configurations (CONFIGS below): ours-tcp = provider tcp with the same-host shm rail off (data
really over tcp on lo); ours-shm = provider shm; ours-tcp-default = provider tcp as shipped
(peers on this host go over the extra shm rail); ucx = the wheel's UCX; stock-libfabric = the
wheel's LIBFABRIC plugin (NIXL_PLUGIN_DIR unset).

The orchestrator (this process, no NIXL agent) measures the baselines (single-thread memcpy,
raw loopback TCP between two processes), then for each backend configuration
  1. probes in a throw-away process whether the backend can be created (NIXL_LOG_LEVEL=DEBUG,
     so a plugin that fails to load leaves its dlopen error in the log), and
  2. starts an initiator process, which starts its target process. The target sends its
     metadata and buffer address over its stdout pipe; afterwards the pipe pair (initiator ->
     target stdin, target stdout -> initiator) carries ZERO/FILL/CRC/QUIT commands, so the
     control path never goes through the backend being measured.
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

Prints a table, writes DIR/<YYYY-MM-DD>.json and DIR/<YYYY-MM-DD>.png (if matplotlib is
there). Exit status 1 if a loaded backend returned wrong bytes or one of our configurations
failed; a stock backend that cannot be loaded is reported, not failed.
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
import time
import zlib

import numpy as np

KiB, MiB = 1 << 10, 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SPAN = 64 * MiB                      # registered buffer per side (largest point)
SINGLE = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB]
KV = [(4096, 4 * KiB), (1024, 16 * KiB), (256, 256 * KiB)]
OPS = ["WRITE", "READ"]
CPU_BLOCKS = 4096                    # transfer() CPU time is measured on WRITE 4096 x 4 KiB
XFER_TIMEOUT_S = 30.0                # one post that takes longer than this aborts the config
CONFIG_TIMEOUT_S = 300

# Iteration policy (scaled down by --quick): enough posts per point for a median, bounded in
# bytes and in seconds so a slow backend cannot stretch the run.
IDLE_S = 10.0  # idle-CPU measurement of one engine (issue: "measure idle CPU for 10 s")
POLICY = {"byte_budget": 256 * MiB, "min_iters": 5, "max_iters": 100, "max_point_s": 3.0,
          "warmup": 2, "lat_iters": 2000, "lat_warmup": 100,
          "memcpy_runs": 10, "tcp_runs": 5}
QUICK = {"byte_budget": 32 * MiB, "min_iters": 3, "max_iters": 20, "max_point_s": 1.0,
         "warmup": 1, "lat_iters": 300, "lat_warmup": 20,
         "memcpy_runs": 4, "tcp_runs": 2}

# label, backend name, environment changes, physical limit used for its fractions.
# "@plugins" is replaced by the private copy of our plugin (see private_plugin).
CONFIGS = {
    # Data over tcp;ofi_rxm on lo: the same-host shm rail (on by default) is switched off,
    # else a peer on this host would be served by shm and this would not measure tcp.
    "ours-tcp": ("LIBFABRIC", {"NIXL_PLUGIN_DIR": "@plugins", "NIXL_FABRIC_PROVIDER": "tcp",
                               "NIXL_FABRIC_SAME_HOST_SHM": "false"}, "tcp"),
    # shm is not a network provider: iface=lo names no shm domain and backend creation fails
    # ("provider shm has no domain matching iface 'lo'"), so the iface is left unset here.
    "ours-shm": ("LIBFABRIC", {"NIXL_PLUGIN_DIR": "@plugins", "NIXL_FABRIC_PROVIDER": "shm",
                               "NIXL_FABRIC_IFACE": None}, "memcpy"),
    # What a user gets with provider tcp: same-host peers go over the extra shm rail.
    "ours-tcp-default": ("LIBFABRIC", {"NIXL_PLUGIN_DIR": "@plugins",
                                       "NIXL_FABRIC_PROVIDER": "tcp",
                                       "NIXL_FABRIC_SAME_HOST_SHM": None}, "memcpy"),
    # UCX_LOG_LEVEL=info makes UCX log the transports it picked (reported).
    "ucx": ("UCX", {"NIXL_PLUGIN_DIR": None, "UCX_LOG_LEVEL": "info"}, "memcpy"),
    # NIXL_PLUGIN_DIR unset: LIBFABRIC is the wheel's own plugin.
    "stock-libfabric": ("LIBFABRIC", {"NIXL_PLUGIN_DIR": None}, "tcp"),
}
TITLES = {"ours-tcp": "nixl-fabric tcp", "ours-shm": "nixl-fabric shm",
          "ours-tcp-default": "nf tcp+samehost", "ucx": "stock UCX",
          "stock-libfabric": "stock LIBFABRIC"}
OURS = ("ours-tcp", "ours-shm", "ours-tcp-default")
SHORT = {"ours-tcp": "tcp", "ours-shm": "shm", "ours-tcp-default": "dflt", "ucx": "UCX",
         "stock-libfabric": "stLF"}
STOCK = ("ucx", "stock-libfabric")


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

def make_agent(name, backend):
    from nixl_cu12._api import nixl_agent, nixl_agent_config
    # No backend in the config (the constructor would only warn about a missing plugin);
    # create_backend raises when the plugin cannot be loaded or created.
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=True, backends=[]))
    agent.create_backend(backend, {})
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
    import nixl_cu12
    plugdir = os.path.join(os.path.dirname(nixl_cu12.__file__), "..", ".nixl_cu12.mesonpy.libs",
                           "plugins")
    say(f"PLUGDIR {os.path.realpath(plugdir)}")
    try:
        agent = make_agent("bench-probe", backend)
        del agent
        say("PROBE ok")
    except Exception as e:  # noqa: BLE001 - reported, not handled
        say(f"PROBE fail {type(e).__name__}: {e}")
    return finish(backend, 0)


def role_idle(backend, quick):
    """One agent with a registered region and nothing to do: the CPU time its process
    spends over IDLE_S seconds (progress threads included)."""
    import resource
    agent = make_agent("bench-idle", backend)
    buf = np.zeros(64 * MiB, dtype=np.uint8)
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    time.sleep(1.0)
    secs = 3.0 if quick else IDLE_S
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    time.sleep(secs)
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    say("IDLE " + json.dumps({"seconds": round(t1 - t0, 2), "cpu_s": round(cpu, 4),
                              "cpu_pct": round(100 * cpu / (t1 - t0), 3)}))
    agent.deregister_memory(reg)
    del agent
    return finish(backend, 0)


def role_target(backend):
    agent = make_agent("bench-target", backend)
    buf = np.zeros(SPAN, dtype=np.uint8)
    buf[:] = 0  # touch every page before registration
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    src = np.random.default_rng(2).integers(0, 256, SPAN + 4 * KiB, dtype=np.uint8)
    say(f"META {agent.get_agent_metadata().hex()} {buf.ctypes.data}")
    for line in sys.stdin:  # EOF (initiator gone) ends the target too
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "QUIT":
            break
        if cmd[0] == "ZERO":
            buf[: int(cmd[1])] = 0
            say("OK")
        elif cmd[0] == "CRC":
            say(f"CRC {crc(buf[: int(cmd[1])])}")
        elif cmd[0] == "FILL":  # content for a READ; reply: CRC the initiator must end up with
            seed, blocks, size = (int(x) for x in cmd[1:4])
            n = blocks * size
            off = seed % (4 * KiB)
            buf[:n] = src[off: off + n]
            say(f"CRC {crc(reversed_blocks(buf, blocks, size))}")
    agent.deregister_memory(reg)
    del agent
    return finish(backend, 0)


class Initiator:
    def __init__(self, backend, policy):
        self.backend, self.p = backend, policy
        self.child = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--role", "target", "--backend", backend],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        meta_hex, addr = self.hear("META").split()
        self.rbase = int(addr)
        self.agent = make_agent("bench-init", backend)
        self.loc = np.zeros(SPAN, dtype=np.uint8)
        self.loc[:] = 0
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


def role_initiator(backend, quick):
    policy = QUICK if quick else POLICY
    ini = Initiator(backend, policy)
    try:
        for op in OPS:
            for blocks, size in [(1, s) for s in SINGLE] + KV:
                log(f"{backend}: {point_key(op, blocks, size)}")
                # CPU time of transfer() is taken on the prepared 4096-descriptor WRITE handle
                cpu = (op, blocks) == ("WRITE", CPU_BLOCKS)
                r = ini.bandwidth(op, blocks, size, cpu=cpu)
                say("POINT " + json.dumps(r))
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


def role_tcp_sink():
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    say(f"PORT {ls.getsockname()[1]}")
    s, _ = ls.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(SPAN)
    hdr = bytearray(9)
    while True:
        recv_exact(s, memoryview(hdr))
        cmd, n = hdr[:1], struct.unpack("<Q", hdr[1:])[0]
        if cmd == b"B":    # bulk: receive n bytes, ack with their CRC
            recv_exact(s, memoryview(buf)[:n])
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


def tcp_baseline(p):
    """Raw loopback TCP between two processes: 64 MiB per run (until the receiver's ack), and
    an 8-byte ping-pong round trip (the latency a delivered write needs at least)."""
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "tcp-sink"],
                             stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline().split()[1])
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        data = np.random.default_rng(4).integers(0, 256, SPAN, dtype=np.uint8)
        want = crc(data)
        ack = memoryview(bytearray(4))
        ts, ok = [], True
        for i in range(p["tcp_runs"] + 1):
            t0 = time.perf_counter()
            s.sendall(b"B" + struct.pack("<Q", SPAN))
            s.sendall(memoryview(data))
            recv_exact(s, ack)
            if i:  # first run is warm-up
                ts.append(time.perf_counter() - t0)
            ok &= struct.unpack("<I", ack)[0] == want
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
            "rtt_p99_us": lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e6}


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


def probe(label, env, logdir):
    backend = CONFIGS[label][0]
    env = dict(env, NIXL_LOG_LEVEL="DEBUG")
    logpath = os.path.join(logdir, f"{label}.probe.log")
    with open(logpath, "w") as logf:
        rc, out = run_child([sys.executable, os.path.abspath(__file__), "--role", "probe",
                             "--backend", backend], env, 120, logf)
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


def run_config(label, quick, logdir, plugdir):
    backend, changes, limit = CONFIGS[label]
    changes = {k: (plugdir if v == "@plugins" else v) for k, v in changes.items()}
    env = base_env()
    for k, v in changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    res = {"label": label, "title": TITLES[label], "backend": backend, "limit": limit,
           "env": {k: v for k, v in changes.items()}, "points": {}, "loadavg_before": os.getloadavg()}
    why = probe(label, env, logdir)
    if why:
        res["error"] = why
        return res
    logpath = os.path.join(logdir, f"{label}.log")
    t0 = time.time()
    args = [sys.executable, os.path.abspath(__file__), "--role", "initiator", "--backend", backend]
    if quick:
        args.append("--quick")
    with open(logpath, "w") as logf:
        rc, out = run_child(args, env, CONFIG_TIMEOUT_S, logf)
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
    if rc != 0 and "error" not in res:
        tail = open(logpath, errors="replace").read().strip().splitlines()[-3:]
        res["error"] = f"initiator rc {rc}: " + " | ".join(tail)
    if res.get("target_rc", 0) != 0:
        res.setdefault("error", f"target rc {res['target_rc']}")
    if "error" not in res:
        args = [sys.executable, os.path.abspath(__file__), "--role", "idle", "--backend", backend]
        if quick:
            args.append("--quick")
        with open(os.path.join(logdir, f"{label}.idle.log"), "w") as logf:
            _, out = run_child(args, env, IDLE_S + 60, logf)
        m = re.search(r"^IDLE (.*)$", out, re.M)
        if m:
            res["idle"] = json.loads(m.group(1))
    if label == "ucx":  # which UCX transports carried it (UCX_LOG_LEVEL=info; UCX logs to stdout)
        cfg = re.findall(r"intra-node cfg#\d+ (.*)", out + open(logpath, errors="replace").read())
        if cfg:
            res["ucx_transports"] = cfg[0].strip()
    return res


def point_order():
    keys = []
    for op in OPS:
        keys += [point_key(op, 1, s) for s in SINGLE]
        keys += [point_key(op, b, s) for b, s in KV]
    return keys


def all_verified(r):
    vals = [p["verified"] for p in r["points"].values()]
    vals += [r[k]["verified"] for k in ("latency", "cpu") if k in r]
    return all(vals)


def print_table(report):
    base, cfgs = report["baselines"], report["configs"]
    limits = {"memcpy": base["memcpy"]["gbps"], "tcp": base["tcp"]["gbps"]}
    loaded = [c for c in cfgs if cfgs[c]["points"]]
    ratios = [(o, s) for o in OURS for s in STOCK if o in loaded and s in loaded]
    w = 17
    head = f"{'point':<22}" + "".join(f"{TITLES[c]:>{w}}" for c in loaded)
    head += "".join(f"{SHORT[o] + '/' + SHORT[s]:>10}" for o, s in ratios)
    head += "  check"
    lines = ["", f"memcpy (1 thread, 64 MiB): {limits['memcpy']:.2f} GB/s   raw loopback TCP "
             f"(64 MiB, 2 processes): {limits['tcp']:.2f} GB/s   TCP 8 B round trip: "
             f"{base['tcp']['rtt_median_us']:.1f} us median, {base['tcp']['rtt_p99_us']:.1f} us p99",
             "bandwidth in GB/s (median); (%) = fraction of the physical limit: raw TCP for "
             "nixl-fabric tcp and stock LIBFABRIC, memcpy for the shm paths and UCX", "", head,
             "-" * len(head)]

    def row(name, vals, fmt, pct, capped=()):
        s = f"{name:<22}"
        for c in loaded:
            v = vals.get(c)
            if v is None:
                s += f"{'-':>{w}}"
                continue
            txt = fmt(v)
            if pct:
                txt += f" ({100 * pct(c, v):3.0f}%)"
            txt += "*" if c in capped else " "
            s += f"{txt:>{w}}"
        for o, st in ratios:
            a, b = vals.get(o), vals.get(st)
            s += f"{num(a / b):>10}" if a and b else f"{'-':>10}"
        return s

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
        lines.append(row(key, vals, num,
                         lambda c, v: v / limits[cfgs[c]["limit"]], capped)
                     + ("  ok" if not bad else "  WRONG BYTES: " + ", ".join(bad)))
    rtt = base["tcp"]["rtt_median_us"]
    for what, field in (("8 B WRITE lat med us", "median_us"), ("8 B WRITE lat p99 us", "p99_us")):
        vals = {c: cfgs[c]["latency"][field] for c in loaded if "latency" in cfgs[c]}
        ok = all(cfgs[c]["latency"]["verified"] for c in vals)
        pct = (lambda c, v: rtt / v) if field == "median_us" else None
        lines.append(row(what, vals, lambda v: f"{v:.1f}", pct) + ("  ok" if ok else "  WRONG"))
    for what, field in (("post 4096: CPU ns/desc", "cpu_ns_per_desc"),
                        ("post 4096: wall ns/desc", "wall_ns_per_desc")):
        vals = {c: cfgs[c]["cpu"][field] for c in loaded if "cpu" in cfgs[c]}
        ok = all(cfgs[c]["cpu"]["verified"] for c in vals)
        lines.append(row(what, vals, lambda v: f"{v:.0f}", None) + ("  ok" if ok else "  WRONG"))
    lines.append("")
    lines.append("ratios: ours/stock of the figure in the row (bandwidth: higher is better; latency "
                 "and ns/desc rows: lower is better). latency (%) = raw TCP round trip / latency.")
    lines.append("* = fewer posts than the minimum (one post took most of the point's time "
                 "budget); post 4096 rows: transfer() alone on the prepared WRITE 4096 x 4 KiB "
                 "handle (CPU = calling thread's CPU time).")
    for c, r in cfgs.items():
        if r.get("error"):
            lines.append(f"{TITLES[c]}: {r['error']}")
    if "ucx_transports" in cfgs.get("ucx", {}):
        lines.append(f"stock UCX transports: {cfgs['ucx']['ucx_transports']}")
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
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for col, op in enumerate(OPS):
        for row, (title, xs, keyf) in enumerate((
                (f"{op}, one descriptor", SINGLE, lambda s: point_key(op, 1, s)),
                (f"{op}, KV batch (16-64 MiB per request)", [s for _, s in KV],
                 lambda s: point_key(op, dict((sz, b) for b, sz in KV)[s], s)))):
            ax = axes[row][col]
            for c, r in cfgs.items():
                pts = [(x, r["points"][keyf(x)]["gbps"]) for x in xs if keyf(x) in r["points"]]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=TITLES[c])
            ax.axhline(base["memcpy"]["gbps"], ls="--", color="gray", label="memcpy (1 thread)")
            ax.axhline(base["tcp"]["gbps"], ls=":", color="black", label="raw loopback TCP")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(xs, [fmt_size(x) for x in xs])
            ax.set_xlabel("descriptor size" if row == 0 else "block size (blocks x size)")
            ax.set_ylabel("GB/s (median)")
            ax.set_title(title)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"nixl-fabric vs stock NIXL backends, two processes on {report['host']} "
                 f"({report['date']}; {report['nproc']} cores)")
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
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def orchestrate(a):
    policy = QUICK if a.quick else POLICY
    labels = a.configs.split(",")
    for c in labels:
        if c not in CONFIGS:
            sys.exit(f"unknown config {c}; known: {','.join(CONFIGS)}")
    logdir = os.path.join(ROOT, "build", "bench")
    os.makedirs(logdir, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    plugin, plugdir = private_plugin(a.plugin, logdir)
    t0 = time.time()
    date = datetime.date.today().isoformat()
    report = {"date": date, "started": datetime.datetime.now().isoformat(timespec="seconds"),
              "host": socket.gethostname(), "nproc": os.cpu_count(), "git_rev": git_rev(),
              "plugin": plugin,
              "quick": a.quick, "policy": policy, "loadavg_start": os.getloadavg(),
              "baselines": {}, "configs": {}}
    try:
        import nixl_cu12  # noqa: F401 - version only
        from importlib.metadata import version
        report["nixl_version"] = version("nixl-cu12")
    except Exception:  # noqa: BLE001
        pass
    log("baseline: memcpy")
    report["baselines"]["memcpy"] = memcpy_baseline(policy)
    log("baseline: raw loopback TCP")
    report["baselines"]["tcp"] = tcp_baseline(policy)
    for c in labels:
        log(f"{TITLES[c]} ...")
        r = run_config(c, a.quick, logdir, plugdir)
        report["configs"][c] = r
        log(f"{TITLES[c]}: " + (r.get("error") or f"{len(r['points'])} points, {r.get('seconds')} s"))
    report["seconds"] = round(time.time() - t0, 1)
    table = print_table(report)
    idle = [f"{TITLES[c]} {r['idle']['cpu_s'] * 1000:.1f} ms ({r['idle']['cpu_pct']:.2f} %)"
            for c, r in report["configs"].items() if r.get("idle")]
    if idle:
        secs = next(r["idle"]["seconds"] for r in report["configs"].values() if r.get("idle"))
        table += f"\nidle CPU of one engine (agent + 64 MiB registered, {secs:.0f} s): " + ", ".join(idle)
    print(table)
    report["table"] = table
    out_json = os.path.join(a.out, f"{date}.json")
    with open(out_json + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(out_json + ".tmp", out_json)
    png = os.path.join(a.out, f"{date}.png")
    made = plot(report, png)
    print(f"\nwrote {out_json}" + (f" and {png}" if made else "") + f" in {report['seconds']} s; "
          f"logs in {logdir}")
    failed = []
    for c, r in report["configs"].items():
        if r["points"] and not all_verified(r):
            failed.append(f"{TITLES[c]} returned wrong bytes")
        if c in OURS and r.get("error"):
            failed.append(f"{TITLES[c]}: {r['error']}")
    if not report["baselines"]["tcp"]["verified"]:
        failed.append("raw TCP baseline returned wrong bytes")
    for f in failed:
        print("bench FAILED:", f)
    return 1 if failed else 0


def main():
    # kill -USR1 <pid> prints every thread's Python stack into the log (hang diagnosis).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", default="orchestrate",
                    choices=["orchestrate", "initiator", "target", "probe", "tcp-sink", "idle"])
    ap.add_argument("--backend")
    ap.add_argument("--quick", action="store_true", help="few iterations (smoke run)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--plugin", default=os.path.join(ROOT, "build", "plugins",
                                                     "libplugin_LIBFABRIC.so"),
                    help="our plugin (copied privately before the run)")
    a = ap.parse_args()
    if a.role == "initiator":
        return role_initiator(a.backend, a.quick)
    if a.role == "target":
        return role_target(a.backend)
    if a.role == "probe":
        return role_probe(a.backend)
    if a.role == "tcp-sink":
        return role_tcp_sink()
    if a.role == "idle":
        return role_idle(a.backend, a.quick)
    return orchestrate(a)


if __name__ == "__main__":
    sys.exit(main())
