#!/usr/bin/env python3
"""A minimal stock NIXL runtime of one nixl-cu12 release, cached for the version matrix.

    runtime.py CACHE VERSION [VERSION ...]

For each VERSION, CACHE/<VERSION>/site becomes a directory to put on PYTHONPATH that holds
what a DRAM test needs of the wheel and nothing else (~15-30 MB instead of 100-300):
the Python package, its dist-info (the plugin reads the release from it), the agent's
libraries in .nixl_cu12.mesonpy.libs with only the UCX plugin, the bundled libraries in
nixl_cu12.libs that those need (the ELF NEEDED closure), and UCX's cma module. A second run
finds CACHE/<VERSION>/.ok and downloads nothing. Wheels are fetched with
`pip download --no-deps --only-binary=:all:` for this interpreter's Python version and
deleted once unpacked.

CACHE/stubs holds a stand-in `torch` package: releases up to 1.3.2 import torch at module
load, and DRAM tests only need its `Tensor` name to exist.
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = os.environ.get("NIXL_MATRIX_PACKAGE", "nixl-cu12")
MODULE = PACKAGE.replace("-", "_")
LIBS = f".{MODULE}.mesonpy.libs/"
BUNDLED = f"{MODULE}.libs/"
# Plugins kept: the stock UCX one (the matrix checks it still works beside ours).
KEEP_PLUGINS = re.compile(r"/plugins/libplugin_UCX\.so$")
# UCX transport modules kept (tcp, self, sysv and posix are built into libuct itself).
KEEP_UCX_MODULES = re.compile(r"/ucx/libuct_cma\.so")


def needed(path):
    """DT_NEEDED entries of an ELF file (readelf ships with binutils, which gcc pulls in)."""
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def unpack(wheel, site):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        first = []
        for n in names:
            if n.endswith("/"):
                continue
            top = n.split("/", 1)[0]
            if top == MODULE or top.endswith(".dist-info"):
                first.append(n)
            elif n.startswith(LIBS) and ("/plugins/" not in n or KEEP_PLUGINS.search(n)):
                first.append(n)
            elif n.startswith(BUNDLED) and KEEP_UCX_MODULES.search(n):
                first.append(n)
        for n in first:
            z.extract(n, site)
        # The bundled libraries that the kept objects need, transitively.
        bundled = {n[len(BUNDLED):]: n for n in names if n.startswith(BUNDLED) and n.count("/") == 1}
        todo = [os.path.join(site, n) for n in first if re.search(r"\.so(\.|$)", n)]
        seen = set()
        while todo:
            path = todo.pop()
            for lib in needed(path):
                if lib in bundled and lib not in seen:
                    seen.add(lib)
                    z.extract(bundled[lib], site)
                    todo.append(os.path.join(site, bundled[lib]))
    for p in subprocess.run(["find", site, "-name", "*.so*", "-type", "f"], capture_output=True,
                            text=True).stdout.split():
        os.chmod(p, 0o755)


def torch_stub(cache):
    stub = os.path.join(cache, "stubs", "torch")
    os.makedirs(stub, exist_ok=True)
    with open(os.path.join(stub, "__init__.py"), "w") as f:
        f.write('"""Stand-in for torch: NIXL <= 1.3.2 imports it at load; DRAM tests use numpy."""\n'
                "class Tensor:\n    pass\n")


def fetch(cache, version):
    root = os.path.join(cache, version)
    if os.path.exists(os.path.join(root, ".ok")):
        return f"{version}: cached"
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        py = f"{sys.version_info.major}.{sys.version_info.minor}"
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "--python-version", py, "--implementation", "cp",
                        "--platform", "manylinux_2_28_x86_64", "-d", tmp,
                        f"{PACKAGE}=={version}"], check=True)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if len(wheels) != 1:
            raise SystemExit(f"{version}: expected one wheel, got {wheels}")
        unpack(os.path.join(tmp, wheels[0]), os.path.join(root, "site"))
    size = subprocess.run(["du", "-sh", root], capture_output=True, text=True).stdout.split()[0]
    open(os.path.join(root, ".ok"), "w").close()
    return f"{version}: unpacked ({size})"


def main():
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    cache = os.path.abspath(sys.argv[1])
    os.makedirs(cache, exist_ok=True)
    torch_stub(cache)
    for v in sys.argv[2:]:
        print(fetch(cache, v), flush=True)


if __name__ == "__main__":
    main()
