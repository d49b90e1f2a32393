#!/usr/bin/env python3
"""Descriptor-heavy requests over DRAM (issue #23): what one request of many small
descriptors costs to create, post and complete, ours next to stock UCX in the same run.

    descs.py [--quick] [--out DIR] [--plugin SO] [--configs LABEL,..] [--ns 1024,4096,..]
             [--orders shuffled,adjacent,reversed] [--ops WRITE,READ] [--budget S]
    descs.py --plot JSON --png PNG            (the plot alone, from a written report)

Configurations (`--configs`, default all, most important first): ours/ucx x one process (two
agents, `1p`) or two processes (`2p`) x progress thread on or off (`-noprog`):
ours-1p, ucx-1p, ours-2p, ucx-2p, ours-1p-noprog, ucx-1p-noprog, ours-2p-noprog, ucx-2p-noprog.
Both backends as shipped (ours: default configuration, same-host paths on; UCX: default
transports, loopback only). Each configuration is a process of its own (NIXL_PLUGIN_DIR is
read once per process), which starts its target agent in a thread-free second agent (1p) or in
a second process (2p, a socketpair carries the control messages, never the backend).

Per point (N descriptors of 4 KiB, an order, an operation), with one `prep_xfer_dlist` of the
N slots on each side (slot i at base + i*4 KiB, the way vLLM preps all blocks once):
  orders   shuffled: local indices 0..N-1, remote indices a fixed random permutation, so no
           two neighbours of the request are neighbours in memory (nothing can coalesce);
           reversed: remote indices N-1..0; adjacent: both 0..N-1 (everything could coalesce)
  repeats  R fresh handles: `make_prepped_xfer` (timed: create), `transfer` (timed: post),
           poll until DONE (first: done latency of the first post of a fresh handle), byte
           check; then S reposts of the same handle (steady: done latency), byte check;
           `release_xfer_handle` (timed).
  reported create ns per descriptor (median over R, and of the first handle), post us,
           first and steady done latency (median), first/steady, GB/s steady and end to end
           (create + post + done of a fresh handle), verified.
Before the points, one 4 KiB transfer opens the connection (reported as connect_ms), so
`first` is a fresh handle's first post on an existing connection. Buffers are pre-faulted
and written before registration. Every byte is checked: each 8-byte word holds (generation,
source slot, word index), and the generation changes before every checked transfer.

Prints one table per configuration pair (ours vs UCX, ratios), writes DIR/descs-<date>.json
and .png. Exit status 1 if any point returned wrong bytes or one of our configurations failed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import kvcommon as kc  # noqa: E402

ROOT = os.path.dirname(HERE)
BS = 4 * kc.KiB
NS = (1024, 4096, 16384, 65536)
ORDERS = ("shuffled", "adjacent")
OPS = ("WRITE", "READ")


def config(backend, procs, prog):
    who = "ours" if backend == "LIBFABRIC" else "ucx"
    return {"label": f"{who}-{procs}p" + ("" if prog else "-noprog"), "backend": backend,
            "procs": procs, "prog": prog}


CONFIGS = {c["label"]: c for c in (config(b, p, g) for g in (1, 0) for p in (1, 2)
                                   for b in ("LIBFABRIC", "UCX"))}
# (repeats R, reposts S) by descriptor count: enough samples for a median, bounded time
REPS = {"full": lambda n: (9, 5) if n <= 4096 else (5, 4) if n <= 16384 else (3, 3),
        "quick": lambda n: (3, 3)}


def orders(n, name):
    """(local indices, remote indices) as int32 arrays."""
    loc = np.arange(n, dtype=np.int32)
    if name == "adjacent":
        return loc, loc.copy()
    if name == "reversed":
        return loc, loc[::-1].copy()
    if name == "shuffled":
        perm = np.random.default_rng(n).permutation(n).astype(np.int32)
        # a fixed permutation in which no neighbours stay neighbours
        for i in np.flatnonzero(np.diff(perm) == 1):
            j = (i + n // 2) % n
            perm[[i, j]] = perm[[j, i]]
        return loc, perm
    raise SystemExit(f"unknown order {name}")


# ----------------------------------------------------------------------------- target side

class LocalTarget:
    """The target agent in this process (1p)."""

    def __init__(self, module, backend, prog, n):
        self.agent = kc.new_agent(module, f"descs-tgt-{os.getpid()}", backend, prog)
        self.slots = kc.Slots(n, BS)
        self.slots.fill(0, n)
        self.reg = self.agent.register_memory([(self.slots.base, self.slots.buf.nbytes, 0, "")],
                                              "DRAM")
        self.md, self.base = self.agent.get_agent_metadata(), self.slots.base
        self.pump = () if prog else (self.agent,)

    def fill(self, gen, n):
        self.slots.fill(gen, n)

    def check(self, gen, dst, src):
        return self.slots.check(gen, dst, src)

    def close(self):
        self.agent.deregister_memory(self.reg)
        return 0


class RemoteTarget:
    """The target agent in a process of its own (2p): descs.py --role target."""

    def __init__(self, module, backend, prog, n):
        self.proc, self.ch = kc.spawn_peer(__file__, ["--role", "target", "--module", module,
                                                      "--backend", backend, "--prog", prog,
                                                      "--n", n])
        hello = self.ch.recv(timeout=120)
        self.md, self.base = bytes.fromhex(hello["md"]), hello["base"]
        self.pump = ()

    def fill(self, gen, n):
        self.ch.call(cmd="fill", gen=gen, n=n)

    def check(self, gen, dst, src):
        return self.ch.call(cmd="check", gen=gen, dst=np.asarray(dst, np.int32).tobytes().hex(),
                            src=np.asarray(src, np.int32).tobytes().hex(),
                            timeout=kc.WAIT_S + 60).get("bad")

    def close(self):
        return kc.stop_peer(self.proc, self.ch)


def target_main(a):
    ch = kc.Chan(socket.socket(fileno=a.fd))
    try:
        agent = kc.new_agent(a.module, f"descs-tgt-{os.getpid()}", a.backend, a.prog)
        slots = kc.Slots(a.n, BS)
        slots.fill(0, a.n)
        reg = agent.register_memory([(slots.base, slots.buf.nbytes, 0, "")], "DRAM")
        ch.send(md=agent.get_agent_metadata().hex(), base=slots.base)
    except Exception as e:  # noqa: BLE001 - told to the initiator, which reports it
        ch.send(error=f"target setup: {type(e).__name__}: {e}")
        kc.finish(2)
    # progress thread off: this process drives its own agent while it waits
    idle = None if a.prog else (lambda: (agent.update_notifs(), os.sched_yield()))
    while True:
        try:
            m = ch.recv(timeout=3600, idle=idle)
        except kc.ChanError:
            break
        try:
            if m["cmd"] == "quit":
                break
            if m["cmd"] == "fill":
                slots.fill(m["gen"], m["n"])
                ch.send(ok=True)
            elif m["cmd"] == "check":
                dst = np.frombuffer(bytes.fromhex(m["dst"]), np.int32)
                src = np.frombuffer(bytes.fromhex(m["src"]), np.int32)
                ch.send(ok=True, bad=slots.check(m["gen"], dst, src))
        except Exception as e:  # noqa: BLE001
            ch.send(error=f"target {m.get('cmd')}: {type(e).__name__}: {e}")
    agent.deregister_memory(reg)
    kc.finish(0)


# ----------------------------------------------------------------------------- initiator

def emit(kind, obj):
    print(kind + " " + json.dumps(obj), flush=True)


def measure_point(agent, tgt, local, lp, rp, n, order, op, reps, reposts, gen):
    lidx, ridx = orders(n, order)
    pc = time.perf_counter
    pump = tgt.pump
    creates, posts, firsts, steadies, releases, e2e = [], [], [], [], [], []
    bad = []
    for r in range(reps):
        for g_i in range(2):
            g = next(gen)
            if op == "WRITE":
                local.fill(g, n)
            else:
                tgt.fill(g, n)
            if g_i == 0:
                t0 = pc()
                h = agent.make_prepped_xfer(op, lp, lidx, rp, ridx, b"")
                t1 = pc()
                st = agent.transfer(h)
                t2 = pc()
                kc.wait_done(agent, h, st, pump, what=f"{op} {n} first post")
                t3 = pc()
                creates.append(t1 - t0)
                posts.append(t2 - t1)
                firsts.append(t3 - t1)
                e2e.append(t3 - t0)
            else:
                for _ in range(reposts):
                    t1 = pc()
                    st = agent.transfer(h)
                    kc.wait_done(agent, h, st, pump, what=f"{op} {n} repost")
                    steadies.append(pc() - t1)
            b = (tgt.check(g, ridx, lidx) if op == "WRITE"
                 else local.check(g, lidx, ridx))
            if b:
                bad.append(f"repeat {r} {'first post' if g_i == 0 else 'reposts'}: {b}")
        t4 = pc()
        agent.release_xfer_handle(h)
        releases.append(pc() - t4)
    nbytes = n * BS
    first, steady = kc.med(firsts), kc.med(steadies)
    return {"n": n, "bs": BS, "order": order, "op": op, "reps": reps, "reposts": reposts,
            "create_ns_desc": kc.rnd(kc.med(creates) / n * 1e9),
            "create_ns_desc_first": kc.rnd(creates[0] / n * 1e9),
            "create_ms": [kc.rnd(x * 1e3) for x in creates],
            "post_us": kc.rnd(kc.med(posts) * 1e6),
            "first_ms": kc.rnd(first * 1e3), "first_ms_r0": kc.rnd(firsts[0] * 1e3),
            "firsts_ms": [kc.rnd(x * 1e3) for x in firsts],
            "steady_ms": kc.rnd(steady * 1e3),
            "steady_ms_min": kc.rnd(min(steadies) * 1e3),
            "first_over_steady": kc.ratio(first, steady),
            "release_us": kc.rnd(kc.med(releases) * 1e6),
            "gbps_steady": kc.rnd(nbytes / steady / 1e9),
            "gbps_e2e": kc.rnd(nbytes / kc.med(e2e) / 1e9),
            "verified": not bad, "bad": bad[:4]}


def initiator_main(a):
    module = kc.pick_module(a.module)
    ns = [int(x) for x in a.ns.split(",")]
    maxn = max(ns)
    reps_of = REPS["quick" if a.quick else "full"]
    tgt = None
    try:
        agent = kc.new_agent(module, f"descs-ini-{os.getpid()}", a.backend, a.prog)
        local = kc.Slots(maxn, BS)
        local.fill(0, maxn)
        reg = agent.register_memory([(local.base, local.buf.nbytes, 0, "")], "DRAM")
        tgt = (LocalTarget if a.procs == 1 else RemoteTarget)(module, a.backend, a.prog, maxn)
        peer = kc.as_str(agent.add_remote_agent(tgt.md))
        # the connection: one 4 KiB WRITE, timed from make_prepped_xfer to DONE
        lp = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local.descs(1), "DRAM")
        rp = agent.prep_xfer_dlist(peer, remote_descs(tgt.base, 1), "DRAM")
        t0 = time.perf_counter()
        h = agent.make_prepped_xfer("WRITE", lp, [0], rp, [0], b"")
        kc.wait_done(agent, h, agent.transfer(h), tgt.pump, what="first transfer (connect)")
        emit("INFO", {"connect_ms": kc.rnd((time.perf_counter() - t0) * 1e3)})
        agent.release_xfer_handle(h)
        agent.release_dlist_handle(lp)
        agent.release_dlist_handle(rp)
        gen = iter(range(1, 1 << 40))
        for n in ns:
            t0 = time.perf_counter()
            lp = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local.descs(n), "DRAM")
            t1 = time.perf_counter()
            rp = agent.prep_xfer_dlist(peer, remote_descs(tgt.base, n), "DRAM")
            t2 = time.perf_counter()
            prep = {"prep_local_ms": kc.rnd((t1 - t0) * 1e3),
                    "prep_remote_ms": kc.rnd((t2 - t1) * 1e3)}
            for order in a.orders.split(","):
                for op in a.ops.split(","):
                    reps, reposts = reps_of(n)
                    p = measure_point(agent, tgt, local, lp, rp, n, order, op, reps, reposts, gen)
                    p.update(prep)
                    emit("RESULT", p)
            agent.release_dlist_handle(lp)
            agent.release_dlist_handle(rp)
        agent.remove_remote_agent(peer)
        agent.deregister_memory(reg)
        rc = tgt.close()
        tgt = None
        if rc:
            emit("ERROR", f"target exited with status {rc}")
            kc.finish(1)
    except Exception as e:  # noqa: BLE001 - one clear line for the orchestrator, then the trace
        traceback.print_exc()
        print(f"ERROR {type(e).__name__}: {e}".replace("\n", " | "), flush=True)
        if tgt is not None and isinstance(tgt, RemoteTarget):
            tgt.proc.kill()
        kc.finish(1)
    kc.finish(0)


def remote_descs(base, n):
    d = np.zeros((n, 3), dtype=np.uint64)
    d[:, 0] = np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(BS)
    d[:, 1] = BS
    return d


# ----------------------------------------------------------------------------- orchestrator

def pkey(p):
    return (p["op"], p["order"], p["n"])


def table(report):
    """Ours vs UCX per (procs, prog): create ns/desc, first and steady done latency, GB/s."""
    cfgs = report["configs"]
    lines = []
    for procs in (1, 2):
        for prog in (1, 0):
            o = cfgs.get(config("LIBFABRIC", procs, prog)["label"])
            u = cfgs.get(config("UCX", procs, prog)["label"])
            if not o and not u:
                continue
            title = f"{'one process, two agents' if procs == 1 else 'two processes'}, " \
                    f"progress thread {'on' if prog else 'off'}"
            lines.append(f"\n== {title}" + "".join(
                f"\n   {c['label']}: connect {c.get('connect_ms')} ms; " + first_request(c)
                for c in (o, u) if c)
                + "".join(f"\n   {c['label']} FAILED: {c['error']}" for c in (o, u)
                          if c and c.get("error")))
            lines.append(f"{'point':<28} {'create ns/desc':>23} {'first ms':>17} "
                         f"{'steady ms':>17} {'1st/st':>11} {'GB/s steady':>19} "
                         f"{'GB/s e2e':>17} ok")
            lines.append(f"{'':<28} {'ours':>7} {'UCX':>7} {'x':>7} {'ours':>8} {'UCX':>8} "
                         f"{'ours':>8} {'UCX':>8} {'ours':>5} {'UCX':>5} {'ours':>6} "
                         f"{'UCX':>6} {'x':>5} {'ours':>6} {'UCX':>6} {'x':>4}")
            op_ = {pkey(p): p for p in (o or {}).get("points", [])}
            up_ = {pkey(p): p for p in (u or {}).get("points", [])}
            for k in sorted(set(op_) | set(up_), key=lambda k: (k[0] != "WRITE", k[1], k[2])):
                a, b = op_.get(k, {}), up_.get(k, {})

                def f(d, key, w):
                    v = d.get(key)
                    return f"{'-' if v is None else v:>{w}}"
                ok = "/".join("ok" if d.get("verified") else ("BAD" if d else "-")
                              for d in (a, b))
                lines.append(
                    f"{k[0]:<5} {k[1]:<8} {k[2]:>6} x 4 KiB {f(a, 'create_ns_desc', 7)} "
                    f"{f(b, 'create_ns_desc', 7)} "
                    f"{str(kc.ratio(a.get('create_ns_desc'), b.get('create_ns_desc')) or '-'):>7} "
                    f"{f(a, 'first_ms', 8)} {f(b, 'first_ms', 8)} {f(a, 'steady_ms', 8)} "
                    f"{f(b, 'steady_ms', 8)} {f(a, 'first_over_steady', 5)} "
                    f"{f(b, 'first_over_steady', 5)} {f(a, 'gbps_steady', 6)} "
                    f"{f(b, 'gbps_steady', 6)} "
                    f"{str(kc.ratio(a.get('gbps_steady'), b.get('gbps_steady')) or '-'):>5} "
                    f"{f(a, 'gbps_e2e', 6)} {f(b, 'gbps_e2e', 6)} "
                    f"{str(kc.ratio(a.get('gbps_e2e'), b.get('gbps_e2e')) or '-'):>4} {ok}")
    lines.append("\ncreate ns/desc: make_prepped_xfer / descriptors (median of fresh handles); "
                 "first: post -> DONE of a fresh handle; steady: reposts of it; x = ours / UCX "
                 "(create: lower is better, GB/s: higher is better)")
    return "\n".join(lines)


def first_request(c):
    """The first many-descriptor request of the process (the run's first point, first fresh
    handle): what a worker's first request pays after the connection exists."""
    if not c.get("points"):
        return "no points"
    p = c["points"][0]
    return (f"first request of the process ({p['op']} {p['order']} {p['n']} x 4 KiB): create "
            f"{p['create_ms'][0]} ms, post -> DONE {p['first_ms_r0']} ms; that point's median: "
            f"create {kc.rnd(p['create_ns_desc'] * p['n'] / 1e6)} ms, first {p['first_ms']} ms, "
            f"steady {p['steady_ms']} ms")


def goals(report):
    """The issue's CPU-side goals, checked against this run (one process, progress on)."""
    out = []
    o = report["configs"].get("ours-1p", {})
    u = report["configs"].get("ucx-1p", {})
    up_ = {pkey(p): p for p in u.get("points", [])}
    for p in o.get("points", []):
        b = up_.get(pkey(p))
        if p["n"] in (4096, 16384) and b and p["order"] == "shuffled":
            r = kc.ratio(p["create_ns_desc"], b["create_ns_desc"])
            out.append(f"create {p['op']} {p['n']} x 4 KiB, one process: {r}x UCX "
                       f"(goal <= 2x): {'met' if r is not None and r <= 2 else 'NOT met'}")
        if p["n"] == 4096 and p["order"] == "shuffled":
            r = p["first_over_steady"]
            out.append(f"first/steady {p['op']} 4096 x 4 KiB, one process: {r} "
                       f"(goal <= 2): {'met' if r is not None and r <= 2 else 'NOT met'}")
    return out


def plot(report, png):
    plt = kc.pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    panels = (("create_ns_desc", "make_prepped_xfer ns / descriptor", True),
              ("first_ms", "first post -> DONE, ms (fresh handle)", True),
              ("steady_ms", "repost -> DONE, ms (steady)", True),
              ("gbps_e2e", "GB/s end to end (create + post + done)", False))
    styles = {1: "-", 2: "--"}
    for ax, (key, title, logy) in zip(axes.flat, panels):
        for label, c in report["configs"].items():
            pts = [p for p in c.get("points", []) if p["op"] == "WRITE"
                   and p["order"] == "shuffled" and p.get(key) is not None]
            if not pts or not c["prog"]:
                continue
            pts.sort(key=lambda p: p["n"])
            ax.plot([p["n"] for p in pts], [p[key] for p in pts], styles[c["procs"]],
                    marker="o" if c["backend"] == "LIBFABRIC" else "s",
                    color="tab:blue" if c["backend"] == "LIBFABRIC" else "tab:red",
                    label=label)
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("descriptors of 4 KiB (WRITE, shuffled, progress thread on)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"descs.py {report['date']}, {report['nproc']} cores, "
                 f"{report.get('nixl_module')}, rev {report.get('git_rev', '')[:10]}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return True


def orchestrate(a):
    labels = []
    for x in a.configs.split(","):
        if x not in CONFIGS:
            sys.exit(f"unknown config {x}; known: {','.join(CONFIGS)}")
        labels.append(x)
    os.makedirs(a.out, exist_ok=True)
    in_repo = os.path.isfile(os.path.join(ROOT, "Cargo.toml"))
    logdir = a.logdir or (os.path.join(ROOT, "build", "bench", "descs") if in_repo
                          else os.path.join(a.out, "logs"))
    os.makedirs(logdir, exist_ok=True)
    plugin, plugdir = kc.private_plugin(a.plugin, os.path.join(
        "/tmp", f"nixl-descs-{os.getuid()}"))
    module = kc.pick_module(a.module)
    date = datetime.date.today().isoformat()
    report = {"date": date, "started": datetime.datetime.now().isoformat(timespec="seconds"),
              **kc.host_facts(), "git_rev": kc.git_rev(ROOT, HERE), "plugin": plugin,
              "nixl_module": module, "quick": a.quick, "ns": a.ns, "orders": a.orders,
              "ops": a.ops, "bs": BS, "configs": {}}
    t_start = time.time()
    deadline = t_start + a.budget
    for i, label in enumerate(labels):
        c = dict(CONFIGS[label])
        left = deadline - time.time()
        if left < 20:
            c.update(points=[], error="skipped: time budget spent", skipped=True)
            report["configs"][label] = c
            kc.log(f"{label}: skipped (time budget)")
            continue
        timeout = min(left, max(60, left / (len(labels) - i) * 2))
        kc.log(f"{label} ({timeout:.0f} s at most) ...")
        cmd = [sys.executable, os.path.abspath(__file__), "--role", "initiator",
               "--module", module, "--backend", c["backend"], "--procs", c["procs"],
               "--prog", c["prog"], "--ns", a.ns, "--orders", a.orders, "--ops", a.ops]
        if a.quick:
            cmd.append("--quick")
        logpath = os.path.join(logdir, f"{label}.log")
        t0 = time.time()
        points, err = kc.run_child([str(x) for x in cmd], kc.backend_env(c["backend"], plugdir),
                                   timeout, logpath)
        c.update(points=points, error=err, seconds=round(time.time() - t0, 1), log=logpath)
        for line in open(logpath, errors="replace"):
            if line.startswith("INFO "):
                c.update(json.loads(line[5:]))
        if err:
            c["log_tail"] = kc.tail(logpath)
            kc.log(f"{label}: {err}\n{c['log_tail']}")
        report["configs"][label] = c
        kc.log(f"{label}: {len(points)} points in {c['seconds']} s")
    report["seconds"] = round(time.time() - t_start, 1)
    report["loadavg_end"] = os.getloadavg()
    report["table"] = table(report)
    report["goals"] = goals(report)
    print(report["table"])
    if report["goals"]:
        print("\n" + "\n".join(report["goals"]))
    js, png = kc.write_report(report, a.out, f"descs-{date}{a.suffix}", plot, __file__)
    print(f"\nwrote {js}" + (f" and {png}" if png else "") + f" in {report['seconds']} s; "
          f"logs in {logdir}")
    failed = []
    for label, c in report["configs"].items():
        if any(not p["verified"] for p in c["points"]):
            failed.append(f"{label} returned wrong bytes: "
                          + next(p["bad"][0] for p in c["points"] if not p["verified"]))
        if c["backend"] == "LIBFABRIC" and c.get("error") and not c.get("skipped"):
            failed.append(f"{label}: {c['error']}")
    for f in failed:
        print("descs FAILED:", f)
    return 1 if failed else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", default="orchestrate", choices=["orchestrate", "initiator",
                                                              "target"])
    ap.add_argument("--quick", action="store_true",
                    help="CI smoke: 1024 and 4096 descriptors, shuffled, one process, "
                         "progress on, 3 repeats")
    ap.add_argument("--configs", help="labels, comma-separated (default all; quick: "
                                      "ours-1p,ucx-1p)")
    ap.add_argument("--ns", help="descriptor counts (default 1024,4096,16384,65536)")
    ap.add_argument("--orders", help="shuffled,adjacent,reversed (default shuffled,adjacent)")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--logdir")
    ap.add_argument("--suffix", default="", help="appended to the file names' date")
    ap.add_argument("--plugin", default=os.path.join(ROOT, "build", "plugins",
                                                     "libplugin_LIBFABRIC.so"))
    ap.add_argument("--module", help="nixl_cu13 or nixl_cu12 (default: the first that imports)")
    ap.add_argument("--budget", type=float, default=900, help="seconds for the whole run")
    ap.add_argument("--plot", help="plot an existing report (with --png)")
    ap.add_argument("--png")
    # child roles
    ap.add_argument("--backend")
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--prog", type=int, default=1)
    ap.add_argument("--n", type=int)
    ap.add_argument("--fd", type=int)
    a = ap.parse_args()
    if a.quick and not a.suffix:
        a.suffix = "-quick"   # a smoke run never replaces the day's full results
    a.ns = a.ns or ("1024,4096" if a.quick else ",".join(map(str, NS)))
    a.orders = a.orders or ("shuffled" if a.quick else ",".join(ORDERS))
    a.configs = a.configs or ("ours-1p,ucx-1p" if a.quick else ",".join(CONFIGS))
    if a.plot:
        sys.exit(0 if plot(json.load(open(a.plot)), a.png or a.plot[:-5] + ".png") else 1)
    if a.role == "target":
        target_main(a)
    elif a.role == "initiator":
        initiator_main(a)
    else:
        sys.exit(orchestrate(a))


if __name__ == "__main__":
    main()
