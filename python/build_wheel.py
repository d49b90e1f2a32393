#!/usr/bin/env python3
"""Builds the nixl-fabric wheel: the Python package in python/nixl_fabric plus the plugin and
the diagnostic tool as package data, debug info stripped. libfabric stays a system library
(the plugin's only NEEDED library besides libstdc++, libgcc_s and libc).

    build_wheel.py --so PLUGIN.so --info nixl-fabric-info --version V --out DIR

The platform tag is manylinux_2_<N>_x86_64 where 2.<N> is the newest glibc symbol version
either binary uses (objdump -T), so pip refuses the wheel where they could not load. The
Python tag is py3/none: nothing in it is tied to a Python version or ABI.
"""
import argparse
import base64
import hashlib
import os
import re
import stat
import subprocess
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = "nixl_fabric"
DIST = "nixl_fabric"


def glibc_minor(path):
    out = subprocess.run(["objdump", "-T", path], capture_output=True, text=True, check=True).stdout
    return max((int(m) for m in re.findall(r"GLIBC_2\.(\d+)", out)), default=17)


def stripped(path, tmp):
    dest = os.path.join(tmp, os.path.basename(path))
    subprocess.run(["objcopy", "--strip-debug", path, dest], check=True)
    return dest


def record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--so", required=True)
    ap.add_argument("--info", required=True)
    ap.add_argument("--version", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        so, info = stripped(args.so, tmp), stripped(args.info, tmp)
        tag = f"py3-none-manylinux_2_{max(glibc_minor(so), glibc_minor(info))}_x86_64"
        files = []  # (arcname, bytes, executable)
        pkg_dir = os.path.join(HERE, PACKAGE)
        for name in sorted(os.listdir(pkg_dir)):
            if name.endswith(".py"):
                with open(os.path.join(pkg_dir, name), "rb") as f:
                    files.append((f"{PACKAGE}/{name}", f.read(), False))
        with open(so, "rb") as f:
            files.append((f"{PACKAGE}/plugins/libplugin_LIBFABRIC.so", f.read(), True))
        with open(info, "rb") as f:
            files.append((f"{PACKAGE}/bin/nixl-fabric-info", f.read(), True))

        info_dir = f"{DIST}-{args.version}.dist-info"
        metadata = (f"Metadata-Version: 2.1\nName: nixl-fabric\nVersion: {args.version}\n"
                    "Summary: NIXL backend plugin over libfabric (install it into the stock "
                    "NIXL with: python -m nixl_fabric install)\n"
                    "Requires-Python: >=3.8\n"
                    "Requires-External: libfabric (>=1.17)\n")
        wheel = (f"Wheel-Version: 1.0\nGenerator: nixl-fabric build_wheel.py\n"
                 f"Root-Is-Purelib: false\nTag: {tag}\n")
        entry = "[console_scripts]\nnixl-fabric = nixl_fabric.__main__:main\n"
        files += [(f"{info_dir}/METADATA", metadata.encode(), False),
                  (f"{info_dir}/WHEEL", wheel.encode(), False),
                  (f"{info_dir}/entry_points.txt", entry.encode(), False)]

        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"{DIST}-{args.version}-{tag}.whl")
        records = []
        with zipfile.ZipFile(path + ".tmp", "w", zipfile.ZIP_DEFLATED) as z:
            for arcname, data, executable in files:
                zi = zipfile.ZipInfo(arcname, date_time=(2026, 1, 1, 0, 0, 0))
                # File type bits too: pip marks a file executable only for a regular-file mode.
                zi.external_attr = (stat.S_IFREG | (0o755 if executable else 0o644)) << 16
                zi.compress_type = zipfile.ZIP_DEFLATED
                z.writestr(zi, data)
                records.append(record_line(arcname, data))
            records.append(f"{info_dir}/RECORD,,")
            zi = zipfile.ZipInfo(f"{info_dir}/RECORD", date_time=(2026, 1, 1, 0, 0, 0))
            zi.external_attr = (stat.S_IFREG | 0o644) << 16
            z.writestr(zi, "\n".join(records) + "\n")
        os.replace(path + ".tmp", path)
    print(path)


if __name__ == "__main__":
    main()
