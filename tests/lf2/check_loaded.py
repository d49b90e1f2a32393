"""make test-lf2: proves which libfabric the stock agent's process really loads.

    python check_loaded.py EXPECTED_LIBDIR EXPECTED_MAJOR.MINOR

Creates a stock NIXL agent (nixl-cu12) with our backend in the same environment the suite
gets (NIXL_PLUGIN_DIR, LD_LIBRARY_PATH, provider), then reads /proc/self/maps: exactly one
libfabric.so.* must be mapped, it must lie in EXPECTED_LIBDIR, and its fi_version() must
be EXPECTED. Exit status 1 otherwise (the plugin picked up another libfabric)."""
from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import nfutil as U  # noqa: E402

U.configure_env()


def main() -> int:
    want_dir = os.path.realpath(sys.argv[1])
    want_ver = sys.argv[2]
    agent = U.new_agent("lf2-check", params={})
    mapped = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and "/libfabric.so" in parts[5]:
                mapped.add(os.path.realpath(parts[5]))
    del agent
    if len(mapped) != 1:
        print(f"lf2-check: expected one libfabric mapped, found {sorted(mapped) or 'none'}")
        return 1
    (path,) = mapped
    lib = ctypes.CDLL(path)
    lib.fi_version.restype = ctypes.c_uint32
    v = lib.fi_version()
    ver = f"{v >> 16}.{v & 0xffff}"
    ok = os.path.dirname(path) == want_dir and ver == want_ver
    print(f"lf2-check: agent with backend {U.BACKEND} ({os.environ.get('NIXL_FABRIC_PROVIDER')}) "
          f"mapped {path}, fi_version {ver}: {'OK' if ok else f'WRONG (want {want_ver} from {want_dir})'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
