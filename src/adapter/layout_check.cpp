// Run-time check of the vtable slot order of each engine layout (ABI doc §5.2,
// engine_layouts.h), which static_assert cannot see.
// Under the Itanium C++ ABI a pointer to a virtual member function holds 1 + the byte
// offset of its slot from the vptr; decoding it gives the slot each method occupies.
#include "fabric_engine.h"
#include "plugin_entry.h"

#include <cstring>
#include <initializer_list>
#include <utility>

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

// Each entry is {actual slot, expected slot}; returns the first expected slot that does not
// hold its method, or 0.
int first_wrong(std::initializer_list<std::pair<long, long>> slots) {
    for (const auto &[got, want] : slots)
        if (got != want)
            return static_cast<int>(want);
    return 0;
}

// Slots 2-14, the same in every layout.
template <class E> int check_head() {
    return first_wrong({
        {vslot(&E::supportsRemote), 2},  {vslot(&E::supportsLocal), 3},  {vslot(&E::supportsNotif), 4},
        {vslot(&E::getSupportedMems), 5}, {vslot(&E::registerMem), 6},   {vslot(&E::deregisterMem), 7},
        {vslot(&E::connect), 8},          {vslot(&E::disconnect), 9},    {vslot(&E::unloadMD), 10},
        {vslot(&E::prepXfer), 11},        {vslot(&E::postXfer), 12},     {vslot(&E::checkXfer), 13},
        {vslot(&E::releaseReqH), 14},
    });
}

// The common tail, starting at slot `at`.
template <class E> int check_tail(long at) {
    return first_wrong({
        {vslot(&E::getPublicData), at},          {vslot(&E::getConnInfo), at + 1},
        {vslot(&E::loadRemoteConnInfo), at + 2}, {vslot(&E::loadRemoteMD), at + 3},
        {vslot(&E::loadLocalMD), at + 4},        {vslot(&E::getNotifs), at + 5},
        {vslot(&E::genNotif), at + 6},           {vslot(&E::queryMem), at + 7},
        {vslot(&E::estimateXferCost), at + 8},
    });
}

// The GPU-request slots 15-18 of 0.7-0.10.
template <class E> int check_gpu_requests() {
    return first_wrong({
        {vslot(&E::createGpuXferReq), 15}, {vslot(&E::releaseGpuXferReq), 16},
        {vslot(&E::getGpuSignalSize), 17}, {vslot(&E::prepGpuSignal), 18},
    });
}

// NIXL 1.x: memory views at 15-17, tail at 18 (27 slots).
template <class E> int check_v1() {
    using RemoteView = nixl_status_t (E::*)(const nixl_remote_meta_dlist_t &, nixlMemViewH &,
                                            const nixlBackendOptionalArgs *) const noexcept;
    using LocalView = nixl_status_t (E::*)(const nixl_meta_dlist_t &, nixlMemViewH &,
                                           const nixlBackendOptionalArgs *) const noexcept;
    if (int bad = check_head<E>())
        return bad;
    if (int bad = first_wrong({{vslot(static_cast<RemoteView>(&E::prepMemView)), 15},
                               {vslot(static_cast<LocalView>(&E::prepMemView)), 16},
                               {vslot(&E::releaseMemView), 17}}))
        return bad;
    return check_tail<E>(18);
}

// NIXL 0.10: GPU requests at 15-18, memory views at 19-21, tail at 22 (31 slots).
template <class E> int check_v010() {
    using RemoteView = nixl_status_t (E::*)(const nixl_remote_meta_dlist_t &, nixlMemViewH &,
                                            const nixlBackendOptionalArgs *) const noexcept;
    using LocalView = nixl_status_t (E::*)(const nixl_meta_dlist_t &, nixlMemViewH &,
                                           const nixlBackendOptionalArgs *) const noexcept;
    if (int bad = check_head<E>())
        return bad;
    if (int bad = check_gpu_requests<E>())
        return bad;
    if (int bad = first_wrong({{vslot(static_cast<RemoteView>(&E::prepMemoryView)), 19},
                               {vslot(static_cast<LocalView>(&E::prepMemoryView)), 20},
                               {vslot(&E::releaseMemoryView), 21}}))
        return bad;
    return check_tail<E>(22);
}

// NIXL 0.7-0.9: GPU requests at 15-18, tail at 19 (28 slots).
template <class E> int check_v07() {
    if (int bad = check_head<E>())
        return bad;
    if (int bad = check_gpu_requests<E>())
        return bad;
    return check_tail<E>(19);
}

} // namespace
} // namespace nf::adapter

extern "C" NF_ADAPTER_HIDDEN int nf_adapter_check_layout(void) {
    using namespace nf::adapter;
    // The declared bases, then our engines: FabricEngine is final, adds no virtual of its
    // own, and each override lands in its base's slot. A wrong slot is reported as
    // layout * 100 + slot (layout 1: 0.7-0.9, 2: 0.10, 3: 1.x).
    const int checks[][2] = {
        {3, check_v1<nixlBackendEngine>()},     {3, check_v1<FabricEngineV1>()},
        {2, check_v010<nixlBackendEngineV010>()}, {2, check_v010<FabricEngineV010>()},
        {1, check_v07<nixlBackendEngineV07>()},   {1, check_v07<FabricEngineV07>()},
    };
    for (const auto &c : checks)
        if (c[1])
            return c[0] * 100 + c[1];
    return 0;
}
