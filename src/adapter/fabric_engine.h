// The adapter's engine: a NIXL backend engine whose slots convert NIXL's C++ types to the
// plain C structs of include/nixl_fabric.h and call the Rust engine. No logic and no state
// beyond the C handles; every method catches every exception (none may reach the agent).
// One template over the three engine layouts of engine_layouts.h, so each NIXL release gets
// an object whose vtable is its own; the methods are the same code in all three.
#pragma once

#include "engine_layouts.h"
#include "nixl_fabric.h"

#include <cstdint>

namespace nf::adapter {

using namespace nf::abi;

// Every MD this adapter hands out starts with a tag, so that a pointer of the wrong kind
// (a self or peer MD passed where a local one is expected, or the reverse) is refused
// instead of being cast blindly.
class AdapterMD : public nixlBackendMD {
  public:
    enum class Kind : uint32_t { Local = 0x4e464c4d /* "NFLM" */, Target = 0x4e46544d /* "NFTM" */ };

    AdapterMD(Kind kind, bool is_private) : nixlBackendMD(is_private), kind_(kind) {}
    Kind kind() const { return kind_; }

    // The nf_mem (Local) or nf_rmem (Target) this MD owns. It sits in the base so that both
    // kinds hold it at one offset from the nixlBackendMD the agent puts in each descriptor:
    // prepXfer then hands NIXL's descriptor lists to nf_request_create_meta as they are.
    void *handle = nullptr;
    // That offset, in bytes.
    static size_t handle_offset();

  private:
    Kind kind_;
};

// From registerMem: owns an nf_mem (freed by deregisterMem).
class LocalMD final : public AdapterMD {
  public:
    LocalMD() : AdapterMD(Kind::Local, true) {}
    nf_mem *mem() const { return static_cast<nf_mem *>(handle); }
    uint64_t len = 0;
};

// From loadRemoteMD (a peer's registration) or loadLocalMD (a distinct self MD, via
// nf_rmem_self, which stays valid after its local MD is deregistered): owns an nf_rmem
// (freed by unloadMD).
class TargetMD final : public AdapterMD {
  public:
    TargetMD() : AdapterMD(Kind::Target, false) {}
    nf_rmem *rmem() const { return static_cast<nf_rmem *>(handle); }
};

// From prepXfer: owns an nf_request (freed by releaseReqH once nf_request_release agrees).
class FabricReqH final : public nixlBackendReqH {
  public:
    static constexpr uint64_t kMagic = 0x4e46524551484e44ull; // "NFREQHND"
    uint64_t magic = kMagic;
    // NULL until the request is planned: at prepXfer, or at the first postXfer when
    // plan_at_post is on (the agent hands postXfer the lists it gave prepXfer).
    nf_request *req = nullptr;
    // The request's bytes and operation for telemetry, read once when it is planned (a post
    // that ends at once would otherwise make one more library call).
    uint64_t bytes = 0;
    bool write = false;
    bool known = false;
    ~FabricReqH() override { magic = 0; }
};

template <class Base> class FabricEngine final : public Base {
  public:
    explicit FabricEngine(const nixlBackendInitParams *init);
    // A finished post's status as telemetry: bytes and requests, or the error.
    nixl_status_t account(const FabricReqH &h, nixl_status_t s) const;
    ~FabricEngine() override;

    bool supportsRemote() const noexcept override { return true; }
    bool supportsLocal() const noexcept override { return true; }
    bool supportsNotif() const noexcept override { return true; }
    nixl_mem_list_t getSupportedMems() const noexcept override;

    nixl_status_t registerMem(const nixlBlobDesc &mem, const nixl_mem_t &nixl_mem,
                              nixlBackendMD *&out) noexcept override;
    nixl_status_t deregisterMem(nixlBackendMD *meta) noexcept override;
    nixl_status_t connect(const std::string &remote_agent) noexcept override;
    nixl_status_t disconnect(const std::string &remote_agent) noexcept override;
    nixl_status_t unloadMD(nixlBackendMD *input) noexcept override;

    nixl_status_t prepXfer(const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                           const nixl_meta_dlist_t &remote, const std::string &remote_agent,
                           nixlBackendReqH *&handle,
                           const nixlBackendOptionalArgs *opt_args) const noexcept override;
    nixl_status_t postXfer(const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                           const nixl_meta_dlist_t &remote, const std::string &remote_agent,
                           nixlBackendReqH *&handle,
                           const nixlBackendOptionalArgs *opt_args) const noexcept override;
    nixl_status_t checkXfer(nixlBackendReqH *handle) const noexcept override;
    nixl_status_t releaseReqH(nixlBackendReqH *handle) const noexcept override;

    // Memory views and the 0.7-0.10 GPU-request slots: the layout's own NOT_SUPPORTED
    // defaults (engine_layouts.h), not offered by this plugin.

    nixl_status_t getPublicData(const nixlBackendMD *meta, std::string &str) const noexcept override;
    nixl_status_t getConnInfo(std::string &str) const noexcept override;
    nixl_status_t loadRemoteConnInfo(const std::string &remote_agent,
                                     const std::string &remote_conn_info) noexcept override;
    nixl_status_t loadRemoteMD(const nixlBlobDesc &input, const nixl_mem_t &nixl_mem,
                               const std::string &remote_agent,
                               nixlBackendMD *&output) noexcept override;
    nixl_status_t loadLocalMD(nixlBackendMD *input, nixlBackendMD *&output) noexcept override;
    nixl_status_t getNotifs(notif_list_t &notif_list) noexcept override;
    nixl_status_t genNotif(const std::string &remote_agent, const std::string &msg) const noexcept override;

    nixl_status_t queryMem(const nixl_reg_dlist_t &descs,
                           std::vector<nixl_query_resp_t> &resp) const noexcept override;
    nixl_status_t estimateXferCost(const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                                   const nixl_meta_dlist_t &remote, const std::string &remote_agent,
                                   nixlBackendReqH *const &handle, std::chrono::microseconds &duration,
                                   std::chrono::microseconds &err_margin, nixl_cost_t &method,
                                   const nixlAgentOptionalArgs *extra_opt_args) const noexcept override;

  private:
    nf_engine *engine_ = nullptr; // NULL only when initErr is set
    bool plan_at_post_ = true;    // the configuration's plan_at_post, read at construction
    // Checks and plans a request's descriptors into h->req (NIXL's lists, read in place).
    nixl_status_t plan(FabricReqH &h, const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                       const nixl_meta_dlist_t &remote, const std::string &remote_agent) const;
};

// The engine of each NIXL release (instantiated in fabric_engine.cpp).
using FabricEngineV1 = FabricEngine<nixlBackendEngine>;
using FabricEngineV010 = FabricEngine<nixlBackendEngineV010>;
using FabricEngineV07 = FabricEngine<nixlBackendEngineV07>;

} // namespace nf::adapter
