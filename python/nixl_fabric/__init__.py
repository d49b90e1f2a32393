"""nixl-fabric: a NIXL backend plugin over libfabric, packaged for pip.

`python -m nixl_fabric install [--name LIBFABRIC]` puts the plugin into the plugin folder of
the NIXL this Python uses (so the stock UCX and POSIX plugins stay usable beside it);
`python -m nixl_fabric info` runs the diagnostic. libfabric itself (>= 1.17) comes from the
system (apt-get install libfabric1).
"""
import os

__version__ = "0.1.0"

_HERE = os.path.dirname(os.path.abspath(__file__))
# NIXL_PLUGIN_DIR may point here directly (it then replaces NIXL's own plugin folder).
PLUGIN_DIR = os.path.join(_HERE, "plugins")
PLUGIN = os.path.join(PLUGIN_DIR, "libplugin_LIBFABRIC.so")
INFO_TOOL = os.path.join(_HERE, "bin", "nixl-fabric-info")
