"""Two processes: the test process and tests/python/peer.py, metadata exchanged through the
peer's pipe or through the agents' own listener threads on 127.0.0.1."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

import nfutil as U

pytestmark = pytest.mark.two_process
KiB, MiB = 1 << 10, 1 << 20


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Remote:
    """A peer process plus an agent of this process that has loaded the peer's metadata."""

    def __init__(self, ctx, prog=True, params=None, listen=False, peer_params=None):
        self.ctx = ctx
        self.lport = free_port() if listen else 0
        self.pport = free_port() if listen else 0
        self.ini = ctx.agent("tp-ini", prog=prog, listen=listen, port=self.lport or None,
                             params=params)
        self.peer = U.Peer(ctx.name("tp-peer"), prog=prog, listen_port=self.pport,
                           params=params if peer_params is None else peer_params)
        self.nbuf = 0
        if not listen:
            self.load(self.peer.call("md")["md"])

    def load(self, md_hex):
        assert U.as_str(self.ini.add_remote_agent(bytes.fromhex(md_hex))) == self.peer.name

    def alloc(self, nbytes, seed):
        """A random buffer in the peer; returns (id, addr, a local copy of its content)."""
        k = self.nbuf
        self.nbuf += 1
        rep = self.peer.call("alloc", id=k, nbytes=nbytes, seed=seed)
        self.load(rep["md"])
        return k, rep["addr"], U.random_bytes(nbytes, seed)

    def free_all(self):
        """Free the peer's buffers and reload its metadata from scratch (a later buffer may
        reuse a freed address, which must not match a stale registration)."""
        self.peer.call("free_all")
        self.ini.remove_remote_agent(self.peer.name)
        self.load(self.peer.call("md")["md"])

    def close(self):
        self.peer.close()


@pytest.fixture
def remote(ctx):
    made = []

    def make(**kw):
        r = Remote(ctx, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        if r.peer.proc.poll() is None:
            r.close()
        else:
            assert r.peer.proc.returncode == 0, r.peer.log()[-4000:]


def xfer_and_check(r, op, n, size, path="initialize", seed=0, pump=()):
    """op between a local region and a peer buffer with the same slot layout (gaps of 3 B),
    remote slots permuted; the peer checks the notification, the test checks the bytes."""
    ctx, ini = r.ctx, r.ini
    gap = 3
    L = ctx.region(ini, n, size, gap, seed=seed + 1)
    k, raddr, remote = r.alloc(L.buf.nbytes, seed + 2)
    rng = np.random.default_rng(seed + n + size)
    ri = rng.permutation(n) if path == "initialize" else np.arange(n)
    li = np.arange(n)
    rdesc = np.zeros((n, 3), dtype=np.uint64)
    rdesc[:, 0] = np.uint64(raddr) + ri.astype(np.uint64) * np.uint64(size + gap)
    rdesc[:, 1] = size
    msg = f"tp-{op}-{n}x{size}-{seed}".encode()
    if path == "initialize":
        h = ini.initialize_xfer(op, L.xfer_descs(ini, li), ini.get_xfer_descs(rdesc, "DRAM"),
                                r.peer.name, msg)
    else:
        pl = ini.prep_xfer_dlist("NIXL_INIT_AGENT", L.xfer_descs(ini, li))
        pr = ini.prep_xfer_dlist(r.peer.name, ini.get_xfer_descs(rdesc, "DRAM"))
        h = ini.make_prepped_xfer(op, pl, list(range(n)), pr, list(range(n)), msg)
    U.wait_xfer(ini, h, state=ini.transfer(h), pump=pump, what=f"{op} to peer")
    r.peer.call("wait_notif", **{"from": ini.name, "msg": msg.hex()})
    rv = remote[:n * (size + gap)].reshape(n, size + gap)
    lv = L.slots()
    if op == "WRITE":
        rv[ri, :size] = lv[li, :size]
    else:
        U.assert_bytes_equal(lv[li, :size].ravel(), rv[ri, :size].ravel(), "READ from peer")
    got = r.peer.call("digest", id=k)["sha"]
    assert got == U.digest(remote), f"peer buffer after {op} is not as expected"
    ini.release_xfer_handle(h)
    return L, k, raddr, remote


CASES = [(1, 1), (1, 1 * MiB), (64, 4097), (4096, 256),
         pytest.param(1, 64 * MiB, marks=pytest.mark.large),
         pytest.param(64, 1 * MiB, marks=pytest.mark.large)]


@pytest.fixture(scope="module")
def shared_remote(module_ctx):
    """One peer process for the byte-exact matrix (starting one per case costs seconds)."""
    r = Remote(module_ctx)
    yield r
    r.close()


@pytest.mark.parametrize("n,size", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_two_process_bytes_exact(shared_remote, op, n, size):
    xfer_and_check(shared_remote, op, n, size, seed=n + size)
    shared_remote.free_all()


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_two_process_prepped(shared_remote, op):
    xfer_and_check(shared_remote, op, 64, 8 * KiB, path="prepped", seed=1)
    xfer_and_check(shared_remote, op, 16, 64 * KiB, path="prepped", seed=2)
    shared_remote.free_all()


@pytest.mark.parametrize("ours,theirs", [(1, 3), (3, 1)], ids=["1-vs-3-rails", "3-vs-1-rails"])
def test_two_process_unequal_rail_counts(remote, ours, theirs):
    """Network rails only (same-host paths off), a different rail count on each side: one
    rail of the side with fewer reaches several of the other's (each its own tcp
    connection), and WRITEs still end only once every byte landed, notification last."""
    net = {"provider": "tcp", "iface": "lo", "same_host_shm": "false"}
    r = remote(params={**net, "rails": str(ours)}, peer_params={**net, "rails": str(theirs)})
    for i, (op, n, size) in enumerate([("WRITE", 64, 16 * KiB + 1), ("READ", 64, 16 * KiB + 1),
                                       ("WRITE", 3, 2 * MiB)]):
        xfer_and_check(r, op, n, size, seed=30 + i)
        r.free_all()


def test_two_process_progress_thread_off(remote):
    """Both processes without progress threads: the test polls check_xfer_state, the peer
    polls update_notifs while idle."""
    r = remote(prog=False)
    for i, op in enumerate(["WRITE", "READ", "WRITE"]):
        xfer_and_check(r, op, 64, 16 * KiB + 5, seed=10 + i)
    xfer_and_check(r, "READ", 1, 4 * MiB, seed=20)
    r.peer.call("load_md", md=r.ini.get_agent_metadata().hex())
    r.peer.call("send_notif", to=r.ini.name, msg=b"from-peer".hex())
    U.wait_notif(r.ini, r.peer.name, b"from-peer")


def test_two_process_peer_initiates(shared_remote):
    """The peer is the initiator: it WRITEs into and READs from this process's memory."""
    r = shared_remote
    ini = r.ini
    size = 256 * KiB
    k, raddr, remote_copy = r.alloc(size, 30)
    mine = r.ctx.region(ini, 1, size, seed=31)
    r.peer.call("load_md", md=ini.get_agent_metadata().hex())
    r.peer.call("xfer", op="WRITE", id=k, len=size, agent=ini.name, raddr=mine.base,
                notif=b"peer-wrote".hex())
    U.wait_notif(ini, r.peer.name, b"peer-wrote")
    U.assert_bytes_equal(mine.data(), remote_copy, "buffer written by the peer")
    U.fill_random(mine.buf, 32)
    r.peer.call("xfer", op="READ", id=k, len=size, agent=ini.name, raddr=mine.base,
                notif=b"peer-read".hex())
    U.wait_notif(ini, r.peer.name, b"peer-read")
    assert r.peer.call("digest", id=k)["sha"] == U.digest(mine.data()), "peer READ result"


def test_two_process_notifications(shared_remote):
    r = shared_remote
    r.peer.call("load_md", md=r.ini.get_agent_metadata().hex())
    msgs = [f"n-{i}".encode() * (1 + i % 7) for i in range(50)] + [bytes(range(256))]
    for m in msgs:
        r.ini.send_notif(r.peer.name, m)
    for m in msgs:
        r.peer.call("wait_notif", **{"from": r.ini.name, "msg": m.hex()})
    for m in msgs[:10]:
        r.peer.call("send_notif", to=r.ini.name, msg=m.hex())
    for m in msgs[:10]:
        U.wait_notif(r.ini, r.peer.name, m)
    left = r.peer.call("notifs")["notifs"]
    assert not left.get(r.ini.name), left


def test_two_process_listener_thread(remote):
    """Metadata through the agents' listener threads: fetch_remote_metadata and
    send_local_metadata over 127.0.0.1 ports, no pipe."""
    r = remote(listen=True)
    ini = r.ini
    # register in the peer first, then fetch its metadata by listener
    rep = r.peer.call("alloc", id=0, nbytes=1 * MiB, seed=40)
    r.nbuf = 1
    raddr, remote_copy = rep["addr"], U.random_bytes(1 * MiB, 40)
    peer_desc = ini.get_xfer_descs([(raddr, 1 * MiB, 0)], "DRAM")
    ini.fetch_remote_metadata(r.peer.name, "127.0.0.1", r.pport)
    deadline = time.monotonic() + U.WAIT_S
    while not ini.check_remote_metadata(r.peer.name, peer_desc):
        assert time.monotonic() < deadline, "peer metadata never arrived through the listener"
        time.sleep(0.01)
    ini.send_local_metadata("127.0.0.1", r.pport)
    r.peer.call("wait_md", agent=ini.name)
    L = r.ctx.region(ini, 1, 1 * MiB, seed=41)
    for op in ("WRITE", "READ"):
        if op == "READ":
            U.fill_random(L.buf, 42)
        msg = f"listen-{op}".encode()
        h = ini.initialize_xfer(op, L.xfer_descs(ini, [0]), peer_desc, r.peer.name, msg)
        U.run_xfer(ini, h, what=f"{op} after listener exchange")
        r.peer.call("wait_notif", **{"from": ini.name, "msg": msg.hex()})
        ini.release_xfer_handle(h)
        if op == "WRITE":
            remote_copy[:] = L.data()
        else:
            U.assert_bytes_equal(L.data(), remote_copy, "READ after listener exchange")
        assert r.peer.call("digest", id=0)["sha"] == U.digest(remote_copy)
    r.peer.call("send_notif", to=ini.name, msg=b"listener-back".hex())
    U.wait_notif(ini, r.peer.name, b"listener-back")


def test_two_process_remove_and_add_again(remote):
    r = remote()
    L, k, raddr, remote_copy = xfer_and_check(r, "WRITE", 4, 64 * KiB, seed=50)
    for cycle in range(2):
        r.ini.remove_remote_agent(r.peer.name)
        r.load(r.peer.call("md")["md"])
        xfer_and_check(r, "WRITE" if cycle else "READ", 4, 64 * KiB, seed=51 + cycle)


def test_two_process_peer_exit(remote):
    """The peer exits (cleanly, status 0); a transfer to it then fails with an exception or
    ERR within a bounded time, and the agent keeps working with a new peer."""
    params = {} if U.IS_UCX else {"timeout_ms": "3000"}
    r = remote(params=params)
    L, k, raddr, remote_copy = xfer_and_check(r, "WRITE", 1, 256 * KiB, seed=60)
    r.close()
    desc = r.ini.get_xfer_descs([(raddr, 256 * KiB, 0)], "DRAM")
    t0 = time.monotonic()
    outcome = None
    h = None
    try:
        h = r.ini.initialize_xfer("WRITE", L.xfer_descs(r.ini, [0]), desc, r.peer.name, b"x")
        state = r.ini.transfer(h)
        while state == "PROC" and time.monotonic() - t0 < 30:
            state = r.ini.check_xfer_state(h)
            time.sleep(0.001)
        outcome = state
    except Exception as e:  # the expected path: a NIXL error
        outcome = type(e).__name__
    U.eprint(f"transfer to exited peer: {outcome} after {time.monotonic() - t0:.2f} s")
    assert outcome not in ("PROC", "DONE"), f"transfer to an exited peer: {outcome}"
    if h is not None:
        try:
            r.ini.release_xfer_handle(h)
        except Exception:
            pass
    try:
        r.ini.remove_remote_agent(r.peer.name)
    except Exception:
        pass
    # a new peer process; the same local agent
    r.peer = U.Peer(r.ctx.name("tp-peer2"), params=params)
    r.nbuf = 0
    r.load(r.peer.call("md")["md"])
    xfer_and_check(r, "WRITE", 4, 64 * KiB, seed=61)
    xfer_and_check(r, "READ", 4, 64 * KiB, seed=62)
