/*
 * Drives the STOCK NIXL agent (libnixl_capi.so from the nixl-cu12 1.5.1 wheel) through its
 * C API with our backend, loaded by name from NIXL_PLUGIN_DIR (build/plugins, which holds
 * libplugin_LIBFABRIC.so). No NIXL header is used: the few nixl_capi_* functions needed are
 * declared below from NIXL_PLUGIN_ABI.md §8.
 *
 * Checks, for two agent pairs (progress threads on; progress threads off, where only the
 * agents' own calls progress the engines):
 *   plugin discovery and parameters; a malformed backend parameter fails createBackend while
 *   unknown keys are ignored; DRAM registration; metadata exchange; WRITE with a
 *   notification (the target buffer is compared right after the first success); a repost
 *   with a new message; READ; a multi-descriptor WRITE; a loopback WRITE (remote agent = own
 *   name) with a notification to itself; a standalone notification; release of an in-flight
 *   request; invalidation and teardown.
 * Environment: NIXL_PLUGIN_DIR (required), NIXL_FABRIC_BACKEND (backend name, default
 * LIBFABRIC), plus whatever the engine reads (NIXL_FABRIC_PROVIDER, NIXL_FABRIC_IFACE, ...).
 * Exits 0 when everything passed.
 */
#define _POSIX_C_SOURCE 200809L
#include <dlfcn.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- the stock C API (ABI doc §8) --------------------------------------------------- */

#include "nixl_capi.h"

/* ---- helpers ------------------------------------------------------------------------ */

#define WAIT_S 20.0 /* every wait is bounded; the engine's own timeout is 5 s by default */
#define N (4u << 20)
#define CHUNK (64u << 10)

static const char *g_backend = "LIBFABRIC";
static const char *g_phase = "setup";

static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "agent-capi-test FAIL [%s]: ", g_phase);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

#define CHECK(call)                                                                                      \
    do {                                                                                                 \
        nixl_capi_status_t rc_ = (call);                                                                 \
        if (rc_ != CAPI_SUCCESS)                                                                         \
            fail("%s:%d: %s returned %d", __FILE__, __LINE__, #call, rc_);                               \
    } while (0)

static void step(const char *what) { printf("  ok  %-8s %s\n", g_phase, what), fflush(stdout); }

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void pause_briefly(void) {
    struct timespec ts = {0, 50 * 1000};
    nanosleep(&ts, NULL);
}

static void fill(uint8_t *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; ++i)
        p[i] = (uint8_t)((i * 131u + seed * 7u + (i >> 12)) & 0xff);
}

static void expect_same(const uint8_t *got, const uint8_t *want, size_t n, const char *what) {
    for (size_t i = 0; i < n; ++i)
        if (got[i] != want[i])
            fail("%s: byte %zu is 0x%02x, expected 0x%02x", what, i, got[i], want[i]);
}

static uint8_t *alloc_buf(void) {
    uint8_t *p = aligned_alloc(4096, N);
    if (!p)
        fail("out of memory");
    memset(p, 0, N);
    return p;
}

/* One agent with our backend and an inbox that accumulates its notifications. */
typedef struct {
    const char *name;
    nixl_capi_agent_t agent;
    nixl_capi_backend_t backend;
    nixl_capi_notif_map_t inbox;
} peer_t;

/* Drains the agent's notifications into its inbox (this also progresses its engine). */
static void pump(peer_t *p) { CHECK(nixl_capi_get_notifs(p->agent, p->inbox, NULL)); }

/* How many times (sender, msg) is in the inbox. */
static size_t inbox_count(peer_t *p, const char *sender, const char *msg) {
    size_t senders = 0, found = 0;
    CHECK(nixl_capi_notif_map_size(p->inbox, &senders));
    for (size_t i = 0; i < senders; ++i) {
        const char *name = NULL;
        size_t count = 0;
        CHECK(nixl_capi_notif_map_get_agent_at(p->inbox, i, &name));
        if (strcmp(name, sender) != 0)
            continue;
        CHECK(nixl_capi_notif_map_get_notifs_size(p->inbox, name, &count));
        for (size_t j = 0; j < count; ++j) {
            const void *data = NULL;
            size_t len = 0;
            CHECK(nixl_capi_notif_map_get_notif(p->inbox, name, j, &data, &len));
            if (len == strlen(msg) && memcmp(data, msg, len) == 0)
                ++found;
        }
    }
    return found;
}

/* Waits until `p` has received `msg` from `sender` (exactly once), then empties the inbox.
 * `other` (may be NULL) is pumped as well, for runs without progress threads. */
static void wait_notif(peer_t *p, const char *sender, const char *msg, peer_t *other) {
    const double deadline = now_s() + WAIT_S;
    size_t n;
    while ((n = inbox_count(p, sender, msg)) == 0) {
        if (now_s() > deadline)
            fail("%s: no notification '%s' from %s within %.0f s", p->name, msg, sender, WAIT_S);
        pump(p);
        if (other)
            pump(other);
        pause_briefly();
    }
    if (n != 1)
        fail("%s: notification '%s' from %s arrived %zu times", p->name, msg, sender, n);
    CHECK(nixl_capi_notif_map_clear(p->inbox));
}

/* Polls a posted request until it is done. `other` (may be NULL) is pumped as well: with
 * progress threads off, the target's engine only moves when its agent calls in. */
static void wait_xfer(peer_t *p, nixl_capi_xfer_req_t req, nixl_capi_status_t posted, peer_t *other) {
    const double deadline = now_s() + WAIT_S;
    nixl_capi_status_t s = posted;
    while (s == CAPI_IN_PROG) {
        if (now_s() > deadline)
            fail("%s: transfer still in progress after %.0f s", p->name, WAIT_S);
        if (other)
            pump(other);
        pause_briefly();
        s = nixl_capi_get_xfer_status(p->agent, req);
    }
    if (s != CAPI_SUCCESS)
        fail("%s: transfer failed with %d", p->name, s);
}

static nixl_capi_xfer_dlist_t xfer_list(const uint8_t *base, size_t off, size_t len, size_t count,
                                        size_t stride) {
    nixl_capi_xfer_dlist_t l;
    CHECK(nixl_capi_create_xfer_dlist(CAPI_MEM_DRAM, &l));
    for (size_t i = 0; i < count; ++i)
        CHECK(nixl_capi_xfer_dlist_add_desc(l, (uintptr_t)(base + off + i * stride), len, 0));
    return l;
}

static nixl_capi_opt_args_t opts(peer_t *p, const char *notif) {
    nixl_capi_opt_args_t o;
    CHECK(nixl_capi_create_opt_args(&o));
    CHECK(nixl_capi_opt_args_add_backend(o, p->backend));
    if (notif) {
        CHECK(nixl_capi_opt_args_set_notif_msg(o, notif, strlen(notif)));
        CHECK(nixl_capi_opt_args_set_has_notif(o, true));
    }
    return o;
}

static void release_req(peer_t *p, nixl_capi_xfer_req_t req) {
    CHECK(nixl_capi_release_xfer_req(p->agent, req));
    CHECK(nixl_capi_destroy_xfer_req(req));
}

static bool mem_list_has(nixl_capi_mem_list_t mems, int want) {
    size_t n = 0;
    CHECK(nixl_capi_mem_list_size(mems, &n));
    for (size_t i = 0; i < n; ++i) {
        int t = -1;
        CHECK(nixl_capi_mem_list_get(mems, i, &t));
        if (t == want)
            return true;
    }
    return false;
}

static bool params_have(nixl_capi_params_t params, const char *want) {
    nixl_capi_param_iter_t it;
    bool found = false, more = true;
    CHECK(nixl_capi_params_create_iterator(params, &it));
    while (more) {
        const char *k = NULL, *v = NULL;
        if (nixl_capi_params_iterator_next(it, &k, &v, &more) != CAPI_SUCCESS || !k)
            break;
        if (strcmp(k, want) == 0)
            found = true;
    }
    CHECK(nixl_capi_params_destroy_iterator(it));
    return found;
}

static nixl_capi_params_t params_of(const char *const *kv) {
    nixl_capi_params_t p;
    CHECK(nixl_capi_create_params(&p));
    for (; kv && kv[0]; kv += 2)
        CHECK(nixl_capi_params_add(p, kv[0], kv[1]));
    return p;
}

static void open_peer(peer_t *p, const char *name, bool progress_thread) {
    nixl_capi_agent_config_t cfg = {0};
    cfg.enable_prog_thread = progress_thread;
    cfg.thread_sync = 0;
    p->name = name;
    if (progress_thread)
        CHECK(nixl_capi_create_agent(name, &p->agent));
    else
        CHECK(nixl_capi_create_configured_agent(name, &cfg, &p->agent));
    nixl_capi_params_t params = params_of(NULL);
    CHECK(nixl_capi_create_backend(p->agent, g_backend, params, &p->backend));
    CHECK(nixl_capi_destroy_params(params));
    CHECK(nixl_capi_create_notif_map(&p->inbox));
}

static nixl_capi_reg_dlist_t register_bufs(peer_t *p, uint8_t *const *bufs, size_t count) {
    nixl_capi_reg_dlist_t l;
    CHECK(nixl_capi_create_reg_dlist(CAPI_MEM_DRAM, &l));
    for (size_t i = 0; i < count; ++i)
        CHECK(nixl_capi_reg_dlist_add_desc(l, (uintptr_t)bufs[i], N, 0, NULL, 0));
    CHECK(nixl_capi_register_mem(p->agent, l, NULL));
    return l;
}

/* ---- phases ------------------------------------------------------------------------- */

/* The plugin descriptor as the manager sees it (ABI doc §3), through dlopen: the entry
 * points the agent never calls (name, version) are checked here. */
typedef struct {
    int api_version;
    void *create_engine;
    void *destroy_engine;
    const char *(*get_plugin_name)(void);
    const char *(*get_plugin_version)(void);
    void *get_backend_options; /* C++ by-value returns: not callable from C */
    void *get_backend_mems;
} plugin_desc_t;
_Static_assert(sizeof(plugin_desc_t) == 56, "plugin descriptor is 56 bytes");

static void check_descriptor(void) {
    g_phase = "dlopen";
    char path[4096];
    snprintf(path, sizeof path, "%s/libplugin_%s.so", getenv("NIXL_PLUGIN_DIR"), g_backend);
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h)
        fail("dlopen %s: %s", path, dlerror());
    void *(*init)(void) = NULL;
    void (*fini)(void) = NULL;
    *(void **)&init = dlsym(h, "nixl_plugin_init");
    *(void **)&fini = dlsym(h, "nixl_plugin_fini");
    if (!init || !fini)
        fail("nixl_plugin_init/nixl_plugin_fini not exported");
    if (dlsym(h, "nf_adapter_plugin_init"))
        fail("the adapter's hidden entry point is exported");
    const plugin_desc_t *d = init();
    if (!d || d->api_version != 1)
        fail("descriptor %p with api_version %d", (const void *)d, d ? d->api_version : -1);
    if (init() != d)
        fail("a second nixl_plugin_init returned another descriptor");
    if (!d->create_engine || !d->destroy_engine || !d->get_backend_options || !d->get_backend_mems)
        fail("descriptor has NULL entries");
    const char *name = d->get_plugin_name(), *version = d->get_plugin_version();
    if (!name || strcmp(name, g_backend) != 0)
        fail("get_plugin_name returned '%s', expected the file's name '%s'", name ? name : "(null)", g_backend);
    if (!version || !*version)
        fail("get_plugin_version returned nothing");
    printf("  ok  %-8s descriptor: api 1, name %s, version %s\n", g_phase, name, version);
    fini();
    fini(); /* tolerated more than once */
    dlclose(h);
}

/* Discovery, parameters, and createBackend's handling of backend parameters. */
static void probe_plugin(void) {
    g_phase = "probe";
    nixl_capi_agent_t a;
    CHECK(nixl_capi_create_agent("probe", &a));

    nixl_capi_string_list_t plugins;
    size_t n = 0;
    bool listed = false;
    CHECK(nixl_capi_get_available_plugins(a, &plugins));
    CHECK(nixl_capi_string_list_size(plugins, &n));
    for (size_t i = 0; i < n; ++i) {
        const char *s = NULL;
        CHECK(nixl_capi_string_list_get(plugins, i, &s));
        listed |= strcmp(s, g_backend) == 0;
    }
    CHECK(nixl_capi_destroy_string_list(plugins));
    if (!listed)
        fail("plugin %s not discovered (is NIXL_PLUGIN_DIR=%s right?)", g_backend,
             getenv("NIXL_PLUGIN_DIR") ? getenv("NIXL_PLUGIN_DIR") : "(unset)");
    step("plugin discovered");

    nixl_capi_mem_list_t mems;
    nixl_capi_params_t params;
    CHECK(nixl_capi_get_plugin_params(a, g_backend, &mems, &params));
    if (!mem_list_has(mems, CAPI_MEM_DRAM))
        fail("get_backend_mems does not list DRAM");
    if (!params_have(params, "provider") || !params_have(params, "timeout_ms"))
        fail("get_backend_options lacks the configuration keys");
    CHECK(nixl_capi_destroy_mem_list(mems));
    CHECK(nixl_capi_destroy_params(params));
    step("plugin params: DRAM and config keys");

    static const char *const bad[] = {"timeout_ms", "soon", NULL};
    nixl_capi_params_t p = params_of(bad);
    nixl_capi_backend_t b;
    if (nixl_capi_create_backend(a, g_backend, p, &b) == CAPI_SUCCESS)
        fail("create_backend accepted a malformed value (timeout_ms=soon)");
    CHECK(nixl_capi_destroy_params(p));
    step("malformed backend parameter refused");

    static const char *const foreign[] = {"no_such_key_for_this_test", "1", "num_threads", "4", NULL};
    p = params_of(foreign);
    CHECK(nixl_capi_create_backend(a, g_backend, p, &b));
    CHECK(nixl_capi_destroy_params(p));
    CHECK(nixl_capi_get_backend_params(a, b, &mems, &params));
    if (!mem_list_has(mems, CAPI_MEM_DRAM))
        fail("the engine does not serve DRAM");
    CHECK(nixl_capi_destroy_mem_list(mems));
    CHECK(nixl_capi_destroy_params(params));
    CHECK(nixl_capi_destroy_backend(b));
    step("unknown and foreign keys ignored");

    CHECK(nixl_capi_destroy_agent(a));
    step("probe agent destroyed");
}

/* Two agents; `tag` keeps names unique within the process. */
static void run_pair(const char *tag, bool progress_thread) {
    char iname[64], tname[64];
    snprintf(iname, sizeof iname, "initiator-%s", tag);
    snprintf(tname, sizeof tname, "target-%s", tag);
    g_phase = tag;

    peer_t ini = {0}, tgt = {0};
    open_peer(&ini, iname, progress_thread);
    open_peer(&tgt, tname, progress_thread);
    peer_t *helper = progress_thread ? NULL : &tgt; /* who needs pumping while we wait */
    peer_t *ihelper = progress_thread ? NULL : &ini;
    step(progress_thread ? "agents created (progress threads on)" : "agents created (progress threads off)");

    uint8_t *src = alloc_buf(), *loop = alloc_buf(), *rd = alloc_buf(), *dst = alloc_buf();
    uint8_t *ibufs[] = {src, loop, rd};
    nixl_capi_reg_dlist_t ireg = register_bufs(&ini, ibufs, 3);
    nixl_capi_reg_dlist_t treg = register_bufs(&tgt, &dst, 1);
    step("DRAM registered");

    void *md = NULL;
    size_t md_len = 0;
    char *loaded = NULL;
    CHECK(nixl_capi_get_local_md(tgt.agent, &md, &md_len));
    CHECK(nixl_capi_load_remote_md(ini.agent, md, md_len, &loaded));
    if (strcmp(loaded, tname) != 0)
        fail("load_remote_md named '%s', expected '%s'", loaded, tname);
    free(loaded);
    free(md);
    step("metadata exchanged");

    /* WRITE with the notification given at creation (post passes no options). */
    fill(src, N, 1);
    nixl_capi_xfer_dlist_t l = xfer_list(src, 0, N, 1, 0), r = xfer_list(dst, 0, N, 1, 0);
    nixl_capi_opt_args_t o = opts(&ini, "write-1");
    nixl_capi_xfer_req_t wreq;
    CHECK(nixl_capi_create_xfer_req(ini.agent, CAPI_OP_WRITE, l, r, tname, &wreq, o));
    nixl_capi_status_t s = nixl_capi_post_xfer_req(ini.agent, wreq, NULL);
    if (s < 0)
        fail("post WRITE returned %d", s);
    wait_xfer(&ini, wreq, s, helper);
    expect_same(dst, src, N, "WRITE: target right after success");
    wait_notif(&tgt, iname, "write-1", ihelper);
    step("WRITE 4 MiB + notification");

    /* Repost of the same handle with a new message. */
    fill(src, N, 2);
    nixl_capi_opt_args_t o2 = opts(&ini, "write-2");
    s = nixl_capi_post_xfer_req(ini.agent, wreq, o2);
    if (s < 0)
        fail("repost WRITE returned %d", s);
    wait_xfer(&ini, wreq, s, helper);
    expect_same(dst, src, N, "repost: target right after success");
    wait_notif(&tgt, iname, "write-2", ihelper);
    step("repost with a new message");

    /* READ the target's buffer into a third local buffer. */
    fill(dst, N, 3);
    nixl_capi_xfer_dlist_t rl = xfer_list(rd, 0, N, 1, 0);
    nixl_capi_opt_args_t ob = opts(&ini, NULL);
    nixl_capi_xfer_req_t rreq;
    CHECK(nixl_capi_create_xfer_req(ini.agent, CAPI_OP_READ, rl, r, tname, &rreq, ob));
    s = nixl_capi_post_xfer_req(ini.agent, rreq, NULL);
    if (s < 0)
        fail("post READ returned %d", s);
    wait_xfer(&ini, rreq, s, helper);
    expect_same(rd, dst, N, "READ: local right after success");
    release_req(&ini, rreq);
    CHECK(nixl_capi_destroy_xfer_dlist(rl));
    step("READ 4 MiB");

    /* Several descriptors in one request: every other 64 KiB chunk. */
    fill(src, N, 4);
    memset(dst, 0, N);
    const size_t chunks = N / CHUNK / 2;
    nixl_capi_xfer_dlist_t ml = xfer_list(src, 0, CHUNK, chunks, 2 * CHUNK);
    nixl_capi_xfer_dlist_t mr = xfer_list(dst, CHUNK, CHUNK, chunks, 2 * CHUNK);
    nixl_capi_opt_args_t om = opts(&ini, "multi");
    nixl_capi_xfer_req_t mreq;
    CHECK(nixl_capi_create_xfer_req(ini.agent, CAPI_OP_WRITE, ml, mr, tname, &mreq, om));
    s = nixl_capi_post_xfer_req(ini.agent, mreq, NULL);
    if (s < 0)
        fail("post multi-descriptor WRITE returned %d", s);
    wait_xfer(&ini, mreq, s, helper);
    for (size_t i = 0; i < chunks; ++i) {
        expect_same(dst + CHUNK + i * 2 * CHUNK, src + i * 2 * CHUNK, CHUNK, "multi: chunk");
        static const uint8_t zero[CHUNK];
        expect_same(dst + i * 2 * CHUNK, zero, CHUNK, "multi: untouched chunk");
    }
    wait_notif(&tgt, iname, "multi", ihelper);
    release_req(&ini, mreq);
    CHECK(nixl_capi_destroy_xfer_dlist(ml));
    CHECK(nixl_capi_destroy_xfer_dlist(mr));
    CHECK(nixl_capi_destroy_opt_args(om));
    step("WRITE of 32 descriptors");

    /* Loopback: remote agent = own name, target = our own registration (self MD). */
    fill(src, N, 5);
    nixl_capi_xfer_dlist_t ll = xfer_list(loop, 0, N, 1, 0);
    nixl_capi_opt_args_t ol = opts(&ini, "self-1");
    nixl_capi_xfer_req_t lreq;
    CHECK(nixl_capi_create_xfer_req(ini.agent, CAPI_OP_WRITE, l, ll, iname, &lreq, ol));
    s = nixl_capi_post_xfer_req(ini.agent, lreq, NULL);
    if (s < 0)
        fail("post loopback WRITE returned %d", s);
    wait_xfer(&ini, lreq, s, NULL);
    expect_same(loop, src, N, "loopback: target right after success");
    wait_notif(&ini, iname, "self-1", NULL);
    release_req(&ini, lreq);
    CHECK(nixl_capi_destroy_xfer_dlist(ll));
    CHECK(nixl_capi_destroy_opt_args(ol));
    step("loopback WRITE + notification to self");

    /* Standalone notification. */
    CHECK(nixl_capi_gen_notif(ini.agent, tname, "hello", 5, NULL));
    wait_notif(&tgt, iname, "hello", ihelper);
    step("genNotif");

    /* Release while (probably) in flight: the agent aborts through releaseReqH. A refused
     * abort keeps the request (ERR_REPOST_ACTIVE); the second release must free it. It is a
     * READ into `rd`, so late bytes of a request freed undrained cannot disturb the checks
     * that follow. */
    nixl_capi_xfer_dlist_t al = xfer_list(rd, 0, N, 1, 0);
    nixl_capi_xfer_req_t areq;
    CHECK(nixl_capi_create_xfer_req(ini.agent, CAPI_OP_READ, al, r, tname, &areq, ob));
    s = nixl_capi_post_xfer_req(ini.agent, areq, NULL);
    if (s < 0)
        fail("post READ (to abort) returned %d", s);
    if (nixl_capi_release_xfer_req(ini.agent, areq) != CAPI_SUCCESS) {
        printf("  ..  %-8s first release refused (in flight); releasing again\n", g_phase);
        CHECK(nixl_capi_release_xfer_req(ini.agent, areq));
    }
    CHECK(nixl_capi_destroy_xfer_req(areq));
    CHECK(nixl_capi_destroy_xfer_dlist(al));
    /* The engine still works afterwards. */
    fill(src, N, 6);
    s = nixl_capi_post_xfer_req(ini.agent, wreq, o2);
    if (s < 0)
        fail("WRITE after abort returned %d", s);
    wait_xfer(&ini, wreq, s, helper);
    expect_same(dst, src, N, "after abort: target right after success");
    wait_notif(&tgt, iname, "write-2", ihelper);
    step("release in flight, then WRITE again");

    /* Teardown: the target's memory explicitly; the initiator's is left to agent
     * destruction (deregisterMem, then unloadMD of the self MDs). */
    release_req(&ini, wreq);
    CHECK(nixl_capi_destroy_xfer_dlist(l));
    CHECK(nixl_capi_destroy_xfer_dlist(r));
    CHECK(nixl_capi_destroy_opt_args(o));
    CHECK(nixl_capi_destroy_opt_args(o2));
    CHECK(nixl_capi_destroy_opt_args(ob));
    CHECK(nixl_capi_invalidate_remote_md(ini.agent, tname));
    CHECK(nixl_capi_deregister_mem(tgt.agent, treg, NULL));
    CHECK(nixl_capi_destroy_reg_dlist(treg));
    CHECK(nixl_capi_destroy_reg_dlist(ireg));
    pump(&tgt);
    pump(&ini);
    CHECK(nixl_capi_destroy_notif_map(ini.inbox));
    CHECK(nixl_capi_destroy_notif_map(tgt.inbox));
    CHECK(nixl_capi_destroy_backend(ini.backend));
    CHECK(nixl_capi_destroy_backend(tgt.backend));
    CHECK(nixl_capi_destroy_agent(ini.agent));
    CHECK(nixl_capi_destroy_agent(tgt.agent));
    free(src);
    free(loop);
    free(rd);
    free(dst);
    step("teardown");
}

int main(void) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (getenv("NIXL_FABRIC_BACKEND") && *getenv("NIXL_FABRIC_BACKEND"))
        g_backend = getenv("NIXL_FABRIC_BACKEND");
    if (!getenv("NIXL_PLUGIN_DIR"))
        fail("set NIXL_PLUGIN_DIR to the directory holding libplugin_%s.so", g_backend);
    printf("agent-capi-test: backend %s from %s\n", g_backend, getenv("NIXL_PLUGIN_DIR"));

    check_descriptor();
    probe_plugin();
    run_pair("prog", true);
    run_pair("noprog", false);

    printf("agent-capi-test: all checks passed\n");
    return 0;
}
