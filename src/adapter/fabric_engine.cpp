// The engine slots, each a conversion between NIXL's C++ types and one nf_* call; one
// template for the three engine layouts, instantiated at the end of this file.
#include "fabric_engine.h"

#include <exception>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

namespace nf::adapter {

// nf_status is nixl_status_t value for value (include/nixl_fabric.h), so statuses map 1:1.
static_assert(int(NF_IN_PROG) == NIXL_IN_PROG && int(NF_SUCCESS) == NIXL_SUCCESS);
static_assert(int(NF_ERR_NOT_POSTED) == NIXL_ERR_NOT_POSTED);
static_assert(int(NF_ERR_INVALID_PARAM) == NIXL_ERR_INVALID_PARAM);
static_assert(int(NF_ERR_BACKEND) == NIXL_ERR_BACKEND);
static_assert(int(NF_ERR_NOT_FOUND) == NIXL_ERR_NOT_FOUND);
static_assert(int(NF_ERR_MISMATCH) == NIXL_ERR_MISMATCH);
static_assert(int(NF_ERR_NOT_ALLOWED) == NIXL_ERR_NOT_ALLOWED);
static_assert(int(NF_ERR_REPOST_ACTIVE) == NIXL_ERR_REPOST_ACTIVE);
static_assert(int(NF_ERR_UNKNOWN) == NIXL_ERR_UNKNOWN);
static_assert(int(NF_ERR_NOT_SUPPORTED) == NIXL_ERR_NOT_SUPPORTED);
static_assert(int(NF_ERR_REMOTE_DISCONNECT) == NIXL_ERR_REMOTE_DISCONNECT);
static_assert(int(NF_ERR_CANCELED) == NIXL_ERR_CANCELED);
// Memory types and operations are NIXL's values too.
static_assert(int(NF_MEM_DRAM) == DRAM_SEG && int(NF_MEM_VRAM) == VRAM_SEG);
static_assert(int(NF_OP_READ) == NIXL_READ && int(NF_OP_WRITE) == NIXL_WRITE);
static_assert(sizeof(nf_xfer_desc) == 24);
// nixlMetaDesc is addr, len, devId, metadataP at 0/8/16/24 (ABI doc §4.3); prepXfer passes
// its lists as nf_meta_desc, which has the same four fields at the same offsets.
static_assert(sizeof(nixlMetaDesc) == sizeof(nf_meta_desc) && sizeof(nf_meta_desc) == 32);
static_assert(std::is_standard_layout_v<nf_meta_desc>);

namespace {

nixl_status_t to_nixl(nf_status s) { return static_cast<nixl_status_t>(static_cast<int>(s)); }

const uint8_t *bytes(const std::string &s) { return reinterpret_cast<const uint8_t *>(s.data()); }

// Runs a method body; no exception may reach the agent (ABI doc §1).
template <class F> nixl_status_t guarded(F &&body) noexcept {
    try {
        return body();
    } catch (const std::bad_alloc &) {
        return NIXL_ERR_BACKEND;
    } catch (const std::exception &) {
        return NIXL_ERR_BACKEND;
    } catch (...) {
        return NIXL_ERR_UNKNOWN;
    }
}

// A library-allocated blob, released on every path.
struct Blob {
    nf_blob b{nullptr, 0};
    Blob() = default;
    Blob(const Blob &) = delete;
    Blob &operator=(const Blob &) = delete;
    ~Blob() { nf_blob_free(&b); }
    void copy_to(std::string &out) const { out.assign(reinterpret_cast<const char *>(b.data), b.len); }
};

} // namespace

size_t AdapterMD::handle_offset() {
    static const size_t at = [] {
        const LocalMD probe;
        const nixlBackendMD *md = &probe;
        return static_cast<size_t>(reinterpret_cast<const char *>(&probe.handle) - reinterpret_cast<const char *>(md));
    }();
    return at;
}

namespace {

const LocalMD *as_local(const nixlBackendMD *md) {
    auto *a = static_cast<const AdapterMD *>(md);
    return (a && a->kind() == AdapterMD::Kind::Local) ? static_cast<const LocalMD *>(a) : nullptr;
}

const TargetMD *as_target(const nixlBackendMD *md) {
    auto *a = static_cast<const AdapterMD *>(md);
    return (a && a->kind() == AdapterMD::Kind::Target) ? static_cast<const TargetMD *>(a) : nullptr;
}

FabricReqH *as_req(nixlBackendReqH *h) {
    auto *r = static_cast<FabricReqH *>(h);
    return (r && r->magic == FabricReqH::kMagic) ? r : nullptr;
}

// Context of nf_engine_get_notifs: appends into the agent's list. An exception must not
// unwind through the Rust frames that call the callback, so it is caught and recorded.
struct NotifSink {
    notif_list_t *list;
    bool failed = false;
};

void on_notif(void *ctx, const char *sender, size_t sender_len, const uint8_t *msg,
              size_t msg_len) noexcept {
    auto *sink = static_cast<NotifSink *>(ctx);
    try {
        sink->list->emplace_back(std::string(sender, sender_len),
                                 std::string(reinterpret_cast<const char *>(msg), msg_len));
    } catch (...) {
        sink->failed = true;
    }
}

} // namespace

// ---- construction ------------------------------------------------------------------------

template <class Base>
FabricEngine<Base>::FabricEngine(const nixlBackendInitParams *init) : Base(init) {
    nf_config *cfg = nullptr;
    try {
        if (nf_config_new(&cfg) != NF_SUCCESS) {
            this->initErr = true;
            return;
        }
        // The agent's own settings first, so that an explicit backend parameter of the same
        // key (customParams below) overrides them. pthrDelay 0 (what Python always sends)
        // means "the default", so it leaves the configured value alone.
        if (nf_config_set(cfg, "progress_thread", init->enableProgTh ? "true" : "false") != NF_SUCCESS)
            this->initErr = true;
        if (!this->initErr && init->pthrDelay != 0 &&
            nf_config_set(cfg, "progress_delay_us", std::to_string(init->pthrDelay).c_str()) != NF_SUCCESS)
            this->initErr = true;
        if (!this->initErr && init->customParams) {
            for (const auto &[key, value] : *init->customParams) {
                const nf_status s = nf_config_set(cfg, key.c_str(), value.c_str());
                if (s == NF_SUCCESS || s == NF_ERR_NOT_FOUND) // unknown keys: ignored (Rust logs them)
                    continue;
                this->initErr = true; // a malformed value (logged by Rust)
                break;
            }
        }
        char plan_at[8] = {0};
        size_t plan_at_len = 0;
        if (!this->initErr &&
            nf_config_get(cfg, "plan_at_post", plan_at, sizeof plan_at, &plan_at_len) == NF_SUCCESS)
            plan_at_post_ = std::string(plan_at, plan_at_len < sizeof plan_at ? plan_at_len : 0) != "false";
        if (!this->initErr && nf_engine_create(init->localAgent.c_str(), cfg, &engine_) != NF_SUCCESS) {
            engine_ = nullptr;
            this->initErr = true;
        }
    } catch (...) {
        this->initErr = true;
    }
    nf_config_free(cfg);
}

template <class Base>
FabricEngine<Base>::~FabricEngine() {
    if (engine_)
        nf_engine_destroy(engine_);
}

// ---- capabilities ------------------------------------------------------------------------

template <class Base>
nixl_mem_list_t FabricEngine<Base>::getSupportedMems() const noexcept {
    try {
        nixl_mem_list_t mems;
        const uint32_t mask = nf_engine_supported_mems(engine_);
        for (int t = DRAM_SEG; t <= FILE_SEG; ++t)
            if (mask & (1u << t))
                mems.push_back(static_cast<nixl_mem_t>(t));
        return mems;
    } catch (...) {
        return {};
    }
}

// ---- memory ------------------------------------------------------------------------------

template <class Base>
nixl_status_t FabricEngine<Base>::registerMem(const nixlBlobDesc &mem, const nixl_mem_t &nixl_mem,
                                              nixlBackendMD *&out) noexcept {
    return guarded([&] {
        auto md = std::make_unique<LocalMD>();
        nf_mem *h = nullptr;
        const nf_status s = nf_mem_register(engine_, mem.addr, mem.len, static_cast<uint32_t>(nixl_mem),
                                            mem.devId, &h);
        if (s != NF_SUCCESS)
            return to_nixl(s);
        md->handle = h;
        md->len = mem.len;
        this->addTelemetryEvent(nixl_telemetry_event_type_t::AGENT_MEMORY_REGISTERED, mem.len);
        out = md.release();
        return NIXL_SUCCESS;
    });
}

template <class Base>
nixl_status_t FabricEngine<Base>::deregisterMem(nixlBackendMD *meta) noexcept {
    return guarded([&] {
        const LocalMD *md = as_local(meta);
        if (!md)
            return NIXL_ERR_INVALID_PARAM;
        this->addTelemetryEvent(nixl_telemetry_event_type_t::AGENT_MEMORY_DEREGISTERED, md->len);
        const nf_status s = nf_mem_deregister(engine_, md->mem());
        delete md; // the agent forgets the MD whatever the result
        return to_nixl(s);
    });
}

template <class Base>
nixl_status_t FabricEngine<Base>::getPublicData(const nixlBackendMD *meta, std::string &str) const noexcept {
    return guarded([&] {
        const LocalMD *md = as_local(meta);
        if (!md)
            return NIXL_ERR_INVALID_PARAM;
        Blob blob;
        const nf_status s = nf_mem_public_data(engine_, md->mem(), &blob.b);
        if (s != NF_SUCCESS)
            return to_nixl(s);
        blob.copy_to(str);
        return NIXL_SUCCESS;
    });
}

template <class Base>
nixl_status_t FabricEngine<Base>::loadRemoteMD(const nixlBlobDesc &input, const nixl_mem_t &mem,
                                               const std::string &remote_agent,
                                               nixlBackendMD *&output) noexcept {
    return guarded([&] {
        auto md = std::make_unique<TargetMD>();
        nf_rmem *h = nullptr;
        nf_status s = nf_rmem_load(engine_, remote_agent.c_str(), bytes(input.metaInfo),
                                   input.metaInfo.size(), &h);
        if (s != NF_SUCCESS)
            return to_nixl(s);
        md->handle = h;
        // The agent's view of the region must match what the descriptor describes.
        s = nf_rmem_check(h, input.addr, input.len, static_cast<uint32_t>(mem));
        if (s != NF_SUCCESS) {
            nf_rmem_unload(engine_, h);
            md->handle = nullptr;
            return to_nixl(s);
        }
        output = md.release();
        return NIXL_SUCCESS;
    });
}

template <class Base>
nixl_status_t FabricEngine<Base>::loadLocalMD(nixlBackendMD *input, nixlBackendMD *&output) noexcept {
    return guarded([&] {
        const LocalMD *local = as_local(input);
        if (!local)
            return NIXL_ERR_INVALID_PARAM;
        auto md = std::make_unique<TargetMD>();
        nf_rmem *h = nullptr;
        const nf_status s = nf_rmem_self(engine_, local->mem(), &h);
        if (s != NF_SUCCESS)
            return to_nixl(s);
        md->handle = h;
        output = md.release(); // distinct from input: unloadMD may come after deregisterMem
        return NIXL_SUCCESS;
    });
}

template <class Base>
nixl_status_t FabricEngine<Base>::unloadMD(nixlBackendMD *input) noexcept {
    return guarded([&] {
        // Self and peer MDs are both TargetMDs; a local MD is never ours to unload (ours
        // are always distinct from it), so it is refused rather than freed twice.
        const TargetMD *md = as_target(input);
        if (!md)
            return NIXL_ERR_INVALID_PARAM;
        const nf_status s = nf_rmem_unload(engine_, md->rmem());
        delete md;
        return to_nixl(s);
    });
}

// ---- connections -------------------------------------------------------------------------

template <class Base>
nixl_status_t FabricEngine<Base>::getConnInfo(std::string &str) const noexcept {
    return guarded([&] {
        Blob blob;
        const nf_status s = nf_engine_conn_info(engine_, &blob.b);
        if (s != NF_SUCCESS)
            return to_nixl(s);
        blob.copy_to(str);
        return NIXL_SUCCESS;
    });
}

template <class Base>
nixl_status_t FabricEngine<Base>::loadRemoteConnInfo(const std::string &remote_agent,
                                                     const std::string &remote_conn_info) noexcept {
    return guarded([&] {
        return to_nixl(nf_engine_load_conn_info(engine_, remote_agent.c_str(), bytes(remote_conn_info),
                                                remote_conn_info.size()));
    });
}

template <class Base>
nixl_status_t FabricEngine<Base>::connect(const std::string &remote_agent) noexcept {
    return guarded([&] { return to_nixl(nf_engine_connect(engine_, remote_agent.c_str())); });
}

template <class Base>
nixl_status_t FabricEngine<Base>::disconnect(const std::string &remote_agent) noexcept {
    return guarded([&] { return to_nixl(nf_engine_disconnect(engine_, remote_agent.c_str())); });
}

// ---- transfers ---------------------------------------------------------------------------

template <class Base>
nixl_status_t FabricEngine<Base>::plan(FabricReqH &h, const nixl_xfer_op_t &operation,
                                       const nixl_meta_dlist_t &local, const nixl_meta_dlist_t &remote,
                                       const std::string &remote_agent) const {
    const size_t n = local.descCount();
    if (remote.descCount() != n)
        return NIXL_ERR_INVALID_PARAM;
    // NIXL's descriptors are nf_meta_desc as they lie (ABI doc §4.3): the engine reads
    // both lists in place, and each descriptor's metadataP names our MD, whose handle it
    // reads at handle_offset(). A missing MD, or one of the wrong kind in a list (its
    // handle is then not of the kind that list needs), is refused there.
    const auto *l = n ? reinterpret_cast<const nf_meta_desc *>(&local[0]) : nullptr;
    const auto *r = n ? reinterpret_cast<const nf_meta_desc *>(&remote[0]) : nullptr;
    const nf_status s = nf_request_create_meta(engine_, static_cast<uint32_t>(operation), l, r, n,
                                               AdapterMD::handle_offset(), remote_agent.c_str(), &h.req);
    if (s != NF_SUCCESS) {
        h.req = nullptr;
        return to_nixl(s);
    }
    uint32_t op = 0;
    h.known = nf_request_info(h.req, &h.bytes, &op) == NF_SUCCESS;
    h.write = op == NF_OP_WRITE;
    return NIXL_SUCCESS;
}

template <class Base>
nixl_status_t FabricEngine<Base>::prepXfer(const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                                           const nixl_meta_dlist_t &remote, const std::string &remote_agent,
                                           nixlBackendReqH *&handle,
                                           const nixlBackendOptionalArgs *) const noexcept {
    return guarded([&] {
        if (remote.descCount() != local.descCount() || local.descCount() == 0)
            return NIXL_ERR_INVALID_PARAM;
        auto h = std::make_unique<FabricReqH>();
        // With plan_at_post the descriptors wait for the first post, which gets the same
        // lists (ABI doc §6.4): creation then costs what NIXL's own part of it costs, as
        // with the UCX plugin, whose per-descriptor work is in its postXfer too.
        if (!plan_at_post_) {
            const nixl_status_t s = plan(*h, operation, local, remote, remote_agent);
            if (s != NIXL_SUCCESS)
                return s;
        }
        handle = h.release();
        return NIXL_SUCCESS;
    });
}

template <class Base>
nixl_status_t FabricEngine<Base>::postXfer(const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                                           const nixl_meta_dlist_t &remote, const std::string &remote_agent,
                                           nixlBackendReqH *&handle,
                                           const nixlBackendOptionalArgs *opt_args) const noexcept {
    return guarded([&] {
        if (!handle) { // the agent always preps first; tolerate a direct post anyway
            const nixl_status_t s = prepXfer(operation, local, remote, remote_agent, handle, opt_args);
            if (s != NIXL_SUCCESS)
                return s;
        }
        FabricReqH *h = as_req(handle);
        if (!h)
            return NIXL_ERR_INVALID_PARAM;
        if (!h->req) { // first post of a request planned at post (or whose plan failed before)
            const nixl_status_t s = plan(*h, operation, local, remote, remote_agent);
            if (s != NIXL_SUCCESS)
                return account(*h, s);
        }
        const bool has_notif = opt_args && opt_args->hasNotif;
        const uint8_t *msg = has_notif ? bytes(opt_args->notifMsg) : nullptr;
        const size_t msg_len = has_notif ? opt_args->notifMsg.size() : 0;
        return account(*h, to_nixl(nf_request_post(engine_, h->req, msg, msg_len, has_notif)));
    });
}

template <class Base>
nixl_status_t FabricEngine<Base>::checkXfer(nixlBackendReqH *handle) const noexcept {
    return guarded([&] {
        FabricReqH *h = as_req(handle);
        if (!h)
            return NIXL_ERR_INVALID_PARAM;
        if (!h->req) // never planned, so never posted
            return NIXL_ERR_NOT_POSTED;
        return account(*h, to_nixl(nf_request_check(engine_, h->req)));
    });
}

template <class Base>
nixl_status_t FabricEngine<Base>::account(const FabricReqH &h, nixl_status_t s) const {
    using T = nixl_telemetry_event_type_t;
    if (s == NIXL_SUCCESS) {
        if (h.known) {
            this->addTelemetryEvent(h.write ? T::AGENT_TX_BYTES : T::AGENT_RX_BYTES, h.bytes);
            this->addTelemetryEvent(h.write ? T::AGENT_TX_REQUESTS_NUM : T::AGENT_RX_REQUESTS_NUM, 1);
        }
    } else if (s < 0 && s >= NIXL_ERR_CANCELED) {
        // Error events follow the status codes: -1 -> AGENT_ERR_NOT_POSTED, and so on.
        this->addTelemetryEvent(static_cast<T>(static_cast<uint32_t>(T::AGENT_ERR_NOT_POSTED) - 1 - s), 1);
    }
    return s;
}

template <class Base>
nixl_status_t FabricEngine<Base>::releaseReqH(nixlBackendReqH *handle) const noexcept {
    return guarded([&] {
        if (!handle)
            return NIXL_SUCCESS;
        FabricReqH *h = as_req(handle);
        if (!h)
            return NIXL_ERR_INVALID_PARAM;
        if (!h->req) { // never planned: nothing of the engine's to free
            delete h;
            return NIXL_SUCCESS;
        }
        // Negative (NF_ERR_REPOST_ACTIVE: could not drain in time): the C handle is kept,
        // and so is our wrapper; the agent keeps its request and calls again later, and
        // nf_request_release frees on that second call (ABI doc §6.4, src/capi/mod.rs).
        const nf_status s = nf_request_release(engine_, h->req);
        if (static_cast<int>(s) >= 0)
            delete h;
        return to_nixl(s);
    });
}

template <class Base>
nixl_status_t FabricEngine<Base>::estimateXferCost(const nixl_xfer_op_t &, const nixl_meta_dlist_t &,
                                                   const nixl_meta_dlist_t &, const std::string &,
                                                   nixlBackendReqH *const &, std::chrono::microseconds &,
                                                   std::chrono::microseconds &, nixl_cost_t &,
                                                   const nixlAgentOptionalArgs *) const noexcept {
    return NIXL_ERR_NOT_SUPPORTED;
}

// ---- queries: not offered ---------------------------------------------------------------

template <class Base>
nixl_status_t FabricEngine<Base>::queryMem(const nixl_reg_dlist_t &,
                                           std::vector<nixl_query_resp_t> &) const noexcept {
    return NIXL_ERR_NOT_SUPPORTED;
}

// ---- notifications -----------------------------------------------------------------------

template <class Base>
nixl_status_t FabricEngine<Base>::getNotifs(notif_list_t &notif_list) noexcept {
    return guarded([&] {
        NotifSink sink{&notif_list};
        const nf_status s = nf_engine_get_notifs(engine_, &on_notif, &sink);
        if (s != NF_SUCCESS)
            return to_nixl(s);
        return sink.failed ? NIXL_ERR_BACKEND : NIXL_SUCCESS;
    });
}

template <class Base>
nixl_status_t FabricEngine<Base>::genNotif(const std::string &remote_agent,
                                           const std::string &msg) const noexcept {
    return guarded([&] {
        return to_nixl(nf_engine_send_notif(engine_, remote_agent.c_str(), bytes(msg), msg.size()));
    });
}

template class FabricEngine<nixlBackendEngine>;
template class FabricEngine<nixlBackendEngineV010>;
template class FabricEngine<nixlBackendEngineV07>;

} // namespace nf::adapter
