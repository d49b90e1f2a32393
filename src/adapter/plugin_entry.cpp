// The plugin descriptor (ABI doc §3) and the two hidden entry points that src/plugin.rs
// re-exports as nixl_plugin_init / nixl_plugin_fini (only Rust #[no_mangle] symbols leave
// the cdylib).
#include "fabric_engine.h"
#include "host_nixl.h"
#include "plugin_entry.h"

#include <dlfcn.h>
#include <strings.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>

namespace nf::adapter {
namespace {

constexpr const char kFallbackName[] = "LIBFABRIC";

std::string name_from_file();

// One line on stderr in the Rust logger's format (src/logging.rs), written in one call.
void log_line(char level, const std::string &text) noexcept {
    try {
        const std::string line = "[nixl-fabric " + std::string(1, level) + " " +
                                 std::to_string(getpid()) + "] " + text + "\n";
        (void)!fwrite(line.data(), 1, line.size(), stderr);
    } catch (...) {
    }
}

// Whether NIXL_FABRIC_LOG (or else NIXL_LOG_LEVEL) names one of `levels`, the way the Rust
// logger reads them (src/logging.rs).
bool log_level_is(std::initializer_list<const char *> levels) {
    const char *v = std::getenv("NIXL_FABRIC_LOG");
    if (!v)
        v = std::getenv("NIXL_LOG_LEVEL");
    if (!v)
        return false;
    for (const char *level : levels)
        if (strcasecmp(v, level) == 0)
            return true;
    return false;
}

bool info_enabled() { return log_level_is({"INFO", "DEBUG", "TRACE"}); }
bool errors_off() { return log_level_is({"OFF", "NONE"}); }

// An engine whose vtable is the loading NIXL's (host_nixl.h), or NULL with an error line
// when that layout is not one we know: the agent then fails createBackend with
// NIXL_ERR_BACKEND. A refused host's init params are not read (their layout is unknown
// too). Other failures are reported through initErr.
nixlEngineHead *create_engine(const nixlBackendInitParams *init) noexcept {
    try {
        if (!init)
            return nullptr;
        const HostNixl &host = host_nixl();
        switch (host.layout) {
        case EngineLayout::V1: return new FabricEngineV1(init);
        case EngineLayout::V010: return new FabricEngineV010(init);
        case EngineLayout::V07: return new FabricEngineV07(init);
        case EngineLayout::Unknown: break;
        }
        if (!errors_off())
            log_line('E', refusal_message(host, name_from_file()));
        return nullptr;
    } catch (...) {
        return nullptr;
    }
}

void destroy_engine(nixlEngineHead *engine) noexcept {
    try {
        delete engine; // virtual deleting destructor (slot 1 in every layout)
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

// Reads the loading NIXL's layout now, once, so that every engine of the process gets the
// same answer (host_nixl caches it).
extern "C" NF_ADAPTER_HIDDEN void *nf_adapter_plugin_init(void) {
    using namespace nf::adapter;
    try {
        const HostNixl &host = host_nixl();
        if (host.layout != EngineLayout::Unknown && info_enabled())
            log_line('I', describe(host));
    } catch (...) {
    }
    return &g_plugin;
}

// For nixl-fabric-info: what the detector makes of the NIXL libraries mapped in this
// process right now (not cached), as one line into buf (NUL-terminated, truncated to len).
// Returns the layout: 0 unknown, 1 for 0.7-0.9, 2 for 0.10, 3 for 1.x.
extern "C" NF_ADAPTER_HIDDEN int nf_adapter_host_report(char *buf, size_t len) {
    using namespace nf::adapter;
    try {
        const HostNixl host = classify(scan_process());
        if (buf && len) {
            const std::string text = describe(host);
            std::snprintf(buf, len, "%s", text.c_str());
        }
        return static_cast<int>(host.layout);
    } catch (...) {
        if (buf && len)
            buf[0] = 0;
        return 0;
    }
}

extern "C" NF_ADAPTER_HIDDEN void nf_adapter_plugin_fini(void) {}
