"""Shared helpers for the Python integration suite (test files and helper processes).

The suite drives a NIXL backend plugin through the stock agent from the PyPI wheel
(nixl-cu12 1.5.1, module nixl_cu12._api). The backend under test is chosen with
NF_TEST_BACKEND (default LIBFABRIC, our plugin); NF_TEST_BACKEND=UCX runs the same tests
against the wheel's stock UCX plugin, which is how the tests themselves are checked.

Import this module, and call configure_env(), before the first nixl_agent is created: the
plugin directory is fixed once per process (ABI doc section 2.1).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BACKEND = os.environ.get("NF_TEST_BACKEND", "LIBFABRIC")
IS_UCX = BACKEND == "UCX"
# Upper bound for any single wait (transfer completion, notification, metadata arrival).
WAIT_S = float(os.environ.get("NF_TEST_WAIT_S", "60"))
# Default environment for every test process: traffic stays on loopback, and UCX does not
# load its InfiniBand module (it segfaults at exit in this environment, ABI doc 9.1).
DEFAULT_ENV = {
    "UCX_MODULES": "^ib",
    "FI_TCP_IFACE": "lo",
    "FI_SOCKETS_IFACE": "lo",
    "NIXL_FABRIC_IFACE": "lo",
    "NIXL_FABRIC_PROVIDER": "tcp",
}


def plugin_dir() -> Path:
    """Directory holding our built plugin (make's $(PLUGINS))."""
    return Path(os.environ.get("NF_TEST_PLUGIN_DIR", str(ROOT / "build" / "plugins")))


def plugin_file(name: str = BACKEND) -> Path:
    return plugin_dir() / f"libplugin_{name}.so"


def configure_env(env=None) -> dict:
    """Fill in the suite's defaults (without overriding what the caller set).

    For our backend NIXL_PLUGIN_DIR points at the build's plugin directory; for UCX it is left
    alone so the wheel's own plugin directory is used.
    """
    if env is None:
        env = os.environ
    for k, v in DEFAULT_ENV.items():
        env.setdefault(k, v)
    if not IS_UCX:
        env.setdefault("NIXL_PLUGIN_DIR", str(plugin_dir()))
    return env


def site_packages() -> Path:
    import nixl_cu12  # importing the package does not create the plugin manager

    return Path(nixl_cu12.__file__).resolve().parent.parent


def stock_plugin(name: str) -> Path:
    return site_packages() / ".nixl_cu12.mesonpy.libs" / "plugins" / f"libplugin_{name}.so"


def stock_lib_path() -> str:
    """LD_LIBRARY_PATH that lets a symlinked stock plugin find its libraries (ABI doc 9.2)."""
    sp = site_packages()
    return f"{sp / 'nixl_cu12.libs'}:{sp / '.nixl_cu12.mesonpy.libs'}"


# ----------------------------------------------------------------------------- agents


def new_agent(name, prog=True, listen=False, port=None, params=None, backend=BACKEND,
              sync_mode=None):
    """An agent holding exactly one backend, created explicitly so a failure raises."""
    from nixl_cu12._api import DEFAULT_COMM_PORT, nixl_agent, nixl_agent_config

    cfg = nixl_agent_config(
        enable_prog_thread=prog,
        enable_listen_thread=listen,
        listen_port=port if port is not None else DEFAULT_COMM_PORT,
        backends=[],
        sync_mode=sync_mode,
    )
    agent = nixl_agent(name, cfg)
    if backend:
        agent.create_backend(backend, dict(params or {}))
    return agent


def as_str(name) -> str:
    return name.decode() if isinstance(name, (bytes, bytearray)) else name


def connect(ini, tgt):
    """Load tgt's current metadata into ini (call again after new registrations)."""
    name = as_str(ini.add_remote_agent(tgt.get_agent_metadata()))
    assert name == tgt.name
    return name


def helper_env(plugin_dir=None, extra=None) -> dict:
    """Environment for a helper process: the suite's defaults, optionally another plugin
    directory (then with LD_LIBRARY_PATH so symlinked stock plugins find their libraries)."""
    env = dict(os.environ)
    configure_env(env)
    if plugin_dir is not None:
        env["NIXL_PLUGIN_DIR"] = str(plugin_dir)
        env["LD_LIBRARY_PATH"] = stock_lib_path() + (
            ":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    env["PYTHONPATH"] = str(HERE) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def run_helper(args, env=None, timeout=120) -> subprocess.CompletedProcess:
    """Run a helper script to completion; it must exit 0."""
    p = subprocess.run([sys.executable, *map(str, args)], env=env or helper_env(),
                       capture_output=True, text=True, errors="replace", timeout=timeout)
    assert p.returncode == 0, (
        f"{args[0]} exited with {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n"
        f"--- stderr\n{p.stderr[-8000:]}")
    return p


# ----------------------------------------------------------------------------- waiting


def _nap(i: int) -> None:
    # Spin briefly, then yield the CPU: the suite must also run on a 2-core machine where
    # progress threads compete with the polling test thread.
    if i > 200:
        time.sleep(0.0005)


def wait_xfer(agent, handle, pump=(), state="PROC", timeout=None, what="transfer"):
    """Poll check_xfer_state until DONE; pump = agents to progress meanwhile (update_notifs)."""
    deadline = time.monotonic() + (timeout or WAIT_S)
    i = 0
    while state == "PROC":
        state = agent.check_xfer_state(handle)
        for p in pump:
            p.update_notifs()
        if state == "PROC" and time.monotonic() > deadline:
            raise AssertionError(f"{what}: still PROC after {timeout or WAIT_S:.0f} s")
        i += 1
        _nap(i)
    assert state == "DONE", f"{what}: state {state}"
    return state


def take_notif(agent, sender: str, msg: bytes) -> bool:
    """Remove one notification (sender, msg) from agent.notifs, exact match; True if found."""
    lst = agent.notifs.get(sender)
    if lst and msg in lst:
        lst.remove(msg)
        return True
    return False


def wait_notif(agent, sender: str, msg: bytes, pump=(), timeout=None):
    """Wait until agent has received msg from sender (exact match), pumping other agents."""
    deadline = time.monotonic() + (timeout or WAIT_S)
    i = 0
    while True:
        agent.update_notifs()
        if take_notif(agent, sender, msg):
            return
        for p in pump:
            p.update_notifs()
        if time.monotonic() > deadline:
            raise AssertionError(
                f"notification {msg!r} from {sender!r} not received after "
                f"{timeout or WAIT_S:.0f} s; pending: {summarize_notifs(agent.notifs)}")
        i += 1
        _nap(i)


def summarize_notifs(notifs) -> str:
    return "{" + ", ".join(f"{k}: {[m[:40] for m in v][:8]}" for k, v in notifs.items()) + "}"


def run_xfer(initiator, handle, pump=(), notif=None, target=None, timeout=None, what="transfer",
             notif_msg=b""):
    """Post handle, wait for DONE, and (if notif) wait for it at target."""
    state = initiator.transfer(handle, notif_msg) if notif_msg else initiator.transfer(handle)
    wait_xfer(initiator, handle, pump=pump, state=state, timeout=timeout, what=what)
    if notif is not None:
        wait_notif(target, initiator.name, notif, pump=(initiator,) + tuple(pump), timeout=timeout)


# ----------------------------------------------------------------------------- buffers


_PERIOD = 1048573  # prime: a misplaced slot never lines up with the pattern's repeat
_CHUNK = 4 << 20


def alloc(n: int) -> np.ndarray:
    """n zero bytes, page-aligned and pre-faulted (MAP_POPULATE: first-touch page faults of
    fresh numpy buffers dominate the run time of big cases on small VMs)."""
    if n < (1 << 16):
        return np.zeros(n, dtype=np.uint8)
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                  | getattr(mmap, "MAP_POPULATE", 0))
    return np.frombuffer(m, dtype=np.uint8, count=n)


def fill_random(a: np.ndarray, seed: int) -> np.ndarray:
    """Fill a with pseudo-random bytes; beyond 1 MiB a random prime-length block repeats."""
    rng = np.random.default_rng(seed)
    n = a.size
    if n <= _PERIOD:
        a[:] = rng.integers(0, 256, size=n, dtype=np.uint8)
        return a
    base = rng.integers(0, 256, size=_PERIOD, dtype=np.uint8)
    reps = n // _PERIOD
    a[:reps * _PERIOD].reshape(reps, _PERIOD)[:] = base
    a[reps * _PERIOD:] = base[:n - reps * _PERIOD]
    return a


def random_bytes(n: int, seed: int) -> np.ndarray:
    return fill_random(alloc(n), seed)


class Region:
    """A buffer registered as one region, holding `n` slots of `size` bytes.

    Slot k starts at base + off + k * stride (stride = size + gap). The bytes outside the
    slots (gaps, the first `off` bytes, 8 trailing bytes) must never be written by a transfer,
    which checks that each descriptor moves exactly its own bytes.
    """

    def __init__(self, n: int, size: int, gap: int, seed: int, off: int = 0):
        self.n, self.size, self.gap, self.off = n, size, gap, off
        self.stride = size + gap
        self.buf = random_bytes(off + n * self.stride + 8, seed)
        self.base = self.buf.ctypes.data
        self.reg = None

    def register(self, agent):
        self.reg = agent.register_memory([(self.base, self.buf.nbytes, 0, "")], "DRAM")
        return self

    def data(self) -> np.ndarray:
        """The slot area (without the 8 trailing bytes that no descriptor covers)."""
        return self.buf[self.off:self.off + self.n * self.stride]

    def slots(self) -> np.ndarray:
        return self.data().reshape(self.n, self.stride)

    def outside(self) -> bytes:
        """Every byte no slot covers (gaps, leading and trailing bytes), for snapshots."""
        gaps = self.slots()[:, self.size:].tobytes() if self.gap else b""
        return (self.buf[:self.off].tobytes() + gaps
                + self.buf[self.off + self.n * self.stride:].tobytes())

    def desc_array(self, order) -> np.ndarray:
        order = np.asarray(order, dtype=np.uint64)
        d = np.zeros((len(order), 3), dtype=np.uint64)
        d[:, 0] = np.uint64(self.base + self.off) + order * np.uint64(self.stride)
        d[:, 1] = self.size
        return d

    def xfer_descs(self, agent, order):
        return agent.get_xfer_descs(self.desc_array(order), "DRAM")


def check_slots(dst: Region, dst_order, src: Region, src_order, what="destination"):
    """Slot dst_order[i] of dst equals slot src_order[i] of src, for every i (chunked, so no
    full-size temporaries)."""
    dst_order, src_order = np.asarray(dst_order), np.asarray(src_order)
    size = dst.size
    ds, ss = dst.slots(), src.slots()
    if size >= _CHUNK:
        for i in range(len(dst_order)):
            a, b = ds[dst_order[i], :size], ss[src_order[i], :size]
            for o in range(0, size, _CHUNK):
                if not np.array_equal(a[o:o + _CHUNK], b[o:o + _CHUNK]):
                    _report(a[o:o + _CHUNK], b[o:o + _CHUNK], f"{what}: descriptor {i}", o)
        return
    k = max(1, _CHUNK // max(size, 1))
    for g in range(0, len(dst_order), k):
        a, b = ds[dst_order[g:g + k], :size], ss[src_order[g:g + k], :size]
        if not np.array_equal(a, b):
            rows = np.flatnonzero((a != b).any(axis=1))
            i = g + rows[0]
            _report(a[rows[0]], b[rows[0]], f"{what}: {rows.size}+ descriptors differ, "
                    f"first descriptor {i} (slot {dst_order[i]} <- {src_order[i]})", 0)


def _report(actual, expected, what, base):
    bad = np.flatnonzero(actual != expected)
    raise AssertionError(
        f"{what}: {bad.size} of {actual.size} bytes differ; first at offset {base + bad[0]} "
        f"(got {actual[bad[0]]}, expected {expected[bad[0]]}); last at {base + bad[-1]}")


def assert_bytes_equal(actual: np.ndarray, expected: np.ndarray, what="buffer"):
    assert actual.size == expected.size, f"{what}: size {actual.size} != {expected.size}"
    for o in range(0, actual.size, _CHUNK):
        if not np.array_equal(actual[o:o + _CHUNK], expected[o:o + _CHUNK]):
            _report(actual[o:o + _CHUNK], expected[o:o + _CHUNK], what, o)


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a)).hexdigest()


# ----------------------------------------------------------------------------- metadata

# The agent metadata (get_agent_metadata) is NIXL's serializer format: "nixlSerDes|", then
# fields written as <tag><u64 little-endian length><value>"|" (the tag may be empty). The
# helpers below find the parts that belong to one backend: its connection info (tag "c",
# right after tag "t" with the backend name) and, in its memory section (tag "bknd"), one
# untagged field per registration: addr, len, devId as three u64, then the backend's
# getPublicData blob.


def _field(md: bytes, tag: bytes, pos: int):
    """(value_start, value_len) of the field with `tag` at pos, or raise."""
    if md[pos:pos + len(tag)] != tag:
        raise ValueError(f"tag {tag!r} expected at {pos}")
    (n,) = struct.unpack_from("<Q", md, pos + len(tag))
    start = pos + len(tag) + 8
    if md[start + n:start + n + 1] != b"|":
        raise ValueError(f"field {tag!r} at {pos} not terminated")
    return start, n


def conn_info_span(md: bytes, backend: str = BACKEND):
    """(start, length) of backend's connection info inside md."""
    name = backend.encode()
    key = b"|t" + struct.pack("<Q", len(name)) + name + b"|c"
    p = md.find(key)
    if p < 0:
        raise ValueError(f"no connection info for {backend} in metadata")
    return _field(md, b"c", p + len(key) - 1)


def mem_desc_fields(md: bytes, backend: str = BACKEND):
    """[(start, length)] of the descriptor fields (one per registration of backend) in md.

    A field holds addr, len and devId (three u64), then the backend's metaInfo blob.
    """
    name = backend.encode()
    key = b"bknd" + struct.pack("<Q", len(name)) + name + b"|"
    spans = []
    p = md.find(key)
    while p >= 0:
        q = p + len(key)
        s, n = _field(md, b"nixlDList", q)          # list class name
        s, n = _field(md, b"t", s + n + 1)           # memory type (u32)
        s, n = _field(md, b"n", s + n + 1)           # descriptor count (u64)
        (count,) = struct.unpack_from("<Q", md, s)
        q = s + n + 1
        for _ in range(count):
            s, ln = _field(md, b"", q)
            spans.append((s, ln))
            q = s + ln + 1
        p = md.find(key, q)
    return spans


def blob_span(field):
    """(start, length) of the metaInfo blob inside a descriptor field."""
    return field[0] + 24, field[1] - 24


def replace_blob(md: bytes, field, new: bytes) -> bytes:
    """md with the metaInfo blob of one descriptor field replaced by new."""
    start, n = field
    return (md[:start - 8] + struct.pack("<Q", 24 + len(new)) + md[start:start + 24] + new
            + md[start + n:])


def replace_span(md: bytes, span, new: bytes) -> bytes:
    """md with the field value at span replaced by new (length prefix rewritten)."""
    start, n = span
    return md[:start - 8] + struct.pack("<Q", len(new)) + new + md[start + n:]


def flip(md: bytes, positions) -> bytes:
    m = bytearray(md)
    for p in positions:
        m[p] ^= 0xFF
    return bytes(m)


def eprint(*a):
    print(*a, file=sys.stderr, flush=True)


class Peer:
    """A peer.py process: start(), call(cmd, **args) -> reply dict, close() (must exit 0)."""

    def __init__(self, name, prog=True, listen_port=0, params=None, env=None):
        import json
        import tempfile

        self.name = name
        self._json = json
        self.stderr = tempfile.TemporaryFile(mode="w+", errors="replace")
        cmd = [sys.executable, str(HERE / "peer.py"), name, "--prog", str(int(prog)),
               "--listen-port", str(listen_port), "--params", json.dumps(params or {})]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, errors="replace",
                                     env=env or helper_env())
        self.hello = self._read(timeout=60)

    def _read(self, timeout):
        import select

        deadline = time.monotonic() + timeout
        line = ""
        while not line.startswith("{"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            line = self.proc.stdout.readline() if ready else ""
            if not line:
                break
        if not line:
            self.proc.poll()
            raise AssertionError(f"peer {self.name}: no reply (rc={self.proc.returncode})\n"
                                 f"--- peer stderr\n{self.log()[-8000:]}")
        return self._json.loads(line)

    def log(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()

    def call(self, cmd, check=True, timeout=None, **kw):
        kw["cmd"] = cmd
        if timeout is not None:
            kw["timeout"] = timeout
        self.proc.stdin.write(self._json.dumps(kw) + "\n")
        self.proc.stdin.flush()
        rep = self._read(timeout=(timeout or WAIT_S) + 30)
        if check and not rep.get("ok"):
            raise AssertionError(f"peer {self.name}: {cmd} failed: {rep.get('error')}\n"
                                 f"{rep.get('trace', '')}")
        return rep

    def close(self, timeout=60):
        """Ask the peer to exit; return its exit status after checking it is 0."""
        if self.proc.returncode is None and self.proc.poll() is None:
            try:
                self.call("exit")
            except Exception:
                pass
            try:
                self.proc.stdin.close()
            except Exception:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"peer {self.name} did not exit\n{self.log()[-8000:]}")
        rc = self.proc.returncode
        assert rc == 0, f"peer {self.name} exited with {rc}\n--- peer stderr\n{self.log()[-8000:]}"
        return rc

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
