/*
 * The TensorRT-LLM transfer-agent flow (NixlTransferAgent, disaggregated serving) through the
 * STOCK NIXL agent's C API (libnixl_capi.so from the nixl-cu12 1.5.1 wheel), two processes,
 * our backend loaded by name (default LIBFABRIC) from NIXL_PLUGIN_DIR.
 *
 *   trtllm_flow                  generation side; forks and execs itself as the context side
 *   trtllm_flow --role ctx ...   context side (started by the generation side)
 *
 * Both sides, as TRT-LLM's NixlTransferAgent does:
 *   - an agent with the progress thread and the metadata listener thread, thread sync STRICT
 *     (the stock listener binds its port on all interfaces, 0.0.0.0; peers are reached at
 *     127.0.0.1 only);
 *   - get_plugin_params(backend), then create_backend with those defaults plus num_workers=4
 *     (a key TRT-LLM passes to every backend: it must be accepted);
 *   - a DRAM KV pool registered (128 blocks x 32 KiB).
 * Metadata goes through the listener threads, no side channel: the context side calls
 * fetch_remote_md (ip 127.0.0.1, the generation side's port) and send_local_md to the same
 * address, as TRT-LLM's loadRemoteAgent(name, ip:port) does, then polls check_remote_md; the
 * generation side polls check_remote_md for the context side. (Only the generation side's
 * pool address and port travel on the command line: in TRT-LLM they are part of the request
 * info its own communicator carries.)
 * The context side writes a scattered set of its blocks into scattered blocks of the
 * generation side's pool with two WRITE requests (create_xfer_req with a notification each),
 * polls get_xfer_status, releases them. The generation side polls get_notifs, checks every
 * byte of every written block and that no other block changed, and tells the context side it
 * is done (gen_notif: TRT-LLM's sync message back). Both then invalidate_remote_md and tear
 * down. Every wait is bounded (WAIT_S). Exit status 0 when everything passed.
 *
 * Environment: NIXL_PLUGIN_DIR (required), NIXL_FABRIC_BACKEND (backend name, default
 * LIBFABRIC), plus what the engine reads (NIXL_FABRIC_PROVIDER, NIXL_FABRIC_IFACE, ...).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---- the stock C API (ABI doc §8) --------------------------------------------------- */

#include "nixl_capi.h"

/* ---- helpers ------------------------------------------------------------------------ */

#define WAIT_S 20.0 /* bound of every wait; the engine's own timeout is 5 s by default */
#define NBLOCKS 128u
#define BLOCK (32u << 10)
#define POOL (NBLOCKS * BLOCK)
#define NREQ 2u           /* WRITE requests from the context side */
#define BLOCKS_PER_REQ 24u /* blocks per request, scattered on both sides */

static const char *g_backend = "LIBFABRIC";
static const char *g_role = "gen";

static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "trtllm_flow [%s] FAIL: ", g_role);
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

static void step(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("  ok  [%s] ", g_role);
    vprintf(fmt, ap);
    putchar('\n');
    fflush(stdout);
    va_end(ap);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void nap(void) {
    struct timespec ts = {0, 200 * 1000};
    nanosleep(&ts, NULL);
}

/* Content of the context side's block b. */
static uint8_t pattern(unsigned b, size_t i) { return (uint8_t)((i * 131u + b * 29u + (i >> 9) + 1u) & 0xff); }

/* Which blocks request r moves: context block src -> generation block dst (both scattered,
 * disjoint across requests: multiplication by a unit modulo NBLOCKS is a permutation). */
static unsigned src_block(unsigned r, unsigned k) { return ((r * BLOCKS_PER_REQ + k) * 37u + 5u) % NBLOCKS; }
static unsigned dst_block(unsigned r, unsigned k) { return ((r * BLOCKS_PER_REQ + k) * 91u + 17u) % NBLOCKS; }

static int free_port(void) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    if (s < 0 || bind(s, (struct sockaddr *)&a, sizeof a) != 0 || getsockname(s, (struct sockaddr *)&a, &len) != 0)
        fail("no free port: %s", strerror(errno));
    close(s);
    return ntohs(a.sin_port);
}

typedef struct {
    char name[96];
    int port;
    nixl_capi_agent_t agent;
    nixl_capi_backend_t backend;
    nixl_capi_notif_map_t inbox;
    uint8_t *pool;
    nixl_capi_reg_dlist_t reg;
} side_t;

/* Agent with progress and listener threads; backend from the plugin's defaults plus
 * num_workers=4; the KV pool registered. */
static void open_side(side_t *s) {
    nixl_capi_agent_config_t cfg = {0};
    cfg.enable_prog_thread = true;
    cfg.enable_listen_thread = true;
    cfg.listen_port = s->port;
    cfg.thread_sync = CAPI_SYNC_STRICT;
    cfg.lthr_delay_us = 10000;
    CHECK(nixl_capi_create_configured_agent(s->name, &cfg, &s->agent));

    nixl_capi_mem_list_t mems;
    nixl_capi_params_t defaults, params;
    CHECK(nixl_capi_get_plugin_params(s->agent, g_backend, &mems, &defaults));
    CHECK(nixl_capi_destroy_mem_list(mems));
    CHECK(nixl_capi_create_params(&params));
    nixl_capi_param_iter_t it;
    bool more = true;
    size_t copied = 0;
    char shown[160] = "";
    CHECK(nixl_capi_params_create_iterator(defaults, &it));
    while (more) {
        const char *k = NULL, *v = NULL;
        if (nixl_capi_params_iterator_next(it, &k, &v, &more) != CAPI_SUCCESS || !k)
            break;
        CHECK(nixl_capi_params_add(params, k, v));
        ++copied;
        if (strcmp(k, "provider") == 0 || strcmp(k, "iface") == 0) /* where the traffic goes */
            snprintf(shown + strlen(shown), sizeof shown - strlen(shown), "%s%s='%s'", *shown ? " " : "", k, v);
    }
    CHECK(nixl_capi_params_destroy_iterator(it));
    CHECK(nixl_capi_destroy_params(defaults));
    if (copied == 0)
        fail("get_plugin_params(%s) returned no parameters", g_backend);
    CHECK(nixl_capi_params_add(params, "num_workers", "4"));
    if (nixl_capi_create_backend(s->agent, g_backend, params, &s->backend) != CAPI_SUCCESS)
        fail("create_backend(%s) with its %zu plugin defaults + num_workers=4 failed", g_backend, copied);
    CHECK(nixl_capi_destroy_params(params));
    CHECK(nixl_capi_create_notif_map(&s->inbox));

    s->pool = aligned_alloc(4096, POOL);
    if (!s->pool)
        fail("out of memory");
    memset(s->pool, 0, POOL);
    CHECK(nixl_capi_create_reg_dlist(CAPI_MEM_DRAM, &s->reg));
    CHECK(nixl_capi_reg_dlist_add_desc(s->reg, (uintptr_t)s->pool, POOL, 0, NULL, 0));
    CHECK(nixl_capi_register_mem(s->agent, s->reg, NULL));
    step("agent %s: listener on port %d, %s backend from %zu plugin defaults (%s) + num_workers=4, "
         "%u x %u KiB pool registered", s->name, s->port, g_backend, copied, shown, NBLOCKS, BLOCK >> 10);
}

static void close_side(side_t *s, const char *peer) {
    CHECK(nixl_capi_invalidate_remote_md(s->agent, peer));
    CHECK(nixl_capi_deregister_mem(s->agent, s->reg, NULL));
    CHECK(nixl_capi_destroy_reg_dlist(s->reg));
    CHECK(nixl_capi_destroy_notif_map(s->inbox));
    CHECK(nixl_capi_destroy_backend(s->backend));
    CHECK(nixl_capi_destroy_agent(s->agent));
    free(s->pool);
    step("invalidated %s, torn down", peer);
}

static void wait_remote_md(side_t *s, const char *peer) {
    const double deadline = now_s() + WAIT_S;
    while (nixl_capi_check_remote_md(s->agent, peer, NULL) != CAPI_SUCCESS) {
        if (now_s() > deadline)
            fail("metadata of %s did not arrive through the listener within %.0f s", peer, WAIT_S);
        nap();
    }
}

/* Count of (sender, msg) in the inbox. */
static size_t inbox_count(side_t *s, const char *sender, const char *msg) {
    size_t senders = 0, found = 0;
    CHECK(nixl_capi_notif_map_size(s->inbox, &senders));
    for (size_t i = 0; i < senders; ++i) {
        const char *name = NULL;
        size_t count = 0;
        CHECK(nixl_capi_notif_map_get_agent_at(s->inbox, i, &name));
        CHECK(nixl_capi_notif_map_get_notifs_size(s->inbox, name, &count));
        for (size_t j = 0; j < count; ++j) {
            const void *data = NULL;
            size_t len = 0;
            CHECK(nixl_capi_notif_map_get_notif(s->inbox, name, j, &data, &len));
            if (strcmp(name, sender) == 0 && len == strlen(msg) && memcmp(data, msg, len) == 0)
                ++found;
            else if (strcmp(name, sender) != 0)
                fail("notification from unexpected agent '%s'", name);
        }
    }
    return found;
}

static void wait_notif(side_t *s, const char *sender, const char *msg) {
    const double deadline = now_s() + WAIT_S;
    size_t n;
    while ((n = inbox_count(s, sender, msg)) == 0) {
        if (now_s() > deadline)
            fail("no notification '%s' from %s within %.0f s", msg, sender, WAIT_S);
        CHECK(nixl_capi_get_notifs(s->agent, s->inbox, NULL)); /* appends */
        nap();
    }
    if (n != 1)
        fail("notification '%s' from %s arrived %zu times", msg, sender, n);
}

/* ---- context side: writes its KV blocks into the generation side's pool ---------------- */

static int run_ctx(const char *name, const char *gen, int gen_port, uintptr_t gen_pool) {
    side_t s = {0};
    snprintf(s.name, sizeof s.name, "%s", name);
    s.port = free_port();
    open_side(&s);
    for (unsigned b = 0; b < NBLOCKS; ++b)
        for (size_t i = 0; i < BLOCK; ++i)
            s.pool[(size_t)b * BLOCK + i] = pattern(b, i);

    /* TRT-LLM's loadRemoteAgent(name, ip:port): fetch theirs, send ours, poll. */
    nixl_capi_opt_args_t addr;
    CHECK(nixl_capi_create_opt_args(&addr));
    CHECK(nixl_capi_opt_args_set_ip_addr(addr, "127.0.0.1"));
    CHECK(nixl_capi_opt_args_set_port(addr, (uint16_t)gen_port));
    CHECK(nixl_capi_fetch_remote_md(s.agent, gen, addr));
    CHECK(nixl_capi_send_local_md(s.agent, addr));
    CHECK(nixl_capi_destroy_opt_args(addr));
    wait_remote_md(&s, gen);
    step("metadata of %s fetched through its listener at 127.0.0.1:%d (and ours sent there)", gen, gen_port);

    nixl_capi_xfer_dlist_t src[NREQ], dst[NREQ];
    nixl_capi_opt_args_t opt[NREQ];
    nixl_capi_xfer_req_t req[NREQ];
    nixl_capi_status_t st[NREQ];
    const double t0 = now_s();
    for (unsigned r = 0; r < NREQ; ++r) {
        CHECK(nixl_capi_create_xfer_dlist(CAPI_MEM_DRAM, &src[r]));
        CHECK(nixl_capi_create_xfer_dlist(CAPI_MEM_DRAM, &dst[r]));
        for (unsigned k = 0; k < BLOCKS_PER_REQ; ++k) {
            CHECK(nixl_capi_xfer_dlist_add_desc(src[r], (uintptr_t)(s.pool + (size_t)src_block(r, k) * BLOCK), BLOCK, 0));
            CHECK(nixl_capi_xfer_dlist_add_desc(dst[r], gen_pool + (uintptr_t)dst_block(r, k) * BLOCK, BLOCK, 0));
        }
        char msg[32];
        snprintf(msg, sizeof msg, "kv-ready:%u", r);
        CHECK(nixl_capi_create_opt_args(&opt[r]));
        CHECK(nixl_capi_opt_args_add_backend(opt[r], s.backend));
        CHECK(nixl_capi_opt_args_set_notif_msg(opt[r], msg, strlen(msg)));
        CHECK(nixl_capi_opt_args_set_has_notif(opt[r], true));
        CHECK(nixl_capi_create_xfer_req(s.agent, CAPI_OP_WRITE, src[r], dst[r], gen, &req[r], opt[r]));
        st[r] = nixl_capi_post_xfer_req(s.agent, req[r], NULL);
        if (st[r] < 0)
            fail("post of WRITE request %u returned %d", r, st[r]);
    }
    const double deadline = now_s() + WAIT_S;
    for (bool busy = true; busy;) {
        busy = false;
        for (unsigned r = 0; r < NREQ; ++r) {
            if (st[r] == CAPI_IN_PROG)
                st[r] = nixl_capi_get_xfer_status(s.agent, req[r]);
            if (st[r] < 0)
                fail("WRITE request %u failed with %d", r, st[r]);
            busy |= st[r] == CAPI_IN_PROG;
        }
        if (busy && now_s() > deadline)
            fail("WRITE requests still in progress after %.0f s", WAIT_S);
        if (busy)
            nap();
    }
    const double dt = now_s() - t0;
    for (unsigned r = 0; r < NREQ; ++r) {
        CHECK(nixl_capi_release_xfer_req(s.agent, req[r]));
        CHECK(nixl_capi_destroy_xfer_req(req[r]));
        CHECK(nixl_capi_destroy_xfer_dlist(src[r]));
        CHECK(nixl_capi_destroy_xfer_dlist(dst[r]));
        CHECK(nixl_capi_destroy_opt_args(opt[r]));
    }
    step("%u WRITE requests (%u scattered blocks of %u KiB each, notification attached) done in "
         "%.1f ms (first transfer: connects), released", NREQ, BLOCKS_PER_REQ, BLOCK >> 10, dt * 1e3);

    wait_notif(&s, gen, "gen-done");
    step("generation side confirmed the bytes");
    close_side(&s, gen);
    return 0;
}

/* ---- generation side: receives the KV blocks -------------------------------------------- */

static int run_gen(const char *self_exe) {
    side_t s = {0};
    char ctx[96];
    snprintf(s.name, sizeof s.name, "trtllm-gen-%d", (int)getpid());
    snprintf(ctx, sizeof ctx, "trtllm-ctx-%d", (int)getpid());
    s.port = free_port();
    open_side(&s);

    char port_s[16], pool_s[32];
    snprintf(port_s, sizeof port_s, "%d", s.port);
    snprintf(pool_s, sizeof pool_s, "%#lx", (unsigned long)(uintptr_t)s.pool);
    fflush(NULL);
    pid_t child = fork();
    if (child < 0)
        fail("fork: %s", strerror(errno));
    if (child == 0) {
        execl(self_exe, self_exe, "--role", "ctx", ctx, s.name, port_s, pool_s, (char *)NULL);
        fprintf(stderr, "exec %s: %s\n", self_exe, strerror(errno));
        _exit(127); /* the forked copy must not run the parent's teardown */
    }

    wait_remote_md(&s, ctx);
    step("metadata of %s arrived through our listener", ctx);

    for (unsigned r = 0; r < NREQ; ++r) {
        char msg[32];
        snprintf(msg, sizeof msg, "kv-ready:%u", r);
        wait_notif(&s, ctx, msg);
    }
    step("%u notifications from %s", NREQ, ctx);

    /* Every byte of every written block; every other block still zero. */
    bool written[NBLOCKS] = {false};
    for (unsigned r = 0; r < NREQ; ++r)
        for (unsigned k = 0; k < BLOCKS_PER_REQ; ++k) {
            const unsigned sb = src_block(r, k), db = dst_block(r, k);
            if (written[db])
                fail("test bug: block %u written twice", db);
            written[db] = true;
            const uint8_t *p = s.pool + (size_t)db * BLOCK;
            for (size_t i = 0; i < BLOCK; ++i)
                if (p[i] != pattern(sb, i))
                    fail("block %u (from context block %u), byte %zu: 0x%02x, expected 0x%02x", db, sb, i, p[i],
                         pattern(sb, i));
        }
    for (unsigned b = 0; b < NBLOCKS; ++b)
        for (size_t i = 0; !written[b] && i < BLOCK; ++i)
            if (s.pool[(size_t)b * BLOCK + i] != 0)
                fail("block %u was not written but byte %zu is 0x%02x", b, i, s.pool[(size_t)b * BLOCK + i]);
    step("%u blocks verified byte by byte (%u KiB), the other %u blocks untouched", NREQ * BLOCKS_PER_REQ,
         NREQ * BLOCKS_PER_REQ * (BLOCK >> 10), NBLOCKS - NREQ * BLOCKS_PER_REQ);

    CHECK(nixl_capi_gen_notif(s.agent, ctx, "gen-done", 8, NULL));

    int status = 0;
    const double deadline = now_s() + WAIT_S;
    pid_t w;
    while ((w = waitpid(child, &status, WNOHANG)) == 0) {
        if (now_s() > deadline) {
            kill(child, SIGKILL);
            waitpid(child, &status, 0);
            fail("context side did not exit within %.0f s (killed)", WAIT_S);
        }
        nap();
    }
    if (w < 0)
        fail("waitpid: %s", strerror(errno));
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        fail("context side ended with %s %d", WIFEXITED(status) ? "status" : "signal",
             WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
    step("context side exited 0");
    close_side(&s, ctx);
    printf("trtllm_flow: ok (%s): context WRITE %u x %u blocks of %u KiB into generation, metadata "
           "through the listener threads, %u notifications + 1 back, every byte verified\n",
           g_backend, NREQ, BLOCKS_PER_REQ, BLOCK >> 10, NREQ);
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    /* Loopback only (defaults; what the caller set wins). The backend is created from the
     * plugin's reported defaults, as TRT-LLM does, so libfabric's own interface filters are
     * what pins the tcp and sockets providers to lo. */
    setenv("FI_TCP_IFACE", "lo", 0);
    setenv("FI_SOCKETS_IFACE", "lo", 0);
    setenv("NIXL_FABRIC_IFACE", "lo", 0);
    setenv("NIXL_FABRIC_PROVIDER", "tcp", 0);
    if (getenv("NIXL_FABRIC_BACKEND") && *getenv("NIXL_FABRIC_BACKEND"))
        g_backend = getenv("NIXL_FABRIC_BACKEND");
    if (argc == 7 && strcmp(argv[1], "--role") == 0 && strcmp(argv[2], "ctx") == 0) {
        g_role = "ctx";
        return run_ctx(argv[3], argv[4], atoi(argv[5]), (uintptr_t)strtoull(argv[6], NULL, 0));
    }
    if (argc != 1) {
        fprintf(stderr, "usage: %s   (runs the generation side, which starts the context side)\n", argv[0]);
        return 2;
    }
    if (!getenv("NIXL_PLUGIN_DIR") && strcmp(g_backend, "UCX") != 0)
        fail("set NIXL_PLUGIN_DIR to the directory holding libplugin_%s.so", g_backend);
    printf("trtllm_flow: backend %s from %s\n", g_backend,
           getenv("NIXL_PLUGIN_DIR") ? getenv("NIXL_PLUGIN_DIR") : "(the wheel's plugins)");
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0)
        fail("readlink /proc/self/exe: %s", strerror(errno));
    self[n] = '\0';
    return run_gen(self);
}
