// The plugin descriptor (ABI doc §3) and the two hidden entry points that src/plugin.rs
// re-exports as nixl_plugin_init / nixl_plugin_fini (only Rust #[no_mangle] symbols leave
// the cdylib).
#include "fabric_engine.h"
#include "plugin_entry.h"

#include <dlfcn.h>

#include <cstring>
#include <string>

namespace nf::adapter {
namespace {

constexpr const char kFallbackName[] = "LIBFABRIC";

nixlBackendEngine *create_engine(const nixlBackendInitParams *init) noexcept {
    try {
        return init ? new FabricEngine(init) : nullptr; // failure is reported through initErr
    } catch (...) {
        return nullptr;
    }
}

void destroy_engine(nixlBackendEngine *engine) noexcept {
    try {
        delete engine; // virtual deleting destructor
    } catch (...) {
    }
}

// NAME of the file we were loaded from, libplugin_<NAME>.so (the backend name the agent
// uses); the fallback when loaded some other way (tests, a renamed file).
std::string name_from_file() {
    Dl_info info{};
    if (dladdr(reinterpret_cast<const void *>(&create_engine), &info) == 0 || !info.dli_fname)
        return kFallbackName;
    std::string base = info.dli_fname;
    if (const auto slash = base.rfind('/'); slash != std::string::npos)
        base.erase(0, slash + 1);
    constexpr std::string_view prefix = "libplugin_", suffix = ".so";
    if (base.size() <= prefix.size() + suffix.size() || !base.starts_with(prefix) || !base.ends_with(suffix))
        return kFallbackName;
    return base.substr(prefix.size(), base.size() - prefix.size() - suffix.size());
}

const char *get_plugin_name() noexcept {
    try {
        static const std::string name = name_from_file();
        return name.c_str();
    } catch (...) {
        return kFallbackName;
    }
}

const char *get_plugin_version() noexcept { return nf_version(); }

// Every configuration key with its default (the agent shows these to users).
nixl_b_params_t get_backend_options() noexcept {
    try {
        nixl_b_params_t options;
        const size_t n = nf_config_key_count();
        for (size_t i = 0; i < n; ++i) {
            const char *key = nullptr, *def = nullptr, *help = nullptr;
            if (nf_config_key_at(i, &key, &def, &help) == NF_SUCCESS && key)
                options.emplace(key, def ? def : "");
        }
        return options;
    } catch (...) {
        return {};
    }
}

// DRAM only for now; an engine reports what it really serves through getSupportedMems.
nixl_mem_list_t get_backend_mems() noexcept {
    try {
        return nixl_mem_list_t{DRAM_SEG};
    } catch (...) {
        return {};
    }
}

// Static storage: valid for as long as the (RTLD_NODELETE) image is mapped, and the same
// object on every nixl_plugin_init.
nixlBackendPlugin g_plugin = {
    kPluginApiVersion, create_engine,       destroy_engine,  get_plugin_name,
    get_plugin_version, get_backend_options, get_backend_mems,
};

} // namespace
} // namespace nf::adapter

extern "C" NF_ADAPTER_HIDDEN void *nf_adapter_plugin_init(void) { return &nf::adapter::g_plugin; }

extern "C" NF_ADAPTER_HIDDEN void nf_adapter_plugin_fini(void) {}
