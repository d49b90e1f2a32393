// Run-time check of the vtable slot order (ABI doc §5.2), which static_assert cannot see.
// Under the Itanium C++ ABI a pointer to a virtual member function holds 1 + the byte
// offset of its slot from the vptr; decoding it gives the slot each method occupies.
#include "fabric_engine.h"
#include "plugin_entry.h"

#include <cstring>

namespace nf::adapter {
namespace {

template <class PMF> long vslot(PMF pmf) {
    struct Rep {
        uintptr_t ptr;
        ptrdiff_t adj;
    } rep;
    static_assert(sizeof(PMF) == sizeof(Rep), "Itanium member-function pointer");
    std::memcpy(&rep, &pmf, sizeof rep);
    if ((rep.ptr & 1) == 0 || rep.adj != 0)
        return -1; // not virtual
    return static_cast<long>((rep.ptr - 1) / sizeof(void *));
}

template <class E> int check() {
    using RemoteView = nixl_status_t (E::*)(const nixl_remote_meta_dlist_t &, nixlMemViewH &,
                                            const nixlBackendOptionalArgs *) const;
    using LocalView = nixl_status_t (E::*)(const nixl_meta_dlist_t &, nixlMemViewH &,
                                           const nixlBackendOptionalArgs *) const;
    const long slots[] = {
        vslot(&E::supportsRemote),     // 2
        vslot(&E::supportsLocal),      // 3
        vslot(&E::supportsNotif),      // 4
        vslot(&E::getSupportedMems),   // 5
        vslot(&E::registerMem),        // 6
        vslot(&E::deregisterMem),      // 7
        vslot(&E::connect),            // 8
        vslot(&E::disconnect),         // 9
        vslot(&E::unloadMD),           // 10
        vslot(&E::prepXfer),           // 11
        vslot(&E::postXfer),           // 12
        vslot(&E::checkXfer),          // 13
        vslot(&E::releaseReqH),        // 14
        vslot(static_cast<RemoteView>(&E::prepMemView)), // 15
        vslot(static_cast<LocalView>(&E::prepMemView)),  // 16
        vslot(&E::releaseMemView),     // 17
        vslot(&E::getPublicData),      // 18
        vslot(&E::getConnInfo),        // 19
        vslot(&E::loadRemoteConnInfo), // 20
        vslot(&E::loadRemoteMD),       // 21
        vslot(&E::loadLocalMD),        // 22
        vslot(&E::getNotifs),          // 23
        vslot(&E::genNotif),           // 24
        vslot(&E::queryMem),           // 25
        vslot(&E::estimateXferCost),   // 26
    };
    for (size_t i = 0; i < sizeof slots / sizeof slots[0]; ++i)
        if (slots[i] != static_cast<long>(i) + 2)
            return static_cast<int>(i) + 2;
    return 0;
}

} // namespace
} // namespace nf::adapter

extern "C" NF_ADAPTER_HIDDEN int nf_adapter_check_layout(void) {
    using namespace nf::adapter;
    if (const int bad = check<nixlBackendEngine>())
        return bad;
    // Our engine adds no virtual of its own (it is final and every method says override),
    // and each override lands in the base's slot.
    return check<FabricEngine>();
}
