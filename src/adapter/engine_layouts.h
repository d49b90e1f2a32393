// The three backend-engine vtables NIXL has shipped. Slots 0-14 and the data are the same
// in all of them (nixlEngineHead, nixl_abi.h); what follows slot 14 differs:
//
//   NIXL 0.7.x-0.9.x  28 slots: 15 createGpuXferReq, 16 releaseGpuXferReq,
//                     17 getGpuSignalSize, 18 prepGpuSignal, then the common tail at 19
//   NIXL 0.10.x       31 slots: the four GPU-request methods at 15-18, 19 prepMemoryView
//                     (remote list), 20 prepMemoryView (local list), 21 releaseMemoryView,
//                     then the common tail at 22
//   NIXL 1.0-1.5.x    27 slots: 15 prepMemView (remote), 16 prepMemView (local),
//                     17 releaseMemView, then the common tail at 18
//
// The common tail is getPublicData, getConnInfo, loadRemoteConnInfo, loadRemoteMD,
// loadLocalMD, getNotifs, genNotif, queryMem, estimateXferCost, with the same parameter
// types in every release (their mangled names are identical in all 16 wheels).
// Read from the stock UCX plugin's copy of the base vtable (relocations of
// `vtable for nixlBackendEngine`) in each nixl-cu12 wheel; the abstract base's size is
// 0xf0, 0x108 and 0xe8 bytes respectively.
//
// The engine is assembled as EngineTail<Middle>: single inheritance appends each class's
// new virtuals after its base's, so head (0-14) + middle + tail gives each release's order,
// and no class after the head adds data (size stays 208). Methods our plugin does not offer
// answer NIXL_ERR_NOT_SUPPORTED, as the base defaults do.
#pragma once

#include "nixl_abi.h"

namespace nf::abi {

// ---- the middle slots of each release ---------------------------------------------------

// NIXL 1.0-1.5.x: memory views (slots 15-17; remote overload declared first).
class MiddleV1 : public nixlEngineHead {
  public:
    using nixlEngineHead::nixlEngineHead;
    virtual nixl_status_t prepMemView(const nixl_remote_meta_dlist_t &, nixlMemViewH &,
                                      const nixlBackendOptionalArgs * = nullptr) const noexcept {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual nixl_status_t prepMemView(const nixl_meta_dlist_t &, nixlMemViewH &,
                                      const nixlBackendOptionalArgs * = nullptr) const noexcept {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual void releaseMemView(nixlMemViewH) const noexcept {}
};

// The GPU-request methods of 0.7-0.10 (slots 15-18). Their return types are not part of
// the mangled names we read; each is declared to return a status, so that a caller that
// expects one gets NOT_SUPPORTED and a caller that expects void ignores the register.
class MiddleGpuRequests : public nixlEngineHead {
  public:
    using nixlEngineHead::nixlEngineHead;
    virtual nixl_status_t createGpuXferReq(const nixlBackendReqH &, const nixl_meta_dlist_t &,
                                           const nixl_meta_dlist_t &, void *&) const noexcept {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual nixl_status_t releaseGpuXferReq(void *) const noexcept { return NIXL_ERR_NOT_SUPPORTED; }
    virtual nixl_status_t getGpuSignalSize(size_t &) const noexcept { return NIXL_ERR_NOT_SUPPORTED; }
    virtual nixl_status_t prepGpuSignal(const nixlBackendMD &, void *,
                                        const nixlBackendOptionalArgs *) const noexcept {
        return NIXL_ERR_NOT_SUPPORTED;
    }
};

// NIXL 0.7.x-0.9.x: the GPU-request methods only.
class MiddleV07 : public MiddleGpuRequests {
  public:
    using MiddleGpuRequests::MiddleGpuRequests;
};

// NIXL 0.10.x: the GPU-request methods, then the memory views under their 0.10 names
// (slots 19-21; remote overload declared first, as in 1.x).
class MiddleV010 : public MiddleGpuRequests {
  public:
    using MiddleGpuRequests::MiddleGpuRequests;
    virtual nixl_status_t prepMemoryView(const nixl_remote_meta_dlist_t &, nixlMemViewH &,
                                         const nixlBackendOptionalArgs *) const noexcept {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual nixl_status_t prepMemoryView(const nixl_meta_dlist_t &, nixlMemViewH &,
                                         const nixlBackendOptionalArgs *) const noexcept {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual nixl_status_t releaseMemoryView(nixlMemViewH) const noexcept { return NIXL_ERR_NOT_SUPPORTED; }
};

// ---- the common tail ----------------------------------------------------------------------

template <class Middle> class EngineTail : public Middle {
  public:
    using Middle::Middle;

    virtual nixl_status_t getPublicData(const nixlBackendMD *, std::string &) const {
        return NIXL_ERR_BACKEND;
    }
    virtual nixl_status_t getConnInfo(std::string &) const { return NIXL_ERR_BACKEND; }
    virtual nixl_status_t loadRemoteConnInfo(const std::string &, const std::string &) {
        return NIXL_ERR_BACKEND;
    }
    virtual nixl_status_t loadRemoteMD(const nixlBlobDesc &, const nixl_mem_t &, const std::string &,
                                       nixlBackendMD *&) {
        return NIXL_ERR_BACKEND;
    }
    virtual nixl_status_t loadLocalMD(nixlBackendMD *, nixlBackendMD *&) { return NIXL_ERR_BACKEND; }
    virtual nixl_status_t getNotifs(notif_list_t &) { return NIXL_ERR_BACKEND; }
    virtual nixl_status_t genNotif(const std::string &, const std::string &) const {
        return NIXL_ERR_BACKEND;
    }
    virtual nixl_status_t queryMem(const nixl_reg_dlist_t &, std::vector<nixl_query_resp_t> &) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
    virtual nixl_status_t estimateXferCost(const nixl_xfer_op_t &, const nixl_meta_dlist_t &,
                                           const nixl_meta_dlist_t &, const std::string &,
                                           nixlBackendReqH *const &, std::chrono::microseconds &,
                                           std::chrono::microseconds &, nixl_cost_t &,
                                           const nixlAgentOptionalArgs * = nullptr) const {
        return NIXL_ERR_NOT_SUPPORTED;
    }
};

// The engine bases of each release, by the name NIXL gives its own.
using nixlBackendEngine = EngineTail<MiddleV1>;       // NIXL 1.0-1.5.x, 27 slots
using nixlBackendEngineV010 = EngineTail<MiddleV010>; // NIXL 0.10.x, 31 slots
using nixlBackendEngineV07 = EngineTail<MiddleV07>;   // NIXL 0.7.x-0.9.x, 28 slots

static_assert(sizeof(nixlBackendEngine) == 208 && sizeof(nixlBackendEngineV010) == 208 &&
                  sizeof(nixlBackendEngineV07) == 208,
              "the middle and tail classes add no data");

} // namespace nf::abi
