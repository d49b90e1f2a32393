"""Where the active NIXL looks for backend plugins.

The stock agent lists exactly one folder: NIXL_PLUGIN_DIR if set (it *replaces* the default),
else the `plugins` folder next to the libnixl.so it loaded. For the pip wheels that is
site-packages/.nixl_cu12.mesonpy.libs/plugins (nixl-cu13: .nixl_cu13...). Installing our
plugin into that folder keeps the stock UCX and POSIX plugins usable beside it; a symlink to
a stock plugin placed in another folder does not load (its RPATH is relative to its own
folder).

Also runnable as a script: `python3 locate.py` prints the folder (exit 1 if none).
Only the standard library is used, and NIXL itself is never imported (releases up to
1.3.2 import torch at load).
"""
import glob
import importlib.util
import os
import sys

# The NIXL wheels, newest CUDA first. `nixl` is the meta-package name (it pulls one of them).
PACKAGES = ("nixl_cu13", "nixl_cu12", "nixl")


class Found:
    """One NIXL installation: its plugin folder and how it was found."""

    def __init__(self, plugin_dir, how, package=None, version=None):
        self.plugin_dir = plugin_dir
        self.how = how
        self.package = package
        self.version = version

    def __repr__(self):
        return f"Found({self.plugin_dir!r}, {self.how!r}, {self.package!r}, {self.version!r})"


def _version(site, package):
    for info in glob.glob(os.path.join(site, f"{package}-*.dist-info")):
        return os.path.basename(info)[len(package) + 1:-len(".dist-info")]
    return None


def from_python_packages():
    """NIXL wheels importable by this interpreter, without importing them."""
    found = []
    for package in PACKAGES:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.submodule_search_locations:
            continue
        site = os.path.dirname(os.path.abspath(list(spec.submodule_search_locations)[0]))
        plugins = os.path.join(site, f".{package}.mesonpy.libs", "plugins")
        if os.path.isdir(plugins):
            found.append(Found(plugins, f"Python package {package}", package, _version(site, package)))
    return found


# Where source builds and NVIDIA's containers put libnixl.so.
PREFIXES = ("/opt/nvidia/nvda_nixl/lib/x86_64-linux-gnu", "/opt/nvidia/nvda_nixl/lib64",
            "/usr/local/nixl/lib/x86_64-linux-gnu", "/usr/local/nixl/lib64", "/usr/local/lib",
            "/usr/lib/x86_64-linux-gnu", "/usr/lib64")


def from_libnixl():
    """A libnixl.so on LD_LIBRARY_PATH or in a usual prefix, with a plugins folder beside it."""
    found = []
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d] + list(PREFIXES)
    for d in dirs:
        if os.path.isfile(os.path.join(d, "libnixl.so")) and os.path.isdir(os.path.join(d, "plugins")):
            found.append(Found(os.path.join(d, "plugins"), f"libnixl.so in {d}"))
    return found


def nixl_installations():
    """Every NIXL plugin folder found, the one the agent would use first.

    NIXL_PLUGIN_DIR wins when set, as it does in the agent."""
    found = []
    env = os.environ.get("NIXL_PLUGIN_DIR")
    if env:
        found.append(Found(env, "NIXL_PLUGIN_DIR"))
    seen = set()
    for f in found + from_python_packages() + from_libnixl():
        key = os.path.realpath(f.plugin_dir)
        if key not in seen:
            seen.add(key)
            yield f


def active_plugin_dir():
    for f in nixl_installations():
        return f
    return None


if __name__ == "__main__":
    f = active_plugin_dir()
    if f is None:
        print("no NIXL found (no nixl_cu12/nixl_cu13 package in this Python, no libnixl.so with a "
              "plugins folder, NIXL_PLUGIN_DIR unset)", file=sys.stderr)
        sys.exit(1)
    print(f.plugin_dir)
