#!/usr/bin/env python3
"""The vLLM NixlConnector flow (disaggregated prefill/decode), two processes, stock agent.

    python examples/vllm_flow.py                   # prefill; spawns the decode process itself
    python examples/vllm_flow.py --backend UCX     # the same flow over the wheel's UCX plugin

What each side does, in the order vLLM's NixlConnector (v1) does it:

  prefill  creates its agent (backend LIBFABRIC, our plugin from build/plugins via
           NIXL_PLUGIN_DIR) with the metadata listener thread on a 127.0.0.1 port, registers
           its KV cache (one DRAM region per layer: 2 layers x 256 blocks x 16 KiB), fills every
           block with a pattern unique to (layer, block), and hands the decode process what
           vLLM's handshake carries besides the agent metadata (agent name, listener port,
           per-layer base addresses, block count and size) as one JSON line on its stdin.
  decode   creates its own agent (listener on its own port: the agent's comm thread does the
           fetch), registers its own KV cache, fetches prefill's agent metadata through the
           listener (fetch_remote_metadata + check_remote_metadata), prepares block-indexed
           descriptor lists for both sides with prep_xfer_dlist (descriptor index =
           layer * num_blocks + block id, as vLLM's _get_block_descs_ids), and for each
           request builds a READ of a scattered set of remote block ids into its own block ids
           with make_prepped_xfer(notif_msg=b"<req>:1"); the backend delivers that notification
           to prefill once the READ is done (vLLM's "done reading, free the blocks"). A request
           with no blocks to read only sends the notification (send_notif), as vLLM does.
           Decode then checks every byte of every block it read, and that the rest of its
           cache stayed zero.
  prefill  waits for one notification per request from decode, checks its own cache was not
           modified by the READs, waits for decode's verdict and exit status, and prints one
           summary line.

Traffic stays on loopback: FI_TCP_IFACE=lo, NIXL_FABRIC_IFACE=lo, NIXL_FABRIC_PROVIDER=tcp
(defaults, set here unless already set), listener connections to 127.0.0.1 (the stock
listener itself binds its port on 0.0.0.0; the agent offers no bind address). Every wait is
bounded (--timeout, default 20 s). Exit status 0 when everything was verified.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import select
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TAG = "vllm_flow"

# Requests decode pulls from prefill: (request id, remote block ids, local block ids).
# Built from a seeded RNG in requests(); one request has no blocks (notification only).
NUM_REQUESTS_WITH_BLOCKS = 3


def configure_env(backend: str) -> None:
    """Loopback only; our plugin from the build unless the stock UCX plugin is asked for.
    Must run before the first nixl_agent is created (the plugin directory is fixed then)."""
    for k, v in {"FI_TCP_IFACE": "lo", "FI_SOCKETS_IFACE": "lo", "NIXL_FABRIC_IFACE": "lo",
                 "NIXL_FABRIC_PROVIDER": "tcp", "UCX_MODULES": "^ib", "UCX_NET_DEVICES": "lo",
                 "UCX_TLS": "tcp,self,sm"}.items():
        os.environ.setdefault(k, v)
    if backend != "UCX":
        os.environ.setdefault("NIXL_PLUGIN_DIR", str(ROOT / "build" / "plugins"))


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def log(role: str, msg: str) -> None:
    sys.stderr.write(f"{TAG} [{role}] {msg}\n")
    sys.stderr.flush()


def block_pattern(layer: int, block: int, block_len: int) -> np.ndarray:
    """Content of prefill's block `block` of layer `layer`: unique per (layer, block)."""
    rng = np.random.default_rng(layer * 1_000_003 + block)
    b = rng.integers(0, 256, block_len, dtype=np.uint8)
    b[:8] = np.frombuffer(np.array([layer, block], dtype="<u4").tobytes(), dtype=np.uint8)
    return b


def requests(num_blocks: int, seed: int = 7):
    """Scattered remote block ids (with some consecutive runs, which the agent merges into
    longer descriptors) into disjoint local block ids, plus one request with no blocks."""
    rng = np.random.default_rng(seed)
    # req-1: a run of consecutive blocks on both sides (freshly allocated blocks often are),
    # which the agent merges into one descriptor per layer; the others are scattered.
    run = max(1, num_blocks // 10)
    rstart = int(rng.integers(0, num_blocks - run + 1))
    lstart = int(rng.integers(0, num_blocks - run + 1))
    runs = (list(range(rstart, rstart + run)), list(range(lstart, lstart + run)))
    remote_free = [b for b in rng.permutation(num_blocks).tolist() if b not in runs[0]]
    local_free = [b for b in rng.permutation(num_blocks).tolist() if b not in runs[1]]
    out = []
    for i, n in enumerate([num_blocks // 8, run, 3][:NUM_REQUESTS_WITH_BLOCKS]):
        if i == 1:
            remote, local = runs
        else:
            n = min(n, len(remote_free), len(local_free))
            remote, remote_free = remote_free[:n], remote_free[n:]
            local, local_free = local_free[:n], local_free[n:]
        out.append((f"req-{i}", remote, local))
    out.append((f"req-{len(out)}", [], []))  # nothing to read: notification only
    return out


def block_desc_ids(block_ids, num_layers: int, num_blocks: int) -> np.ndarray:
    """vLLM's _get_block_descs_ids: for each region (layer), for each block."""
    return np.array([layer * num_blocks + b for layer in range(num_layers) for b in block_ids],
                    dtype=np.int32)


def blocks_data(bases, num_blocks: int, block_len: int):
    """vLLM's per-block descriptors: (addr, len, device id), region-major."""
    return [(base + b * block_len, block_len, 0) for base in bases for b in range(num_blocks)]


def make_agent(name: str, backend: str, port: int):
    from nixl_cu12._api import nixl_agent, nixl_agent_config
    # num_threads is what vLLM passes for UCX; the Python API forwards it to LIBFABRIC too,
    # where our plugin accepts and ignores it.
    cfg = nixl_agent_config(enable_prog_thread=True, enable_listen_thread=True,
                            listen_port=port, num_threads=4, backends=[backend])
    agent = nixl_agent(name, cfg)
    if backend not in agent.backends:
        raise RuntimeError(f"backend {backend} not created (plugins found: {agent.get_plugin_list()}; "
                           f"NIXL_PLUGIN_DIR={os.environ.get('NIXL_PLUGIN_DIR')})")
    return agent


def deadline_after(s: float) -> float:
    return time.monotonic() + s


# ---- decode -------------------------------------------------------------------------------


def decode(args) -> int:
    role = "decode"
    ready, _, _ = select.select([sys.stdin], [], [], args.timeout)
    if not ready:
        log(role, "no handshake from prefill")
        return 1
    hs = json.loads(sys.stdin.readline())
    layers, nblocks, blen = hs["num_layers"], hs["num_blocks"], hs["block_len"]
    prefill = hs["agent_name"]

    name = f"decode-{uuid.uuid4().hex[:8]}"
    agent = make_agent(name, args.backend, free_port())
    kv = [np.zeros((nblocks, blen), dtype=np.uint8) for _ in range(layers)]
    reg = agent.register_memory([(c.ctypes.data, c.nbytes, 0, "") for c in kv], "DRAM")

    # Prefill's agent metadata through the listener threads (the rest came in the handshake).
    remote_descs = agent.get_xfer_descs(blocks_data(hs["kv_caches_base_addr"], nblocks, blen), "DRAM")
    agent.fetch_remote_metadata(prefill, "127.0.0.1", hs["listen_port"])
    end = deadline_after(args.timeout)
    while not agent.check_remote_metadata(prefill, remote_descs):
        if time.monotonic() > end:
            log(role, f"metadata of {prefill} did not arrive through 127.0.0.1:{hs['listen_port']}")
            return 1
        time.sleep(0.005)

    local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", blocks_data([c.ctypes.data for c in kv], nblocks, blen), "DRAM")
    remote_h = agent.prep_xfer_dlist(prefill, remote_descs)

    # Start every request's READ (vLLM starts them as requests arrive), then poll them all.
    reqs = requests(nblocks)
    t0 = time.perf_counter()
    inflight = {}
    for rid, remote, local in reqs:
        notif = f"{rid}:1".encode()  # vLLM: f"{remote_request_id}:{tp_ratio}"
        if not remote:
            agent.send_notif(prefill, notif)
            continue
        h = agent.make_prepped_xfer("READ", local_h, block_desc_ids(local, layers, nblocks),
                                    remote_h, block_desc_ids(remote, layers, nblocks), notif)
        state = agent.transfer(h)
        if state == "ERR":
            log(role, f"{rid}: transfer returned ERR")
            return 1
        inflight[rid] = h
    end = deadline_after(args.timeout)
    while inflight:
        for rid, h in list(inflight.items()):
            state = agent.check_xfer_state(h)
            if state == "DONE":
                agent.release_xfer_handle(h)
                del inflight[rid]
            elif state != "PROC":
                log(role, f"{rid}: transfer state {state}")
                return 1
        if time.monotonic() > end:
            log(role, f"READs still in progress after {args.timeout:.0f} s: {sorted(inflight)}")
            return 1
    dt = time.perf_counter() - t0

    # Every byte of every block read, and nothing else touched.
    bad, nread = [], 0
    touched = [np.zeros(nblocks, dtype=bool) for _ in range(layers)]
    for rid, remote, local in reqs:
        for rb, lb in zip(remote, local):
            for layer in range(layers):
                nread += 1
                touched[layer][lb] = True
                if not np.array_equal(kv[layer][lb], block_pattern(layer, rb, blen)):
                    bad.append(f"{rid} layer {layer} remote block {rb} -> local block {lb}")
    for layer in range(layers):
        if kv[layer][~touched[layer]].any():
            bad.append(f"layer {layer}: a block that was not read is not zero")

    agent.release_dlist_handle(local_h)
    agent.release_dlist_handle(remote_h)
    agent.remove_remote_agent(prefill)
    agent.deregister_memory(reg)
    result = {"agent": name, "ok": not bad, "blocks": nread, "bytes": nread * blen,
              "requests": len(reqs), "seconds": dt, "bad": bad[:5]}
    say("RESULT " + json.dumps(result))
    return 0 if not bad else 1


# ---- prefill ------------------------------------------------------------------------------


def reader(stream, q: queue.Queue) -> None:
    for line in stream:
        q.put(line)
    q.put(None)


def prefill(args) -> int:
    role = "prefill"
    layers, nblocks, blen = args.layers, args.blocks, args.block_kib << 10
    name = f"prefill-{uuid.uuid4().hex[:8]}"
    port = free_port()
    agent = make_agent(name, args.backend, port)
    kv = [np.empty((nblocks, blen), dtype=np.uint8) for _ in range(layers)]
    for layer in range(layers):
        for b in range(nblocks):
            kv[layer][b] = block_pattern(layer, b, blen)
    digest = [hashlib.sha256(c.tobytes()).hexdigest() for c in kv]
    reg = agent.register_memory([(c.ctypes.data, c.nbytes, 0, "") for c in kv], "DRAM")

    child = subprocess.Popen([sys.executable, __file__, "--role", "decode", "--backend", args.backend,
                              "--timeout", str(args.timeout)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=reader, args=(child.stdout, lines), daemon=True).start()
    handshake = {"agent_name": name, "listen_port": port, "kv_caches_base_addr": [c.ctypes.data for c in kv],
                 "num_layers": layers, "num_blocks": nblocks, "block_len": blen}
    child.stdin.write(json.dumps(handshake) + "\n")
    child.stdin.flush()

    # One notification per request: decode is done reading those blocks (vLLM frees them now).
    expected = {f"{rid}:1".encode() for rid, _, _ in requests(nblocks)}
    got: dict[bytes, int] = {}
    senders = set()
    end = deadline_after(args.timeout * 2)
    problems = []
    while not expected <= set(got):
        for sender, msgs in agent.get_new_notifs().items():
            senders.add(sender if isinstance(sender, str) else sender.decode())
            for m in msgs:
                got[m] = got.get(m, 0) + 1
        if child.poll() is not None and not expected <= set(got):
            # decode is gone; take what already arrived, once more
            time.sleep(0.2)
            for sender, msgs in agent.get_new_notifs().items():
                for m in msgs:
                    got[m] = got.get(m, 0) + 1
            if not expected <= set(got):
                problems.append(f"decode exited ({child.returncode}) before all notifications")
                break
        if time.monotonic() > end:
            problems.append(f"notifications missing after {args.timeout * 2:.0f} s")
            break
        time.sleep(0.001)
    missing = sorted(m.decode() for m in expected - set(got))
    if missing:
        problems.append(f"missing notifications {missing}")
    extra = {m.decode(): n for m, n in got.items() if m not in expected or n != 1}
    if extra:
        problems.append(f"unexpected or repeated notifications {extra}")

    result = None
    end = deadline_after(args.timeout)
    while result is None and time.monotonic() < end:
        try:
            line = lines.get(timeout=max(0.01, end - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
    try:
        rc = child.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        rc = child.wait(timeout=5)
        problems.append("decode did not exit in time (killed)")
    if result is None:
        problems.append("no result line from decode")
    elif not result["ok"]:
        problems.append(f"decode found bad blocks: {result['bad']}")
    elif senders != {result["agent"]}:
        problems.append(f"notifications came from {sorted(senders)}, expected {result['agent']}")
    if rc != 0:
        problems.append(f"decode exited with {rc}")
    if [hashlib.sha256(c.tobytes()).hexdigest() for c in kv] != digest:
        problems.append("prefill's KV cache changed during the READs")

    agent.deregister_memory(reg)
    if problems:
        say(f"{TAG}: FAILED ({args.backend}): " + "; ".join(problems))
        return 1
    mib = result["bytes"] / (1 << 20)
    say(f"{TAG}: ok ({args.backend}): decode READ {result['blocks']} blocks of {blen >> 10} KiB "
        f"({layers} layers, {mib:.1f} MiB, scattered ids) from prefill in {result['seconds'] * 1e3:.1f} ms "
        f"({result['bytes'] / max(result['seconds'], 1e-9) / 1e6:.0f} MB/s, first READ: connects), metadata via listener 127.0.0.1:{port}, "
        f"{len(got)} notifications (one per request), every byte verified")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", default="prefill", choices=["prefill", "decode"])
    ap.add_argument("--backend", default=os.environ.get("NIXL_FABRIC_BACKEND", "LIBFABRIC"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-kib", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=20.0, help="bound of every wait, seconds")
    args = ap.parse_args()
    configure_env(args.backend)
    return decode(args) if args.role == "decode" else prefill(args)


if __name__ == "__main__":
    sys.exit(main())
