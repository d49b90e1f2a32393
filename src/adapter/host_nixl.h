// Which NIXL loaded us, and which engine layout (engine_layouts.h) it expects.
//
// The plugin API version is 1 in every release and the loader checks nothing else, so the
// layout is read from facts the loaded libnixl exposes: the base class's default methods it
// exports (their set differs between 0.7-0.9, 0.10 and 1.x, and their mangled names pin the
// parameter types), the size of the descriptor list's vtable, the data offsets its own
// accessors read, and the release number of its wheel. Anything that does not match one of
// the shipped releases exactly is refused: backend creation fails with a message naming the
// NIXL seen and the ones supported, instead of handing the agent a wrong object.
#pragma once

#include <cstddef>
#include <set>
#include <string>
#include <vector>

namespace nf::adapter {

enum class EngineLayout { Unknown, V07, V010, V1 };

// What a scan of the process found (host_symbols.cpp, host_version.cpp).
struct NixlFacts {
    std::vector<std::string> libraries;      // NIXL libraries mapped in this process
    std::set<std::string> engine_methods;    // defined `nixlBackendEngine::` symbols (mangled)
    std::vector<std::string> markers;        // symbols of unreleased shapes (host_layout.cpp)
    size_t meta_dlist_vtable_size = 0;       // `vtable for nixlDescList<nixlMetaDesc>`, bytes
    // The host's own accessors of nixlDescList<nixlMetaDesc>, used to check its data layout.
    const void *dlist_desc_count = nullptr;
    const void *dlist_get_type = nullptr;
    const void *dlist_begin = nullptr;
    std::string version;                     // "1.5.1"; empty when no source names it
    std::string version_source;              // where the version came from
};

struct HostNixl {
    EngineLayout layout = EngineLayout::Unknown;
    std::string version; // as seen, or empty
    std::string library; // the libnixl path, or empty
    std::string why;     // for Unknown: what did not match
};

// Scans the libraries mapped in this process (no cache).
NixlFacts scan_process();

// The release number of the wheel or build that `libnixl` belongs to (empty if none found).
void find_version(const std::string &libnixl, NixlFacts &facts);

// Classifies gathered facts (pure apart from the descriptor-list probe, which calls the
// host's accessors on a buffer of ours).
HostNixl classify(const NixlFacts &facts);

// scan_process + classify, done once per process (at plugin init).
const HostNixl &host_nixl();

const char *layout_name(EngineLayout layout);

// "NIXL 1.5.1 (/path/libnixl.so): engine layout 1.x (27 slots)".
std::string describe(const HostNixl &host);

// The refusal line for backend `backend`: what was seen, why, and what is supported.
std::string refusal_message(const HostNixl &host, const std::string &backend);

// The releases this plugin serves, for messages and the README.
extern const char kSupportedReleases[];

} // namespace nf::adapter
