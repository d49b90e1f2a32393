"""Concurrency through the stock agent's thread-sync modes: 8 application threads post to 2
peers on one engine (one initiator agent, one backend), NF_TEST_SYNC_REQS requests each
(default 10000), byte-exact, with sync_mode NONE, STRICT and RW, progress thread on and off.

How it works:
  * One initiator agent (the mode under test, progress thread on or off) and two target agents
    (same mode, progress thread on) in this process. Each thread t owns, per peer p, 4 slots
    of 4 KiB in the initiator's source region, 4 in its read-back region and 4 in peer p's
    target region; no two threads ever touch the same bytes.
  * A thread alternates peers: it posts one request to peer 0 and one to peer 1, then waits
    for both (at most one request in flight per thread and peer), so 16 requests are in flight
    on the engine at once. Before a WRITE it fills its source descriptors with bytes that
    identify the request: an 8-byte stamp (thread, peer, descriptor, request number), then
    bytes from a per-thread random pool at a per-request offset.
  * Handles are prepared once per thread and peer and reposted (the realistic pattern): two
    initialize_xfer WRITE handles and two make_prepped_xfer WRITE handles, 1-3 descriptors of
    64..4096 B, and one READ handle over the 4 slots. Every 50th request at a peer is a fresh
    initialize_xfer handle released after it completes (create/release concurrent with posts),
    and the last request to each peer is a fresh handle carrying a notification.
  * The thread keeps a shadow of what its target slots must hold. Every 8th request to a peer
    is a READ of the 4 slots, compared with the shadow; every 16th WRITE is followed by a
    direct comparison of the target memory with the shadow. At the end the main thread
    compares all target memory (and the bytes between slots, which nothing may write), and
    collects exactly one notification per thread at each peer.
  * Every wait is bounded (NF_TEST_WAIT_S), and the main thread fails the test when no thread
    makes progress for NF_TEST_WAIT_S.

Sync modes (nixl_thread_sync_t; the agent builds its lock from it, src/core/sync.h):
  STRICT  every agent call takes one exclusive lock: threads call the agent freely.
  RW      calls that change the agent's tables take the lock exclusively, the data path
          (create/post/status) shares it: threads call freely and the backend sees concurrent
          posts and polls. (The backend is also told the mode in its init params.)
  NONE    the agent takes no lock at all, and the backend is told that its caller serializes.
          The caller must then guarantee that no two threads are inside the agent at once, so
          in this mode every call of the initiator (prepare, post, poll, release) goes through
          one test-side lock (`Serialized`); the worker threads still interleave their requests
          to both peers, and the backend's own progress thread still runs concurrently.
"""

from __future__ import annotations

import faulthandler
import os
import struct
import sys
import threading
import time

import numpy as np
import pytest

import nfutil as U
from nixl_cu12._api import nixl_thread_sync_t

REQS = int(os.environ.get("NF_TEST_SYNC_REQS", "10000"))  # requests per thread
THREADS = 8
PEERS = 2
SLOTS = 4              # per thread and peer
SLOT = 4096            # bytes per slot (largest descriptor)
GAP = 16               # bytes between slots that no descriptor covers
POOL = 64 << 10        # per-thread random pool the payloads are cut from

# Reposted WRITE handles, per thread and peer: (path, [(slot, length), ...]).
VARIANTS = [
    ("initialize", [(0, 64)]),
    ("initialize", [(1, 4096), (2, 1000)]),
    ("prepped", [(3, 4096), (0, 2048), (2, 4096)]),
    ("prepped", [(2, 333), (1, 64)]),
]
READ_EVERY = 8         # request k at a peer with k % 8 == 7 is a READ of all 4 slots
FRESH_EVERY = 50       # k % 50 == 25: a fresh initialize_xfer handle, released afterwards
CHECK_EVERY = 16       # every 16th WRITE: compare the target memory with the shadow

MODES = {
    "NONE": nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE,
    "STRICT": nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    "RW": nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
}


class Serialized:
    """The agent with every method call under one lock: what NIXL_THREAD_SYNC_NONE requires
    of an application that calls one agent from several threads (the agent itself does no
    locking in that mode). The lock wait is bounded like every other wait of the suite."""

    def __init__(self, agent, lock):
        self._agent, self._lock = agent, lock
        self.name = agent.name

    def __getattr__(self, attr):
        v = getattr(self._agent, attr)
        if not callable(v):
            return v

        def call(*a, **kw):
            if not self._lock.acquire(timeout=U.WAIT_S):
                raise AssertionError(f"agent lock not free after {U.WAIT_S:.0f} s ({attr})")
            try:
                return v(*a, **kw)
            finally:
                self._lock.release()
        return call


def descs(region, idx, lens):
    """Nx3 descriptor array: slot idx[i] of region, its first lens[i] bytes."""
    d = np.zeros((len(idx), 3), dtype=np.uint64)
    d[:, 0] = np.uint64(region.base + region.off) + np.asarray(idx, np.uint64) * np.uint64(
        region.stride)
    d[:, 1] = np.asarray(lens, np.uint64)
    return d


def stamp_of(row: np.ndarray) -> str:
    t, p, d, k = struct.unpack("<BBHI", row[:8].tobytes())
    return f"stamp(thread {t}, peer {p}, desc {d}, request {k})"


def expect(actual: np.ndarray, expected: np.ndarray, what: str):
    """actual and expected are (slots, SLOT) arrays; on a mismatch name the first bad byte and
    the stamps of the slot as found and as expected (which request's data landed there)."""
    if np.array_equal(actual, expected):
        return
    bad = np.argwhere(actual != expected)
    s, o = bad[0]
    raise AssertionError(
        f"{what}: {len(bad)} bytes differ; first in slot {s} at offset {o} (got {actual[s, o]},"
        f" expected {expected[s, o]}); slot holds {stamp_of(actual[s])}, expected "
        f"{stamp_of(expected[s])}")


class Worker:
    def __init__(self, t, agent, L, RB, R, peers, n, stop):
        self.t, self.agent, self.L, self.RB, self.R, self.peers = t, agent, L, RB, R, peers
        self.n, self.stop = n, stop
        self.pool = U.random_bytes(POOL + SLOT, 1000 + t)
        # shadow[p]: what thread t's 4 slots at peer p must hold (starts as the target's bytes)
        self.shadow = [R[p].slots()[self.rslots(), :SLOT].copy() for p in range(PEERS)]
        self.done = 0               # requests completed (read by the main thread)
        self.counts = {"write": 0, "read": 0, "fresh": 0, "checks": 0}
        self.error = None
        self.final = {}             # peer -> notification message of the last request
        self.handles = {}           # (p, v) -> reposted handle
        self.dlists = []

    def lslots(self, p):            # thread t's slots for peer p in L and RB
        b = (self.t * PEERS + p) * SLOTS
        return np.arange(b, b + SLOTS)

    def rslots(self):               # thread t's slots in each target region
        return np.arange(self.t * SLOTS, (self.t + 1) * SLOTS)

    def prepare(self):
        a = self.agent
        for p, peer in enumerate(self.peers):
            ls, rs = self.lslots(p), self.rslots()
            prepped = sorted({sl for path, v in VARIANTS if path == "prepped" for sl in v})
            pl = a.prep_xfer_dlist("NIXL_INIT_AGENT", a.get_xfer_descs(
                descs(self.L, ls[[s for s, _ in prepped]], [n for _, n in prepped]), "DRAM"))
            pr = a.prep_xfer_dlist(peer, a.get_xfer_descs(
                descs(self.R[p], rs[[s for s, _ in prepped]], [n for _, n in prepped]), "DRAM"))
            self.dlists += [pl, pr]
            for v, (path, dl) in enumerate(VARIANTS):
                if path == "initialize":
                    self.handles[p, v] = self.create("WRITE", p, dl)
                else:
                    ix = np.array([prepped.index(x) for x in dl], dtype=np.int32)
                    self.handles[p, v] = a.make_prepped_xfer("WRITE", pl, ix, pr, ix)
            self.handles[p, "read"] = a.initialize_xfer(
                "READ", a.get_xfer_descs(descs(self.RB, ls, [SLOT] * SLOTS), "DRAM"),
                a.get_xfer_descs(descs(self.R[p], rs, [SLOT] * SLOTS), "DRAM"), peer)

    def create(self, op, p, dl, msg=b""):
        a, ls, rs = self.agent, self.lslots(p), self.rslots()
        idx, lens = [s for s, _ in dl], [n for _, n in dl]
        return a.initialize_xfer(op, a.get_xfer_descs(descs(self.L, ls[idx], lens), "DRAM"),
                                 a.get_xfer_descs(descs(self.R[p], rs[idx], lens), "DRAM"),
                                 self.peers[p], msg)

    def fill(self, p, k, dl):
        """Write request k's payload into the source descriptors dl for peer p."""
        src = self.L.slots()
        for d, (s, n) in enumerate(dl):
            o = (k * 7919 + d * 1231 + p * 577) % POOL
            row = src[self.lslots(p)[s]]
            row[:n] = self.pool[o:o + n]
            row[:8] = np.frombuffer(struct.pack("<BBHI", self.t, p, d, k), np.uint8)

    def plan(self, p, k):
        """(kind, handle, descriptors, fresh, msg) of request k at peer p."""
        last = k == (self.n - 1 - p) // PEERS
        if last:
            msg = f"sync-{self.t}-{p}-{k}".encode()
            self.final[p] = msg
            return "write", None, VARIANTS[1][1], True, msg
        if k % READ_EVERY == READ_EVERY - 1:
            return "read", self.handles[p, "read"], None, False, b""
        if k % FRESH_EVERY == FRESH_EVERY // 2:
            return "write", None, VARIANTS[(k // FRESH_EVERY) % len(VARIANTS)][1], True, b""
        v = k % len(VARIANTS)
        return "write", self.handles[p, v], VARIANTS[v][1], False, b""

    def run(self):
        try:
            self.prepare()
            i = 0
            while i < self.n and not self.stop.is_set():
                batch = []
                for j in range(i, min(i + PEERS, self.n)):  # one request to each peer
                    p, k = j % PEERS, j // PEERS
                    kind, h, dl, fresh, msg = self.plan(p, k)
                    if kind == "write":
                        self.fill(p, k, dl)
                    if fresh:
                        h = self.create("WRITE", p, dl, msg)
                    batch.append((p, k, kind, h, dl, fresh, self.agent.transfer(h)))
                for p, k, kind, h, dl, fresh, state in batch:
                    U.wait_xfer(self.agent, h, state=state,
                                what=f"thread {self.t} request {k} to peer {p} ({kind})")
                    if fresh:
                        self.agent.release_xfer_handle(h)
                        self.counts["fresh"] += 1
                    self.completed(p, k, kind, dl)
                    self.done += 1
                i += PEERS
        except BaseException as e:  # reported by the main thread
            self.error = f"thread {self.t}: {type(e).__name__}: {e}"
            self.stop.set()

    def completed(self, p, k, kind, dl):
        sh, ls = self.shadow[p], self.lslots(p)
        if kind == "read":
            self.counts["read"] += 1
            expect(self.RB.slots()[ls, :SLOT], sh,
                   f"thread {self.t}: READ {k} from peer {p} (read-back vs what was written)")
            return
        src = self.L.slots()
        for s, n in dl:
            sh[s, :n] = src[ls[s], :n]
        self.counts["write"] += 1
        if self.counts["write"] % CHECK_EVERY == 0:
            self.counts["checks"] += 1
            expect(self.R[p].slots()[self.rslots(), :SLOT], sh,
                   f"thread {self.t}: target {p} memory after WRITE {k}")

    def release(self):
        for h in self.handles.values():
            self.agent.release_xfer_handle(h)
        for d in self.dlists:
            self.agent.release_dlist_handle(d)
        self.handles.clear()
        self.dlists.clear()


def join_all(threads, workers, stop):
    """Wait for the workers while any of them makes progress (no fixed total bound: the run
    time depends on the host), and fail when none has for NF_TEST_WAIT_S."""
    last, t_last = -1, time.monotonic()
    while any(th.is_alive() for th in threads):
        for th in threads:
            th.join(0.2)
        s = sum(w.done for w in workers)
        if s != last:
            last, t_last = s, time.monotonic()
        elif time.monotonic() - t_last > U.WAIT_S + 5:
            stop.set()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            raise AssertionError(
                f"no request completed for {U.WAIT_S + 5:.0f} s; done per thread "
                f"{[w.done for w in workers]} of {REQS} (stacks on stderr)")


@pytest.mark.parametrize("prog", [True, False], ids=["prog", "noprog"])
@pytest.mark.parametrize("mode", list(MODES))
def test_sync_modes(ctx, mode, prog):
    ini = ctx.agent("sm-ini", prog=prog, sync_mode=MODES[mode])
    tgts = [ctx.agent(f"sm-tgt{p}", prog=True, sync_mode=MODES[mode]) for p in range(PEERS)]
    L = ctx.region(ini, THREADS * PEERS * SLOTS, SLOT, GAP, seed=90, off=8)
    RB = ctx.region(ini, THREADS * PEERS * SLOTS, SLOT, GAP, seed=91, off=8)
    R = [ctx.region(tg, THREADS * SLOTS, SLOT, GAP, seed=92 + p, off=8)
         for p, tg in enumerate(tgts)]
    for tg in tgts:
        U.connect(ini, tg)
    outside = [r.outside() for r in (L, RB, *R)]
    # NONE: the agent does no locking, so the application serializes its calls (see above).
    agent = Serialized(ini, threading.Lock()) if mode == "NONE" else ini
    stop = threading.Event()
    workers = [Worker(t, agent, L, RB, R, [tg.name for tg in tgts], REQS, stop)
               for t in range(THREADS)]
    threads = [threading.Thread(target=w.run, name=f"sync-{mode}-{t}", daemon=True)
               for t, w in enumerate(workers)]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    join_all(threads, workers, stop)
    elapsed = time.monotonic() - t0
    errors = [w.error for w in workers if w.error]
    assert not errors, "\n".join(errors)
    assert [w.done for w in workers] == [REQS] * THREADS

    for p in range(PEERS):
        expect(R[p].slots()[:, :SLOT], np.concatenate([w.shadow[p] for w in workers]),
               f"target {p} memory at the end")
    for r, snap, what in zip((L, RB, *R), outside, ["source", "read-back", "target 0",
                                                    "target 1"]):
        assert r.outside() == snap, f"{mode}: bytes outside the descriptors of {what} changed"
    for p, tg in enumerate(tgts):
        for w in workers:
            if p in w.final:
                U.wait_notif(tg, ini.name, w.final[p], pump=(ini,))
        tg.update_notifs()
        assert not tg.notifs.get(ini.name), \
            f"extra notifications at target {p}: {U.summarize_notifs(tg.notifs)}"
    for w in workers:
        w.release()
    c = {k: sum(w.counts[k] for w in workers) for k in workers[0].counts}
    U.eprint(f"sync {mode} ({'prog' if prog else 'noprog'}): {THREADS} threads x {REQS} "
             f"requests to {PEERS} peers in {elapsed:.1f} s ({THREADS * REQS / elapsed:.0f}/s); "
             f"{c['write']} WRITE ({c['fresh']} fresh handles), {c['read']} READ verified, "
             f"{c['checks']} target checks")
