"""Transfers between two agents of one process: byte-exact WRITE and READ, both request paths,
notifications, reposts, loopback, progress thread on and off."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import nfutil as U
from nixl_cu12._api import nixl_thread_sync_t

KiB, MiB = 1 << 10, 1 << 20
large = pytest.mark.large

# (descriptor count, bytes per descriptor, request path). The 64 MiB cases are marked large.
CASES = []
for _n, _size, _large in [(1, 1, 0), (1, 4097, 0), (1, 1 * MiB, 0), (1, 64 * MiB, 1),
                          (64, 1, 0), (64, 4097, 0), (64, 1 * MiB, 1),
                          (4096, 1, 0), (4096, 4 * KiB, 0), (4096, 16 * KiB, 1)]:
    for _path in ("initialize", "prepped"):
        if _large and _n > 1 and _path == "prepped":
            continue  # the big multi-descriptor cases run once, on the initialize path
        CASES.append(pytest.param(_n, _size, _path, marks=[large] if _large else [],
                                  id=f"{_n}x{_size // MiB}MiB-{_path}" if _size >= MiB
                                  else f"{_n}x{_size}-{_path}"))


def layout(n, size, path, seed):
    """Local order li and remote order ri: descriptor i moves local slot li[i] <-> remote ri[i].

    initialize_xfer: remote slots permuted and gaps between slots, so a wrong pairing or an
    overlong write is seen. make_prepped_xfer: no gaps and the first half in order, so the
    agent merges that half into one descriptor and the rest stays separate.
    """
    rng = np.random.default_rng(n * 1000003 + size)
    li = np.arange(n)
    if path == "initialize":
        ri = rng.permutation(n)
    else:
        h = n // 2
        ri = np.concatenate([np.arange(h), h + rng.permutation(n - h)])
    return li, ri


def do_transfer(ctx, ini, tgt, op, n, size, path, seed=0, notif=True, pump=()):
    gap = 0 if path == "prepped" else (3 if size < 64 * KiB else 4 * KiB)
    L = ctx.region(ini, n, size, gap, seed=seed + 1, off=1 if size < 4 * KiB else 0)
    R = ctx.region(tgt, n, size, gap + (5 if gap else 0), seed=seed + 2, off=0)
    U.connect(ini, tgt)
    li, ri = layout(n, size, path, seed)
    msg = f"{op}-{path}-{n}x{size}-{seed}".encode() if notif else b""
    if path == "initialize":
        h = ini.initialize_xfer(op, L.xfer_descs(ini, li), R.xfer_descs(ini, ri), tgt.name, msg)
        dl = ()
    else:
        pl = ini.prep_xfer_dlist("NIXL_INIT_AGENT", L.xfer_descs(ini, np.arange(n)))
        pr = ini.prep_xfer_dlist(tgt.name, R.xfer_descs(ini, np.arange(n)))
        h = ini.make_prepped_xfer(op, pl, li.astype(np.int32), pr, ri.astype(np.int32), msg)
        dl = (pl, pr)
    src, dst = (L, R) if op == "WRITE" else (R, L)
    src_digest, dst_outside = U.digest(src.buf), dst.outside()
    U.run_xfer(ini, h, pump=pump, notif=msg if notif else None, target=tgt,
               what=f"{op} {n}x{size}")
    if op == "WRITE":
        U.check_slots(R, ri, L, li, "target after WRITE")
    else:
        U.check_slots(L, li, R, ri, "initiator after READ")
    assert dst.outside() == dst_outside, f"{op} wrote outside its descriptors"
    assert U.digest(src.buf) == src_digest, f"source of the {op} changed"
    ini.release_xfer_handle(h)
    for d in dl:
        ini.release_dlist_handle(d)
    return L, R


@pytest.mark.parametrize("n,size,path", CASES)
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_bytes_exact(ctx, op, n, size, path):
    ini, tgt = ctx.pair()
    do_transfer(ctx, ini, tgt, op, n, size, path)


@pytest.mark.parametrize("mode", ["both_off", "initiator_off", "target_off"])
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_progress_thread_off(ctx, op, mode):
    """enable_prog_thread=False: the test thread progresses by polling check_xfer_state on
    the initiator and update_notifs on the target."""
    ini, tgt = ctx.pair(prog_init=mode == "target_off", prog_target=mode == "initiator_off")
    pump = (tgt,) if mode != "initiator_off" else ()
    do_transfer(ctx, ini, tgt, op, 64, 4097, "initialize", seed=3, pump=pump)
    do_transfer(ctx, ini, tgt, op, 1, 2 * MiB, "prepped", seed=4, pump=pump)


def test_progress_off_get_new_notifs(ctx):
    """Both progress threads off; the target collects with get_new_notifs (not update_notifs)."""
    ini, tgt = ctx.pair(prog_init=False, prog_target=False)
    L = ctx.region(ini, 8, 64 * KiB, seed=5)
    R = ctx.region(tgt, 8, 64 * KiB, seed=6)
    U.connect(ini, tgt)
    h = ini.initialize_xfer("WRITE", L.xfer_descs(ini, range(8)), R.xfer_descs(ini, range(8)),
                            tgt.name, b"gnn-1")
    state = ini.transfer(h)
    got = []
    deadline = U.time.monotonic() + U.WAIT_S
    while state == "PROC" or not got:
        if state == "PROC":
            state = ini.check_xfer_state(h)
        new = tgt.get_new_notifs()
        got += new.get(ini.name, [])
        ini.update_notifs()
        assert U.time.monotonic() < deadline, f"state {state}, notifs {got}"
    assert state == "DONE"
    assert got == [b"gnn-1"]
    U.assert_bytes_equal(R.data(), L.data(), "target")
    # nothing else arrives later
    assert not tgt.get_new_notifs().get(ini.name)
    ini.release_xfer_handle(h)


def _follow(ctx, poll_initiator):
    ini, tgt = ctx.pair()
    n, size = 32, 512 * KiB
    L = ctx.region(ini, n, size, seed=7)
    R = ctx.region(tgt, n, size, seed=8)
    U.connect(ini, tgt)
    for rep in range(3):
        U.fill_random(L.buf, 100 + rep)
        msg = f"follow-{rep}".encode()
        h = ini.initialize_xfer("WRITE", L.xfer_descs(ini, range(n)),
                                R.xfer_descs(ini, range(n)), tgt.name, msg)
        state = ini.transfer(h)
        deadline = U.time.monotonic() + U.WAIT_S
        while True:
            tgt.update_notifs()
            if U.take_notif(tgt, ini.name, msg):
                break
            if poll_initiator and state == "PROC":
                state = ini.check_xfer_state(h)
            assert U.time.monotonic() < deadline, f"no notification {msg!r}; state {state}"
        U.assert_bytes_equal(R.data(), L.data(), f"target when notification {msg!r} arrived")
        U.wait_xfer(ini, h, state=state)
        ini.release_xfer_handle(h)


def test_notification_follows_data(ctx):
    """The target checks the data the moment the notification arrives (the initiator polls
    its state meanwhile but the target never waits for it)."""
    _follow(ctx, poll_initiator=True)


@pytest.mark.ours_only  # stock UCX sends the notification only when the initiator polls
def test_notification_without_initiator_polling(ctx):
    """With progress threads on, a posted WRITE and its notification complete even if the
    initiator never calls check_xfer_state until the notification has arrived."""
    _follow(ctx, poll_initiator=False)


def test_send_notif(ctx):
    ini, tgt = ctx.pair()
    U.connect(ini, tgt)
    msgs = [b"hello", b"\x00\x01\xff\x00binary\x00", bytes(range(256)) * 4, b"x" * 1000]
    msgs += [f"seq-{i}".encode() for i in range(100)]
    for m in msgs:
        ini.send_notif(tgt.name, m)
    for m in msgs:
        U.wait_notif(tgt, ini.name, m)
    tgt.update_notifs()
    assert not tgt.notifs.get(ini.name), f"extra notifications {U.summarize_notifs(tgt.notifs)}"


@pytest.mark.parametrize("size", [64 * KiB, 64 * KiB + 1, 1 * MiB])
def test_large_notification(ctx, size):
    """A notification up to 64 KiB (our default max_notif_size) is delivered intact; a bigger
    one is either refused with an exception when sent or delivered intact, never truncated
    or lost. The same holds for the message attached to a transfer."""
    ini, tgt = ctx.pair()
    L = ctx.region(ini, 1, 4096, seed=60)
    R = ctx.region(tgt, 1, 4096, seed=61)
    U.connect(ini, tgt)
    msg = U.random_bytes(size, size).tobytes()
    for how in ("send_notif", "transfer"):
        m = bytes([ord(how[0])]) + msg[1:]
        try:
            if how == "send_notif":
                ini.send_notif(tgt.name, m)
            else:
                h = ini.initialize_xfer("WRITE", L.xfer_descs(ini, [0]), R.xfer_descs(ini, [0]),
                                        tgt.name, m)
                try:
                    U.wait_xfer(ini, h, state=ini.transfer(h))
                finally:
                    ini.release_xfer_handle(h)
        except Exception as e:
            assert size > 64 * KiB, f"{how} of a {size} B notification refused: {e!r}"
            U.eprint(f"{how} of a {size} B notification refused: {type(e).__name__}")
            continue
        U.wait_notif(tgt, ini.name, m)
    ini.send_notif(tgt.name, b"small-after")
    U.wait_notif(tgt, ini.name, b"small-after")


def test_send_notif_both_directions(ctx):
    a, b = ctx.pair()
    U.connect(a, b)
    U.connect(b, a)
    a.send_notif(b.name, b"a->b")
    b.send_notif(a.name, b"b->a")
    U.wait_notif(b, a.name, b"a->b")
    U.wait_notif(a, b.name, b"b->a")


def test_transfer_with_and_without_notif(ctx):
    """A transfer without a notification delivers none; one with a message delivers it once."""
    ini, tgt = ctx.pair()
    L = ctx.region(ini, 1, 4096, seed=9)
    R = ctx.region(tgt, 1, 4096, seed=10)
    U.connect(ini, tgt)
    h = ini.initialize_xfer("WRITE", L.xfer_descs(ini, [0]), R.xfer_descs(ini, [0]), tgt.name)
    U.run_xfer(ini, h)
    U.assert_bytes_equal(R.data(), L.data(), "target")
    ini.release_xfer_handle(h)
    h = ini.initialize_xfer("READ", L.xfer_descs(ini, [0]), R.xfer_descs(ini, [0]), tgt.name,
                            b"with-notif")
    U.run_xfer(ini, h, notif=b"with-notif", target=tgt)
    ini.release_xfer_handle(h)
    tgt.update_notifs()
    assert not tgt.notifs.get(ini.name), U.summarize_notifs(tgt.notifs)


@pytest.mark.parametrize("path", ["initialize", "prepped"])
def test_repost(ctx, path):
    """Repost one handle, with a new message or with none. With none, the 1.5.1 agent re-sends
    the most recent message of that handle (the creation message until a post gives one)."""
    ini, tgt = ctx.pair()
    n, size = 16, 64 * KiB
    L = ctx.region(ini, n, size, seed=11)
    R = ctx.region(tgt, n, size, seed=12)
    U.connect(ini, tgt)
    if path == "initialize":
        h = ini.initialize_xfer("WRITE", L.xfer_descs(ini, range(n)),
                                R.xfer_descs(ini, range(n)), tgt.name, b"r-create")
    else:
        pl = ini.prep_xfer_dlist("", L.xfer_descs(ini, range(n)))
        pr = ini.prep_xfer_dlist(tgt.name, R.xfer_descs(ini, range(n)))
        h = ini.make_prepped_xfer("WRITE", pl, list(range(n)), pr, list(range(n)), b"r-create")
    plan = [None, None, b"r-2", b"r-3", None, b"r-5"]
    last = b"r-create"
    for i, msg in enumerate(plan):
        U.fill_random(L.buf, 200 + i)
        last = msg or last
        U.run_xfer(ini, h, notif=last, target=tgt, notif_msg=msg or b"")
        U.assert_bytes_equal(R.data(), L.data(), f"target after post {i}")
    ini.release_xfer_handle(h)
    tgt.update_notifs()
    assert not tgt.notifs.get(ini.name), U.summarize_notifs(tgt.notifs)


@pytest.mark.parametrize("plan_at_post", ["true", "false"])
def test_plan_at_post_or_prep(ctx, plan_at_post):
    """Where the descriptors are planned (prepXfer, or the first postXfer with plan_at_post)
    changes no outcome: a handle released unposted, and a request posted three times (READ and
    WRITE, prepped in a shuffled local order with a notification), bytes checked each time."""
    if U.IS_UCX:
        pytest.skip("a key of our plugin")
    ini, tgt = ctx.pair(params={"plan_at_post": plan_at_post})
    n, size = 64, 16 * KiB
    L = ctx.region(ini, n, size, seed=21)
    R = ctx.region(tgt, n, size, seed=22)
    U.connect(ini, tgt)
    pl = ini.prep_xfer_dlist("", L.xfer_descs(ini, range(n)))
    pr = ini.prep_xfer_dlist(tgt.name, R.xfer_descs(ini, range(n)))
    idx = list(np.random.default_rng(5).permutation(n))
    never = ini.make_prepped_xfer("WRITE", pl, idx, pr, list(range(n)), b"never")
    ini.release_xfer_handle(never)
    for op in ("WRITE", "READ"):
        h = ini.make_prepped_xfer(op, pl, idx, pr, list(range(n)), b"p-" + op.encode())
        for i in range(3):
            U.fill_random(L.buf if op == "WRITE" else R.buf, 300 + i)
            U.run_xfer(ini, h, notif=b"p-" + op.encode(), target=tgt)
            if op == "WRITE":
                U.check_slots(R, list(range(n)), L, idx, f"target after WRITE post {i}")
            else:
                U.check_slots(L, idx, R, list(range(n)), f"initiator after READ post {i}")
        ini.release_xfer_handle(h)
    ini.release_dlist_handle(pl)
    ini.release_dlist_handle(pr)
    tgt.update_notifs()
    assert not tgt.notifs.get(ini.name), U.summarize_notifs(tgt.notifs)


@pytest.mark.parametrize("plan_at_post", ["true", "false"])
def test_many_descriptors_planned_in_parts(ctx, plan_at_post):
    """A request of 40000 descriptors planned by four threads at once (plan_threads; on a
    host of eight cores or more that is the default) moves every byte to its slot, READ and
    WRITE, posted twice, through the agent's own descriptor lists (the C ABI's meta lists)."""
    if U.IS_UCX:
        pytest.skip("a key of our plugin")
    ini, tgt = ctx.pair(params={"plan_at_post": plan_at_post, "plan_threads": "4"})
    n, size = 40000, 64
    L = ctx.region(ini, n, size, 8, seed=31)
    R = ctx.region(tgt, n, size, 24, seed=32)
    U.connect(ini, tgt)
    pl = ini.prep_xfer_dlist("", L.xfer_descs(ini, range(n)))
    pr = ini.prep_xfer_dlist(tgt.name, R.xfer_descs(ini, range(n)))
    ri = list(np.random.default_rng(7).permutation(n))
    for op in ("WRITE", "READ"):
        h = ini.make_prepped_xfer(op, pl, list(range(n)), pr, ri, b"parts-" + op.encode())
        for i in range(2):
            U.fill_random(L.buf if op == "WRITE" else R.buf, 400 + i)
            src, dst = (L, R) if op == "WRITE" else (R, L)
            src_digest, dst_outside = U.digest(src.buf), dst.outside()
            U.run_xfer(ini, h, notif=b"parts-" + op.encode(), target=tgt, what=f"{op} {n} descriptors")
            if op == "WRITE":
                U.check_slots(R, ri, L, list(range(n)), f"target after WRITE post {i}")
            else:
                U.check_slots(L, list(range(n)), R, ri, f"initiator after READ post {i}")
            assert dst.outside() == dst_outside, f"{op} wrote outside its descriptors"
            assert U.digest(src.buf) == src_digest, f"source of the {op} changed"
        ini.release_xfer_handle(h)
    ini.release_dlist_handle(pl)
    ini.release_dlist_handle(pr)


def test_repost_while_active(ctx):
    """Posting a handle that is still in progress is refused (nixlRepostActiveError) or, if it
    has finished meanwhile, accepted; either way the data ends up right."""
    from nixl_cu12._bindings import nixlRepostActiveError

    ini, tgt = ctx.pair()
    n, size = 64, 512 * KiB
    L = ctx.region(ini, n, size, seed=13)
    R = ctx.region(tgt, n, size, seed=14)
    U.connect(ini, tgt)
    h = ini.initialize_xfer("WRITE", L.xfer_descs(ini, range(n)), R.xfer_descs(ini, range(n)),
                            tgt.name)
    refused = 0
    for _ in range(3):
        state = ini.transfer(h)
        try:
            state = ini.transfer(h)
        except nixlRepostActiveError:
            refused += 1
        U.wait_xfer(ini, h, state=state)
    U.assert_bytes_equal(R.data(), L.data(), "target")
    ini.release_xfer_handle(h)
    U.eprint(f"repost while active: refused {refused} of 3")


@pytest.mark.parametrize("path", ["initialize", "prepped"])
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_loopback(ctx, op, path):
    """Remote agent = the agent itself: self MDs, one completion, notification to itself."""
    a = ctx.agent("self")
    n, size = 64, 8 * KiB + 3
    S = ctx.region(a, n, size, gap=7, seed=15)
    D = ctx.region(a, n, size, gap=9, seed=16)
    rng = np.random.default_rng(17)
    si, di = np.arange(n), rng.permutation(n)
    msg = f"loop-{op}-{path}".encode()
    if path == "initialize":
        h = a.initialize_xfer(op, S.xfer_descs(a, si), D.xfer_descs(a, di), a.name, msg)
    else:
        pl = a.prep_xfer_dlist("NIXL_INIT_AGENT", S.xfer_descs(a, range(n)))
        pr = a.prep_xfer_dlist(a.name, D.xfer_descs(a, range(n)))
        h = a.make_prepped_xfer(op, pl, si.astype(np.int32), pr, di.astype(np.int32), msg)
    src, dst = (S, D) if op == "WRITE" else (D, S)
    src_digest, dst_outside = U.digest(src.buf), dst.outside()
    U.run_xfer(a, h, notif=msg, target=a)
    if op == "WRITE":
        U.check_slots(D, di, S, si, "loopback WRITE target")
    else:
        U.check_slots(S, si, D, di, "loopback READ local")
    assert dst.outside() == dst_outside, f"loopback {op} wrote outside its descriptors"
    assert U.digest(src.buf) == src_digest, f"source of the loopback {op} changed"
    # completes exactly once: no second notification, state stays DONE
    assert a.check_xfer_state(h) == "DONE"
    a.update_notifs()
    assert not a.notifs.get(a.name), U.summarize_notifs(a.notifs)
    a.send_notif(a.name, b"self-notif")
    U.wait_notif(a, a.name, b"self-notif")
    a.release_xfer_handle(h)


def test_loopback_and_remote_same_agent(ctx):
    """One agent does a loopback transfer and a remote one, interleaved."""
    a, b = ctx.pair()
    A1 = ctx.region(a, 4, 32 * KiB, seed=18)
    A2 = ctx.region(a, 4, 32 * KiB, seed=19)
    B1 = ctx.region(b, 4, 32 * KiB, seed=20)
    U.connect(a, b)
    hl = a.initialize_xfer("WRITE", A1.xfer_descs(a, range(4)), A2.xfer_descs(a, range(4)),
                           a.name, b"L")
    hr = a.initialize_xfer("WRITE", A1.xfer_descs(a, range(4)), B1.xfer_descs(a, range(4)),
                           b.name, b"R")
    for i in range(3):
        U.fill_random(A1.buf, 300 + i)
        sl, sr = a.transfer(hl), a.transfer(hr)
        U.wait_xfer(a, hl, state=sl)
        U.wait_xfer(a, hr, state=sr)
        U.wait_notif(a, a.name, b"L")
        U.wait_notif(b, a.name, b"R")
        U.assert_bytes_equal(A2.data(), A1.data(), "loopback target")
        U.assert_bytes_equal(B1.data(), A1.data(), "remote target")
    a.release_xfer_handle(hl)
    a.release_xfer_handle(hr)


def test_many_registrations(ctx):
    """64 separately registered buffers per side; one transfer touches all of them."""
    ini, tgt = ctx.pair()
    n, size = 64, 3 * KiB + 1
    srcs = [ctx.region(None, 1, size, seed=400 + i) for i in range(n)]
    dsts = [ctx.region(None, 1, size, seed=500 + i) for i in range(n)]
    ini.register_memory([(s.base, s.buf.nbytes, 0, "") for s in srcs[:32]], "DRAM")
    for s in srcs[32:]:
        s.register(ini)
    tgt.register_memory([(d.base, d.buf.nbytes, 0, "") for d in dsts], "DRAM")
    U.connect(ini, tgt)
    perm = np.random.default_rng(21).permutation(n)
    local = ini.get_xfer_descs([(s.base, size, 0) for s in srcs], "DRAM")
    remote = ini.get_xfer_descs([(dsts[p].base, size, 0) for p in perm], "DRAM")
    h = ini.initialize_xfer("WRITE", local, remote, tgt.name, b"many")
    U.run_xfer(ini, h, notif=b"many", target=tgt)
    for i, p in enumerate(perm):
        U.assert_bytes_equal(dsts[p].buf[:size], srcs[i].buf[:size], f"region {p}")
    ini.release_xfer_handle(h)


def test_deregister_and_register_again(ctx):
    ini, tgt = ctx.pair()
    L = ctx.region(ini, 1, 1 * MiB, seed=22)
    R = ctx.region(tgt, 1, 1 * MiB, seed=23)
    U.connect(ini, tgt)
    h = ini.initialize_xfer("WRITE", L.xfer_descs(ini, [0]), R.xfer_descs(ini, [0]), tgt.name)
    U.run_xfer(ini, h)
    ini.release_xfer_handle(h)
    R2 = ctx.region(None, 1, 1 * MiB, seed=24)
    tgt.deregister_memory(R.reg)
    R2.register(tgt)
    ini.remove_remote_agent(tgt.name)
    U.connect(ini, tgt)
    h = ini.initialize_xfer("WRITE", L.xfer_descs(ini, [0]), R2.xfer_descs(ini, [0]), tgt.name,
                            b"rereg")
    U.run_xfer(ini, h, notif=b"rereg", target=tgt)
    U.assert_bytes_equal(R2.data(), L.data(), "new target region")
    ini.release_xfer_handle(h)
    ini.deregister_memory(L.reg)


def test_register_after_connect(ctx):
    """The target registers more memory after the initiator loaded its metadata; loading the
    metadata again adds the new region (same connection info), and both regions work."""
    ini, tgt = ctx.pair()
    L = ctx.region(ini, 2, 128 * KiB, seed=70)
    R1 = ctx.region(tgt, 1, 128 * KiB, seed=71)
    U.connect(ini, tgt)
    R2 = ctx.region(tgt, 1, 128 * KiB, seed=72)
    with pytest.raises(Exception):  # not loaded yet
        ini.initialize_xfer("WRITE", L.xfer_descs(ini, [1]), R2.xfer_descs(ini, [0]), tgt.name)
    U.connect(ini, tgt)
    h = ini.initialize_xfer("WRITE", L.xfer_descs(ini, [0, 1]),
                            ini.get_xfer_descs(np.vstack([R1.desc_array([0]), R2.desc_array([0])]),
                                               "DRAM"), tgt.name, b"both")
    U.run_xfer(ini, h, notif=b"both", target=tgt)
    U.assert_bytes_equal(R1.slots()[0], L.slots()[0], "first region")
    U.assert_bytes_equal(R2.slots()[0], L.slots()[1], "region registered after connect")
    ini.release_xfer_handle(h)


def test_partial_metadata(ctx):
    """get_partial_agent_metadata with connection info and one of two regions: the initiator
    can reach that region only; a second partial message adds the other."""
    ini, tgt = ctx.pair()
    L = ctx.region(ini, 1, 64 * KiB, seed=73)
    R1 = ctx.region(tgt, 1, 64 * KiB, seed=74)
    R2 = ctx.region(tgt, 1, 64 * KiB, seed=75)
    md1 = tgt.get_partial_agent_metadata(R1.reg, True, [U.BACKEND])
    assert U.as_str(ini.add_remote_agent(md1)) == tgt.name
    h = ini.initialize_xfer("WRITE", L.xfer_descs(ini, [0]), R1.xfer_descs(ini, [0]), tgt.name,
                            b"p1")
    U.run_xfer(ini, h, notif=b"p1", target=tgt)
    U.assert_bytes_equal(R1.data(), L.data(), "region in the partial metadata")
    ini.release_xfer_handle(h)
    with pytest.raises(Exception):
        ini.initialize_xfer("WRITE", L.xfer_descs(ini, [0]), R2.xfer_descs(ini, [0]), tgt.name)
    md2 = tgt.get_partial_agent_metadata(R2.reg, False, [U.BACKEND])
    ini.add_remote_agent(md2)
    h = ini.initialize_xfer("READ", L.xfer_descs(ini, [0]), R2.xfer_descs(ini, [0]), tgt.name,
                            b"p2")
    U.run_xfer(ini, h, notif=b"p2", target=tgt)
    U.assert_bytes_equal(L.data(), R2.data(), "region added by the second partial metadata")
    ini.release_xfer_handle(h)


def test_fan_out_fan_in(ctx):
    """One initiator to three targets, then three initiators to one target, concurrently."""
    a = ctx.agent("hub")
    others = [ctx.agent(f"leaf{i}") for i in range(3)]
    size = 256 * KiB
    A = ctx.region(a, 3, size, seed=25)
    O = [ctx.region(o, 1, size, seed=26 + i) for i, o in enumerate(others)]
    for o in others:
        U.connect(a, o)
        U.connect(o, a)
    hs = [a.initialize_xfer("WRITE", A.xfer_descs(a, [i]), O[i].xfer_descs(a, [0]), o.name,
                            b"out") for i, o in enumerate(others)]
    states = [a.transfer(h) for h in hs]
    for h, s in zip(hs, states):
        U.wait_xfer(a, h, state=s)
    for i, o in enumerate(others):
        U.wait_notif(o, a.name, b"out")
        U.assert_bytes_equal(O[i].buf[:size], A.slots()[i, :size], f"leaf {i}")
        a.release_xfer_handle(hs[i])
    for i in range(3):
        U.fill_random(O[i].buf, 40 + i)
    hs = [o.initialize_xfer("WRITE", O[i].xfer_descs(o, [0]), A.xfer_descs(o, [i]), a.name,
                            f"in-{i}".encode()) for i, o in enumerate(others)]
    states = [o.transfer(h) for o, h in zip(others, hs)]
    for o, h, s in zip(others, hs, states):
        U.wait_xfer(o, h, state=s)
    for i, o in enumerate(others):
        U.wait_notif(a, o.name, f"in-{i}".encode())
        U.assert_bytes_equal(A.slots()[i, :size], O[i].buf[:size], f"hub slot {i}")
        o.release_xfer_handle(hs[i])


def test_concurrent_threads(ctx):
    """Four application threads post and poll their own handles on one agent (sync mode RW,
    so the engine's const methods run concurrently)."""
    rw = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
    ini = ctx.agent("mt-ini", sync_mode=rw)
    tgt = ctx.agent("mt-tgt", sync_mode=rw)
    T, size = 4, 128 * KiB
    L = ctx.region(ini, T, size, seed=50)
    R = ctx.region(tgt, T, size, seed=51)
    U.connect(ini, tgt)
    hs = [ini.initialize_xfer("WRITE", L.xfer_descs(ini, [t]), R.xfer_descs(ini, [t]), tgt.name)
          for t in range(T)]
    errors = []

    def worker(t):
        try:
            for _ in range(20):
                U.wait_xfer(ini, hs[t], state=ini.transfer(hs[t]), what=f"thread {t}")
        except Exception as e:  # reported below
            errors.append(f"thread {t}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(T)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(U.WAIT_S * 2)
    assert not any(th.is_alive() for th in threads), "worker threads hung"
    assert not errors, errors
    U.assert_bytes_equal(R.data(), L.data(), "target")
    for h in hs:
        ini.release_xfer_handle(h)


@pytest.mark.perf
@pytest.mark.parametrize("notif", [b"", b"lat"], ids=["no-notif", "notif"])
def test_small_transfer_latency(ctx, notif):
    """A 64 B WRITE reposted 200 times (progress threads on): the median time from post to
    DONE stays under 1 ms (stock UCX: about 25 us here). A generous bound that catches a
    progress-thread wake-up delay, not a benchmark."""
    ini, tgt = ctx.pair()
    L = ctx.region(ini, 1, 64, seed=80)
    R = ctx.region(tgt, 1, 64, seed=81)
    U.connect(ini, tgt)
    h = ini.initialize_xfer("WRITE", L.xfer_descs(ini, [0]), R.xfer_descs(ini, [0]), tgt.name,
                            notif)
    # Up to three runs of 200: a wake-up delay of ours shows in every run, while a host busy
    # with other work (a build beside `make test` on two cores) can take one run's median
    # to its scheduler tick (4 ms, seen once).
    runs = []
    for _ in range(3):
        times = []
        for _ in range(200):
            t0 = U.time.perf_counter()
            state = ini.transfer(h)
            while state == "PROC":  # tight loop: wait_xfer's naps would dominate the time
                state = ini.check_xfer_state(h)
                assert U.time.perf_counter() - t0 < U.WAIT_S, "transfer stuck"
            assert state == "DONE", state
            times.append(U.time.perf_counter() - t0)
        times.sort()
        med, p90 = times[len(times) // 2], times[len(times) * 9 // 10]
        runs.append(f"median {med * 1e6:.0f} us, p90 {p90 * 1e6:.0f} us")
        U.eprint(f"64 B WRITE{' + notification' if notif else ''}: {runs[-1]}")
        if med < 1e-3:
            break
    ini.release_xfer_handle(h)
    assert med < 1e-3, f"median post-to-DONE over 1 ms in every run: {runs}"


def test_query_backend_and_estimate(ctx):
    from nixl_cu12._bindings import nixlNotSupportedError

    ini, tgt = ctx.pair()
    L = ctx.region(ini, 4, 4096, seed=52)
    R = ctx.region(tgt, 4, 4096, seed=53)
    U.connect(ini, tgt)
    ini.make_connection(tgt.name)
    h = ini.initialize_xfer("READ", L.xfer_descs(ini, range(4)), R.xfer_descs(ini, range(4)),
                            tgt.name)
    assert ini.query_xfer_backend(h) == U.BACKEND
    try:
        dur, margin, method = ini.estimate_xfer_cost(h)
        assert dur >= 0 and margin >= 0, (dur, margin, method)
    except nixlNotSupportedError:
        pass
    U.run_xfer(ini, h)
    U.assert_bytes_equal(L.data(), R.data(), "initiator after READ")
    ini.release_xfer_handle(h)
