// Classifies what host_symbols.cpp found into one of the engine layouts NIXL has shipped,
// or refuses. Every rule below was read from the 16 nixl-cu12 wheels 0.7.1-1.5.1 (nm -D,
// the UCX plugin's base vtable, disassembly of the descriptor-list accessors); the version
// matrix (tests/versions) runs each of them.
#include "host_nixl.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string_view>

namespace nf::adapter {

const char kSupportedReleases[] =
    "NIXL 0.7.x-0.9.x (28-slot engine), 0.10.x (31 slots) and 1.0-1.5.x (27 slots)";

namespace {

// The base-class default methods each release's libnixl defines (mangled, so a change of a
// parameter type is a different name). The nine of the common tail are in every release.
constexpr const char *kCommonTail[] = {
    "_ZNK17nixlBackendEngine13getPublicDataEPK13nixlBackendMDRNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE",
    "_ZNK17nixlBackendEngine11getConnInfoERNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE",
    "_ZN17nixlBackendEngine18loadRemoteConnInfoERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEES7_",
    "_ZN17nixlBackendEngine12loadRemoteMDERK12nixlBlobDescRK10nixl_mem_tRKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEERP13nixlBackendMD",
    "_ZN17nixlBackendEngine11loadLocalMDEP13nixlBackendMDRS1_",
    "_ZN17nixlBackendEngine9getNotifsERSt6vectorISt4pairINSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEES7_ESaIS8_EE",
    "_ZNK17nixlBackendEngine8genNotifERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEES7_",
    "_ZNK17nixlBackendEngine8queryMemERK12nixlDescListI12nixlBlobDescERSt6vectorISt8optionalISt13unordered_mapINSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEESD_St4hashISD_ESt8equal_toISD_ESaISt4pairIKSD_SD_EEEESaISN_EE",
    "_ZNK17nixlBackendEngine16estimateXferCostERK14nixl_xfer_op_tRK12nixlDescListI12nixlMetaDescES7_RKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEERKP15nixlBackendReqHRNSt6chrono8durationIlSt5ratioILl1ELl1000000EEEESP_R11nixl_cost_tPK21nixlAgentOptionalArgs",
};

// 0.7-0.10: the GPU-request methods (slots 15-18).
constexpr const char *kGpuRequests[] = {
    "_ZNK17nixlBackendEngine16createGpuXferReqERK15nixlBackendReqHRK12nixlDescListI12nixlMetaDescES7_RPv",
    "_ZNK17nixlBackendEngine17releaseGpuXferReqEPv",
    "_ZNK17nixlBackendEngine16getGpuSignalSizeERm",
    "_ZNK17nixlBackendEngine13prepGpuSignalERK13nixlBackendMDPvPK23nixlBackendOptionalArgs",
};

// 0.10 only: the memory views under their first names (slots 19-21).
constexpr const char *kMemoryViews010[] = {
    "_ZNK17nixlBackendEngine14prepMemoryViewERK12nixlDescListI12nixlMetaDescERPvPK23nixlBackendOptionalArgs",
    "_ZNK17nixlBackendEngine14prepMemoryViewERK12nixlDescListI18nixlRemoteMetaDescERPvPK23nixlBackendOptionalArgs",
    "_ZNK17nixlBackendEngine17releaseMemoryViewEPv",
};

// 1.0 on: the memory views (slots 15-17).
constexpr const char *kMemViews1[] = {
    "_ZNK17nixlBackendEngine11prepMemViewERK12nixlDescListI12nixlMetaDescERPvPK23nixlBackendOptionalArgs",
    "_ZNK17nixlBackendEngine11prepMemViewERK12nixlDescListI18nixlRemoteMetaDescERPvPK23nixlBackendOptionalArgs",
    "_ZNK17nixlBackendEngine14releaseMemViewEPv",
};

// Shapes on NIXL branches that no release has shipped: each adds a virtual to the engine
// base (a new slot after supportsNotif, moving every later one) without changing the
// plugin API version. Refused by name until a release ships them and we add its layout.
struct Unreleased {
    const char *symbol;
    const char *what;
};
constexpr Unreleased kUnreleased[] = {
    {"_ZNK17nixlBackendEngine13supportsProxyEv", "supportsProxy() after supportsNotif"},
    {"_ZNK17nixlBackendEngine22supportsNotifInjectionEv", "supportsNotifInjection() after supportsNotif"},
};

struct Shape {
    EngineLayout layout;
    size_t dlist_vtable; // bytes of `vtable for nixlDescList<nixlMetaDesc>`
    int first_major, first_minor, end_major, end_minor; // releases [first, end)
    std::initializer_list<const char *const *> groups;
    std::initializer_list<size_t> sizes;
};

template <size_t N> constexpr size_t count(const char *const (&)[N]) { return N; }

// The descriptor list gained no data between releases (type at +8, vector at +16, checked
// below through the host's own accessors); its vtable lost one slot in 1.0.
const Shape kShapes[] = {
    {EngineLayout::V07, 0x40, 0, 7, 0, 10, {kCommonTail, kGpuRequests}, {count(kCommonTail), count(kGpuRequests)}},
    {EngineLayout::V010, 0x40, 0, 10, 1, 0, {kCommonTail, kGpuRequests, kMemoryViews010},
     {count(kCommonTail), count(kGpuRequests), count(kMemoryViews010)}},
    {EngineLayout::V1, 0x38, 1, 0, 1, 6, {kCommonTail, kMemViews1}, {count(kCommonTail), count(kMemViews1)}},
};

std::set<std::string> names_of(const Shape &s) {
    std::set<std::string> out;
    auto size = s.sizes.begin();
    for (const char *const *group : s.groups) {
        for (size_t i = 0; i < *size; ++i)
            out.emplace(group[i]);
        ++size;
    }
    return out;
}

// "prepMemView" from "_ZNK17nixlBackendEngine11prepMemViewE...".
std::string short_name(const std::string &mangled) {
    size_t at = mangled.find("17nixlBackendEngine");
    if (at == std::string::npos)
        return mangled;
    at += std::strlen("17nixlBackendEngine");
    size_t len = 0;
    while (at < mangled.size() && mangled[at] >= '0' && mangled[at] <= '9')
        len = len * 10 + static_cast<size_t>(mangled[at++] - '0');
    return len && at + len <= mangled.size() ? mangled.substr(at, len) : mangled;
}

std::string list(const std::set<std::string> &names) {
    std::string out;
    for (const std::string &n : names)
        out += (out.empty() ? "" : ", ") + short_name(n);
    return out;
}

struct Release {
    int major = -1, minor = -1;
};

Release parse_release(const std::string &v) {
    Release r;
    char *end = nullptr;
    const long major = std::strtol(v.c_str(), &end, 10);
    if (end == v.c_str() || *end != '.')
        return r;
    const char *p = end + 1;
    const long minor = std::strtol(p, &end, 10);
    if (end == p)
        return r;
    r.major = static_cast<int>(major);
    r.minor = static_cast<int>(minor);
    return r;
}

bool in_range(const Release &r, const Shape &s) {
    const auto key = [](int a, int b) { return a * 1000 + b; };
    const int k = key(r.major, r.minor);
    return k >= key(s.first_major, s.first_minor) && k < key(s.end_major, s.end_minor);
}

// Runs the host's own nixlDescList<nixlMetaDesc> accessors on a buffer laid out the way
// nixl_abi.h declares the list (type at +8, begin/end at +16/+24, 32-byte descriptors);
// they must read back what we put there. The buffer is larger than the list so that a
// host reading further stays inside it. Only called once the symbols matched a known
// release, whose accessors are plain loads (checked by disassembly in every wheel).
std::string probe_desc_list(const NixlFacts &f) {
    if (!f.dlist_desc_count || !f.dlist_get_type || !f.dlist_begin)
        return "libnixl does not export nixlDescList<nixlMetaDesc>'s accessors";
    alignas(16) unsigned char descs[5 * 32] = {};
    alignas(16) unsigned char list[128] = {};
    const uint32_t type = 3; // OBJ_SEG: a value no zeroed buffer reads by accident
    const uintptr_t begin = reinterpret_cast<uintptr_t>(descs), end = begin + sizeof descs;
    std::memcpy(list + 8, &type, sizeof type);
    std::memcpy(list + 16, &begin, sizeof begin);
    std::memcpy(list + 24, &end, sizeof end);
    using SizeFn = size_t (*)(const void *);
    using TypeFn = uint32_t (*)(const void *);
    using PtrFn = const void *(*)(const void *);
    // SAFETY (in the Rust sense): each is a const member function without arguments; under
    // the Itanium ABI `this` is the only argument, and the results are plain scalars.
    const size_t n = reinterpret_cast<SizeFn>(const_cast<void *>(f.dlist_desc_count))(list);
    const uint32_t t = reinterpret_cast<TypeFn>(const_cast<void *>(f.dlist_get_type))(list);
    const void *b = reinterpret_cast<PtrFn>(const_cast<void *>(f.dlist_begin))(list);
    if (n != 5 || t != type || b != descs)
        return "nixlDescList<nixlMetaDesc> is laid out differently (its accessors read " +
               std::to_string(n) + " descriptors, type " + std::to_string(t) + ")";
    return {};
}

} // namespace

const char *layout_name(EngineLayout layout) {
    switch (layout) {
    case EngineLayout::V07: return "0.7-0.9 (28 slots)";
    case EngineLayout::V010: return "0.10 (31 slots)";
    case EngineLayout::V1: return "1.x (27 slots)";
    case EngineLayout::Unknown: break;
    }
    return "unknown";
}

HostNixl classify(const NixlFacts &f) {
    HostNixl h;
    h.version = f.version;
    for (const std::string &lib : f.libraries)
        if (lib.find("/libnixl.so") != std::string::npos || lib.rfind("libnixl.so", 0) == 0)
            h.library = lib;
    if (f.libraries.empty()) {
        h.why = "no NIXL library (libnixl.so) is loaded in this process";
        return h;
    }
    for (const Unreleased &u : kUnreleased)
        if (f.engine_methods.count(u.symbol)) {
            h.why = std::string("its engine base has ") + u.what + ", which no NIXL release has shipped";
            return h;
        }
    if (!f.markers.empty()) {
        h.why = "it hands engines a tracer (" + f.markers.front() +
                "), which changes the init parameters and no NIXL release has shipped";
        return h;
    }
    const Shape *match = nullptr;
    std::string nearest;
    size_t nearest_diff = SIZE_MAX;
    for (const Shape &s : kShapes) {
        const std::set<std::string> want = names_of(s);
        std::set<std::string> missing, extra;
        for (const std::string &n : want)
            if (!f.engine_methods.count(n))
                missing.insert(n);
        for (const std::string &n : f.engine_methods)
            if (!want.count(n))
                extra.insert(n);
        if (missing.empty() && extra.empty()) {
            match = &s;
            break;
        }
        if (missing.size() + extra.size() < nearest_diff) {
            nearest_diff = missing.size() + extra.size();
            nearest = std::string("its engine base's methods match no release (nearest: ") +
                      layout_name(s.layout) + (extra.empty() ? "" : "; unknown: " + list(extra)) +
                      (missing.empty() ? "" : "; missing: " + list(missing)) + ")";
        }
    }
    if (!match) {
        h.why = nearest;
        return h;
    }
    if (f.meta_dlist_vtable_size != match->dlist_vtable) {
        h.why = "its descriptor-list vtable is " + std::to_string(f.meta_dlist_vtable_size) +
                " bytes, not the " + std::to_string(match->dlist_vtable) + " of layout " +
                layout_name(match->layout);
        return h;
    }
    if (std::string bad = probe_desc_list(f); !bad.empty()) {
        h.why = bad;
        return h;
    }
    if (!f.version.empty()) {
        const Release r = parse_release(f.version);
        const char *accept = std::getenv("NIXL_FABRIC_ACCEPT_NIXL");
        const bool accepted = accept && f.version == accept;
        if (r.major < 0) {
            h.why = "its release number '" + f.version + "' cannot be read";
            return h;
        }
        if (!in_range(r, *match) && !accepted) {
            h.why = std::string("its symbols are those of layout ") + layout_name(match->layout) +
                    " but its release is not one that shipped it (a newer or unreleased NIXL; "
                    "NIXL_FABRIC_ACCEPT_NIXL=" + f.version + " accepts it at your own risk)";
            return h;
        }
    }
    h.layout = match->layout;
    return h;
}

const HostNixl &host_nixl() {
    static const HostNixl host = [] {
        try {
            return classify(scan_process());
        } catch (...) {
            HostNixl h;
            h.why = "the scan of the loaded libraries failed (out of memory)";
            return h;
        }
    }();
    return host;
}

std::string describe(const HostNixl &h) {
    std::string s = "NIXL " + (h.version.empty() ? std::string("(release unknown)") : h.version);
    if (!h.library.empty())
        s += " (" + h.library + ")";
    s += ": engine layout ";
    s += layout_name(h.layout);
    if (h.layout == EngineLayout::Unknown)
        s += ": " + h.why;
    return s;
}

std::string refusal_message(const HostNixl &h, const std::string &backend) {
    return "cannot create backend " + backend + ": the loading NIXL is " +
           (h.version.empty() ? std::string("of an unknown release") : "NIXL " + h.version) +
           (h.library.empty() ? "" : " (" + h.library + ")") + ", and " + h.why +
           ". This plugin supports " + kSupportedReleases +
           "; use one of those or a nixl-fabric release that knows this NIXL.";
}

} // namespace nf::adapter
