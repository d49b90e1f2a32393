#!/usr/bin/env python3
"""One case of the version matrix: bytes through one backend of whichever NIXL is on
PYTHONPATH (a release unpacked by runtime.py), written only against the Python API that
every release from 0.7.1 to 1.5.1 has.

    case.py one BACKEND      two agents in this process
    case.py two BACKEND      this process initiates; a second process (case.py target) owns
                             the target buffer and answers over stdin/stdout
    case.py refused BACKEND  creating the backend must fail with an exception (a NIXL the
                             plugin does not know), and the process must live on

Each case: WRITE of 4 descriptors with a notification, a repost of the same handle with a
new notification and new bytes, a standalone notification, then READ back of bytes the
target refilled; every byte compared (sha256 of the whole target buffer). Prints
`PASS <what>` and exits 0, or prints the failure and exits 1.
"""
import hashlib
import json
import os
import subprocess
import sys
import time

import numpy as np

# NIXL's Python logger and native libraries print to stdout: the protocol between the two
# processes keeps its own copy of the original stdout, and fd 1 becomes stderr.
PROTO = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

from nixl_cu12._api import nixl_agent, nixl_agent_config  # noqa: E402

DESCS = 4
CHUNK = 256 << 10
N = DESCS * CHUNK
DEADLINE_S = 30


def pattern(seed):
    return np.random.default_rng(seed).integers(0, 256, N, dtype=np.uint8)


def sha(buf):
    return hashlib.sha256(buf.tobytes()).hexdigest()


def name(x):
    return x.decode() if isinstance(x, bytes) else x


def new_agent(agent_name, backend):
    # No backend from the config (the default list would create UCX in every agent); the
    # one under test is created explicitly, as users do.
    agent = nixl_agent(agent_name, nixl_agent_config(enable_prog_thread=True, backends=[]))
    agent.create_backend(backend, {})
    return agent


def post(agent, xfer, what, notif=None):
    state = agent.transfer(xfer, notif) if notif is not None else agent.transfer(xfer)
    deadline = time.time() + DEADLINE_S
    while state == "PROC":
        if time.time() > deadline:
            raise SystemExit(f"{what}: still in progress after {DEADLINE_S} s")
        state = agent.check_xfer_state(xfer)
    if state != "DONE":
        raise SystemExit(f"{what}: state {state}")


def wait_notif(agent, sender, msg, what):
    deadline = time.time() + DEADLINE_S
    while not agent.check_remote_xfer_done(sender, msg):
        if time.time() > deadline:
            raise SystemExit(f"{what}: notification {msg!r} from {sender} not received")
        time.sleep(0.001)


def descs(buf):
    base = buf.ctypes.data
    return [(base + i * CHUNK, CHUNK, 0) for i in range(DESCS)]


class LocalTarget:
    """The target agent in this process."""

    def __init__(self, backend):
        self.agent = new_agent("target", backend)
        self.buf = np.zeros(N, dtype=np.uint8)
        self.reg = self.agent.register_memory([(self.buf.ctypes.data, N, 0, "")], "DRAM")
        self.md = self.agent.get_agent_metadata()
        self.addrs = [d[0] for d in descs(self.buf)]

    def wait(self, msg, what):
        wait_notif(self.agent, "initiator", msg, what)
        return sha(self.buf)

    def fill(self, seed):
        self.buf[:] = pattern(seed)

    def close(self):
        self.agent.deregister_memory(self.reg)


class RemoteTarget:
    """The target agent in a second process (this script, role `target`)."""

    def __init__(self, backend):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "target", backend],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = self.ask(None)
        self.md = bytes.fromhex(hello["md"])
        self.addrs = hello["addrs"]

    def ask(self, req):
        if req is not None:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"target process ended (rc {self.proc.wait()}) on {req}")
        reply = json.loads(line)
        if "error" in reply:
            raise SystemExit(f"target: {reply['error']}")
        return reply

    def wait(self, msg, what):
        return self.ask({"cmd": "wait", "msg": msg.hex(), "what": what})["sha"]

    def fill(self, seed):
        self.ask({"cmd": "fill", "seed": seed})

    def close(self):
        self.ask({"cmd": "exit"})
        self.proc.wait(timeout=DEADLINE_S)


def serve_target(backend):
    """Role `target`: owns the target buffer, answers the initiator's requests."""
    def reply(obj):
        PROTO.write(json.dumps(obj) + "\n")
        PROTO.flush()

    try:
        t = LocalTarget(backend)
        reply({"md": t.md.hex(), "addrs": t.addrs})
        for line in sys.stdin:
            req = json.loads(line)
            if req["cmd"] == "wait":
                reply({"sha": t.wait(bytes.fromhex(req["msg"]), req["what"])})
            elif req["cmd"] == "fill":
                t.fill(req["seed"])
                reply({"ok": True})
            elif req["cmd"] == "exit":
                t.close()
                reply({"ok": True})
                break
    except BaseException as e:  # reported to the initiator, which fails the case
        reply({"error": f"{type(e).__name__}: {e}"})
    sys.stdout.flush()
    os._exit(0)


def run(mode, backend):
    initiator = new_agent("initiator", backend)
    target = LocalTarget(backend) if mode == "one" else RemoteTarget(backend)
    src = pattern(1)
    src_reg = initiator.register_memory([(src.ctypes.data, N, 0, "")], "DRAM")
    peer = name(initiator.add_remote_agent(target.md))
    if peer != "target":
        raise SystemExit(f"add_remote_agent returned {peer!r}")
    remote = initiator.get_xfer_descs([(a, CHUNK, 0) for a in target.addrs], "DRAM")

    # WRITE with a notification, then a repost of the same handle with new bytes.
    local = initiator.get_xfer_descs(descs(src), "DRAM")
    xfer = initiator.initialize_xfer("WRITE", local, remote, "target", b"write-1")
    post(initiator, xfer, "WRITE")
    if target.wait(b"write-1", "WRITE") != sha(src):
        raise SystemExit("WRITE: target bytes differ")
    src[:] = pattern(2)
    post(initiator, xfer, "repost", b"write-2")
    if target.wait(b"write-2", "repost") != sha(src):
        raise SystemExit("repost: target bytes differ")
    initiator.release_xfer_handle(xfer)

    # A standalone notification.
    initiator.send_notif("target", b"hello")
    target.wait(b"hello", "genNotif")

    # READ back what the target holds now.
    target.fill(3)
    dst = np.zeros(N, dtype=np.uint8)
    dst_reg = initiator.register_memory([(dst.ctypes.data, N, 0, "")], "DRAM")
    xfer = initiator.initialize_xfer("READ", initiator.get_xfer_descs(descs(dst), "DRAM"), remote,
                                     "target")
    post(initiator, xfer, "READ")
    if sha(dst) != sha(pattern(3)):
        raise SystemExit("READ: bytes differ")
    initiator.release_xfer_handle(xfer)

    initiator.remove_remote_agent("target")
    initiator.deregister_memory(src_reg)
    initiator.deregister_memory(dst_reg)
    target.close()


def refused(backend):
    agent = nixl_agent("refused", nixl_agent_config(enable_prog_thread=True, backends=[]))
    try:
        agent.create_backend(backend, {})
    except Exception as e:  # the binding raises nixlBackendError (its class differs by release)
        return type(e).__name__
    raise SystemExit("the backend was created")


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("one", "two", "target", "refused"):
        raise SystemExit(__doc__)
    mode, backend = sys.argv[1], sys.argv[2]
    if mode == "target":
        serve_target(backend)
    if mode == "refused":
        print(f"PASS {backend} refused: createBackend raised {refused(backend)}", file=PROTO, flush=True)
        os._exit(0)
    started = time.time()
    run(mode, backend)
    print(f"PASS {backend} {mode}: WRITE+notif, repost, genNotif, READ, "
          f"{N} bytes exact ({time.time() - started:.1f} s)", file=PROTO, flush=True)
    # Exit-time destructors of some bundled libraries crash (ABI doc §9.1): skip them.
    os._exit(0)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:
        if isinstance(e.code, str):
            print(f"FAIL {' '.join(sys.argv[1:])}: {e.code}", file=PROTO, flush=True)
            os._exit(1)
        raise
