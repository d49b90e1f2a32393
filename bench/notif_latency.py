#!/usr/bin/env python3
"""Small-transfer latency through the stock NIXL agent, two processes on one host (issue #23):

  WRITE until notified   one agent WRITEs n bytes with a notification; the other, the moment
                         get_new_notifs shows it, WRITEs the same back with one; half the round
                         trip is the time from transfer() until the target sees the
                         notification (ping-pong, so no clock is shared between processes)
  WRITE until DONE       transfer() until check_xfer_state() says DONE (the initiator's view;
                         for nixl-fabric DONE means delivered)
  READ until DONE        the same for a READ
  notification alone     genNotif ping-pong, half the round trip: the floor under the first
  idle get_new_notifs    one call with nothing arriving: a poller's turn of its loop

    notif_latency.py [--configs ours-tcp,ours-tcp-flush,ucx-tcp] [--sizes 4096,65536]
                     [--iters 1000] [--rounds N] [--plugin-dir DIR] [--out FILE.json]

Configurations: ours-tcp (provider tcp on lo, one rail, same-host shm off, progress threads
on), ours-tcp-before (the same with the plugin in --before-dir), ours-tcp-flush (the same with notif_behind_data=false: the notification after a flush
read, as before FI_ORDER_SAW was used), ours-tcp-noprog (no progress threads: each side polls), ours-tcp-thread (ours on, the
agent's off: a C++ user's defaults), ours-tcp-thread-only (the same, every pass on our thread),
ours-tcp-r4 (four rails), ucx-tcp (UCX_TLS=tcp,self),
ucx-tcp-noprog (the agent's progress thread off, so UCX progresses in every poll), ucx (as
shipped), stock-libfabric (the wheel's LIBFABRIC; needs libfabric main, libcudart and
a non-loopback interface, see /work/shared/tools/README.md; NOTIF_IFACE=<veth> puts ours on the
same interface). Medians in microseconds; every
point byte-checked (the destination's CRC at the end of the point).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SPAN = 1 << 20
# The agents' progress threads (BENCH_AGENT_PROG_THREAD=0: off, the application polls).
PROG = os.environ.get("BENCH_AGENT_PROG_THREAD", "1") != "0"


# No progress threads anywhere (the C++ API's default): each side drives its own agent from
# its polls.
NOPROG = {"NIXL_FABRIC_PROGRESS_THREAD": "false", "BENCH_AGENT_PROG_THREAD": "0"}


def ours(rails=1, **extra):
    # NOTIF_IFACE: another local interface (the veth of a namespace the stock plugin needs)
    env = {"NIXL_PLUGIN_DIR": "@plugins", "NIXL_FABRIC_PROVIDER": "tcp",
           "NIXL_FABRIC_IFACE": os.environ.get("NOTIF_IFACE", "lo"),
           "NIXL_FABRIC_SAME_HOST_SHM": "false", "NIXL_FABRIC_RAILS": str(rails),
           "NIXL_FABRIC_PROGRESS_THREAD": "true", "NIXL_FABRIC_LOG": "info"}
    env.update(extra)
    return {"backend": "LIBFABRIC", "env": env}


# UCX's transports: tcp alone, but where GPUs are present NIXL's UCX backend refuses a UCX_TLS
# without a CUDA transport (run-gpu.sh passes NOTIF_UCX_TLS=tcp,cuda_copy,self there).
UCX_TLS = os.environ.get("NOTIF_UCX_TLS", "tcp,self")

CONFIGS = {
    "ours-tcp": ours(),
    "ours-tcp-flush": ours(NIXL_FABRIC_NOTIF_BEHIND_DATA="false"),
    # ours-tcp with another build of the plugin (--before-dir), e.g. the commit before a change
    "ours-tcp-before": ours(NIXL_PLUGIN_DIR="@before"),
    # NOPROG, as ucx-tcp-noprog
    "ours-tcp-noprog": ours(**NOPROG),
    "ours-tcp-noprog-before": ours(**NOPROG, NIXL_PLUGIN_DIR="@before"),
    # the defaults a C++ user gets: our progress thread on, the agent's off (as the stock
    # plugin, which always runs a thread of its own, in stock-libfabric-noprog)
    "ours-tcp-thread": ours(BENCH_AGENT_PROG_THREAD="0"),
    # the same with every pass on our progress thread (callers only read states), as the
    # stock plugin's thread does
    "ours-tcp-thread-only": ours(BENCH_AGENT_PROG_THREAD="0", NIXL_FABRIC_CALLER_PROGRESS="false"),
    # ours on the libfabric the stock plugin runs on (STOCK_LD_PATH: libfabric main), to tell
    # the provider's share of a difference from ours
    "ours-tcp-noprog-lfmain": ours(**NOPROG, NIXL_FABRIC_CUDA_LIB="/nonexistent", LD_LIBRARY_PATH="@stock_ld"),
    "ours-tcp-r4": ours(4),
    "ours-tcp-r4-flush": ours(4, NIXL_FABRIC_NOTIF_BEHIND_DATA="false"),
    "ucx-tcp": {"backend": "UCX", "env": {"NIXL_PLUGIN_DIR": None, "UCX_TLS": UCX_TLS}},
    # UCX without the agent's progress thread: every poll progresses the worker itself.
    "ucx-tcp-noprog": {"backend": "UCX", "env": {"NIXL_PLUGIN_DIR": None, "UCX_TLS": UCX_TLS,
                                                 "BENCH_AGENT_PROG_THREAD": "0"}},
    "ucx": {"backend": "UCX", "env": {"NIXL_PLUGIN_DIR": None}},
    # STOCK_LD_PATH: where libfabric main, libhwloc, libcudart and a libcuda are (only this
    # configuration's processes get it; ours keep the system's libfabric).
    "stock-libfabric": {"backend": "LIBFABRIC", "env": {"NIXL_PLUGIN_DIR": None, "LD_LIBRARY_PATH": "@stock_ld"}},
    "stock-libfabric-noprog": {"backend": "LIBFABRIC", "env": {"NIXL_PLUGIN_DIR": None, "LD_LIBRARY_PATH": "@stock_ld",
                                                              "BENCH_AGENT_PROG_THREAD": "0"}},
}


def log(msg):
    sys.stderr.write(f"[notif_latency] {msg}\n")
    sys.stderr.flush()


def say(out, line):
    out.write(line + "\n")
    out.flush()


class Lines:
    """Lines from a pipe, read with os.read: a buffered file object may hold the next line
    already while select() says the pipe is empty (a side polling its agent would wait on it
    for ever)."""

    def __init__(self, fd):
        self.fd, self.buf = fd, b""

    def ready(self):
        return b"\n" in self.buf or bool(select.select([self.fd], [], [], 0)[0])

    def readline(self):
        while b"\n" not in self.buf:
            chunk = os.read(self.fd, 65536)
            if not chunk:
                line, self.buf = self.buf, b""
                return line.decode()
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode() + "\n"


def hear(inp, tag, side=None):
    """The rest of the next line from `inp` (Lines) that starts with `tag`; `side` polls its
    agent while it waits (see Side.readline)."""
    while True:
        line = side.readline(inp) if side else inp.readline()
        if not line:
            raise RuntimeError(f"peer exited before {tag}")
        word, _, rest = line.rstrip("\n").partition(" ")
        if word == tag:
            return rest.strip()


def make_agent(name, backend):
    mod = os.environ.get("NIXL_PY_MODULE")
    for m in ([mod] if mod else ["nixl_cu13", "nixl_cu12"]):
        try:
            api = __import__(f"{m}._api", fromlist=["nixl_agent", "nixl_agent_config"])
            break
        except ImportError:
            continue
    else:
        raise SystemExit("no NIXL python module")
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=PROG, backends=[]))
    agent.create_backend(backend, {})
    return agent


def pattern(n, seed):
    return bytes((i * 131 + seed * 7 + (i >> 9)) & 0xFF for i in range(n))


class Side:
    """One agent with a registered buffer of SPAN bytes (a bytearray) and its peer's."""

    def __init__(self, name, peer, backend):
        import ctypes
        self.name, self.peer = name, peer
        self.agent = make_agent(name, backend)
        self.buf = bytearray(SPAN)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))
        self.reg = self.agent.register_memory([(self.addr, SPAN, 0, "")], "DRAM")
        self.raddr = None
        # Notifications from the peer seen but not yet waited for (they may come together).
        self.credit = 0

    def meta(self):
        return f"{self.agent.get_agent_metadata().hex()} {self.addr}"

    def add_peer(self, line):
        meta_hex, addr = line.split()
        self.agent.add_remote_agent(bytes.fromhex(meta_hex))
        self.raddr = int(addr)

    def handle(self, op, n, local_off=0, remote_off=0):
        a = self.agent
        local = a.get_xfer_descs([(self.addr + local_off, n, 0)], "DRAM")
        remote = a.get_xfer_descs([(self.raddr + remote_off, n, 0)], "DRAM")
        return a.initialize_xfer(op, local, remote, self.peer)

    def done(self, h, st):
        t0 = time.perf_counter()
        while st == "PROC":
            st = self.agent.check_xfer_state(h)
            if time.perf_counter() - t0 > 30:
                raise TimeoutError("transfer not DONE after 30 s")
        if st != "DONE":
            raise RuntimeError(f"transfer state {st}")

    def readline(self, inp):
        """The next line from `inp` ("" at its end). Without the agents' progress threads this
        side polls its agent while it waits, as a C++ application's loop does: a transfer
        completes only while its target progresses too (UCX tcp; ours: the flush read)."""
        if not PROG:
            while not inp.ready():
                self.credit += len(self.agent.get_new_notifs().get(self.peer, []))
        return inp.readline()

    def wait_notifs(self, h=None, st="DONE"):
        """Waits for a notification from the peer, meanwhile polling this side's transfer `h`
        (state `st`) as an application does (UCX sends a transfer's notification only when
        the initiator polls it). Returns the transfer's state."""
        t0 = time.perf_counter()
        while True:
            if st == "PROC":
                st = self.agent.check_xfer_state(h)
            self.credit += len(self.agent.get_new_notifs().get(self.peer, []))
            if self.credit > 0:
                self.credit -= 1
                return st
            if time.perf_counter() - t0 > 30:
                raise TimeoutError("notification not seen after 30 s")


def role_b(backend):
    """The echo side: for PONG n count, answers each notification from A with a WRITE of n
    bytes (its buffer's second half to A's second half) and a notification."""
    s = Side("B", "A", backend)
    say(sys.stdout, "META " + s.meta())
    cmds = Lines(sys.stdin.fileno())
    s.add_peer(hear(cmds, "META", s))
    while True:
        line = s.readline(cmds)
        if not line:
            break
        cmd = line.split()
        if not cmd or cmd[0] == "QUIT":
            break
        if cmd[0] == "PONG":
            n, count = int(cmd[1]), int(cmd[2])
            s.buf[SPAN // 2: SPAN // 2 + n] = pattern(n, 2)
            h = s.handle("WRITE", n, SPAN // 2, SPAN // 2)
            s.agent.get_new_notifs()
            s.credit = 0
            say(sys.stdout, "READY")
            st = "DONE"
            for _ in range(count):
                st = s.wait_notifs(h, st)
                s.done(h, st)
                st = s.agent.transfer(h, b"pong")
            s.done(h, st)
            s.agent.release_xfer_handle(h)
            say(sys.stdout, "PONGED")
        elif cmd[0] == "NPONG":
            # notification alone: answer each of A's with one
            count = int(cmd[1])
            s.agent.get_new_notifs()
            s.credit = 0
            say(sys.stdout, "READY")
            for _ in range(count):
                s.wait_notifs()
                s.agent.send_notif(s.peer, b"pong")
            say(sys.stdout, "PONGED")
        elif cmd[0] == "CRC":
            off, n = int(cmd[1]), int(cmd[2])
            say(sys.stdout, f"CRC {zlib.crc32(bytes(s.buf[off:off + n]))}")
        elif cmd[0] == "FILL":
            n = int(cmd[1])
            s.buf[:n] = pattern(n, 3)
            say(sys.stdout, "OK")
    s.agent.remove_remote_agent("A")
    s.agent.deregister_memory(s.reg)
    sys.stdout.flush()
    os._exit(0)


def role_a(backend, sizes, iters, warmup):
    env = dict(os.environ)
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "b", "--backend", backend],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
    s = Side("A", "B", backend)
    out = Lines(child.stdout.fileno())
    s.add_peer(hear(out, "META"))
    say(child.stdin, "META " + s.meta())
    res = []
    for n in sizes:
        # WRITE until notified: A's first half -> B's first half; B echoes into A's second half.
        s.buf[:n] = pattern(n, 1)
        h = s.handle("WRITE", n)
        say(child.stdin, f"PONG {n} {warmup + iters}")
        hear(out, "READY", s)
        st, times = "DONE", []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            s.done(h, st)
            st = s.wait_notifs(h, s.agent.transfer(h, b"ping"))
            if i >= warmup:
                times.append((time.perf_counter() - t0) / 2)
        s.done(h, st)
        hear(out, "PONGED", s)
        if s.credit:
            raise RuntimeError(f"{s.credit} notifications more than answers")
        ok = (int(hear_crc(child, out, 0, n, s)) == zlib.crc32(pattern(n, 1))
              and bytes(s.buf[SPAN // 2: SPAN // 2 + n]) == pattern(n, 2))
        res.append(point("WRITE until notified", n, times, ok))
        # WRITE until DONE (initiator's view), a handle without notification (a reposted one
        # may keep its last notification).
        s.agent.release_xfer_handle(h)
        h = s.handle("WRITE", n)
        times = []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            s.done(h, s.agent.transfer(h))
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        s.agent.release_xfer_handle(h)
        ok = int(hear_crc(child, out, 0, n, s)) == zlib.crc32(pattern(n, 1))
        res.append(point("WRITE until DONE", n, times, ok))
        # READ until DONE: B's first half (refilled) into A's first half.
        say(child.stdin, f"FILL {n}")
        hear(out, "OK", s)
        s.buf[:n] = bytes(n)
        h = s.handle("READ", n)
        times = []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            s.done(h, s.agent.transfer(h))
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        s.agent.release_xfer_handle(h)
        res.append(point("READ until DONE", n, times, bytes(s.buf[:n]) == pattern(n, 3)))
    # Notification alone (genNotif, no data): the floor under "WRITE until notified".
    say(child.stdin, f"NPONG {warmup + iters}")
    hear(out, "READY", s)
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        s.agent.send_notif(s.peer, b"ping")
        s.wait_notifs()
        if i >= warmup:
            times.append((time.perf_counter() - t0) / 2)
    hear(out, "PONGED", s)
    res.append(point("notification alone", 0, times, True))
    # One get_new_notifs() with nothing arriving (B waits for its next command): what a
    # poller pays per turn of its loop, the gap a notification or completion may wait in.
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        s.agent.get_new_notifs()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    res.append(point("idle get_new_notifs", 0, times, True))
    say(child.stdin, "QUIT")
    child.wait(timeout=60)
    s.agent.remove_remote_agent("B")
    s.agent.deregister_memory(s.reg)
    say(sys.stdout, "RESULT " + json.dumps(res))
    sys.stdout.flush()
    os._exit(0)


def hear_crc(child, out, off, n, side=None):
    say(child.stdin, f"CRC {off} {n}")
    return hear(out, "CRC", side)


def point(what, n, times, ok):
    times.sort()
    return {"what": what, "bytes": n, "iters": len(times), "median_us": statistics.median(times) * 1e6,
            "p10_us": times[len(times) // 10] * 1e6, "p90_us": times[9 * len(times) // 10] * 1e6, "verified": ok}


def run_config(args, base, c):
    """One configuration's processes; its points, or {"error": ...}."""
    cfg = CONFIGS[c]
    env = dict(base)
    for k, v in cfg["env"].items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = {"@plugins": args.plugin_dir, "@before": args.before_dir,
                      "@stock_ld": os.environ.get("STOCK_LD_PATH", "")}.get(v, v)
    log(f"{c}: running")
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--role", "a", "--backend", cfg["backend"],
                        "--sizes", ",".join(map(str, args.sizes)), "--iters", str(args.iters),
                        "--warmup", str(args.warmup)],
                       env=env, capture_output=True, text=True, timeout=900)
    line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        log(f"{c}: failed (rc {p.returncode}): {p.stderr[-2000:]}")
        return {"error": p.stderr[-2000:]}
    if args.logs:
        with open(os.path.join(args.logs, f"{c}.log"), "a") as f:
            f.write(p.stderr)
    return {"points": json.loads(line[len("RESULT "):])}


def orchestrate(args):
    base = dict(os.environ)
    iface = os.environ.get("NOTIF_IFACE", "lo")
    base.update(FI_TCP_IFACE=iface, FI_SOCKETS_IFACE=iface, NIXL_FABRIC_IFACE=iface, UCX_NET_DEVICES="lo",
                UCX_MODULES="^ib", OPENBLAS_NUM_THREADS="1")
    for k in ("NIXL_LOG_LEVEL", "UCX_TLS"):
        base.pop(k, None)
    report = {"sizes": args.sizes, "iters": args.iters, "rounds": args.rounds, "configs": {}}
    # With several rounds the configurations alternate (forward, then backward), so that a
    # machine whose speed drifts during the run does not favour the one that runs first; each
    # point is the median of its rounds' medians, and each round's ratio to the first
    # configuration is kept (same round: the same machine state).
    runs = {c: [] for c in args.configs}
    if args.logs:
        for c in args.configs:  # each round appends to its configuration's log
            open(os.path.join(args.logs, f"{c}.log"), "w").close()
    for r in range(args.rounds):
        for c in (args.configs if r % 2 == 0 else args.configs[::-1]):
            runs[c].append(run_config(args, base, c))
    for c, rs in runs.items():
        ok = [x["points"] for x in rs if "points" in x]
        if not ok:
            report["configs"][c] = rs[0]
            continue
        points = []
        for i, p in enumerate(ok[0]):
            # A round that failed keeps its place (None), so that round r of every
            # configuration is still the same round when their ratios are taken.
            meds = [x["points"][i]["median_us"] if "points" in x else None for x in rs]
            points.append(dict(p, median_us=statistics.median([m for m in meds if m is not None]),
                               round_medians_us=meds, verified=all(pts[i]["verified"] for pts in ok)))
        report["configs"][c] = {"points": points}
    names = [c for c in args.configs if "points" in report["configs"][c]]
    print(f"{'point':32}" + "".join(f"{c:>24}" for c in names))
    keys = [(p["what"], p["bytes"]) for p in report["configs"][names[0]]["points"]] if names else []
    for what, n in keys:
        row = f"{what + (' ' + str(n // 1024) + ' KiB' if n else ''):32}"
        cells = [next(p for p in report["configs"][c]["points"] if (p["what"], p["bytes"]) == (what, n)) for c in names]
        for k, p in enumerate(cells):
            cell = f"{p['median_us']:.1f}{'' if p['verified'] else '!'}"
            if args.rounds > 1 and k > 0:
                # per-round ratio first/this (> 1: this one is faster), their range
                rat = [a / b for a, b in zip(cells[0]["round_medians_us"], p["round_medians_us"]) if a and b]
                cell += f" ({min(rat):.2f}-{max(rat):.2f}x)" if rat else ""
            row += f"{cell:>24}"
        print(row)
    if args.rounds > 1 and len(names) > 1:
        print(f"(in brackets: each round's {names[0]} time over this one's, lowest-highest; > 1 is faster)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    bad = [c for c in names if not all(p["verified"] for p in report["configs"][c]["points"])]
    if bad:
        log(f"wrong bytes (marked !): {bad}")
    # Another backend's wrong bytes are a finding for the report, not this run's failure.
    return 1 if any(c.startswith("ours") for c in bad) else 0


def main():
    # kill -USR1 <pid> prints where a stuck side waits (stderr goes to the report/logs).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", default="orchestrate", choices=["orchestrate", "a", "b"])
    ap.add_argument("--backend")
    ap.add_argument("--configs", default="ours-tcp,ours-tcp-flush,ucx-tcp")
    ap.add_argument("--sizes", default="4096,65536")
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--plugin-dir", default=os.path.join(ROOT, "build", "plugins"))
    ap.add_argument("--before-dir", help="plugin folder of ours-tcp-before")
    ap.add_argument("--logs", help="folder for each configuration's stderr")
    ap.add_argument("--out")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every configuration this many times, alternating their order")
    args = ap.parse_args()
    args.sizes = [int(x) for x in args.sizes.split(",")]
    if args.role == "b":
        return role_b(args.backend)
    if args.role == "a":
        return role_a(args.backend, args.sizes, args.iters, args.warmup)
    args.configs = args.configs.split(",")
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
