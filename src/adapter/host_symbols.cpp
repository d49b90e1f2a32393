// Reads the dynamic symbol tables of the NIXL libraries already mapped in this process
// (dl_iterate_phdr), collecting what host_layout.cpp classifies. Nothing is opened or
// loaded: the tables are the ones the dynamic linker itself uses, so what we see is what
// the agent that loaded us was built with.
#include "host_nixl.h"

#include <elf.h>
#include <link.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>

namespace nf::adapter {
namespace {

// libnixl.so (the agent), libnixl_build.so (descriptor lists), libnixl_common.so, with or
// without a version suffix.
bool is_nixl_library(std::string_view base) {
    for (std::string_view stem : {"libnixl.so", "libnixl_build.so", "libnixl_common.so"})
        if (base.substr(0, stem.size()) == stem)
            return true;
    return false;
}

std::string_view base_name(std::string_view path) {
    const size_t slash = path.rfind('/');
    return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

// Number of dynamic symbols, from the GNU hash table (the symbol index past the last chain)
// or the SysV one (nchain).
size_t symbol_count(const uint32_t *gnu, const uint32_t *sysv) {
    if (sysv)
        return sysv[1];
    if (!gnu)
        return 0;
    const uint32_t nbuckets = gnu[0], symoffset = gnu[1], bloom_words = gnu[2];
    const auto *bloom = reinterpret_cast<const ElfW(Addr) *>(gnu + 4);
    const auto *buckets = reinterpret_cast<const uint32_t *>(bloom + bloom_words);
    const uint32_t *chain = buckets + nbuckets;
    uint32_t last = 0;
    for (uint32_t b = 0; b < nbuckets; ++b)
        if (buckets[b] > last)
            last = buckets[b];
    if (last < symoffset)
        return symoffset;
    while ((chain[last - symoffset] & 1) == 0) // the low bit ends a chain
        ++last;
    return last + 1;
}

constexpr std::string_view kEnginePrefix = "_ZN17nixlBackendEngine";
constexpr std::string_view kEngineConstPrefix = "_ZNK17nixlBackendEngine";
constexpr std::string_view kMetaDlistVtable = "_ZTV12nixlDescListI12nixlMetaDescE";
constexpr std::string_view kDescCount = "_ZNK12nixlDescListI12nixlMetaDescE9descCountEv";
constexpr std::string_view kGetType = "_ZNK12nixlDescListI12nixlMetaDescE7getTypeEv";
constexpr std::string_view kBegin = "_ZNK12nixlDescListI12nixlMetaDescE5beginEv";

// Symbols that name the unreleased shapes on NIXL branches (see host_layout.cpp): a tracer
// object handed to engines through the init params.
bool is_marker(std::string_view name) { return name.find("nixlTracer") != std::string_view::npos; }

void collect(const char *name, const ElfW(Sym) &sym, ElfW(Addr) base, NixlFacts &facts) {
    const std::string_view n(name);
    const bool engine = n.substr(0, kEnginePrefix.size()) == kEnginePrefix;
    const bool engine_const = n.substr(0, kEngineConstPrefix.size()) == kEngineConstPrefix;
    if (engine || engine_const) {
        // A method's name follows as <length><name>; constructors (C1/C2), destructors
        // (D0/D1/D2) and anything else are not slots the agent may call by name.
        const size_t at = engine ? kEnginePrefix.size() : kEngineConstPrefix.size();
        if (n.size() > at && n[at] >= '1' && n[at] <= '9')
            facts.engine_methods.emplace(n);
    } else if (n == kMetaDlistVtable) {
        facts.meta_dlist_vtable_size = sym.st_size;
    } else if (n == kDescCount) {
        facts.dlist_desc_count = reinterpret_cast<const void *>(base + sym.st_value);
    } else if (n == kGetType) {
        facts.dlist_get_type = reinterpret_cast<const void *>(base + sym.st_value);
    } else if (n == kBegin) {
        facts.dlist_begin = reinterpret_cast<const void *>(base + sym.st_value);
    } else if (is_marker(n)) {
        facts.markers.emplace_back(n);
    }
}

int on_object(struct dl_phdr_info *info, size_t, void *ctx) noexcept {
    auto &facts = *static_cast<NixlFacts *>(ctx);
    try {
        if (!info->dlpi_name || !is_nixl_library(base_name(info->dlpi_name)))
            return 0;
        const ElfW(Dyn) *dyn = nullptr;
        for (ElfW(Half) i = 0; i < info->dlpi_phnum; ++i)
            if (info->dlpi_phdr[i].p_type == PT_DYNAMIC)
                dyn = reinterpret_cast<const ElfW(Dyn) *>(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
        if (!dyn)
            return 0;
        // glibc rewrites these entries to run-time addresses; other loaders may leave them
        // as offsets from the load base.
        const ElfW(Addr) base = info->dlpi_addr;
        auto at = [base](ElfW(Addr) p) { return p < base ? p + base : p; };
        const ElfW(Sym) *symtab = nullptr;
        const char *strtab = nullptr;
        const uint32_t *gnu = nullptr, *sysv = nullptr;
        for (const ElfW(Dyn) *d = dyn; d->d_tag != DT_NULL; ++d) {
            switch (d->d_tag) {
            case DT_SYMTAB: symtab = reinterpret_cast<const ElfW(Sym) *>(at(d->d_un.d_ptr)); break;
            case DT_STRTAB: strtab = reinterpret_cast<const char *>(at(d->d_un.d_ptr)); break;
            case DT_GNU_HASH: gnu = reinterpret_cast<const uint32_t *>(at(d->d_un.d_ptr)); break;
            case DT_HASH: sysv = reinterpret_cast<const uint32_t *>(at(d->d_un.d_ptr)); break;
            default: break;
            }
        }
        if (!symtab || !strtab)
            return 0;
        // The loader's name may hold "dir/../"; the real path is what users recognise.
        char *real = realpath(info->dlpi_name, nullptr);
        facts.libraries.emplace_back(real ? real : info->dlpi_name);
        free(real);
        const size_t count = symbol_count(gnu, sysv);
        for (size_t i = 1; i < count; ++i) {
            const ElfW(Sym) &sym = symtab[i];
            if (sym.st_shndx == SHN_UNDEF || sym.st_name == 0)
                continue;
            collect(strtab + sym.st_name, sym, base, facts);
        }
    } catch (...) {
        // Out of memory while collecting: what was gathered stays, and the classifier
        // refuses an incomplete picture.
    }
    return 0;
}

} // namespace

NixlFacts scan_process() {
    NixlFacts facts;
    dl_iterate_phdr(&on_object, &facts);
    for (const std::string &lib : facts.libraries)
        if (base_name(lib).substr(0, 10) == "libnixl.so") {
            find_version(lib, facts);
            break;
        }
    return facts;
}

} // namespace nf::adapter
