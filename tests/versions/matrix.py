#!/usr/bin/env python3
"""The version matrix: every case of case.py for every release, our plugin and the stock UCX
plugin side by side in the release's own plugin folder.

    matrix.py --cache DIR --plugin PLUGIN.so [--jobs N] [--report FILE] VERSION...

Each release must already be unpacked in DIR/<VERSION>/site (runtime.py). Our plugin is
linked into that release's own plugin folder as libplugin_FABRICX.so, next to its stock
libplugin_UCX.so, and NIXL_PLUGIN_DIR is left unset: the way `make install` and
`python -m nixl_fabric install` place it. Cases run N at a time; the table (also written to
--report) gives, per release, the engine layout our plugin chose and each case's result.
Exit status 0 only if every case passed.
"""
import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BACKEND = "FABRICX"
MODES = ("one", "two")
TIMEOUT_S = 180


def plugin_dir(cache, version):
    return os.path.join(cache, version, "site", ".nixl_cu12.mesonpy.libs", "plugins")


def needs_cuda(ucx_plugin):
    """The stock UCX plugin of 0.7-0.9 links libcuda.so.1 (a CPU-only host has none)."""
    out = subprocess.run(["readelf", "-d", ucx_plugin], capture_output=True, text=True).stdout
    return "[libcuda.so.1]" in out


def run_case(args, version, mode, backend):
    env = dict(os.environ)
    env.pop("NIXL_PLUGIN_DIR", None)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(args.cache, version, "site"),
                                         os.path.join(args.cache, "stubs")])
    env["UCX_MODULES"] = "^ib"
    env["NIXL_FABRIC_LOG"] = "info"  # the plugin's line naming the layout it chose
    if backend == "UCX" and needs_cuda(os.path.join(plugin_dir(args.cache, version), "libplugin_UCX.so")):
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [args.cuda_stub, env.get("LD_LIBRARY_PATH")]))
    started = time.time()
    try:
        p = subprocess.run([sys.executable, os.path.join(HERE, "case.py"), mode, backend], env=env,
                           capture_output=True, text=True, timeout=TIMEOUT_S)
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        rc = f"timeout after {TIMEOUT_S} s"
    secs = time.time() - started
    ok = rc == 0 and re.search(r"^PASS ", out, re.M) is not None
    layout = re.search(r"engine layout (.*)$", out, re.M)
    with open(os.path.join(args.logs, f"{version}-{backend}-{mode}.log"), "w") as f:
        f.write(out)
    fail = re.search(r"^FAIL .*$", out, re.M)
    why = fail.group(0) if fail else f"rc {rc}: " + " | ".join(out.strip().splitlines()[-3:])
    return version, mode, backend, ok, secs, layout.group(1) if layout else "", "" if ok else why


def unknown_release(args, base="1.5.1", fake="1.6.0"):
    """The stock agent of `base` dressed up as a release no one has tested (its dist-info
    renamed): createBackend must fail cleanly with our message, and the process live on.
    The agent's libraries and the Python package are copied (the plugin reads the release
    from the dist-info beside libnixl's real path); the bundled libraries are linked."""
    src = os.path.join(args.cache, base, "site")
    site = os.path.join(args.cache, "..", f"unreleased-{fake}", "site")
    if not os.path.isdir(site):
        os.makedirs(site)
        shutil.copytree(os.path.join(src, ".nixl_cu12.mesonpy.libs"),
                        os.path.join(site, ".nixl_cu12.mesonpy.libs"), symlinks=True)
        # Copied too: its extension finds libnixl through "$ORIGIN/..", which a symlinked
        # folder would resolve to the original's parent.
        shutil.copytree(os.path.join(src, "nixl_cu12"), os.path.join(site, "nixl_cu12"))
        os.symlink(os.path.join(src, "nixl_cu12.libs"), os.path.join(site, "nixl_cu12.libs"))
        os.makedirs(os.path.join(site, f"nixl_cu12-{fake}.dist-info"))
    env = dict(os.environ, PYTHONPATH=site)
    env.pop("NIXL_PLUGIN_DIR", None)
    p = subprocess.run([sys.executable, os.path.join(HERE, "case.py"), "refused", BACKEND], env=env,
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    out = p.stdout + p.stderr
    want = f"cannot create backend {BACKEND}: the loading NIXL is NIXL {fake}"
    ok = p.returncode == 0 and "PASS" in out and want in out
    line = next((l for l in out.splitlines() if "cannot create backend" in l), "")
    print(f"  {'ok  ' if ok else 'FAIL'} {fake} (the {base} agent, unreleased to us) refused: "
          + (line.split("] ", 1)[-1][:160] + "..." if ok else out.strip()[-400:]), flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", required=True)
    ap.add_argument("--plugin", required=True)
    ap.add_argument("--cuda-stub", default="")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--report", default="")
    ap.add_argument("versions", nargs="+")
    args = ap.parse_args()
    args.cache = os.path.abspath(args.cache)
    args.logs = os.path.join(args.cache, "..", "logs")
    os.makedirs(args.logs, exist_ok=True)
    plugin = os.path.abspath(args.plugin)
    for v in args.versions:
        link = os.path.join(plugin_dir(args.cache, v), f"libplugin_{BACKEND}.so")
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(plugin, link)

    started = time.time()
    cases = [(v, m, b) for v in args.versions for m in MODES for b in (BACKEND, "UCX")]
    results = {}
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for r in pool.map(lambda c: run_case(args, *c), cases):
            version, mode, backend, ok, secs, layout, why = r
            results[(version, mode, backend)] = r
            print(f"  {'ok  ' if ok else 'FAIL'} {version:7} {backend:8} {mode}-process {secs:5.1f} s"
                  + (f"  {why}" if why else ""), flush=True)
    wall = time.time() - started

    lines = [f"| NIXL (nixl-cu12) | engine layout chosen | {BACKEND} 1 process | {BACKEND} 2 processes "
             "| stock UCX 1 process | stock UCX 2 processes |", "|---|---|---|---|---|---|"]
    failed = 0
    for v in args.versions:
        row = [v, results[(v, "one", BACKEND)][5] or "?"]
        for b in (BACKEND, "UCX"):
            for m in MODES:
                r = results[(v, m, b)]
                failed += not r[3]
                row.append(f"pass ({r[4]:.1f} s)" if r[3] else "FAIL")
        lines.append("| " + " | ".join(row) + " |")
    total, note = len(cases), ""
    if "1.5.1" in args.versions:
        total += 1
        failed += not unknown_release(args)
        note = " (the last: an unknown release refused through the stock agent)"
    summary = (f"{total - failed}/{total} cases passed{note}, {len(args.versions)} releases, "
               f"{wall:.0f} s wall with {args.jobs} jobs")
    table = "\n".join(lines + ["", summary])
    print(table)
    if args.report:
        with open(args.report, "w") as f:
            f.write(table + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
