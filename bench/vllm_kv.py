#!/usr/bin/env python3
"""The vLLM KV pattern (issue #23): a decode worker pulls one request's KV blocks from a
prefill worker, two processes on one GPU, through the stock NIXL agent; ours next to stock UCX
in the same run, and a torch gather of the same blocks in one process as the device's own rate.

    vllm_kv.py [--mem vram|dram] [--quick] [--out DIR] [--plugin SO] [--backends LIBFABRIC,UCX]
               [--requests 16,64,256,1024] [--variants random,contiguous] [--layers 32]
               [--total-blocks 2048] [--budget S]
    vllm_kv.py --plot JSON --png PNG          (the plot alone, from a written report)

Layout (vLLM FlashAttention): per layer one tensor [2 (K/V), total_blocks, 16 tokens, 8 heads,
128] bf16, 32 layers; a block of one layer's K or V is 16*8*128*2 = 32 KiB, contiguous. Both
processes register every layer tensor (one register_memory call); the decode process preps
ONE descriptor list per side with a descriptor per (layer, K/V, block) of all blocks, once.
A request of n blocks is then 32 x 2 x n descriptors (16 blocks: 1,024; 256: 16,384):
  decode  picks its destination blocks and the prefill's source blocks (random: like a block
          allocator after a while, neighbours in the request not neighbours in memory; contiguous: one run),
          zeroes its destination blocks, then make_prepped_xfer("READ", local_idx, remote_idx,
          notif) (timed: create), transfer (timed: post), polls until DONE (done); the prefill
          side waits for the notification (its arrival, same clock, gives notif_ms); decode
          compares its blocks with the expected pattern on the device (torch). Then the same
          handle is reposted (steady) a few times, each zeroed before and checked after.
  pattern every int16 of (layer, K/V, block) is a function of (layer, K/V, block, position),
          written by the prefill once; a block that arrives in the wrong place, shifted, partly
          or not at all is found.
Before the requests, a request of one block opens the connection (connect_ms), so `first`
(the first post of a fresh handle) is measured on an existing connection.
Reported per (n, variant, backend): create ms and ns per descriptor, post us, done ms (first
post), end to end (create + post + done) ms and GB/s, steady repost ms and GB/s, first/steady,
notif_ms, verified. Gather baseline: per layer index_select of the same source blocks into a
packed tensor (cuda-event timed; GB/s counts the bytes once) and the gather-scatter
dst[:, lb] = src[:, rb] that the transfer is equivalent to.

--mem dram runs the same code (same descriptors, same requests, same checks) on numpy host
buffers registered as DRAM, with smaller defaults (8 layers, 512 blocks, requests 16,64,256):
the CPU machine's exercise of the script, no torch needed. --mem vram needs torch with CUDA.

Every wait has a deadline; a point stops repeating after --point-s seconds (UCX can take
seconds per request); children run with timeouts and are killed with their process group.
Writes DIR/vllm-kv-<date>[-dram].json and .png; exit status 1 if any block arrived wrong or one
of our runs failed.
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
TOKENS, HEADS, HEAD_DIM, ELEM = 16, 8, 128, 2        # bf16
BLOCK_ELEMS = TOKENS * HEADS * HEAD_DIM               # int16 per (layer, K/V, block)
BLOCK_BYTES = BLOCK_ELEMS * ELEM                      # 32 KiB
DEFAULTS = {"vram": {"layers": 32, "total_blocks": 2048, "requests": "16,64,256,1024"},
            "dram": {"layers": 8, "total_blocks": 512, "requests": "16,64,256"}}


# ----------------------------------------------------------------------------- memory
# Two implementations of one small interface; everything else (descriptors, requests,
# timing, checks) is shared. The pattern of int16 element e of block b of (layer l, K/V kv):
#   base = ((l * 2 + kv) << 20) + b + 1;  value = ((base * 40503 + e * 7 + (base >> 4)) mod
#   65536) - 32768


class NumpyMem:
    kind = "DRAM"

    def __init__(self):
        self.xp = np

    def caches(self, layers, total):
        out = []
        for _ in range(layers):
            buf = kc.alloc(2 * total * BLOCK_BYTES)      # pre-faulted
            out.append(buf.view(np.int16).reshape(2, total, BLOCK_ELEMS))
        return out

    @staticmethod
    def ptr(c):
        return c.ctypes.data

    @staticmethod
    def nbytes(c):
        return c.nbytes

    def dev(self):
        return 0

    def index(self, a):
        return np.asarray(a, dtype=np.int64)

    def pattern(self, layer, blocks):
        base = ((np.arange(2, dtype=np.int64)[:, None] + layer * 2) << 20) \
            + blocks[None, :].astype(np.int64) + 1
        e = np.arange(BLOCK_ELEMS, dtype=np.int64)
        v = (base[:, :, None] * 40503 + e[None, None, :] * 7 + (base[:, :, None] >> 4)) & 0xFFFF
        return (v - 32768).astype(np.int16)

    def fill(self, caches):
        total = caches[0].shape[1]
        for lay, c in enumerate(caches):
            for a in range(0, total, 64):
                blocks = np.arange(a, min(total, a + 64))
                c[:, a:a + len(blocks)] = self.pattern(lay, blocks)

    def zero(self, caches, lb):
        for c in caches:
            c[:, lb] = 0

    def check(self, caches, lb, rb):
        bad, first = 0, None
        for lay, c in enumerate(caches):
            for a in range(0, len(lb), 64):
                got = c[:, lb[a:a + 64]]
                exp = self.pattern(lay, rb[a:a + 64])
                rows = np.argwhere((got != exp).any(axis=2))
                if len(rows):
                    bad += len(rows)
                    if first is None:
                        kv, j = rows[0]
                        first = f"layer {lay} {'KV'[kv]} block {lb[a + j]} <- {rb[a + j]}"
        return None if not bad else f"{bad} of {2 * len(caches) * len(lb)} blocks differ; " \
                                    f"first {first}"

    def sync(self):
        pass

    def gather(self, src, dst, packed, rb, lb, reps):
        """(packed seconds, gather-scatter seconds) medians, perf_counter timed."""
        tp, tg = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            for s, p in zip(src, packed):
                np.take(s, rb, axis=1, out=p)
            t1 = time.perf_counter()
            for s, d in zip(src, dst):
                d[:, lb] = s[:, rb]
            t2 = time.perf_counter()
            tp.append(t1 - t0)
            tg.append(t2 - t1)
        return kc.med(tp), kc.med(tg)

    def packed_ok(self, packed, rb):
        return all(np.array_equal(p, self.pattern(lay, rb))
                   for lay, p in enumerate(packed))


class TorchMem:
    kind = "VRAM"

    def __init__(self):
        import torch
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device (use --mem dram on a host without one)")
        self.t = torch
        torch.cuda.set_device(0)
        self.device = torch.device("cuda", 0)

    def caches(self, layers, total):
        t = self.t
        out = [t.empty((2, total, TOKENS, HEADS, HEAD_DIM), dtype=t.bfloat16, device=self.device)
               for _ in range(layers)]
        for c in out:
            c.zero_()   # touched once: no lazy mapping behind the first transfer
        t.cuda.synchronize()
        return out

    @staticmethod
    def ptr(c):
        return c.data_ptr()

    @staticmethod
    def nbytes(c):
        return c.numel() * c.element_size()

    def dev(self):
        return self.device.index

    def i16(self, c):
        return c.view(self.t.int16).view(2, c.shape[1], BLOCK_ELEMS)

    def index(self, a):
        return self.t.as_tensor(np.asarray(a, dtype=np.int64), device=self.device)

    def pattern(self, layer, blocks):
        t = self.t
        base = ((t.arange(2, dtype=t.int64, device=self.device)[:, None] + layer * 2) << 20) \
            + blocks[None, :].to(t.int64) + 1
        e = t.arange(BLOCK_ELEMS, dtype=t.int64, device=self.device)
        v = (base[:, :, None] * 40503 + e[None, None, :] * 7 + (base[:, :, None] >> 4)) & 0xFFFF
        return (v - 32768).to(t.int16)

    def fill(self, caches):
        total = caches[0].shape[1]
        for lay, c in enumerate(caches):
            c16 = self.i16(c)
            for a in range(0, total, 256):
                blocks = self.t.arange(a, min(total, a + 256), device=self.device)
                c16[:, a:a + len(blocks)] = self.pattern(lay, blocks)
        self.t.cuda.synchronize()

    def zero(self, caches, lb):
        for c in caches:
            self.i16(c)[:, lb] = 0

    def check(self, caches, lb, rb):
        bad, first = 0, None
        for lay, c in enumerate(caches):
            got = self.i16(c)[:, lb]
            exp = self.pattern(lay, rb)
            wrong = (got != exp).any(dim=2)
            nb = int(wrong.sum())
            if nb:
                bad += nb
                if first is None:
                    kv, j = (int(x) for x in wrong.nonzero()[0])
                    first = f"layer {lay} {'KV'[kv]} block {int(lb[j])} <- {int(rb[j])}"
        return None if not bad else f"{bad} of {2 * len(caches) * len(lb)} blocks differ; " \
                                    f"first {first}"

    def sync(self):
        self.t.cuda.synchronize()

    def gather(self, src, dst, packed, rb, lb, reps):
        t = self.t
        tp, tg = [], []
        for _ in range(reps + 1):      # the first is a warm-up (allocator, kernels)
            e0, e1, e2 = (t.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record()
            for s, p in zip(src, packed):
                t.index_select(s, 1, rb, out=p)
            e1.record()
            for s, d in zip(src, dst):
                d[:, lb] = s[:, rb]
            e2.record()
            e2.synchronize()
            tp.append(e0.elapsed_time(e1) / 1e3)
            tg.append(e1.elapsed_time(e2) / 1e3)
        return kc.med(tp[1:]), kc.med(tg[1:])

    def packed_ok(self, packed, rb):
        return all(bool((self.i16(p) == self.pattern(lay, rb)).all())
                   for lay, p in enumerate(packed))


def make_mem(kind):
    return TorchMem() if kind == "vram" else NumpyMem()


# ----------------------------------------------------------------------------- requests

def all_descs(ptrs, total, dev):
    """One descriptor per (layer, K/V, block), index (layer * 2 + kv) * total + block."""
    p = np.asarray(ptrs, dtype=np.uint64)
    addr = (p[:, None, None] + (np.arange(2, dtype=np.uint64) * np.uint64(total * BLOCK_BYTES))
            [None, :, None] + (np.arange(total, dtype=np.uint64) * np.uint64(BLOCK_BYTES))
            [None, None, :]).reshape(-1)
    d = np.zeros((addr.size, 3), dtype=np.uint64)
    d[:, 0] = addr
    d[:, 1] = BLOCK_BYTES
    d[:, 2] = dev
    return d


def req_index(layers, total, blocks):
    """The request's descriptor indices: every layer, K then V, the blocks in request order."""
    lk = (np.arange(layers)[:, None] * 2 + np.arange(2)[None, :]) * total
    return (lk[:, :, None] + np.asarray(blocks)[None, None, :]).reshape(-1).astype(np.int32)


def pick_blocks(rng, total, n, variant):
    """Block ids as a scheduler hands them out: random (no two neighbours adjacent in memory)
    or one contiguous run."""
    if variant == "contiguous":
        s = int(rng.integers(0, total - n + 1))
        return np.arange(s, s + n)
    b = rng.permutation(total)[:n]
    for i in np.flatnonzero(np.abs(np.diff(b)) == 1):
        free = np.setdiff1d(np.arange(total), b)
        far = free[np.abs(free - b[i]) > 1]
        if far.size:
            b[i + 1] = far[int(rng.integers(0, far.size))]
    return b


# ----------------------------------------------------------------------------- prefill (target)

def prefill_main(a):
    ch = kc.Chan(socket.socket(fileno=a.fd))
    try:
        mem = make_mem(a.mem)
        agent = kc.new_agent(a.module, f"prefill-{os.getpid()}", a.backend, 1)
        caches = mem.caches(a.layers, a.total_blocks)
        mem.fill(caches)
        reg = agent.register_memory([(mem.ptr(c), mem.nbytes(c), mem.dev(), "") for c in caches],
                                    mem.kind)
        ch.send(md=agent.get_agent_metadata().hex(), ptrs=[mem.ptr(c) for c in caches],
                dev=mem.dev())
    except Exception as e:  # noqa: BLE001 - told to the decode process, which reports it
        traceback.print_exc()
        ch.send(error=f"prefill setup: {type(e).__name__}: {e}")
        kc.finish(2)
    seen = {}          # notification -> arrival times (time.monotonic, same clock as decode)

    def take():
        for _who, msgs in agent.get_new_notifs().items():
            now = time.monotonic()
            for m in msgs:
                seen.setdefault(bytes(m), []).append(now)

    def idle():
        take()
        os.sched_yield()
    while True:
        try:
            m = ch.recv(timeout=3600, idle=idle)
        except kc.ChanError:
            break
        if m["cmd"] == "quit":
            break
        if m["cmd"] == "notif":
            msg, count = bytes.fromhex(m["msg"]), m["count"]
            deadline = time.monotonic() + m.get("timeout", kc.WAIT_S)
            while len(seen.get(msg, ())) < count and time.monotonic() < deadline:
                take()
                os.sched_yield()
            got = seen.get(msg, [])
            if len(got) >= count:
                ch.send(ok=True, t=got[count - 1])
            else:
                ch.send(error=f"notification {msg!r} #{count} not received within "
                              f"{m.get('timeout', kc.WAIT_S):.0f} s (got {len(got)}; "
                              f"others: {sorted(seen)[:6]})")
    agent.deregister_memory(reg)
    kc.finish(0)


# ----------------------------------------------------------------------------- decode (initiator)

def emit(kind, obj):
    print(kind + " " + json.dumps(obj), flush=True)


def decode_main(a):
    module = kc.pick_module(a.module)
    proc = ch = None
    try:
        mem = make_mem(a.mem)
        agent = kc.new_agent(module, f"decode-{os.getpid()}", a.backend, 1)
        caches = mem.caches(a.layers, a.total_blocks)
        reg = agent.register_memory([(mem.ptr(c), mem.nbytes(c), mem.dev(), "") for c in caches],
                                    mem.kind)
        proc, ch = kc.spawn_peer(__file__, [
            "--role", "prefill", "--module", module, "--backend", a.backend, "--mem", a.mem,
            "--layers", a.layers, "--total-blocks", a.total_blocks])
        hello = ch.recv(timeout=300)
        peer = kc.as_str(agent.add_remote_agent(bytes.fromhex(hello["md"])))
        T, L = a.total_blocks, a.layers
        t0 = time.perf_counter()
        lp = agent.prep_xfer_dlist("NIXL_INIT_AGENT",
                                   all_descs([mem.ptr(c) for c in caches], T, mem.dev()), mem.kind)
        t1 = time.perf_counter()
        rp = agent.prep_xfer_dlist(peer, all_descs(hello["ptrs"], T, hello["dev"]), mem.kind)
        t2 = time.perf_counter()
        emit("INFO", {"prep_local_ms": kc.rnd((t1 - t0) * 1e3),
                      "prep_remote_ms": kc.rnd((t2 - t1) * 1e3), "descs_per_side": L * 2 * T})
        rng = np.random.default_rng(23)
        notes = iter(range(1 << 40))

        def one(n_blocks, variant, reposts, deadline):
            rb = pick_blocks(rng, T, n_blocks, variant)
            lb = pick_blocks(rng, T, n_blocks, variant)
            lidx, ridx = req_index(L, T, lb), req_index(L, T, rb)
            lbt, rbt = mem.index(lb), mem.index(rb)
            notif = f"kv-{a.backend}-{n_blocks}-{variant}-{next(notes)}".encode()
            res = {"bad": []}
            mem.zero(caches, lbt)
            mem.sync()
            pc = time.perf_counter
            t0 = pc()
            h = agent.make_prepped_xfer("READ", lp, lidx, rp, ridx, notif)
            t1 = pc()
            tm = time.monotonic()
            st = agent.transfer(h)
            t2 = pc()
            kc.wait_done(agent, h, st, what=f"READ {n_blocks} blocks, first post")
            t3 = pc()
            res.update(create=t1 - t0, post=t2 - t1, done=t3 - t1, e2e=t3 - t0, steady=[],
                       notif=[])
            arr = ch.call(cmd="notif", msg=notif.hex(), count=1, timeout=kc.WAIT_S + 15)["t"]
            res["notif"].append(arr - tm)
            b = mem.check(caches, lbt, rbt)
            if b:
                res["bad"].append(f"first post: {b}")
            for k in range(reposts):
                if k and time.monotonic() > deadline:
                    break
                mem.zero(caches, lbt)
                mem.sync()
                t1 = pc()
                tm = time.monotonic()
                st = agent.transfer(h)
                kc.wait_done(agent, h, st, what=f"READ {n_blocks} blocks, repost")
                res["steady"].append(pc() - t1)
                arr = ch.call(cmd="notif", msg=notif.hex(), count=k + 2,
                              timeout=kc.WAIT_S + 15)["t"]
                res["notif"].append(arr - tm)
                b = mem.check(caches, lbt, rbt)
                if b:
                    res["bad"].append(f"repost {k}: {b}")
            t4 = pc()
            agent.release_xfer_handle(h)
            res["release"] = pc() - t4
            return res

        c = one(1, "contiguous", 0, 0)
        emit("INFO", {"connect_ms": kc.rnd(c["e2e"] * 1e3),
                      "connect_verified": not c["bad"]})
        for n in a.requests:
            for variant in a.variants:
                t_end = time.monotonic() + a.point_s
                runs = []
                for r in range(a.reps):
                    if r and time.monotonic() > t_end:
                        break
                    runs.append(one(n, variant, a.reposts, t_end))
                emit("RESULT", summarize(runs, n, variant, L, a.reps))
        agent.release_dlist_handle(lp)
        agent.release_dlist_handle(rp)
        agent.remove_remote_agent(peer)
        agent.deregister_memory(reg)
        rc = kc.stop_peer(proc, ch)
        proc = None
        if rc:
            emit("ERROR", f"prefill exited with status {rc}")
            kc.finish(1)
    except Exception as e:  # noqa: BLE001 - one clear line for the orchestrator, then the trace
        traceback.print_exc()
        print(f"ERROR {type(e).__name__}: {e}".replace("\n", " | "), flush=True)
        if proc is not None and proc.poll() is None:
            proc.kill()
        kc.finish(1)
    kc.finish(0)


def summarize(runs, n, variant, layers, reps):
    nd = layers * 2 * n
    nbytes = nd * BLOCK_BYTES
    med = kc.med
    create, done, e2e = (med([r[k] for r in runs]) for k in ("create", "done", "e2e"))
    steady = med([s for r in runs for s in r["steady"]])
    bad = [b for r in runs for b in r["bad"]]
    return {"blocks": n, "variant": variant, "descs": nd, "bytes": nbytes, "runs": len(runs),
            "bounded": len(runs) < reps,
            "create_ms": kc.rnd(create * 1e3), "create_ns_desc": kc.rnd(create / nd * 1e9),
            "create_ns_desc_first": kc.rnd(runs[0]["create"] / nd * 1e9),
            "post_us": kc.rnd(med([r["post"] for r in runs]) * 1e6),
            "done_ms": kc.rnd(done * 1e3), "e2e_ms": kc.rnd(e2e * 1e3),
            "gbps_e2e": kc.rnd(nbytes / e2e / 1e9),
            "steady_ms": kc.rnd(steady * 1e3) if steady else None,
            "gbps_steady": kc.rnd(nbytes / steady / 1e9) if steady else None,
            "first_over_steady": kc.ratio(done, steady),
            "notif_ms": kc.rnd(med([x for r in runs for x in r["notif"]]) * 1e3),
            "release_us": kc.rnd(med([r["release"] for r in runs]) * 1e6),
            "e2e_all_ms": [kc.rnd(r["e2e"] * 1e3) for r in runs],
            "create_all_ms": [kc.rnd(r["create"] * 1e3) for r in runs],
            "done_all_ms": [kc.rnd(r["done"] * 1e3) for r in runs],
            "verified": not bad, "bad": bad[:4]}


# ----------------------------------------------------------------------------- gather baseline

def gather_main(a):
    """The same blocks copied by the device itself, one process, no NIXL."""
    try:
        mem = make_mem(a.mem)
        src = mem.caches(a.layers, a.total_blocks)
        mem.fill(src)
        dst = mem.caches(a.layers, a.total_blocks)
        rng = np.random.default_rng(23)
        for n in a.requests:
            for variant in a.variants:
                rb = pick_blocks(rng, a.total_blocks, n, variant)
                lb = pick_blocks(rng, a.total_blocks, n, variant)
                rbt, lbt = mem.index(rb), mem.index(lb)
                packed = mem.caches(a.layers, n)   # the request's blocks, packed per layer
                tp, tg = mem.gather(src, dst, packed, rbt, lbt, a.gather_reps)
                mem.sync()
                ok = mem.packed_ok(packed, rbt) and mem.check(dst, lbt, rbt) is None
                nbytes = a.layers * 2 * n * BLOCK_BYTES
                emit("RESULT", {"blocks": n, "variant": variant, "bytes": nbytes,
                                "packed_ms": kc.rnd(tp * 1e3), "gbps_packed": kc.rnd(nbytes / tp / 1e9),
                                "scatter_ms": kc.rnd(tg * 1e3), "gbps_scatter": kc.rnd(nbytes / tg / 1e9),
                                "verified": ok})
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        print(f"ERROR {type(e).__name__}: {e}".replace("\n", " | "), flush=True)
        kc.finish(1)
    kc.finish(0)


# ----------------------------------------------------------------------------- orchestrator

def table(report):
    o = {(p["blocks"], p["variant"]): p for p in report["runs"].get("LIBFABRIC", {}).get("points", [])}
    u = {(p["blocks"], p["variant"]): p for p in report["runs"].get("UCX", {}).get("points", [])}
    g = {(p["blocks"], p["variant"]): p for p in report["runs"].get("gather", {}).get("points", [])}
    lines = [f"{report['mem'].upper()}, {report['layers']} layers x [2, {report['total_blocks']}, "
             f"16, 8, 128] bf16 per side, blocks of 32 KiB; READ with notification; "
             f"ours {report['runs'].get('LIBFABRIC', {}).get('connect_ms')} ms / UCX "
             f"{report['runs'].get('UCX', {}).get('connect_ms')} ms to connect"]
    for who in ("LIBFABRIC", "UCX", "gather"):
        err = report["runs"].get(who, {}).get("error")
        if err:
            lines.append(f"{who} FAILED: {err}")
    for who in ("LIBFABRIC", "UCX"):
        pts = report["runs"].get(who, {}).get("points")
        if pts:
            p = pts[0]
            lines.append(f"{who}: first request of the process ({p['blocks']} blocks, "
                         f"{p['variant']}): create {p['create_all_ms'][0]} ms, post -> DONE "
                         f"{p['done_all_ms'][0]} ms; that point's median: create {p['create_ms']} "
                         f"ms, done {p['done_ms']} ms, steady {p['steady_ms']} ms")
    hdr = (f"{'request':<22} {'descs':>6} | {'ours: create ms':>15} {'ns/d':>6} {'post us':>8} "
           f"{'done ms':>8} {'e2e GB/s':>9} {'steady ms':>9} {'1st/st':>6} {'notif ms':>8} | "
           f"{'UCX: create ms':>14} {'ns/d':>6} {'done ms':>8} {'e2e GB/s':>9} {'steady ms':>9} | "
           f"{'create x':>8} {'e2e x':>7} | {'gather GB/s':>11} {'g+s GB/s':>9} | ok")
    lines += [hdr, "-" * len(hdr)]

    def f(d, k, w):
        v = d.get(k)
        return f"{'-' if v is None else v:>{w}}"
    for k in sorted(set(o) | set(u) | set(g)):
        a, b, c = o.get(k, {}), u.get(k, {}), g.get(k, {})
        size = (a or b or c).get("bytes", 0) / kc.MiB
        ok = "/".join("ok" if d.get("verified") else ("BAD" if d else "-") for d in (a, b, c))
        lines.append(
            f"{k[0]:>5} {k[1]:<10} {size:>4.0f}M {f(a or b, 'descs', 6)} | {f(a, 'create_ms', 15)} "
            f"{f(a, 'create_ns_desc', 6)} {f(a, 'post_us', 8)} {f(a, 'done_ms', 8)} "
            f"{f(a, 'gbps_e2e', 9)} {f(a, 'steady_ms', 9)} {f(a, 'first_over_steady', 6)} "
            f"{f(a, 'notif_ms', 8)} | {f(b, 'create_ms', 14)} {f(b, 'create_ns_desc', 6)} "
            f"{f(b, 'done_ms', 8)} {f(b, 'gbps_e2e', 9)} {f(b, 'steady_ms', 9)} | "
            f"{str(kc.ratio(a.get('create_ns_desc'), b.get('create_ns_desc')) or '-'):>8} "
            f"{str(kc.ratio(a.get('gbps_e2e'), b.get('gbps_e2e')) or '-'):>7} | "
            f"{f(c, 'gbps_packed', 11)} {f(c, 'gbps_scatter', 9)} | {ok}"
            + (" (bounded)" if a.get("bounded") or b.get("bounded") else ""))
    lines.append("create x = ours / UCX per descriptor (lower is better); e2e x = ours / UCX "
                 "end-to-end GB/s (create + post + done of a fresh handle); gather: "
                 "index_select (torch; numpy take for DRAM) of the same blocks into a packed "
                 "tensor, g+s: dst[:, lb] = src[:, rb] (one process, the device's own rate)")
    return "\n".join(lines)


def goals(report):
    o = {(p["blocks"], p["variant"]): p for p in report["runs"].get("LIBFABRIC", {}).get("points", [])}
    u = {(p["blocks"], p["variant"]): p for p in report["runs"].get("UCX", {}).get("points", [])}
    out = []

    def verdict(ok):
        return "met" if ok else "NOT met"
    for (n, v), p in sorted(o.items()):
        if v != "random":
            continue
        b = u.get((n, v))
        if b:
            r = kc.ratio(p["create_ns_desc"], b["create_ns_desc"])
            out.append(f"create per descriptor, {n} blocks: {r}x UCX (goal <= 1.0): "
                       f"{verdict(r is not None and r <= 1.0)}")
        fs = p.get("first_over_steady")
        out.append(f"first/steady, {n} blocks: {fs} (goal <= 2): {verdict(fs is not None and fs <= 2)}")
    if report["mem"] == "vram":
        p256, p1k = o.get((256, "random")), o.get((1024, "random"))
        if p256:
            out.append(f"256 blocks end to end: {p256['gbps_e2e']} GB/s (goal >= 100): "
                       f"{verdict(p256['gbps_e2e'] >= 100)}")
        if p256 and p1k:
            out.append(f"1024 blocks end to end: {p1k['gbps_e2e']} GB/s vs 256: {p256['gbps_e2e']} "
                       f"(goal: at least as fast): {verdict(p1k['gbps_e2e'] >= p256['gbps_e2e'])}")
    return out


def plot(report, png):
    plt = kc.pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    runs = report["runs"]
    colors = {"LIBFABRIC": "tab:blue", "UCX": "tab:red", "gather": "tab:green"}
    for variant, style in (("random", "-"), ("contiguous", "--")):
        for who, key, ax_i, lab in (("LIBFABRIC", "gbps_e2e", 0, "ours e2e"),
                                    ("UCX", "gbps_e2e", 0, "UCX e2e"),
                                    ("gather", "gbps_packed", 0, "gather (packed)"),
                                    ("LIBFABRIC", "create_ns_desc", 1, "ours"),
                                    ("UCX", "create_ns_desc", 1, "UCX"),
                                    ("LIBFABRIC", "done_ms", 2, "ours first"),
                                    ("LIBFABRIC", "steady_ms", 2, "ours steady"),
                                    ("UCX", "done_ms", 2, "UCX first"),
                                    ("UCX", "steady_ms", 2, "UCX steady")):
            pts = sorted((p for p in runs.get(who, {}).get("points", [])
                          if p["variant"] == variant and p.get(key)), key=lambda p: p["blocks"])
            if pts:
                axes[ax_i].plot([p["blocks"] for p in pts], [p[key] for p in pts], style,
                                marker="s" if "steady" in key else "o", color=colors[who],
                                alpha=0.6 if "steady" in key else 1.0,
                                label=f"{lab} ({variant})")
    for ax, title in zip(axes, ("GB/s end to end (create + post + done)",
                                "make_prepped_xfer ns per descriptor",
                                "post -> DONE ms: first post of a fresh handle, and reposts")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("blocks per request")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    where = report.get("gpu") or f"{report['nproc']} cores"
    fig.suptitle(f"vLLM KV pattern, {report['mem'].upper()}, {report['layers']} layers, "
                 f"{report['date']}, {where}, rev {report.get('git_rev', '')[:10]}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return True


def gpu_name():
    import subprocess
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def orchestrate(a):
    if a.mem == "vram":
        try:
            import torch  # noqa: F401 - only whether it is there; children use the device
        except ImportError as e:
            sys.exit(f"vllm_kv: --mem vram needs torch ({e}); on a host without it: --mem dram")
    os.makedirs(a.out, exist_ok=True)
    in_repo = os.path.isfile(os.path.join(ROOT, "Cargo.toml"))
    logdir = a.logdir or (os.path.join(ROOT, "build", "bench", "vllm_kv") if in_repo
                          else os.path.join(a.out, "logs"))
    os.makedirs(logdir, exist_ok=True)
    plugin, plugdir = kc.private_plugin(a.plugin, os.path.join("/tmp", f"nixl-vllm-kv-{os.getuid()}"))
    module = kc.pick_module(a.module)
    date = datetime.date.today().isoformat()
    report = {"date": date, "started": datetime.datetime.now().isoformat(timespec="seconds"),
              **kc.host_facts(), "git_rev": kc.git_rev(ROOT, HERE), "plugin": plugin,
              "nixl_module": module, "mem": a.mem, "layers": a.layers,
              "total_blocks": a.total_blocks, "requests": a.requests, "variants": a.variants,
              "reps": a.reps, "reposts": a.reposts, "point_s": a.point_s,
              "block_bytes": BLOCK_BYTES, "runs": {}}
    if a.mem == "vram":
        report["gpu"] = gpu_name()
        try:
            import torch
            report["torch"] = torch.__version__
        except ImportError:
            pass
    common = ["--module", module, "--mem", a.mem, "--layers", a.layers, "--total-blocks",
              a.total_blocks, "--requests", ",".join(map(str, a.requests)),
              "--variants", ",".join(a.variants), "--reps", a.reps, "--reposts", a.reposts,
              "--point-s", a.point_s, "--gather-reps", a.gather_reps]
    t_start = time.time()
    deadline = t_start + a.budget
    whos = (["gather"] if not a.no_gather else []) + a.backends
    for i, who in enumerate(whos):
        left = deadline - time.time()
        if left < 20:
            report["runs"][who] = {"points": [], "error": "skipped: time budget spent",
                                   "skipped": True}
            continue
        timeout = min(left, max(60, left / (len(whos) - i) * 1.5))
        kc.log(f"{who} ({timeout:.0f} s at most) ...")
        role = ["--role", "gather"] if who == "gather" else ["--role", "decode", "--backend", who]
        cmd = [sys.executable, os.path.abspath(__file__), *role, *common]
        logpath = os.path.join(logdir, f"{who}.log")
        t0 = time.time()
        env = kc.backend_env(who, plugdir)
        points, err = kc.run_child([str(x) for x in cmd], env, timeout, logpath)
        r = {"points": points, "error": err, "seconds": round(time.time() - t0, 1), "log": logpath}
        for line in open(logpath, errors="replace"):
            if line.startswith("INFO "):
                r.update(json.loads(line[5:]))
        if err:
            r["log_tail"] = kc.tail(logpath)
            kc.log(f"{who}: {err}\n{r['log_tail']}")
        report["runs"][who] = r
        kc.log(f"{who}: {len(points)} points in {r['seconds']} s")
    report["seconds"] = round(time.time() - t_start, 1)
    report["loadavg_end"] = os.getloadavg()
    report["table"] = table(report)
    report["goals"] = goals(report)
    print(report["table"])
    if report["goals"]:
        print("\n" + "\n".join(report["goals"]))
    stem = f"vllm-kv-{date}" + ("-dram" if a.mem == "dram" else "") + a.suffix
    js, png = kc.write_report(report, a.out, stem, plot, __file__)
    print(f"\nwrote {js}" + (f" and {png}" if png else "") + f" in {report['seconds']} s; "
          f"logs in {logdir}")
    failed = []
    for who, r in report["runs"].items():
        if any(not p["verified"] for p in r["points"]):
            p = next(p for p in r["points"] if not p["verified"])
            failed.append(f"{who} returned wrong bytes: {p.get('bad', ['(gather check)'])[:1]}")
        if who != "UCX" and r.get("error") and not r.get("skipped"):
            failed.append(f"{who}: {r['error']}")
    for f in failed:
        print("vllm_kv FAILED:", f)
    return 1 if failed else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", default="orchestrate",
                    choices=["orchestrate", "decode", "prefill", "gather"])
    ap.add_argument("--mem", default="vram", choices=["vram", "dram"])
    ap.add_argument("--quick", action="store_true", help="2 repeats, 1 repost, random only")
    ap.add_argument("--backends", default="LIBFABRIC,UCX")
    ap.add_argument("--no-gather", action="store_true")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--total-blocks", type=int)
    ap.add_argument("--requests", help="blocks per request (vram: 16,64,256,1024)")
    ap.add_argument("--variants", default="random,contiguous")
    ap.add_argument("--reps", type=int, default=5, help="fresh requests per point")
    ap.add_argument("--reposts", type=int, default=3, help="reposts of each request's handle")
    ap.add_argument("--point-s", type=float, default=20.0,
                    help="a point stops repeating after this many seconds")
    ap.add_argument("--gather-reps", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--logdir")
    ap.add_argument("--suffix", default="")
    ap.add_argument("--plugin", default=os.path.join(ROOT, "build", "plugins",
                                                     "libplugin_LIBFABRIC.so"))
    ap.add_argument("--module", help="nixl_cu13 or nixl_cu12 (default: the first that imports)")
    ap.add_argument("--budget", type=float, default=480, help="seconds for the whole run")
    ap.add_argument("--plot", help="plot an existing report (with --png)")
    ap.add_argument("--png")
    ap.add_argument("--backend")
    ap.add_argument("--fd", type=int)
    a = ap.parse_args()
    if a.quick and not a.suffix:
        a.suffix = "-quick"   # a smoke run never replaces the day's full results
    d = DEFAULTS[a.mem]
    a.layers = a.layers or d["layers"]
    a.total_blocks = a.total_blocks or d["total_blocks"]
    a.requests = [int(x) for x in (a.requests or d["requests"]).split(",")]
    a.variants = a.variants.split(",")
    a.backends = [b for b in a.backends.split(",") if b]
    if a.quick:
        a.reps, a.reposts, a.gather_reps = 2, 1, 3
        if a.variants == ["random", "contiguous"]:
            a.variants = ["random"]
    if max(a.requests) > a.total_blocks:
        sys.exit(f"vllm_kv: a request of {max(a.requests)} blocks needs --total-blocks >= that")
    if a.plot:
        sys.exit(0 if plot(json.load(open(a.plot)), a.png or a.plot[:-5] + ".png") else 1)
    {"prefill": prefill_main, "decode": decode_main, "gather": gather_main}.get(
        a.role, lambda a: sys.exit(orchestrate(a)))(a)


if __name__ == "__main__":
    main()
