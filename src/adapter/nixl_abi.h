// Our own declarations of the NIXL backend-plugin interface, written from
// /work/shared/NIXL_PLUGIN_ABI.md (no NIXL headers or source are used) and from the
// exported symbols and vtables of every nixl-cu12 wheel from 0.7.1 to 1.5.1. Every size and
// offset is pinned by a static_assert below; the virtual slot order of each engine layout
// (§5.2, engine_layouts.h) is checked at run time by nf_adapter_check_layout()
// (layout_check.cpp), because a vtable index is not observable at compile time.
//
// Class and namespace names do not matter for dispatch (the agent only uses vtable slots
// and data offsets), so everything lives in namespace nf::abi to keep it apart from any
// other copy of these names in the process.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#if !defined(_GLIBCXX_USE_CXX11_ABI) || !_GLIBCXX_USE_CXX11_ABI
#error "the NIXL agent uses the libstdc++ CXX11 string ABI (ABI doc §1)"
#endif

namespace nf::abi {

// ---- §4.1 enums (all 4 bytes) ----------------------------------------------------------

enum nixl_mem_t { DRAM_SEG = 0, VRAM_SEG = 1, BLK_SEG = 2, OBJ_SEG = 3, FILE_SEG = 4 };

enum nixl_xfer_op_t { NIXL_READ = 0, NIXL_WRITE = 1 };

enum nixl_status_t : int {
    NIXL_IN_PROG = 1,
    NIXL_SUCCESS = 0,
    NIXL_ERR_NOT_POSTED = -1,
    NIXL_ERR_INVALID_PARAM = -2,
    NIXL_ERR_BACKEND = -3,
    NIXL_ERR_NOT_FOUND = -4,
    NIXL_ERR_MISMATCH = -5,
    NIXL_ERR_NOT_ALLOWED = -6,
    NIXL_ERR_REPOST_ACTIVE = -7,
    NIXL_ERR_UNKNOWN = -8,
    NIXL_ERR_NOT_SUPPORTED = -9,
    NIXL_ERR_REMOTE_DISCONNECT = -10,
    NIXL_ERR_CANCELED = -11,
    NIXL_ERR_NO_TELEMETRY = -12,
};

enum class nixl_thread_sync_t : int { NONE = 0, STRICT = 1, RW = 2, DEFAULT = NONE };

enum class nixl_cost_t : int { ANALYTICAL_BACKEND = 0 };

enum class nixl_telemetry_event_type_t : uint32_t {
    AGENT_TX_BYTES = 0,
    AGENT_RX_BYTES = 1,
    AGENT_TX_REQUESTS_NUM = 2,
    AGENT_RX_REQUESTS_NUM = 3,
    AGENT_MEMORY_REGISTERED = 4,
    AGENT_MEMORY_DEREGISTERED = 5,
    AGENT_XFER_TIME = 6,
    AGENT_XFER_POST_TIME = 7,
    // 8..19: one per status error, -1..-12 in order.
    AGENT_ERR_NOT_POSTED = 8,
    AGENT_ERR_NO_TELEMETRY = 19,
    AGENT_TELEMETRY_EVENTS_DROPPED = 20,
};

// ---- §4.2 aliases -----------------------------------------------------------------------

using nixl_backend_t = std::string;
using nixl_blob_t = std::string;
using nixl_b_params_t = std::unordered_map<std::string, std::string>;
using nixl_mem_list_t = std::vector<nixl_mem_t>;
using notif_list_t = std::vector<std::pair<std::string, std::string>>;
using nixl_query_resp_t = std::optional<nixl_b_params_t>;
using nixlMemViewH = void *;

// ---- §4.7 metadata and request-handle bases ---------------------------------------------

class nixlBackendMD {
  public:
    explicit nixlBackendMD(bool is_private) : isPrivateMD(is_private) {}
    nixlBackendMD(const nixlBackendMD &) = delete;
    nixlBackendMD &operator=(const nixlBackendMD &) = delete;
    virtual ~nixlBackendMD() = default;

  protected:
    bool isPrivateMD;

    friend struct LayoutCheck;
};

class nixlBackendReqH {
  public:
    nixlBackendReqH() = default;
    nixlBackendReqH(const nixlBackendReqH &) = delete;
    nixlBackendReqH &operator=(const nixlBackendReqH &) = delete;
    virtual ~nixlBackendReqH() = default;
};

// Opaque to plugins (only pointers to it appear, inside nixlAgentOptionalArgs).
class nixlBackendH;

// ---- §4.3 descriptors (no vtables) -----------------------------------------------------

class nixlBasicDesc {
  public:
    uintptr_t addr;
    size_t len;
    uint64_t devId;
};

class nixlBlobDesc : public nixlBasicDesc {
  public:
    nixl_blob_t metaInfo;
};

class nixlMetaDesc : public nixlBasicDesc {
  public:
    nixlBackendMD *metadataP;
};

class nixlRemoteMetaDesc : public nixlMetaDesc {
  public:
    std::string remoteAgent;
};

// ---- §4.4 descriptor list: has a vtable ------------------------------------------------
// The vtables live in libnixl; plugins only ever receive lists by const reference, so this
// declaration can never be constructed (no vtable of ours is emitted or referenced).
template <class T> class nixlDescList {
  public:
    nixlDescList() = delete;
    nixlDescList(const nixlDescList &) = delete;
    nixlDescList &operator=(const nixlDescList &) = delete;
    virtual ~nixlDescList() = default;                          // slots 0, 1
    virtual void resize(const size_t &count) = 0;               // slot 2
    virtual void addDesc(const T &desc) = 0;                    // slot 3
    virtual int getIndex(const nixlBasicDesc &query) const = 0; // slot 4

    nixl_mem_t getType() const { return type; }
    size_t descCount() const { return descs.size(); }
    const T &operator[](size_t i) const { return descs[i]; }

  protected:
    nixl_mem_t type;
    std::vector<T> descs;

    friend struct LayoutCheck;
};

using nixl_meta_dlist_t = nixlDescList<nixlMetaDesc>;
using nixl_reg_dlist_t = nixlDescList<nixlBlobDesc>;
using nixl_remote_meta_dlist_t = nixlDescList<nixlRemoteMetaDesc>;

// ---- §4.5 per-transfer backend options -------------------------------------------------

class nixlBackendOptionalArgs {
  public:
    std::string notifMsg;
    bool hasNotif = false;
    std::string customParam;
};

// ---- §4.6 agent options (reaches plugins only through estimateXferCost) ----------------

class nixlAgentOptionalArgs {
  public:
    std::vector<nixlBackendH *> backends;
    std::optional<std::string> notif;
    std::string notifMsg;
    bool hasNotif = false;
    bool skipDescMerge = false;
    bool includeConnInfo = false;
    std::string ipAddr;
    int port = 0;
    std::string metadataLabel;
    std::string customParam;
};

// ---- §4.8 init params (agent's stack; valid only during create_engine) ------------------

class nixlBackendInitParams {
  public:
    std::string localAgent;
    nixl_backend_t type;
    nixl_b_params_t *customParams;
    bool enableProgTh;
    uint64_t pthrDelay; // µs
    nixl_thread_sync_t syncMode;
    bool enableTelemetry_;
};

// ---- §4.9 telemetry event ----------------------------------------------------------------

struct nixlTelemetryEvent {
    nixl_telemetry_event_type_t eventType;
    uint64_t value;
};

// ---- §5 the engine base: data and the slots every release shares ----------------------
// Data layout of §5.1 and virtual slots 0-14 of §5.2, which are the same in every NIXL
// release from 0.7 to 1.5 (checked in each wheel: the agent reads initErr at +160 and calls
// slots 2-14 at the same offsets). The slots after 14 differ by release; the three shipped
// arrangements are in engine_layouts.h, which completes this class for each of them.
class nixlEngineHead {
  private:
    const nixl_backend_t backendType;                   // +8
    nixl_b_params_t customParams;                       // +40
    std::vector<nixlTelemetryEvent> telemetryEvents_;   // +96 (never drained by the agent)
    mutable std::mutex telemetryEventsMutex_;           // +120

  protected:
    bool initErr = false;                               // +160, read by the agent
    const std::string localAgent;                       // +168
    const bool enableTelemetry_;                        // +200

  public:
    explicit nixlEngineHead(const nixlBackendInitParams *init)
        : backendType(init->type),
          customParams(init->customParams ? *init->customParams : nixl_b_params_t{}),
          localAgent(init->localAgent), enableTelemetry_(init->enableTelemetry_) {}
    nixlEngineHead(const nixlEngineHead &) = delete;
    nixlEngineHead(nixlEngineHead &&) = delete;
    nixlEngineHead &operator=(const nixlEngineHead &) = delete;
    nixlEngineHead &operator=(nixlEngineHead &&) = delete;

  protected:
    // Pushes one telemetry event the way the base class keeps them: only with telemetry
    // on, at most 1000, under the base's mutex. (The vector is the base's own state; the
    // agent never drains it in 1.5.1, so the cap keeps it bounded.)
    void addTelemetryEvent(nixl_telemetry_event_type_t type, uint64_t value) const {
        if (!enableTelemetry_)
            return;
        std::lock_guard<std::mutex> g(telemetryEventsMutex_);
        auto &events = const_cast<std::vector<nixlTelemetryEvent> &>(telemetryEvents_);
        if (events.size() < 1000)
            events.push_back({type, value});
    }

  public:
    // Inline accessors as the agent uses them (it reads the fields directly).
    const nixl_backend_t &getType() const { return backendType; }
    const nixl_b_params_t &getCustomParams() const { return customParams; }
    bool getInitErr() const { return initErr; }

    // slots 0, 1
    virtual ~nixlEngineHead() = default;

    // slots 2-5
    virtual bool supportsRemote() const = 0;
    virtual bool supportsLocal() const = 0;
    virtual bool supportsNotif() const = 0;
    virtual nixl_mem_list_t getSupportedMems() const = 0;

    // slots 6-10
    virtual nixl_status_t registerMem(const nixlBlobDesc &mem, const nixl_mem_t &nixl_mem,
                                      nixlBackendMD *&out) = 0;
    virtual nixl_status_t deregisterMem(nixlBackendMD *meta) = 0;
    virtual nixl_status_t connect(const std::string &remote_agent) = 0;
    virtual nixl_status_t disconnect(const std::string &remote_agent) = 0;
    virtual nixl_status_t unloadMD(nixlBackendMD *input) = 0;

    // slots 11-14
    virtual nixl_status_t prepXfer(const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                                   const nixl_meta_dlist_t &remote, const std::string &remote_agent,
                                   nixlBackendReqH *&handle,
                                   const nixlBackendOptionalArgs *opt_args = nullptr) const = 0;
    virtual nixl_status_t postXfer(const nixl_xfer_op_t &operation, const nixl_meta_dlist_t &local,
                                   const nixl_meta_dlist_t &remote, const std::string &remote_agent,
                                   nixlBackendReqH *&handle,
                                   const nixlBackendOptionalArgs *opt_args = nullptr) const = 0;
    virtual nixl_status_t checkXfer(nixlBackendReqH *handle) const = 0;
    virtual nixl_status_t releaseReqH(nixlBackendReqH *handle) const = 0;

    friend struct LayoutCheck;
};

// ---- §3 plugin descriptor (only public data, 56 bytes) ---------------------------------

// The engine pointers are typed as the shared head: every layout's engine starts with it
// at offset 0, and its virtual destructor is slot 0/1 in all of them.
struct nixlBackendPlugin {
    int api_version;
    nixlEngineHead *(*create_engine)(const nixlBackendInitParams *init);
    void (*destroy_engine)(nixlEngineHead *engine);
    const char *(*get_plugin_name)();
    const char *(*get_plugin_version)();
    nixl_b_params_t (*get_backend_options)();
    nixl_mem_list_t (*get_backend_mems)();
};

inline constexpr int kPluginApiVersion = 1;

// ---- layout pins -------------------------------------------------------------------------
// offsetof on classes with vtables or bases is "conditionally supported"; GCC supports it
// and computes the Itanium layout, which is what we want to pin.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"
struct LayoutCheck {
    // §1 standard-library layouts that cross the boundary.
    static_assert(sizeof(void *) == 8, "x86-64 / LP64 only");
    static_assert(sizeof(std::string) == 32);
    static_assert(sizeof(std::vector<int>) == 24);
    static_assert(sizeof(nixl_b_params_t) == 56);
    static_assert(sizeof(std::optional<std::string>) == 40);
    static_assert(sizeof(nixl_query_resp_t) == 64);
    static_assert(sizeof(std::mutex) == 40);
    static_assert(sizeof(std::chrono::microseconds) == 8);

    // §4.1 enums.
    static_assert(sizeof(nixl_mem_t) == 4 && sizeof(nixl_xfer_op_t) == 4);
    static_assert(sizeof(nixl_status_t) == 4 && sizeof(nixl_thread_sync_t) == 4);
    static_assert(sizeof(nixl_cost_t) == 4 && sizeof(nixl_telemetry_event_type_t) == 4);

    // §4.3 descriptors.
    static_assert(sizeof(nixlBasicDesc) == 24);
    static_assert(offsetof(nixlBasicDesc, addr) == 0);
    static_assert(offsetof(nixlBasicDesc, len) == 8);
    static_assert(offsetof(nixlBasicDesc, devId) == 16);
    static_assert(sizeof(nixlBlobDesc) == 56);
    static_assert(offsetof(nixlBlobDesc, metaInfo) == 24);
    static_assert(sizeof(nixlMetaDesc) == 32);
    static_assert(offsetof(nixlMetaDesc, metadataP) == 24);
    static_assert(sizeof(nixlRemoteMetaDesc) == 64);
    static_assert(offsetof(nixlRemoteMetaDesc, remoteAgent) == 32);

    // §4.4 descriptor lists: vptr, type at 8, descs at 16, size 40.
    static_assert(sizeof(nixl_meta_dlist_t) == 40);
    static_assert(offsetof(nixl_meta_dlist_t, type) == 8);
    static_assert(offsetof(nixl_meta_dlist_t, descs) == 16);
    static_assert(sizeof(nixl_reg_dlist_t) == 40);
    static_assert(offsetof(nixl_reg_dlist_t, descs) == 16);
    static_assert(sizeof(nixl_remote_meta_dlist_t) == 40);
    static_assert(offsetof(nixl_remote_meta_dlist_t, descs) == 16);

    // §4.5 backend options.
    static_assert(sizeof(nixlBackendOptionalArgs) == 72);
    static_assert(offsetof(nixlBackendOptionalArgs, notifMsg) == 0);
    static_assert(offsetof(nixlBackendOptionalArgs, hasNotif) == 32);
    static_assert(offsetof(nixlBackendOptionalArgs, customParam) == 40);

    // §4.6 agent options.
    static_assert(sizeof(nixlAgentOptionalArgs) == 208);
    static_assert(offsetof(nixlAgentOptionalArgs, backends) == 0);
    static_assert(offsetof(nixlAgentOptionalArgs, notif) == 24);
    static_assert(offsetof(nixlAgentOptionalArgs, notifMsg) == 64);
    static_assert(offsetof(nixlAgentOptionalArgs, hasNotif) == 96);
    static_assert(offsetof(nixlAgentOptionalArgs, skipDescMerge) == 97);
    static_assert(offsetof(nixlAgentOptionalArgs, includeConnInfo) == 98);
    static_assert(offsetof(nixlAgentOptionalArgs, ipAddr) == 104);
    static_assert(offsetof(nixlAgentOptionalArgs, port) == 136);
    static_assert(offsetof(nixlAgentOptionalArgs, metadataLabel) == 144);
    static_assert(offsetof(nixlAgentOptionalArgs, customParam) == 176);

    // §4.7 bases.
    static_assert(sizeof(nixlBackendMD) == 16);
    static_assert(offsetof(nixlBackendMD, isPrivateMD) == 8);
    static_assert(sizeof(nixlBackendReqH) == 8);

    // §4.8 init params.
    static_assert(sizeof(nixlBackendInitParams) == 96);
    static_assert(offsetof(nixlBackendInitParams, localAgent) == 0);
    static_assert(offsetof(nixlBackendInitParams, type) == 32);
    static_assert(offsetof(nixlBackendInitParams, customParams) == 64);
    static_assert(offsetof(nixlBackendInitParams, enableProgTh) == 72);
    static_assert(offsetof(nixlBackendInitParams, pthrDelay) == 80);
    static_assert(offsetof(nixlBackendInitParams, syncMode) == 88);
    static_assert(offsetof(nixlBackendInitParams, enableTelemetry_) == 92);

    // §4.9 telemetry event.
    static_assert(sizeof(nixlTelemetryEvent) == 16);
    static_assert(offsetof(nixlTelemetryEvent, value) == 8);

    // §5.1 engine base.
    static_assert(sizeof(nixlEngineHead) == 208 && alignof(nixlEngineHead) == 8);
    static_assert(offsetof(nixlEngineHead, backendType) == 8);
    static_assert(offsetof(nixlEngineHead, customParams) == 40);
    static_assert(offsetof(nixlEngineHead, telemetryEvents_) == 96);
    static_assert(offsetof(nixlEngineHead, telemetryEventsMutex_) == 120);
    static_assert(offsetof(nixlEngineHead, initErr) == 160);
    static_assert(offsetof(nixlEngineHead, localAgent) == 168);
    static_assert(offsetof(nixlEngineHead, enableTelemetry_) == 200);

    // §3 plugin descriptor.
    static_assert(sizeof(nixlBackendPlugin) == 56 && alignof(nixlBackendPlugin) == 8);
    static_assert(offsetof(nixlBackendPlugin, api_version) == 0);
    static_assert(offsetof(nixlBackendPlugin, create_engine) == 8);
    static_assert(offsetof(nixlBackendPlugin, destroy_engine) == 16);
    static_assert(offsetof(nixlBackendPlugin, get_plugin_name) == 24);
    static_assert(offsetof(nixlBackendPlugin, get_plugin_version) == 32);
    static_assert(offsetof(nixlBackendPlugin, get_backend_options) == 40);
    static_assert(offsetof(nixlBackendPlugin, get_backend_mems) == 48);
};
#pragma GCC diagnostic pop

} // namespace nf::abi
