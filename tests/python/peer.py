"""Second-process NIXL agent for the two-process tests, driven over stdin/stdout.

Each request is one JSON line on stdin; each reply is one JSON line on stdout ({"ok": true,
...} or {"ok": false, "error": "..."}). Bytes travel as hex. While idle the peer keeps
calling update_notifs, so its engine is progressed even with the progress thread off.

Requests:
  {"cmd": "md"}                              -> {"md": <this agent's metadata>}
  {"cmd": "alloc", "id": k, "nbytes": n, "seed": s}
                                             -> {"addr": a, "md": ...}; random bytes, registered
  {"cmd": "load_md", "md": ...}              -> {"name": <loaded agent>}
  {"cmd": "wait_md", "agent": name}          -> waits for metadata of name (listener thread)
  {"cmd": "wait_notif", "from": name, "msg": hex}
  {"cmd": "notifs"}                          -> {"notifs": {sender: [hex, ...]}}, and clears
  {"cmd": "digest", "id": k, "off": o, "len": n}   -> {"sha": sha256 of those bytes}
  {"cmd": "fill", "id": k, "seed": s}        -> refills buffer k with new random bytes
  {"cmd": "send_notif", "to": name, "msg": hex}
  {"cmd": "xfer", "op": "WRITE"|"READ", "id": k, "off": o, "len": n, "agent": name,
   "raddr": a, "notif": hex}                 -> this peer initiates one transfer and waits
  {"cmd": "fetch_md", "agent": name, "port": p}    -> fetch_remote_metadata over 127.0.0.1
  {"cmd": "send_md", "port": p}                    -> send_local_metadata to 127.0.0.1:p
  {"cmd": "free_all"}                        -> deregisters and frees every buffer
  {"cmd": "exit"}                            -> cleans up, replies, exits 0

Usage: peer.py NAME [--prog 0|1] [--listen-port P] [--params JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import sys
import time
import traceback

# The protocol gets its own copy of stdout; fd 1 itself becomes stderr, because NIXL's Python
# logger (and any native library) prints to stdout.
PROTO = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import nfutil as U  # noqa: E402

U.configure_env()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--prog", type=int, default=1)
    ap.add_argument("--listen-port", type=int, default=0)
    ap.add_argument("--params", default="{}")
    args = ap.parse_args()

    agent = U.new_agent(args.name, prog=bool(args.prog), listen=args.listen_port > 0,
                        port=args.listen_port or None, params=json.loads(args.params))
    bufs = {}   # id -> numpy buffer
    regs = {}   # id -> registration list
    out = PROTO

    def reply(**kw):
        kw.setdefault("ok", True)
        out.write(json.dumps(kw) + "\n")
        out.flush()

    def wait(cond, what, timeout):
        deadline = time.monotonic() + timeout
        i = 0
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} after {timeout:.0f} s")
            i += 1
            if i > 200:
                time.sleep(0.0005)

    reply(hello=args.name, pid=os.getpid())
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.002)
        if not ready:
            agent.update_notifs()   # progress the engine while idle (progress thread off)
            continue
        line = sys.stdin.readline()
        if not line:
            break  # the test closed our stdin: treat as exit
        req = json.loads(line)
        cmd = req["cmd"]
        timeout = float(req.get("timeout", U.WAIT_S))
        try:
            if cmd == "md":
                reply(md=agent.get_agent_metadata().hex())
            elif cmd == "alloc":
                k = req["id"]
                bufs[k] = U.random_bytes(int(req["nbytes"]), int(req["seed"]))
                regs[k] = agent.register_memory(
                    [(bufs[k].ctypes.data, bufs[k].nbytes, 0, "")], "DRAM")
                reply(addr=bufs[k].ctypes.data, md=agent.get_agent_metadata().hex())
            elif cmd == "load_md":
                reply(name=U.as_str(agent.add_remote_agent(bytes.fromhex(req["md"]))))
            elif cmd == "wait_md":
                wait(lambda: agent.check_remote_metadata(req["agent"]),
                     f"metadata of {req['agent']}", timeout)
                reply()
            elif cmd == "wait_notif":
                msg = bytes.fromhex(req["msg"])
                U.wait_notif(agent, req["from"], msg, timeout=timeout)
                reply()
            elif cmd == "notifs":
                agent.update_notifs()
                reply(notifs={k: [m.hex() for m in v] for k, v in agent.notifs.items()})
                agent.notifs.clear()
            elif cmd == "digest":
                b = bufs[req["id"]]
                off = int(req.get("off", 0))
                n = int(req.get("len", b.nbytes - off))
                reply(sha=U.digest(b[off:off + n]))
            elif cmd == "fill":
                b = bufs[req["id"]]
                U.fill_random(b, int(req["seed"]))
                reply()
            elif cmd == "send_notif":
                agent.send_notif(req["to"], bytes.fromhex(req["msg"]))
                reply()
            elif cmd == "xfer":
                b = bufs[req["id"]]
                off, n = int(req.get("off", 0)), int(req["len"])
                local = agent.get_xfer_descs([(b.ctypes.data + off, n, 0)], "DRAM")
                remote = agent.get_xfer_descs([(int(req["raddr"]), n, 0)], "DRAM")
                h = agent.initialize_xfer(req["op"], local, remote, req["agent"],
                                          bytes.fromhex(req.get("notif", "")))
                U.wait_xfer(agent, h, state=agent.transfer(h), timeout=timeout,
                            what=f"peer {req['op']}")
                agent.release_xfer_handle(h)
                reply()
            elif cmd == "fetch_md":
                agent.fetch_remote_metadata(req["agent"], "127.0.0.1", int(req["port"]))
                reply()
            elif cmd == "send_md":
                agent.send_local_metadata("127.0.0.1", int(req["port"]))
                reply()
            elif cmd == "free_all":
                for k in list(regs):
                    agent.deregister_memory(regs.pop(k))
                    del bufs[k]
                reply()
            elif cmd == "exit":
                for k in list(regs):
                    agent.deregister_memory(regs.pop(k))
                reply(bye=True)
                break
            else:
                reply(ok=False, error=f"unknown command {cmd}")
        except Exception as e:  # report to the test, keep serving
            reply(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
    del agent
    return 0


if __name__ == "__main__":
    sys.exit(main())
