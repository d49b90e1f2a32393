"""python -m nixl_fabric {install,uninstall,info,where} ...

  install [--name LIBFABRIC] [--dir DIR] [--so FILE]
      copies the plugin into the active NIXL's plugin folder (NIXL_PLUGIN_DIR if set, else
      the folder of the nixl_cu13/nixl_cu12 package this Python imports, else the one next
      to a libnixl.so); prints the NIXL_PLUGIN_DIR to use when there is none or it is not
      writable (exit status 3: nothing installed)
  uninstall [--name LIBFABRIC] [--dir DIR]
  info [ARGS...]     runs nixl-fabric-info (providers, rails, CUDA, the NIXL it would serve)
  where              lists the NIXL plugin folders found, the active one first
"""
import argparse
import os
import sys

from . import INFO_TOOL, PLUGIN, PLUGIN_DIR
from .install import install, is_ours, uninstall
from .locate import active_plugin_dir, nixl_installations

NOT_INSTALLED = 3


def fallback(reason):
    print(f"nixl-fabric: not installed: {reason}.\n"
          f"Point NIXL at the plugin folder of this package instead:\n"
          f"  export NIXL_PLUGIN_DIR={PLUGIN_DIR}   # backend name LIBFABRIC\n"
          "(it replaces NIXL's own plugin folder: stock UCX is then not listed; a symlink to a\n"
          "stock plugin placed there does not load, its RPATH is relative to its own folder)",
          file=sys.stderr)
    return NOT_INSTALLED


def cmd_install(args):
    so = args.so or PLUGIN
    if not os.path.isfile(so):
        print(f"nixl-fabric: plugin file {so} missing", file=sys.stderr)
        return 1
    target = args.dir
    how = "--dir"
    if not target:
        found = active_plugin_dir()
        if found is None:
            return fallback("no NIXL found for this Python (no nixl_cu12/nixl_cu13 package, no "
                            "libnixl.so with a plugins folder, NIXL_PLUGIN_DIR unset)")
        target, how = found.plugin_dir, found.how + (f" {found.version}" if found.version else "")
    try:
        os.makedirs(target, exist_ok=True)
        dest, backup = install(so, args.name, target)
    except OSError as e:
        return fallback(f"cannot write to {target} ({e.strerror or e})")
    print(f"installed {dest} (from {how})")
    if backup:
        print(f"kept the stock plugin of that name as {backup} (uninstall puts it back)")
    print(f"use it as backend {args.name}; the other plugins of that folder stay available")
    return 0


def cmd_uninstall(args):
    target = args.dir or (active_plugin_dir().plugin_dir if active_plugin_dir() else None)
    if not target:
        print("nixl-fabric: no NIXL plugin folder found", file=sys.stderr)
        return 1
    for line in uninstall(args.name, target):
        print(line)
    return 0


def cmd_where(_args):
    found = list(nixl_installations())
    if not found:
        print("no NIXL plugin folder found")
        return 1
    for i, f in enumerate(found):
        ours = sorted(n for n in os.listdir(f.plugin_dir) if n.endswith(".so")
                      and is_ours(os.path.join(f.plugin_dir, n))) if os.path.isdir(f.plugin_dir) else []
        print(f"{'active' if i == 0 else 'other '} {f.plugin_dir}  ({f.how}"
              + (f" {f.version}" if f.version else "") + ")"
              + (f"  nixl-fabric as: {', '.join(ours)}" if ours else ""))
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["info"]:
        if not os.path.isfile(INFO_TOOL):
            print(f"nixl-fabric: {INFO_TOOL} missing", file=sys.stderr)
            return 1
        # The tool asks this Python (not whatever python3 is on PATH) where NIXL is.
        os.environ["NIXL_PYTHON"] = sys.executable
        os.execv(INFO_TOOL, [INFO_TOOL] + argv[1:])
    ap = argparse.ArgumentParser(prog="python -m nixl_fabric", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("install")
    p.add_argument("--name", default="LIBFABRIC")
    p.add_argument("--dir")
    p.add_argument("--so")
    p = sub.add_parser("uninstall")
    p.add_argument("--name", default="LIBFABRIC")
    p.add_argument("--dir")
    sub.add_parser("where")
    sub.add_parser("info")
    args = ap.parse_args(argv)
    return {"install": cmd_install, "uninstall": cmd_uninstall, "where": cmd_where}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
