"""Helper process: two agents that each hold several backends (our plugin next to the stock
UCX plugin) do the same transfers through each backend, and the results must be identical.

Run with NIXL_PLUGIN_DIR pointing at a directory holding all the named plugins, and
LD_LIBRARY_PATH set so the symlinked stock plugin finds its libraries (ABI doc 9.2).
Usage: compare_ucx.py BACKEND[,BACKEND...]
Prints one JSON line: {"plugins": [...], "backends": {...}, "ok": true}.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nfutil as U  # noqa: E402

U.configure_env()

import numpy as np  # noqa: E402

KiB = 1 << 10


def main():
    backends = sys.argv[1].split(",")
    a = U.new_agent(f"cmp-a-{os.getpid()}", backend=None)
    b = U.new_agent(f"cmp-b-{os.getpid()}", backend=None)
    plugins = a.get_plugin_list()
    for bk in backends:
        assert bk in plugins, (bk, plugins)
        a.create_backend(bk, {})
        b.create_backend(bk, {})
    n, size = 64, 16 * KiB + 1
    src = U.Region(n, size, 3, 1).register(a)           # registered with every backend
    dst = {bk: U.Region(n, size, 5, 2) for bk in backends}
    for d in dst.values():
        d.register(b)
    back = {bk: U.Region(n, size, 0, 3) for bk in backends}
    for r in back.values():
        r.register(a)
    assert U.as_str(a.add_remote_agent(b.get_agent_metadata())) == b.name
    assert U.as_str(b.add_remote_agent(a.get_agent_metadata())) == a.name
    perm = np.random.default_rng(4).permutation(n)
    result = {}
    for bk in backends:
        msg = f"via-{bk}".encode()
        h = a.initialize_xfer("WRITE", src.xfer_descs(a, range(n)), dst[bk].xfer_descs(a, perm),
                              b.name, msg, backends=[bk])
        assert a.query_xfer_backend(h) == bk
        U.run_xfer(a, h, notif=msg, target=b, what=f"WRITE via {bk}")
        U.check_slots(dst[bk], perm, src, range(n), f"WRITE via {bk}")
        a.release_xfer_handle(h)
        h = a.initialize_xfer("READ", back[bk].xfer_descs(a, range(n)),
                              dst[bk].xfer_descs(a, perm), b.name, msg + b"-read", backends=[bk])
        U.run_xfer(a, h, notif=msg + b"-read", target=b, what=f"READ via {bk}")
        U.check_slots(back[bk], range(n), src, range(n), f"READ via {bk}")
        a.release_xfer_handle(h)
        # send_notif(backend=...) is broken in the 1.5.1 binding (passes a handle where the
        # C++ call wants a list), so call genNotif with the one-backend list directly.
        b.agent.genNotif(a.name, msg + b"-notif", [b.backends[bk]])
        U.wait_notif(a, b.name, msg + b"-notif")
        result[bk] = {"dst": U.digest(dst[bk].buf), "back": U.digest(back[bk].data())}
    # every backend produced the same bytes (gaps included)
    assert len({r["dst"] for r in result.values()}) == 1, result
    assert len({r["back"] for r in result.values()}) == 1, result
    print(json.dumps({"plugins": plugins, "backends": result, "ok": True}), flush=True)
    a.remove_remote_agent(b.name)
    b.remove_remote_agent(a.name)
    del a, b
    return 0


if __name__ == "__main__":
    sys.exit(main())
