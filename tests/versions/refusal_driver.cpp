// Loads a (fake) libnixl, then our plugin as the NIXL plugin manager does, and asks for one
// engine; prints whether it got one. With `accept` the engine must come back (and is
// destroyed again), with `refuse` create_engine must return NULL. The refusal line itself
// goes to stderr, where refusal.sh checks it.
//   refusal_driver LIBNIXL|none PLUGIN accept|refuse
#include "nixl_abi.h"

#include <dlfcn.h>

#include <cstdio>
#include <cstring>

using namespace nf::abi;

int main(int argc, char **argv) {
    if (argc != 4) {
        std::fprintf(stderr, "usage: refusal_driver LIBNIXL|none PLUGIN accept|refuse\n");
        return 2;
    }
    const bool want_engine = std::strcmp(argv[3], "accept") == 0;
    if (std::strcmp(argv[1], "none") != 0 && !dlopen(argv[1], RTLD_NOW | RTLD_LOCAL)) {
        std::fprintf(stderr, "dlopen %s: %s\n", argv[1], dlerror());
        return 2;
    }
    void *plugin = dlopen(argv[2], RTLD_NOW | RTLD_LOCAL);
    if (!plugin) {
        std::fprintf(stderr, "dlopen %s: %s\n", argv[2], dlerror());
        return 2;
    }
    auto init = reinterpret_cast<nixlBackendPlugin *(*)()>(dlsym(plugin, "nixl_plugin_init"));
    nixlBackendPlugin *desc = init ? init() : nullptr;
    if (!desc || desc->api_version != kPluginApiVersion) {
        std::fprintf(stderr, "no plugin descriptor\n");
        return 2;
    }
    nixl_b_params_t params{{"provider", "tcp"}};
    nixlBackendInitParams ip{};
    ip.localAgent = "refusal-test";
    ip.type = "FABRICX";
    ip.customParams = &params;
    ip.enableProgTh = false;
    ip.pthrDelay = 0;
    ip.syncMode = nixl_thread_sync_t::NONE;
    ip.enableTelemetry_ = false;
    nixlEngineHead *engine = desc->create_engine(&ip);
    std::printf("create_engine: %s\n", engine ? "engine" : "NULL");
    if (engine) {
        const bool init_err = engine->getInitErr();
        desc->destroy_engine(engine);
        if (init_err) {
            std::printf("engine reported initErr\n");
            return 1;
        }
    }
    return (engine != nullptr) == want_engine ? 0 : 1;
}
