"""Helper process: feed corrupted agent metadata to add_remote_agent, then prove the agent
still works. Run in its own process so that a crash (stock UCX aborts on some corrupted
connection info) is reported as this process's exit status instead of killing pytest.

Usage: corrupt_md.py cases [--ours-cases 0|1] [--reload-same 0|1]
       corrupt_md.py fuzz --region own|framing|all --iters N --seed S [--reload-same 0|1]
       (--only 3,7 --name-suffix 12345: replay single attempts of a failed run)
Prints one JSON object per line: {"case": ..., "loaded": bool, "must_raise": bool} for each
attempt (the case name also goes to stderr before the attempt, so a crash shows which one),
and finally {"good_transfer": true}. Exit status 0 unless something other than a rejected
load went wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nfutil as U  # noqa: E402

U.configure_env()

import nixl_cu12._bindings as B  # noqa: E402

ERRORS = tuple(getattr(B, n) for n in dir(B) if n.startswith("nixl") and n.endswith("Error"))
KiB = 1 << 10


def try_load(ini, md, name):
    """True if md loaded. The peer is removed again afterwards, so the next load starts
    clean (a failed load may leave connection info behind)."""
    try:
        loaded = ini.add_remote_agent(md)  # raw name: a flipped name may not be UTF-8
    except ERRORS:
        loaded = None
    for n in {name, loaded} - {None}:
        try:
            ini.remove_remote_agent(n)
        except ERRORS:
            pass
    return loaded is not None


def cases(md, ours):
    ci = U.conn_info_span(md)
    fields = U.mem_desc_fields(md)
    assert len(fields) == 1, fields
    bs = U.blob_span(fields[0])
    conn, blob = md[ci[0]:ci[0] + ci[1]], md[bs[0]:bs[0] + bs[1]]
    rnd = random.Random(5)

    def junk(n):
        return bytes(rnd.randrange(256) for _ in range(n))

    # name -> (metadata, must raise). The agent's own parser rejects the first group; the
    # second group is the backend's own bytes (connection info, memory blob), which our
    # plugin must validate. Stock UCX aborts the process on several of those, so they are
    # only run for our plugin (ours=True).
    out = {
        "empty": (b"", True),
        "truncated to half": (md[:len(md) // 2], True),
        "last byte cut": (md[:-1], True),
        "header flipped": (U.flip(md, [0, 1, 2]), True),
        "random bytes": (junk(len(md)), True),
        "conn info: empty": (U.replace_span(md, ci, b""), True),
    }
    if ours:
        out.update({
            "conn info: first 8 bytes flipped": (U.flip(md, range(ci[0], ci[0] + 8)), True),
            "conn info: truncated to half": (U.replace_span(md, ci, conn[:len(conn) // 2]), True),
            "conn info: 1 byte": (U.replace_span(md, ci, conn[:1]), True),
            "conn info: random": (U.replace_span(md, ci, junk(len(conn))), True),
            "conn info: 64 KiB random": (U.replace_span(md, ci, junk(64 * KiB)), True),
            "conn info: trailing junk": (U.replace_span(md, ci, conn + junk(16)), False),
            "mem blob: first 8 bytes flipped":
                (U.flip(md, range(bs[0], bs[0] + min(8, bs[1]))), True),
            "mem blob: truncated to half":
                (U.replace_blob(md, fields[0], blob[:len(blob) // 2]), True),
            "mem blob: empty": (U.replace_blob(md, fields[0], b""), True),
            "mem blob: random": (U.replace_blob(md, fields[0], junk(len(blob))), True),
            "mem blob: 64 KiB random": (U.replace_blob(md, fields[0], junk(64 * KiB)), True),
            "mem blob: trailing junk": (U.replace_blob(md, fields[0], blob + junk(16)), False),
        })
    return out


def fuzz(md, region, iters, seed):
    ci = U.conn_info_span(md)
    bs = U.blob_span(U.mem_desc_fields(md)[0])
    own = set(range(ci[0], ci[0] + ci[1])) | set(range(bs[0], bs[0] + bs[1]))
    # The memory-type field of each memory section is left alone: the stock 1.5.1 agent
    # crashes (SIGSEGV in nixlMemSection::emplace, with UCX as with ours) on an out-of-range
    # type, before any backend sees it.
    key = b"nixlSDList|t" + struct.pack("<Q", 4)
    agent_bug = set()
    p = md.find(key)
    while p >= 0:
        agent_bug |= set(range(p + len(key), p + len(key) + 4))
        p = md.find(key, p + 1)
    pool = {"own": sorted(own),
            "framing": [i for i in range(len(md)) if i not in own | agent_bug],
            "all": [i for i in range(len(md)) if i not in agent_bug]}[region]
    rnd = random.Random(seed)
    for it in range(iters):
        m = bytearray(md)
        pos = sorted(rnd.choice(pool) for _ in range(rnd.randint(1, 4)))
        for p in pos:
            m[p] ^= 1 << rnd.randrange(8)
        yield f"fuzz {region} #{it} at {pos}", (bytes(m), False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["cases", "fuzz"])
    ap.add_argument("--ours-cases", type=int, default=int(not U.IS_UCX))
    ap.add_argument("--region", default="all")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--reload-same", type=int, default=0)
    ap.add_argument("--only", default="", help="comma-separated attempt numbers (to reproduce)")
    ap.add_argument("--name-suffix", default=str(os.getpid()),
                    help="agent name suffix (fuzz offsets depend on the name length)")
    args = ap.parse_args()

    ini = U.new_agent(f"cmd-ini-{args.name_suffix}")
    tgt = U.new_agent(f"cmd-tgt-{args.name_suffix}")
    L = U.Region(1, 256 * KiB, 0, 1).register(ini)
    R = U.Region(1, 256 * KiB, 0, 2).register(tgt)
    md = tgt.get_agent_metadata()
    todo = (cases(md, bool(args.ours_cases)).items() if args.mode == "cases"
            else fuzz(md, args.region, args.iters, args.seed))
    only = {int(x) for x in args.only.split(",") if x}
    for i, (name, (bad, must_raise)) in enumerate(todo):
        if only and i not in only:
            continue
        U.eprint(f"trying: {name}")
        loaded = try_load(ini, bad, tgt.name)
        print(json.dumps({"case": name, "loaded": loaded, "must_raise": must_raise}), flush=True)

    # The agent is still usable: it loads a fresh peer's metadata and transfers; and (our
    # plugin only) it loads the real metadata of the same peer again and transfers. Stock UCX
    # refuses the second after a partially failed load (it keeps the peer's endpoint).
    fresh = U.new_agent(f"cmd-fresh-{os.getpid()}")
    F = U.Region(1, 256 * KiB, 0, 5).register(fresh)
    peers = [(fresh, F)] + ([] if U.IS_UCX and not args.reload_same else [(tgt, R)])
    for peer, P in peers:
        U.connect(ini, peer)
        for op, seed in (("WRITE", 3), ("READ", 4)):
            U.fill_random((P if op == "READ" else L).buf, seed)
            msg = f"after-corruption-{op}".encode()
            h = ini.initialize_xfer(op, L.xfer_descs(ini, [0]), P.xfer_descs(ini, [0]),
                                    peer.name, msg)
            what = f"{op} to {'a fresh' if peer is fresh else 'the same'} peer after corruption"
            U.run_xfer(ini, h, notif=msg, target=peer, what=what)
            U.assert_bytes_equal(P.data(), L.data(), what)
            ini.release_xfer_handle(h)
        ini.remove_remote_agent(peer.name)
    print(json.dumps({"good_transfer": True}), flush=True)
    del ini, tgt, fresh
    return 0


if __name__ == "__main__":
    sys.exit(main())
