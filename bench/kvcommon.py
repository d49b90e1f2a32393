"""Shared pieces of the descriptor-heavy benchmarks (bench/descs.py, bench/vllm_kv.py).

Neither script needs the rest of the repository: `make gpu-bundle` copies them with this file
into .gpu/. Everything here is plain Python + numpy (no NIXL, no torch), so the orchestrating
process of a benchmark never loads a backend; each backend runs in processes of its own
(NIXL_PLUGIN_DIR is read once per process).
"""
from __future__ import annotations

import datetime
import hashlib
import json
import mmap
import os
import select
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

KiB, MiB = 1 << 10, 1 << 20
# Upper bound on any single wait (transfer completion, notification, control message).
WAIT_S = float(os.environ.get("KV_BENCH_WAIT_S", "60"))


def log(msg):
    sys.stderr.write(f"[{os.path.basename(sys.argv[0])}:{os.getpid()}] {msg}\n")
    sys.stderr.flush()


def med(xs):
    return statistics.median(xs) if xs else None


def rnd(v, nd=3):
    """Round to nd significant digits (None passes through)."""
    if v is None:
        return None
    return float(f"{v:.{nd}g}")


def ratio(a, b):
    return rnd(a / b) if a and b else None


# ----------------------------------------------------------------------------- environment

def pick_module(want=None):
    """The stock agent's Python module: nixl_cu13 on the GPU host, nixl_cu12 here."""
    want = want or os.environ.get("NIXL_PY_MODULE")
    for m in ([want] if want else ["nixl_cu13", "nixl_cu12"]):
        try:
            __import__(f"{m}._api")
            return m
        except ImportError:
            continue
    raise SystemExit(f"no NIXL python module among {want or 'nixl_cu13, nixl_cu12'} "
                     f"(PYTHONPATH={os.environ.get('PYTHONPATH', '')})")


def backend_env(backend, plugdir, extra=None):
    """Environment of a process that runs `backend`: loopback only; ours from plugdir, UCX
    (and anything else) from the stock agent's own plugin directory (NIXL_PLUGIN_DIR unset)."""
    env = dict(os.environ)
    env.update(FI_TCP_IFACE="lo", FI_SOCKETS_IFACE="lo", NIXL_FABRIC_IFACE="lo",
               # UCX's InfiniBand module (and the bundled libnl it pulls in) segfaults at exit
               # in these environments; numpy's idle BLAS threads only cost CPU on 2 cores.
               UCX_MODULES="^ib", OPENBLAS_NUM_THREADS="1")
    env.pop("NIXL_LOG_LEVEL", None)
    if backend == "LIBFABRIC" and plugdir:
        env["NIXL_PLUGIN_DIR"] = plugdir
    else:
        env.pop("NIXL_PLUGIN_DIR", None)
    for k, v in (extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def private_plugin(src, plugdir):
    """Copy our plugin into a directory of our own (a rebuild rewrites build/plugins in place,
    and a process that maps the old file dies of SIGBUS). Returns (facts, directory)."""
    os.makedirs(plugdir, exist_ok=True)
    dst = os.path.join(plugdir, "libplugin_LIBFABRIC.so")
    data = open(src, "rb").read()
    with open(dst + ".tmp", "wb") as f:
        f.write(data)
    os.chmod(dst + ".tmp", 0o755)
    os.replace(dst + ".tmp", dst)
    st = os.stat(src)
    return ({"source": os.path.abspath(src), "sha256": hashlib.sha256(data).hexdigest(),
             "bytes": len(data), "mtime": datetime.datetime.fromtimestamp(st.st_mtime)
             .isoformat(timespec="seconds")}, plugdir)


def git_rev(root, here):
    """HEAD of the checkout; in the GPU bundle, the GIT_REV file `make gpu-bundle` wrote."""
    try:
        rev = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        rev = ""
    if not rev:
        try:
            rev = open(os.path.join(here, "GIT_REV")).read().strip()
        except OSError:
            pass
    return rev


def host_facts():
    def read(p):
        try:
            return open(p).read().strip()
        except OSError:
            return None
    return {"host": socket.gethostname(), "nproc": os.cpu_count(),
            "kernel": os.uname().release, "python": sys.version.split()[0],
            "loadavg_start": os.getloadavg(),
            "ptrace_scope": read("/proc/sys/kernel/yama/ptrace_scope")}


# ----------------------------------------------------------------------------- agents

def new_agent(module, name, backend, prog):
    """An agent with exactly one backend, created explicitly so that a plugin that cannot be
    loaded raises here (the constructor would only warn)."""
    api = __import__(f"{module}._api", fromlist=["nixl_agent", "nixl_agent_config"])
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=bool(prog),
                                                       backends=[]))
    agent.create_backend(backend, json.loads(os.environ.get("KV_BENCH_PARAMS") or "{}"))
    return agent


def as_str(name):
    return name.decode() if isinstance(name, (bytes, bytearray)) else name


def wait_done(agent, handle, state, pump=(), timeout=WAIT_S, what="transfer"):
    """Poll check_xfer_state until DONE. Spins (the numbers are latencies), yielding the CPU
    after a while so a 2-core host's progress threads and peer still run; `pump` = agents of
    this process to drive meanwhile (progress threads off)."""
    deadline = time.monotonic() + timeout
    i = 0
    while state == "PROC":
        for p in pump:
            p.update_notifs()
        state = agent.check_xfer_state(handle)
        i += 1
        if i > 2000:
            os.sched_yield()
            if (i & 1023) == 0 and time.monotonic() > deadline:
                raise TimeoutError(f"{what}: still PROC after {timeout:.0f} s")
    if state != "DONE":
        raise RuntimeError(f"{what}: state {state}")


# ----------------------------------------------------------------------------- control channel

class ChanError(Exception):
    """The control channel is gone or out of step: the run cannot go on."""


class Chan:
    """JSON lines over a socket; every receive has a deadline and notices a dead peer."""

    def __init__(self, sock, peer=None):
        self.sock, self.buf, self.peer = sock, b"", peer

    def send(self, **kw):
        self.sock.sendall((json.dumps(kw) + "\n").encode())

    def recv(self, timeout=WAIT_S, idle=None):
        """One message; `idle` is called between polls (a target drives its agent there)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChanError(f"no control message within {timeout:.0f} s")
            if self.peer is not None and self.peer.poll() is not None:
                raise ChanError(f"the peer process exited with status {self.peer.returncode}")
            r, _, _ = select.select([self.sock], [], [], 0 if idle else min(left, 0.2))
            if r:
                chunk = self.sock.recv(1 << 20)
                if not chunk:
                    raise ChanError("control channel closed by the peer")
                self.buf += chunk
            elif idle:
                idle()
        line, self.buf = self.buf.split(b"\n", 1)
        msg = json.loads(line)
        if msg.get("error"):
            raise RuntimeError(f"peer: {msg['error']}")
        return msg

    def call(self, timeout=WAIT_S, **kw):
        self.send(**kw)
        return self.recv(timeout=timeout)


def spawn_peer(script, args, env=None):
    """Start `script --role ... --fd N` with one end of a socketpair; (Popen, Chan)."""
    parent, child = socket.socketpair()
    cmd = [sys.executable, os.path.abspath(script), *map(str, args), "--fd", str(child.fileno())]
    proc = subprocess.Popen(cmd, pass_fds=[child.fileno()], env=env)
    child.close()
    return proc, Chan(parent, proc)


def stop_peer(proc, chan, timeout=30):
    """Ask the peer to exit, then make sure it did (kill after timeout); its exit status."""
    if proc is None:
        return None
    if proc.poll() is None:
        try:
            chan.send(cmd="quit")
        except OSError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log(f"peer {proc.pid} did not exit within {timeout} s: killing it")
            proc.kill()
            proc.wait()
    return proc.returncode


def finish(rc):
    """Leave without exit-time destructors: the wheel's UCX can segfault in them (bundled
    libnl, _dl_fini) after everything was released; the results are already printed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


# ----------------------------------------------------------------------------- host buffers

def alloc(n):
    """n bytes, page-aligned and pre-faulted (MAP_POPULATE), so first-touch page faults do
    not land in the first transfer."""
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                  | getattr(mmap, "MAP_POPULATE", 0))
    a = np.frombuffer(m, dtype=np.uint8, count=n)
    a.fill(0xA5)   # and written once: no copy-on-write zero page behind any of it
    return a


def stamp(gen, slots):
    """The first 64-bit word of each slot's pattern: generation and slot number; the word's
    index inside the slot is added to it, so a shifted or partial copy shows too."""
    return (np.uint64(gen) << np.uint64(48)) | (np.asarray(slots, dtype=np.uint64)
                                                 << np.uint64(20))


class Slots:
    """A host buffer of n slots of bs bytes (bs a multiple of 8), stamped per generation."""

    CHUNK = 4096   # slots per step of fill/check (bounded temporaries)

    def __init__(self, n, bs):
        assert bs % 8 == 0
        self.n, self.bs = n, bs
        self.buf = alloc(n * bs)
        self.base = self.buf.ctypes.data
        self.words = self.buf.view(np.uint64).reshape(n, bs // 8)
        self.w = np.arange(bs // 8, dtype=np.uint64)

    def descs(self, n):
        """(n, 3) uint64: slot i at base + i*bs, bs bytes, device 0."""
        d = np.zeros((n, 3), dtype=np.uint64)
        d[:, 0] = np.uint64(self.base) + np.arange(n, dtype=np.uint64) * np.uint64(self.bs)
        d[:, 1] = self.bs
        return d

    def fill(self, gen, n):
        for a in range(0, n, self.CHUNK):
            b = min(n, a + self.CHUNK)
            np.add(stamp(gen, np.arange(a, b))[:, None], self.w[None, :], out=self.words[a:b])

    def check(self, gen, dst, src):
        """Slot dst[i] holds source slot src[i]'s pattern of gen, for every i. Returns None or
        a line saying what differs."""
        dst, src = np.asarray(dst), np.asarray(src)
        bad, first = 0, None
        for a in range(0, len(dst), self.CHUNK):
            got = self.words[dst[a:a + self.CHUNK]]
            exp = stamp(gen, src[a:a + self.CHUNK])[:, None] + self.w[None, :]
            rows = np.flatnonzero((got != exp).any(axis=1))
            if rows.size:
                bad += rows.size
                if first is None:
                    i = a + rows[0]
                    g = got[rows[0]]
                    first = (f"descriptor {i} (slot {dst[i]} <- {src[i]}): first word "
                             f"{int(g[0]):#x}, expected {int(exp[rows[0]][0]):#x}")
        return None if not bad else f"{bad} of {len(dst)} descriptors differ; first {first}"


# ----------------------------------------------------------------------------- children, results

def run_child(cmd, env, timeout, logpath):
    """Run a measuring child; its stdout lines `RESULT {json}` are the points (kept even when
    it is killed on timeout), everything else goes to logpath. (points, error or None)."""
    points, err = [], None
    with open(logpath, "w") as logf:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=logf, text=True,
                                errors="replace", start_new_session=True)
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    err = f"timed out after {timeout:.0f} s"
                    break
                r, _, _ = select.select([proc.stdout], [], [], min(left, 1.0))
                if not r:
                    if proc.poll() is not None:
                        break
                    continue
                line = proc.stdout.readline()
                if not line:
                    break
                if line.startswith("RESULT "):
                    points.append(json.loads(line[7:]))
                elif line.startswith("ERROR "):
                    err = line[6:].strip()
                logf.write(line)
                logf.flush()
        finally:
            if proc.poll() is None:
                try:
                    proc.wait(timeout=5 if err else timeout)
                except subprocess.TimeoutExpired:
                    # the child's process group: its own peer process goes with it
                    try:
                        os.killpg(proc.pid, 9)
                    except OSError:
                        pass
                    proc.wait()
    if proc.returncode and not err:
        err = f"exited with status {proc.returncode}"
    return points, err


def tail(path, n=25):
    try:
        lines = open(path, errors="replace").read().splitlines()
    except OSError:
        return ""
    lines = [ln for ln in lines if "NIXL INFO" not in ln and not ln.startswith("RESULT ")]
    return "\n".join(lines[-n:])


def write_report(report, out_dir, stem, plot, script):
    """DIR/STEM.json and, when matplotlib is there, DIR/STEM.png; (json path, png or None).
    A plot that fails in this process is retried in one without PYTHONPATH (the GPU host's
    matplotlib may be built against another numpy than the bundle's)."""
    os.makedirs(out_dir, exist_ok=True)
    js = os.path.join(out_dir, stem + ".json")
    with open(js + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(js + ".tmp", js)
    png = os.path.join(out_dir, stem + ".png")
    try:
        made = plot(report, png)
    except Exception as e:  # noqa: BLE001 - the JSON is written; a plot bug must not fail the run
        log(f"plot failed: {type(e).__name__}: {e}")
        made = False
    if not made and os.environ.get("PYTHONPATH"):
        env = dict(os.environ)
        env.pop("PYTHONPATH")
        try:
            made = subprocess.run([sys.executable, os.path.abspath(script), "--plot", js,
                                   "--png", png], env=env, timeout=120).returncode == 0
        except (OSError, subprocess.TimeoutExpired) as e:
            log(f"plot without PYTHONPATH failed: {e}")
    return js, (png if made else None)


def pyplot():
    """matplotlib.pyplot with the Agg backend, or None."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        log("matplotlib missing: no PNG (make bench installs it)")
        return None
