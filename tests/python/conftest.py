"""pytest configuration for the Python integration suite.

Environment (all optional):
  NF_TEST_BACKEND     backend under test: LIBFABRIC (default, our plugin) or UCX (stock; used
                      to check the tests themselves). Tests marked ours_only skip under UCX.
  NF_TEST_PLUGIN_DIR  directory with our libplugin_<NAME>.so (default <repo>/build/plugins).
  NIXL_PLUGIN_DIR     set by the suite to NF_TEST_PLUGIN_DIR for our backend.
  NF_TEST_WAIT_S      bound on each wait for a transfer, notification or metadata (60).
  NF_TEST_TIMEOUT_S   per-test watchdog (180): on expiry all thread stacks are written to
                      the hang report and the run exits with status 1 instead of hanging.
  NF_TEST_HANG_REPORT where that report goes; it is deleted when pytest ends normally.
Markers: large (64 MiB cases: -m "not large" skips them), ours_only, two_process, perf.
"""

from __future__ import annotations

import faulthandler
import gc
import itertools
import os
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import nfutil as U  # noqa: E402

U.configure_env()  # before any agent exists: fixes the plugin directory for this process

TEST_TIMEOUT_S = float(os.environ.get("NF_TEST_TIMEOUT_S", "180"))
HANG_REPORT = Path(os.environ.get(
    "NF_TEST_HANG_REPORT", str(Path(tempfile.gettempdir()) / f"nf-python-hang-{os.getpid()}.txt")))


def pytest_configure(config):
    for m in ("large: the largest transfers (64 MiB); deselect with -m 'not large'",
              "ours_only: only meaningful for our plugin; skipped with NF_TEST_BACKEND=UCX",
              "two_process: uses a second process (tests/python/peer.py)",
              "perf: loose timing bounds (deselect with -m 'not perf' on an overloaded host)"):
        config.addinivalue_line("markers", m)
    pdir = os.environ.get("NIXL_PLUGIN_DIR")
    if pdir and not (Path(pdir) / f"libplugin_{U.BACKEND}.so").exists():
        raise pytest.UsageError(
            f"NIXL_PLUGIN_DIR={pdir} has no libplugin_{U.BACKEND}.so (build it with `make build`, "
            f"or run the suite against the stock backend with NF_TEST_BACKEND=UCX)")


def pytest_unconfigure(config):
    # Reaching here means pytest ended normally: drop the report, so that its presence after
    # a run means a hang (it then holds every thread's stack) or a crash (python.mk prints it).
    try:
        HANG_REPORT.unlink()
    except OSError:
        pass


def pytest_report_header(config):
    return [f"nixl-fabric suite: backend {U.BACKEND}, NIXL_PLUGIN_DIR="
            f"{os.environ.get('NIXL_PLUGIN_DIR', '(wheel default)')}, hang report {HANG_REPORT}"]


def pytest_collection_modifyitems(config, items):
    if U.IS_UCX:
        skip = pytest.mark.skip(reason="ours_only: not applicable to the stock UCX backend")
        for item in items:
            if "ours_only" in item.keywords:
                item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # A hang in the plugin must fail the run, not block it: dump every thread's stack and
    # exit(1) when one test (setup, call and teardown) takes longer than the watchdog.
    with open(HANG_REPORT, "w") as f:
        f.write(f"running {item.nodeid} (watchdog {TEST_TIMEOUT_S:.0f} s)\n")
        f.flush()
        faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True, file=f)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()


# ----------------------------------------------------------------------------- fixtures

_names = itertools.count()


class Ctx:
    """Owns the agents and buffers of one test; agents are destroyed before the buffers."""

    def __init__(self, nodeid: str):
        self.tag = f"{os.getpid()}"
        self.agents = []
        self.keep = []

    def name(self, role: str) -> str:
        return f"{role}-{self.tag}-{next(_names)}"

    def agent(self, role="agent", **kw):
        a = U.new_agent(self.name(role), **kw)
        self.agents.append(a)
        return a

    def region(self, agent, n, size, gap=0, seed=0, off=0):
        r = U.Region(n, size, gap, seed, off)
        self.keep.append(r)
        if agent is not None:
            r.register(agent)
        return r

    def hold(self, *objs):
        self.keep.extend(objs)
        return objs[0] if len(objs) == 1 else objs

    def pair(self, prog_init=True, prog_target=True, params=None, **kw):
        """(initiator, target) agents; register memory, then U.connect(ini, tgt)."""
        ini = self.agent("ini", prog=prog_init, params=params, **kw)
        tgt = self.agent("tgt", prog=prog_target, params=params, **kw)
        return ini, tgt

    def close(self):
        self.agents.clear()
        gc.collect()
        self.keep.clear()
        gc.collect()


@pytest.fixture
def ctx(request):
    c = Ctx(request.node.nodeid)
    yield c
    c.close()


@pytest.fixture(scope="module")
def module_ctx(request):
    """Like ctx, shared by the tests of one module (e.g. one peer process for many cases)."""
    c = Ctx(request.node.nodeid)
    yield c
    c.close()


@pytest.fixture(scope="session")
def cmp_plugin_dir(tmp_path_factory):
    """A plugin directory holding our plugin and the stock UCX plugin (symlinks)."""
    d = tmp_path_factory.mktemp("plugins-cmp")
    (d / f"libplugin_{U.BACKEND}.so").symlink_to(U.plugin_file().resolve())
    (d / "libplugin_UCX.so").symlink_to(U.stock_plugin("UCX"))
    return d
