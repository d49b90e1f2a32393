"""Plugin discovery, plugin and backend parameters, and our plugin next to stock UCX."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import nfutil as U

KiB = 1 << 10

PROBE = r"""
import json, os
import nfutil as U
U.configure_env()
a = U.new_agent("probe-a", backend=None)
plugins = a.get_plugin_list()
out = {"plugins": plugins, "dir": os.environ.get("NIXL_PLUGIN_DIR")}
if U.BACKEND in plugins:
    a.create_backend(U.BACKEND, {})
    r = U.Region(4, 4096, 1, 1).register(a)
    h = a.initialize_xfer("WRITE", r.xfer_descs(a, [0, 1]), r.xfer_descs(a, [3, 2]), a.name, b"p")
    U.run_xfer(a, h, notif=b"p", target=a)
    U.check_slots(r, [3, 2], r, [0, 1], "probe loopback")
    a.release_xfer_handle(h)
    out["loopback"] = True
else:
    try:
        a.create_backend(U.BACKEND, {})
        out["create_error"] = None
    except Exception as e:
        out["create_error"] = type(e).__name__
print(json.dumps(out))
del a
"""


def probe(env):
    p = U.run_helper(["-c", PROBE], env=env, timeout=60)
    return json.loads(p.stdout.strip().splitlines()[-1])


def good_pair_transfer(ctx, ini, tgt, tag):
    L = ctx.region(ini, 2, 32 * KiB, seed=1)
    R = ctx.region(tgt, 2, 32 * KiB, seed=2)
    U.connect(ini, tgt)
    h = ini.initialize_xfer("WRITE", L.xfer_descs(ini, [0, 1]), R.xfer_descs(ini, [1, 0]),
                            tgt.name, tag)
    U.run_xfer(ini, h, notif=tag, target=tgt)
    U.check_slots(R, [1, 0], L, [0, 1], f"target ({tag!r})")
    ini.release_xfer_handle(h)


def test_plugin_list_in_process(ctx):
    a = ctx.agent("list")
    plugins = a.get_plugin_list()
    assert U.BACKEND in plugins, plugins
    pdir = os.environ.get("NIXL_PLUGIN_DIR")
    if pdir:  # the directory replaces the default one: exactly its plugins are listed
        names = {p.name[len("libplugin_"):-3] for p in Path(pdir).glob("libplugin_*.so")}
        assert set(plugins) == names, (plugins, names)


def test_plugin_dir_replaces_default(tmp_path):
    """NIXL_PLUGIN_DIR set to a directory holding only our plugin (a symlink): the plugin list
    is exactly [NAME], and the backend loads and transfers (in a fresh process)."""
    src = U.stock_plugin("UCX") if U.IS_UCX else U.plugin_file().resolve()
    (tmp_path / f"libplugin_{U.BACKEND}.so").symlink_to(src)
    out = probe(U.helper_env(plugin_dir=tmp_path))
    assert out["plugins"] == [U.BACKEND], out
    assert out.get("loopback"), out


def test_plugin_dir_without_our_plugin(tmp_path):
    """A plugin directory without the plugin (only stock POSIX): it is not listed, and
    creating it fails with an exception instead of a crash."""
    (tmp_path / "libplugin_POSIX.so").symlink_to(U.stock_plugin("POSIX"))
    out = probe(U.helper_env(plugin_dir=tmp_path))
    assert out["plugins"] == ["POSIX"], out
    assert out["create_error"], out


def test_plugin_params(ctx):
    a = ctx.agent("pparams")
    opts = a.get_plugin_params(U.BACKEND)
    mems = a.get_plugin_mem_types(U.BACKEND)
    assert isinstance(opts, dict) and all(isinstance(v, str) for v in opts.values()), opts
    assert "DRAM_SEG" in mems, mems
    assert "DRAM_SEG" in a.get_backend_mem_types(U.BACKEND)
    if not U.IS_UCX:
        assert "timeout_ms" in opts, f"get_backend_options does not list timeout_ms: {opts}"


def test_backend_params_roundtrip(ctx):
    """create_backend(NAME, {...}) -> get_backend_params shows the keys; our plugin accepts
    the unknown key num_workers (UCX knows it)."""
    a = ctx.agent("bparams", backend=None)
    a.create_backend(U.BACKEND, {"timeout_ms": "4000", "num_workers": "4"})
    p = a.get_backend_params(U.BACKEND)
    assert p.get("timeout_ms") == "4000" and p.get("num_workers") == "4", p
    assert "DRAM_SEG" in a.get_backend_mem_types(U.BACKEND)
    b = ctx.agent("bparams-peer")
    good_pair_transfer(ctx, a, b, b"params")


def test_backend_params_defaults_roundtrip(ctx):
    """Every key get_plugin_params lists, passed back with the value it lists, is accepted
    and shows up in get_backend_params."""
    probe_agent = ctx.agent("defaults-probe")
    opts = dict(probe_agent.get_plugin_params(U.BACKEND))
    a = ctx.agent("defaults", backend=None)
    a.create_backend(U.BACKEND, opts)
    p = a.get_backend_params(U.BACKEND)
    assert all(p.get(k) == v for k, v in opts.items()), (opts, p)
    b = ctx.agent("defaults-peer")
    good_pair_transfer(ctx, a, b, b"defaults")


@pytest.mark.ours_only
def test_unknown_key_warns():
    """An unknown key is accepted (kept in the backend params), and the plugin logs a
    warning naming it (checked on the stderr of a fresh process)."""
    code = ("import json, nfutil as U; U.configure_env()\n"
            "a = U.new_agent('warn', params={'num_workers': '4', 'nf_no_such_key': 'x'})\n"
            "print(json.dumps(a.get_backend_params(U.BACKEND)))\n"
            "del a\n")
    p = U.run_helper(["-c", code], timeout=60)
    params = json.loads(p.stdout.strip().splitlines()[-1])
    assert params.get("num_workers") == "4" and params.get("nf_no_such_key") == "x", params
    for key in ("num_workers", "nf_no_such_key"):
        assert any(key in ln for ln in p.stderr.splitlines()), (
            f"no log line names the unknown key {key}; stderr:\n{p.stderr[-4000:]}")


@pytest.mark.ours_only
@pytest.mark.parametrize("value", ["soon", "12abc", "", "-1"])
def test_backend_params_malformed(ctx, value):
    """A malformed value of a known key makes create_backend fail with an exception; the
    agent then creates the backend with good parameters and transfers."""
    a = ctx.agent("badparam", backend=None)
    with pytest.raises(Exception):
        a.create_backend(U.BACKEND, {"timeout_ms": value})
        pytest.fail(f"timeout_ms={value!r} accepted: {a.get_backend_params(U.BACKEND)}")
    a.create_backend(U.BACKEND, {"timeout_ms": "4000"})
    b = ctx.agent("badparam-peer")
    good_pair_transfer(ctx, a, b, b"after-bad-param")


def test_compare_with_ucx(tmp_path):
    """Our plugin and stock UCX loaded side by side (one plugin directory, symlinks): the same
    WRITE and READ through each backend give identical bytes, and each transfer runs on the
    backend it asked for. Under NF_TEST_BACKEND=UCX this checks the script with UCX alone."""
    (tmp_path / "libplugin_UCX.so").symlink_to(U.stock_plugin("UCX"))
    backends = ["UCX"]
    if not U.IS_UCX:
        (tmp_path / f"libplugin_{U.BACKEND}.so").symlink_to(U.plugin_file().resolve())
        backends.append(U.BACKEND)
    p = U.run_helper([U.HERE / "compare_ucx.py", ",".join(backends)],
                     env=U.helper_env(plugin_dir=tmp_path), timeout=120)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["ok"] and set(backends) <= set(out["plugins"]), out
