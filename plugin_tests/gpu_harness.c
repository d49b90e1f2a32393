/* nixl-fabric GPU harness (make test-gpu): VRAM transfers through the C ABI on a CUDA host.
 *
 * Engines and their progress threads are created before any CUDA context exists; VRAM
 * (cuMemAlloc) is registered afterwards, so every device copy the engines make runs on
 * threads that never had a context unless the engine applies the captured one (the seed
 * bug). CUDA is reached through the driver API loaded with dlopen: nothing CUDA at build
 * time, like the plugin itself.
 *
 *   gpu_harness                 all tests; ends with "N passed, M failed"
 *   gpu_harness target FD       (internal) the target process of the two-process tests
 */
#include "harness.h"

#include <dlfcn.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef unsigned long long CUdeviceptr;

static struct {
    CUresult (*init)(unsigned);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*device_count)(int *);
    CUresult (*primary_retain)(CUcontext *, CUdevice);
    CUresult (*ctx_set)(CUcontext);
    CUresult (*ctx_get)(CUcontext *);
    CUresult (*ctx_create_v2)(CUcontext *, unsigned, CUdevice);
    CUresult (*ctx_create_v4)(CUcontext *, void *, unsigned, CUdevice);
    CUresult (*ctx_pop)(CUcontext *);
    CUresult (*mem_alloc)(CUdeviceptr *, size_t);
    CUresult (*mem_free)(CUdeviceptr);
    CUresult (*htod)(CUdeviceptr, const void *, size_t);
    CUresult (*dtoh)(void *, CUdeviceptr, size_t);
    CUresult (*memset8)(CUdeviceptr, unsigned char, size_t);
    CUresult (*sync)(void);
} cu;

static CUcontext g_primary;

/* The provider under test: GPU_HARNESS_PROVIDER (tcp by default; shm for the FI_HMEM run). */
static const char *gpu_prov(void) {
    const char *p = getenv("GPU_HARNESS_PROVIDER");
    return p && *p ? p : "tcp";
}
static CUdevice g_dev;

#define CU(call)                                                                         \
    do {                                                                                 \
        CUresult r_ = (call);                                                            \
        if (r_ != 0) {                                                                   \
            printf("FAIL cuda: %s returned %d\n", #call, r_);                            \
            exit(3);                                                                     \
        }                                                                                \
    } while (0)

static bool cu_load(void) {
    const char *lib = getenv("NIXL_FABRIC_CUDA_LIB");
    void *h = dlopen(lib ? lib : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h)
        return false;
#define SYM(f, n) *(void **)&cu.f = dlsym(h, n)
    SYM(init, "cuInit");
    SYM(device_get, "cuDeviceGet");
    SYM(device_count, "cuDeviceGetCount");
    SYM(primary_retain, "cuDevicePrimaryCtxRetain");
    SYM(ctx_set, "cuCtxSetCurrent");
    SYM(ctx_get, "cuCtxGetCurrent");
    SYM(ctx_create_v2, "cuCtxCreate_v2");
    SYM(ctx_create_v4, "cuCtxCreate_v4");
    SYM(ctx_pop, "cuCtxPopCurrent_v2");
    SYM(mem_alloc, "cuMemAlloc_v2");
    SYM(mem_free, "cuMemFree_v2");
    SYM(htod, "cuMemcpyHtoD_v2");
    SYM(dtoh, "cuMemcpyDtoH_v2");
    SYM(memset8, "cuMemsetD8_v2");
    SYM(sync, "cuCtxSynchronize");
#undef SYM
    return cu.init && cu.mem_alloc && cu.htod && cu.dtoh && cu.primary_retain;
}

static bool cu_setup(void) {
    int n = 0;
    if (!cu_load() || cu.init(0) != 0 || cu.device_count(&n) != 0 || n < 1)
        return false;
    CU(cu.device_get(&g_dev, 0));
    CU(cu.primary_retain(&g_primary, g_dev));
    CU(cu.ctx_set(g_primary));
    return true;
}

static CUcontext cu_new_context(void) {
    CUcontext c = NULL, popped = NULL;
    if (cu.ctx_create_v4)
        CU(cu.ctx_create_v4(&c, NULL, 0, g_dev));
    else
        CU(cu.ctx_create_v2(&c, 0, g_dev));
    CU(cu.ctx_pop(&popped)); /* leave the thread's current context as it was */
    return c;
}

/* One buffer of either kind, registered with an engine. */
typedef struct {
    bool vram;
    size_t len;
    uint8_t *host;
    CUdeviceptr dptr;
    CUcontext ctx;
    nf_mem *mem;
} buf_t;

static uint64_t buf_addr(const buf_t *b) { return b->vram ? (uint64_t)b->dptr : (uint64_t)(uintptr_t)b->host; }

static bool buf_make(buf_t *b, nf_engine *e, bool vram, size_t len, CUcontext ctx) {
    memset(b, 0, sizeof *b);
    b->vram = vram;
    b->len = len;
    b->ctx = ctx;
    if (vram) {
        CU(cu.ctx_set(ctx));
        CU(cu.mem_alloc(&b->dptr, len));
        CU(cu.memset8(b->dptr, 0, len));
        CU(cu.sync());
    } else {
        b->host = xalloc(len);
    }
    int s = nf_mem_register(e, buf_addr(b), len, vram ? NF_MEM_VRAM : NF_MEM_DRAM, 0, &b->mem);
    return check_st(s, NF_SUCCESS, "register %s of %zu bytes", vram ? "VRAM" : "DRAM", len);
}

static void buf_free(buf_t *b, nf_engine *e) {
    if (b->mem)
        nf_mem_deregister(e, b->mem);
    if (b->vram) {
        CU(cu.ctx_set(b->ctx));
        cu.mem_free(b->dptr);
    } else {
        free(b->host);
    }
    memset(b, 0, sizeof *b);
}

static void buf_fill(buf_t *b, uint64_t seed) {
    if (!b->vram) {
        fill_pattern(b->host, b->len, seed);
        return;
    }
    uint8_t *tmp = xalloc(b->len);
    fill_pattern(tmp, b->len, seed);
    CU(cu.ctx_set(b->ctx));
    CU(cu.htod(b->dptr, tmp, b->len));
    free(tmp);
}

static void buf_zero(buf_t *b) {
    if (!b->vram) {
        memset(b->host, 0, b->len);
        return;
    }
    CU(cu.ctx_set(b->ctx));
    CU(cu.memset8(b->dptr, 0, b->len));
    CU(cu.sync());
}

/* Offset of the first byte differing from the pattern, SIZE_MAX when all match. */
static size_t buf_verify(buf_t *b, uint64_t seed) {
    if (!b->vram)
        return verify_pattern(b->host, b->len, seed);
    uint8_t *tmp = xalloc(b->len);
    CU(cu.ctx_set(b->ctx));
    CU(cu.dtoh(tmp, b->dptr, b->len));
    size_t r = verify_pattern(tmp, b->len, seed);
    free(tmp);
    return r;
}

static nf_rmem *load_target(nf_engine *init, const char *peer, nf_engine *owner, nf_mem *m) {
    nf_blob pd = {0};
    nf_rmem *r = NULL;
    if (nf_mem_public_data(owner, m, &pd) != NF_SUCCESS)
        return NULL;
    int s = nf_rmem_load(init, peer, pd.data, pd.len, &r);
    nf_blob_free(&pd);
    return s == NF_SUCCESS ? r : NULL;
}

static const char *kind(bool v) { return v ? "VRAM" : "DRAM"; }

/* One transfer of `len` bytes between a buffer on `a` and one on `b`, verified. With
 * `iters` > 1 it is repeated and the bandwidth printed. */
static void one(nf_engine *a, nf_engine *b, bool thread, int op, bool lvram, bool rvram, size_t len, int iters,
                CUcontext lctx, CUcontext rctx) {
    buf_t l, r;
    if (!buf_make(&l, a, lvram, len, lctx) || !buf_make(&r, b, rvram, len, rctx))
        return;
    nf_rmem *rm = load_target(a, "b", b, r.mem);
    if (!check(rm != NULL, "load %s descriptor of b", kind(rvram)))
        return;
    uint64_t seed = next_seed();
    buf_t *src = op == NF_OP_WRITE ? &l : &r, *dst = op == NF_OP_WRITE ? &r : &l;
    buf_fill(src, seed);
    nf_xfer_desc ld = {buf_addr(&l), len, l.mem}, rd = {buf_addr(&r), len, rm};
    nf_request *req = NULL;
    int s = nf_request_create(a, op, &ld, &rd, 1, "b", &req);
    if (check_st(s, NF_SUCCESS, "create %s %s->%s %zu B", op == NF_OP_WRITE ? "WRITE" : "READ", kind(lvram), kind(rvram), len)) {
        s = post_wait(a, req, b, NULL, 0, false, thread);
        size_t bad = s == NF_SUCCESS ? buf_verify(dst, seed) : 0;
        check(s == NF_SUCCESS && bad == SIZE_MAX, "%s local %s remote %s %zu B: %s, bytes %s", op == NF_OP_WRITE ? "WRITE" : "READ",
              kind(lvram), kind(rvram), len, st_name(s), bad == SIZE_MAX ? "exact" : "differ");
        if (s == NF_SUCCESS && iters > 1) {
            double t0 = now_s();
            int done = 0;
            for (; done < iters; done++)
                if (post_wait(a, req, b, NULL, 0, false, thread) != NF_SUCCESS)
                    break;
            double dt = now_s() - t0;
            printf("bw %s local %s remote %s %8zu KiB: %.2f GB/s\n", op == NF_OP_WRITE ? "WRITE" : "READ", kind(lvram), kind(rvram),
                   len >> 10, done * (double)len / dt / 1e9);
        }
        nf_request_release(a, req);
    }
    nf_rmem_unload(a, rm);
    buf_free(&l, a);
    buf_free(&r, b);
}

static void pair(nf_engine **a, nf_engine **b, bool thread) {
    hx_mode m = {gpu_prov(), thread};
    int s1 = 0, s2 = 0;
    *a = hx_engine("a", &m, 20000, &s1);
    *b = hx_engine("b", &m, 20000, &s2);
    if (!check(*a && *b, "engines a and b (%s)", thread ? "progress thread" : "no thread"))
        exit(2);
    hx_exchange(*a, "a", *b, "b");
}

static void suite_one_process(bool thread, bool full) {
    snprintf(g_ctx, sizeof g_ctx, "gpu/%s", thread ? "thread" : "poll");
    nf_engine *a, *b;
    pair(&a, &b, thread);
    static const size_t sizes[] = {64 << 10, (1 << 20) + 7, 64 << 20};
    for (int op = 0; op < 2; op++)
        for (int k = 0; k < 4; k++) {
            bool lv = k & 1, rv = k & 2;
            for (size_t i = 0; i < (full ? 3u : 1u); i++)
                one(a, b, thread, op, lv, rv, full ? sizes[i] : (4 << 20), 1, g_primary, g_primary);
        }
    nf_engine_destroy(a);
    nf_engine_destroy(b);
}

static void suite_bandwidth(void) {
    snprintf(g_ctx, sizeof g_ctx, "gpu/bw");
    nf_engine *a, *b;
    pair(&a, &b, true);
    static const size_t sizes[] = {64 << 10, 1 << 20, 16 << 20, 64 << 20};
    for (int op = 0; op < 2; op++)
        for (int k = 0; k < 4; k++)
            for (size_t i = 0; i < 4; i++)
                one(a, b, true, op, k & 1, k & 2, sizes[i], sizes[i] >= (16 << 20) ? 8 : 64, g_primary, g_primary);
    nf_engine_destroy(a);
    nf_engine_destroy(b);
}

/* Buffers of two contexts (the primary and a created one) in one engine, one request. */
static void suite_two_contexts(void) {
    snprintf(g_ctx, sizeof g_ctx, "gpu/two-contexts");
    nf_engine *a, *b;
    pair(&a, &b, true);
    CUcontext c2 = cu_new_context();
    size_t len = (3 << 20) + 11;
    buf_t src[2], dst[2];
    buf_make(&src[0], a, false, len, NULL);
    buf_make(&src[1], a, false, len, NULL);
    buf_make(&dst[0], b, true, len, g_primary);
    buf_make(&dst[1], b, true, len, c2);
    nf_rmem *rm[2] = {load_target(a, "b", b, dst[0].mem), load_target(a, "b", b, dst[1].mem)};
    uint64_t seed[2] = {next_seed(), next_seed()};
    nf_xfer_desc ld[2], rd[2];
    for (int i = 0; i < 2; i++) {
        buf_fill(&src[i], seed[i]);
        ld[i] = (nf_xfer_desc){buf_addr(&src[i]), len, src[i].mem};
        rd[i] = (nf_xfer_desc){buf_addr(&dst[i]), len, rm[i]};
    }
    nf_request *req = NULL;
    int s = nf_request_create(a, NF_OP_WRITE, ld, rd, 2, "b", &req);
    if (check_st(s, NF_SUCCESS, "one request over VRAM of two contexts")) {
        s = post_wait(a, req, b, NULL, 0, false, true);
        check(s == NF_SUCCESS && buf_verify(&dst[0], seed[0]) == SIZE_MAX && buf_verify(&dst[1], seed[1]) == SIZE_MAX,
              "WRITE DRAM -> VRAM(primary) + VRAM(created context): %s", st_name(s));
        nf_request_release(a, req);
    }
    /* And back: READ both device buffers into zeroed host buffers. */
    buf_zero(&src[0]);
    buf_zero(&src[1]);
    s = nf_request_create(a, NF_OP_READ, ld, rd, 2, "b", &req);
    if (check_st(s, NF_SUCCESS, "READ request over two contexts")) {
        s = post_wait(a, req, b, NULL, 0, false, true);
        check(s == NF_SUCCESS && buf_verify(&src[0], seed[0]) == SIZE_MAX && buf_verify(&src[1], seed[1]) == SIZE_MAX,
              "READ VRAM(primary) + VRAM(created context) -> DRAM: %s", st_name(s));
        nf_request_release(a, req);
    }
    /* Loopback across the two contexts in one engine: primary -> created. */
    nf_rmem *self = NULL;
    nf_rmem_self(b, dst[1].mem, &self);
    buf_fill(&dst[0], seed[0] ^ 5);
    nf_xfer_desc l0 = {buf_addr(&dst[0]), len, dst[0].mem}, r1 = {buf_addr(&dst[1]), len, self};
    s = nf_request_create(b, NF_OP_WRITE, &l0, &r1, 1, "b", &req);
    if (check_st(s, NF_SUCCESS, "loopback request between contexts")) {
        s = post_wait(b, req, NULL, NULL, 0, false, true);
        check(s == NF_SUCCESS && buf_verify(&dst[1], seed[0] ^ 5) == SIZE_MAX, "loopback VRAM(primary) -> VRAM(created): %s", st_name(s));
        nf_request_release(b, req);
    }
    nf_rmem_unload(b, self);
    for (int i = 0; i < 2; i++) {
        nf_rmem_unload(a, rm[i]);
        buf_free(&src[i], a);
        buf_free(&dst[i], b);
    }
    nf_engine_destroy(a);
    nf_engine_destroy(b);
}

/* Cost of one progress pass with a captured context to re-apply, against none. */
static void suite_reapply_cost(void) {
    snprintf(g_ctx, sizeof g_ctx, "gpu/reapply");
    hx_mode m = {gpu_prov(), false};
    int s = 0;
    nf_engine *e = hx_engine("cost", &m, 0, &s);
    if (!check(e != NULL, "engine without progress thread"))
        return;
    const int N = 200000;
    double t0 = now_s();
    for (int i = 0; i < N; i++)
        nf_engine_progress(e);
    double bare = (now_s() - t0) / N * 1e9;
    buf_t v;
    buf_make(&v, e, true, 1 << 20, g_primary);
    nf_counters c0, c1;
    nf_engine_counters(e, &c0);
    t0 = now_s();
    for (int i = 0; i < N; i++)
        nf_engine_progress(e);
    double with = (now_s() - t0) / N * 1e9;
    nf_engine_counters(e, &c1);
    check(c1.cuda_ctx_applies - c0.cuda_ctx_applies >= (uint64_t)N, "every pass re-applied the context (%" PRIu64 " applies in %d passes)",
          c1.cuda_ctx_applies - c0.cuda_ctx_applies, N);
    printf("reapply: pass without VRAM %.1f ns, with VRAM %.1f ns, re-apply cost %.1f ns per pass\n", bare, with, with - bare);
    buf_free(&v, e);
    nf_engine_destroy(e);
}

/* ---- two processes ---------------------------------------------------------------------- */

/* Target: VRAM registered, its descriptor and conn info sent to the parent; then it
 * answers "check SEED" messages by verifying its VRAM, until "quit". */
static int target_process(int fd) {
    g_quiet = true;
    hx_mode m = {gpu_prov(), true};
    int s = 0;
    nf_engine *e = hx_engine("t", &m, 20000, &s);
    if (!e || !cu_setup())
        return 2;
    size_t len = (8 << 20) + 3;
    buf_t v;
    if (!buf_make(&v, e, true, len, g_primary))
        return 2;
    nf_blob ci = {0}, pd = {0};
    nf_engine_conn_info(e, &ci);
    nf_mem_public_data(e, v.mem, &pd);
    uint64_t addr = buf_addr(&v);
    msg_send(fd, ci.data, ci.len);
    msg_send(fd, pd.data, pd.len);
    msg_send(fd, &addr, sizeof addr);
    size_t n = 0;
    uint8_t *peer = msg_recv(fd, &n, 60);
    if (!peer || nf_engine_load_conn_info(e, "p", peer, n) != NF_SUCCESS)
        return 2;
    free(peer);
    for (;;) {
        uint8_t *cmd = msg_recv(fd, &n, 120);
        if (!cmd || strcmp((char *)cmd, "quit") == 0)
            break;
        uint64_t seed = strtoull((char *)cmd + 6, NULL, 10);
        char ok = buf_verify(&v, seed) == SIZE_MAX ? 'y' : 'n';
        msg_send(fd, &ok, 1);
        free(cmd);
    }
    buf_free(&v, e);
    nf_blob_free(&ci);
    nf_blob_free(&pd);
    nf_engine_destroy(e);
    return 0;
}

/* The parent WRITEs its VRAM (or DRAM) into the target's VRAM and READs it back. With
 * `skip_reapply` the target runs with the debug switch that disables the per-pass
 * context re-apply: the target-side staged copy must then fail with a CUDA context error. */
static void suite_two_processes(bool skip_reapply, bool local_vram) {
    snprintf(g_ctx, sizeof g_ctx, "gpu/2proc%s", skip_reapply ? "/reapply-off" : "");
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        return;
    char fdarg[16], logpath[64];
    snprintf(fdarg, sizeof fdarg, "%d", sv[1]);
    snprintf(logpath, sizeof logpath, "/tmp/nf-gpu-target-%d.log", (int)getpid());
    char *argv[] = {"gpu_harness", "target", fdarg, logpath, NULL};
    if (skip_reapply)
        setenv("NIXL_FABRIC_DEBUG_SKIP_CTX_APPLY", "1", 1);
    int pid = spawn_self(argv, sv[1]);
    unsetenv("NIXL_FABRIC_DEBUG_SKIP_CTX_APPLY");
    close(sv[1]);
    hx_mode m = {gpu_prov(), true};
    int s = 0;
    nf_engine *e = hx_engine("p", &m, 20000, &s);
    size_t n1 = 0, n2 = 0, n3 = 0;
    uint8_t *ci = msg_recv(sv[0], &n1, 60), *pd = msg_recv(sv[0], &n2, 60), *ap = msg_recv(sv[0], &n3, 60);
    if (!check(e && ci && pd && ap && n3 == 8, "target process ready")) {
        wait_child(pid, 10);
        return;
    }
    uint64_t raddr;
    memcpy(&raddr, ap, 8);
    nf_blob mine = {0};
    nf_engine_conn_info(e, &mine);
    msg_send(sv[0], mine.data, mine.len);
    nf_blob_free(&mine);
    nf_engine_load_conn_info(e, "t", ci, n1);
    nf_rmem *rm = NULL;
    check_st(nf_rmem_load(e, "t", pd, n2, &rm), NF_SUCCESS, "load the target's VRAM descriptor");
    size_t len = (8 << 20) + 3;
    buf_t l;
    buf_make(&l, e, local_vram, len, g_primary);
    uint64_t seed = next_seed();
    buf_fill(&l, seed);
    nf_xfer_desc ld = {buf_addr(&l), len, l.mem}, rd = {raddr, len, rm};
    nf_request *req = NULL;
    nf_request_create(e, NF_OP_WRITE, &ld, &rd, 1, "t", &req);
    s = post_wait(e, req, NULL, NULL, 0, false, true);
    nf_request_release(e, req);
    if (skip_reapply) {
        check(s != NF_SUCCESS && s != HX_TIMEOUT, "with the re-apply switched off the target's staged copy fails: %s", st_name(s));
    } else {
        char cmd[64];
        snprintf(cmd, sizeof cmd, "check %" PRIu64, seed);
        msg_send(sv[0], cmd, strlen(cmd) + 1);
        size_t n = 0;
        uint8_t *ok = msg_recv(sv[0], &n, 60);
        check(s == NF_SUCCESS && ok && ok[0] == 'y', "WRITE %s -> remote VRAM in another process: %s, target verified %s", kind(local_vram),
              st_name(s), ok && ok[0] == 'y' ? "yes" : "no");
        free(ok);
        buf_zero(&l);
        nf_request_create(e, NF_OP_READ, &ld, &rd, 1, "t", &req);
        s = post_wait(e, req, NULL, NULL, 0, false, true);
        check(s == NF_SUCCESS && buf_verify(&l, seed) == SIZE_MAX, "READ remote VRAM -> %s: %s", kind(local_vram), st_name(s));
        nf_request_release(e, req);
    }
    msg_send(sv[0], "quit", 5);
    int ws = wait_child(pid, 30);
    check(ws >= 0 && WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "target process exited 0");
    if (skip_reapply) {
        /* The target's log must name the CUDA context error, proving the test hit the bug. */
        FILE *f = fopen(logpath, "r");
        bool seen = false;
        char line[1024];
        while (f && fgets(line, sizeof line, f))
            if (strstr(line, "INVALID_CONTEXT"))
                seen = true;
        if (f)
            fclose(f);
        check(seen, "target log names CUDA_ERROR_INVALID_CONTEXT");
    }
    unlink(logpath);
    nf_rmem_unload(e, rm);
    buf_free(&l, e);
    nf_engine_destroy(e);
    free(ci);
    free(pd);
    free(ap);
    close(sv[0]);
}

/* A host without a CUDA driver: DRAM is served, VRAM is refused with NOT_SUPPORTED. */
static void no_cuda_host(void) {
    snprintf(g_ctx, sizeof g_ctx, "no-cuda");
    nf_engine *a, *b;
    pair(&a, &b, true);
    check(nf_engine_supported_mems(a) == 1u << NF_MEM_DRAM, "supported memory types are DRAM only (mask %#x)", nf_engine_supported_mems(a));
    static uint8_t page[4096] __attribute__((aligned(4096)));
    nf_mem *m = NULL;
    int s = nf_mem_register(a, (uint64_t)(uintptr_t)page, sizeof page, NF_MEM_VRAM, 0, &m);
    check_st(s, NF_ERR_NOT_SUPPORTED, "VRAM registration without a CUDA driver");
    one(a, b, true, NF_OP_WRITE, false, false, 1 << 20, 1, NULL, NULL);
    one(a, b, true, NF_OP_READ, false, false, 1 << 20, 1, NULL, NULL);
    nf_engine_destroy(a);
    nf_engine_destroy(b);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc >= 4 && strcmp(argv[1], "target") == 0) {
        /* The target's log goes to a file the parent reads. */
        if (!freopen(argv[3], "w", stderr))
            return 2;
        setenv("NIXL_FABRIC_LOG", "error", 1);
        return target_process(atoi(argv[2]));
    }
    if (!cu_load()) {
        no_cuda_host();
        printf("%d passed, %d failed\n", g_pass, g_fail);
        return g_fail ? 1 : 0;
    }
    /* Two-process tests first, before this process initialises CUDA (the child execs a
     * fresh image anyway). */
    suite_two_processes(false, false);
    /* CUDA comes up in this thread only; every engine thread starts without a context. */
    if (!cu_setup()) {
        printf("SKIP gpu: no CUDA driver or device\n");
        printf("0 passed, 0 failed, 1 skipped\n");
        return 0;
    }
    suite_two_processes(false, true);
    /* The seed-bug regression concerns the staged path; with FI_HMEM the provider copies. */
    const char *skip_reg = getenv("GPU_HARNESS_SKIP_REGRESSION");
    if (!skip_reg || !*skip_reg)
        suite_two_processes(true, false);
    suite_one_process(true, true);
    suite_one_process(false, false);
    suite_two_contexts();
    suite_reapply_cost();
    if (!getenv("GPU_HARNESS_NO_BW"))
        suite_bandwidth();
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}
