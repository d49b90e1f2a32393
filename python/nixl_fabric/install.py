"""Placing the plugin into a NIXL plugin folder, and taking it out again.

The agent discovers `libplugin_<NAME>.so` files by name, so the plugin is copied in under
the backend name users will ask for. A stock plugin of the same name (the wheel's own
LIBFABRIC) is kept as `libplugin_<NAME>.so.stock`, which the agent does not list, and
put back by `uninstall`.
"""
import os
import re
import shutil

# A string only our plugin's dynamic symbol table holds (its C API).
OUR_MARKER = b"nf_engine_create"
NAME = re.compile(r"^[A-Za-z0-9_]+$")


def plugin_file(plugin_dir, name):
    return os.path.join(plugin_dir, f"libplugin_{name}.so")


def is_ours(path):
    try:
        with open(path, "rb") as f:
            return OUR_MARKER in f.read()
    except OSError:
        return False


def install(so, name, plugin_dir):
    """Copies `so` to plugin_dir/libplugin_<name>.so; returns (destination, stock backup or None).

    The copy is written beside the destination and renamed over it, so an agent that lists
    the folder meanwhile never sees a half-written plugin. Raises OSError (e.g. permission)."""
    if not NAME.match(name):
        raise ValueError(f"backend name {name!r}: letters, digits and _ only")
    dest = plugin_file(plugin_dir, name)
    backup = None
    if os.path.lexists(dest) and not is_ours(dest):
        backup = dest + ".stock"
        if not os.path.lexists(backup):
            os.replace(dest, backup)
    tmp = os.path.join(plugin_dir, f".libplugin_{name}.so.tmp")
    shutil.copyfile(so, tmp)
    os.chmod(tmp, 0o755)
    os.replace(tmp, dest)
    return dest, backup


def uninstall(name, plugin_dir):
    """Removes our plugin of that name; puts a kept stock plugin back. Returns what was done."""
    dest = plugin_file(plugin_dir, name)
    done = []
    if os.path.lexists(dest):
        if not is_ours(dest):
            return [f"{dest} is not nixl-fabric's plugin: left alone"]
        os.remove(dest)
        done.append(f"removed {dest}")
    if os.path.lexists(dest + ".stock"):
        os.replace(dest + ".stock", dest)
        done.append(f"restored the stock plugin {dest}")
    return done or [f"nothing to remove in {plugin_dir}"]
