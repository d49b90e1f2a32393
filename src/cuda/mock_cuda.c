/* A stand-in libcuda for the unit tests of src/cuda (built by the tests with the system C
 * compiler, loaded through NIXL_FABRIC_CUDA_LIB). "Device" memory is host memory that the
 * mock tracks; contexts are per-thread stacks. It is deliberately stricter than the real
 * driver: calls that need a context fail with CUDA_ERROR_INVALID_CONTEXT when none is
 * current, and stream/event calls fail when the current context is not their own. Events
 * report NOT_READY once after each record, to exercise polling.
 *
 * Device memory (cuMemAlloc) lives in a memfd mapped MAP_SHARED, so that the IPC calls can
 * share it between processes the way the real driver shares VRAM: an IPC handle names the
 * owner's pid and memfd, and cuIpcOpenMemHandle maps /proc/<pid>/fd/<fd> (same user only,
 * like the real thing). The IPC and batch calls are as strict as the driver documents:
 * no opening in the exporting process, no opening one allocation twice in a process (so
 * the engine must cache its mappings), no batch copy on the legacy NULL stream.
 * Written from the public driver API reference; not part of the plugin. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct mctx { int magic; int dev; } *CUcontext;
typedef struct mstream { CUcontext ctx; } *CUstream;
typedef struct mevent { CUcontext ctx; int pending; } *CUevent;

typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char bytes[16]; } CUuuid;
typedef struct {
    int srcAccessOrder; /* CUmemcpySrcAccessOrder: 0 is INVALID, 1..3 the real orders */
    struct { int type; int id; } srcLocHint, dstLocHint;
    unsigned flags;
} CUmemcpyAttributes;
_Static_assert(sizeof(CUipcMemHandle) == 64, "CU_IPC_HANDLE_SIZE is 64");
_Static_assert(sizeof(CUmemcpyAttributes) == 24, "CUmemcpyAttributes is 24 bytes");

enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, NO_DEVICE = 100,
       INVALID_DEVICE = 101, INVALID_CONTEXT = 201, ALREADY_MAPPED = 208, INVALID_HANDLE = 400,
       NOT_READY = 600, NOT_SUPPORTED = 801 };

#define NDEV 2
static struct mctx primary[NDEV] = { { 0x5ca1ab1e, 0 }, { 0x5ca1ab1e, 1 } };
static int primary_refs[NDEV];
static int inited;
static __thread CUcontext stack[16];
static __thread int depth;
static long n_get_current, n_set_current, n_push, n_pop;

/* kind: how the memory came to be, which decides how it goes away (and which calls may
 * free it): malloc'd host memory, a registered user range, our memfd device memory, or a
 * peer's memfd mapped by cuIpcOpenMemHandle. */
enum { K_HOST = 0, K_HOSTREG = 1, K_DEVICE = 2, K_IPC = 3, K_VMM = 4 };
struct alloc {
    uintptr_t base; size_t size; CUcontext ctx; unsigned type; int owned; int used;
    int kind; int fd;                  /* K_DEVICE: our memfd */
    int peer_pid, peer_fd; ino_t ino;  /* K_IPC: whose memfd this maps */
    int phys;                          /* K_VMM: index of the physical allocation mapped */
};
#define NALLOC 512
static struct alloc allocs[NALLOC];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static long n_batch, n_copy; /* successful cuMemcpyBatchAsync / single async copies */

static CUcontext cur(void) { return depth > 0 ? stack[depth - 1] : NULL; }

static struct alloc *add_alloc_kind(uintptr_t base, size_t size, unsigned type, int owned, int kind) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < NALLOC; i++) {
        if (!allocs[i].used) {
            allocs[i] = (struct alloc){ base, size, cur(), type, owned, 1, kind, -1, 0, -1, 0, -1 };
            pthread_mutex_unlock(&lock);
            return &allocs[i];
        }
    }
    pthread_mutex_unlock(&lock);
    return NULL;
}
static int add_alloc(uintptr_t base, size_t size, unsigned type, int owned) {
    return add_alloc_kind(base, size, type, owned, owned ? K_HOST : K_HOSTREG) ? 0 : -1;
}

static struct alloc *find(uintptr_t p) {
    struct alloc *a = NULL;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < NALLOC; i++)
        if (allocs[i].used && p >= allocs[i].base && p < allocs[i].base + allocs[i].size) a = &allocs[i];
    pthread_mutex_unlock(&lock);
    return a;
}

/* Forgets the record based at `base` if it is of `kind` and releases its memory. */
static int remove_alloc_kind(uintptr_t base, int kind) {
    pthread_mutex_lock(&lock);
    struct alloc *a = NULL;
    for (int i = 0; i < NALLOC; i++)
        if (allocs[i].used && allocs[i].base == base) a = &allocs[i];
    if (!a || a->kind != kind) { pthread_mutex_unlock(&lock); return -1; }
    struct alloc gone = *a;
    a->used = 0;
    pthread_mutex_unlock(&lock);
    if (gone.kind == K_DEVICE || gone.kind == K_IPC) munmap((void *)gone.base, gone.size);
    if (gone.kind == K_DEVICE) close(gone.fd);
    if (gone.kind == K_HOST) free((void *)gone.base);
    return 0;
}

/* Test hooks. */
void mock_counters(long *get, long *set, long *push, long *pop) {
    *get = n_get_current; *set = n_set_current; *push = n_push; *pop = n_pop;
}
int mock_depth(void) { return depth; }
/* IPC mappings open in this process now. */
int mock_ipc_open_count(void) {
    int n = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < NALLOC; i++) n += allocs[i].used && allocs[i].kind == K_IPC;
    pthread_mutex_unlock(&lock);
    return n;
}
/* Successful cuMemcpyBatchAsync calls, and successful single async copies (cuMemcpyAsync
 * and cuMemcpy{HtoD,DtoH,DtoD}Async), so far. */
long mock_batch_calls(void) { return __atomic_load_n(&n_batch, __ATOMIC_RELAXED); }
long mock_copy_calls(void) { return __atomic_load_n(&n_copy, __ATOMIC_RELAXED); }
/* Bytes the async copies, batch copies and kernel launches moved (a range copied twice
 * counts twice: the byte check alone cannot see that, since both copies write the same). */
static long n_moved;
static void moved(size_t n) { __atomic_add_fetch(&n_moved, (long)n, __ATOMIC_RELAXED); }
long mock_copied_bytes(void) { return __atomic_load_n(&n_moved, __ATOMIC_RELAXED); }

CUresult cuInit(unsigned flags) {
    if (flags != 0) return INVALID_VALUE;
    if (getenv("MOCK_CUDA_NO_DEVICE")) return NO_DEVICE;
    inited = 1;
    return OK;
}
CUresult cuDriverGetVersion(int *v) { if (!v) return INVALID_VALUE; *v = 13000; return OK; }

static const char *names[][2] = {
    { "0", "CUDA_SUCCESS" }, { "1", "CUDA_ERROR_INVALID_VALUE" }, { "2", "CUDA_ERROR_OUT_OF_MEMORY" },
    { "100", "CUDA_ERROR_NO_DEVICE" }, { "101", "CUDA_ERROR_INVALID_DEVICE" },
    { "3", "CUDA_ERROR_NOT_INITIALIZED" },
    { "201", "CUDA_ERROR_INVALID_CONTEXT" }, { "208", "CUDA_ERROR_ALREADY_MAPPED" },
    { "400", "CUDA_ERROR_INVALID_HANDLE" }, { "600", "CUDA_ERROR_NOT_READY" },
    { "801", "CUDA_ERROR_NOT_SUPPORTED" },
};
CUresult cuGetErrorName(CUresult e, const char **p) {
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (atoi(names[i][0]) == e) { *p = names[i][1]; return OK; }
    *p = NULL;
    return INVALID_VALUE;
}

CUresult cuDeviceGetCount(int *n) { if (!inited) return NOT_INITIALIZED; *n = NDEV; return OK; }
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
    if (ordinal < 0 || ordinal >= NDEV) return INVALID_DEVICE;
    *d = ordinal;
    return OK;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) {
    if (d < 0 || d >= NDEV) return INVALID_DEVICE;
    primary_refs[d]++;
    *c = &primary[d];
    return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    if (d < 0 || d >= NDEV || primary_refs[d] == 0) return INVALID_DEVICE;
    primary_refs[d]--;
    return OK;
}
CUresult cuCtxCreate_v2(CUcontext *c, unsigned flags, CUdevice d) {
    (void)flags;
    if (d < 0 || d >= NDEV) return INVALID_DEVICE;
    if (depth == 16) return OUT_OF_MEMORY;
    CUcontext n = malloc(sizeof *n);
    n->magic = 0x5ca1ab1e; n->dev = d;
    stack[depth++] = n;
    *c = n;
    return OK;
}
CUresult cuCtxDestroy_v2(CUcontext c) {
    if (!c || c->magic != 0x5ca1ab1e) return INVALID_CONTEXT;
    if (cur() == c) depth--;
    c->magic = 0;
    free(c);
    return OK;
}
CUresult cuCtxGetCurrent(CUcontext *c) { n_get_current++; *c = cur(); return OK; }
CUresult cuCtxSetCurrent(CUcontext c) {
    n_set_current++;
    if (c && c->magic != 0x5ca1ab1e) return INVALID_CONTEXT;
    if (!c) { if (depth > 0) depth--; return OK; }
    if (depth == 0) stack[depth++] = c; else stack[depth - 1] = c;
    return OK;
}
CUresult cuCtxPushCurrent_v2(CUcontext c) {
    n_push++;
    if (!c || c->magic != 0x5ca1ab1e) return INVALID_CONTEXT;
    if (depth == 16) return OUT_OF_MEMORY;
    stack[depth++] = c;
    return OK;
}
CUresult cuCtxPopCurrent_v2(CUcontext *c) {
    n_pop++;
    if (depth == 0) return INVALID_CONTEXT;
    CUcontext t = stack[--depth];
    if (c) *c = t;
    return OK;
}
CUresult cuCtxGetDevice(CUdevice *d) { if (!cur()) return INVALID_CONTEXT; *d = cur()->dev; return OK; }

static int alloc_dev(const struct alloc *a);
static void put(void *slot, unsigned attr, struct alloc *a) {
    switch (attr) {
    case 1: *(void **)slot = a ? (void *)a->ctx : NULL; break;              /* CONTEXT */
    case 2: *(unsigned *)slot = a ? a->type : 0; break;                     /* MEMORY_TYPE */
    case 8: *(unsigned char *)slot = 0; break;                              /* IS_MANAGED (1 byte) */
    case 9: *(int *)slot = a ? alloc_dev(a) : -2; break;                    /* DEVICE_ORDINAL */
    case 10: *(int *)slot = a && a->kind == K_DEVICE; break;                 /* IS_LEGACY_CUDA_IPC_CAPABLE */
    case 11: *(CUdeviceptr *)slot = a ? a->base : 0; break;                 /* RANGE_START_ADDR */
    case 12: *(size_t *)slot = a ? a->size : 0; break;                      /* RANGE_SIZE */
    }
}
static int known_attr(unsigned a) { return a == 1 || a == 2 || a == 8 || a == 9 || a == 10 || a == 11 || a == 12; }

CUresult cuPointerGetAttributes(unsigned n, unsigned *attrs, void **data, CUdeviceptr p) {
    if (!inited) return NOT_INITIALIZED;
    if (getenv("MOCK_CUDA_NO_GETATTRIBUTES")) return INVALID_VALUE;
    struct alloc *a = find((uintptr_t)p);
    for (unsigned i = 0; i < n; i++) {
        if (!known_attr(attrs[i])) return INVALID_VALUE;
        put(data[i], attrs[i], a);
    }
    return OK;
}
CUresult cuPointerGetAttribute(void *data, unsigned attr, CUdeviceptr p) {
    if (!inited) return NOT_INITIALIZED;
    struct alloc *a = find((uintptr_t)p);
    if (!a || !known_attr(attr)) return INVALID_VALUE;
    put(data, attr, a);
    return OK;
}
CUresult cuPointerSetAttribute(const void *v, unsigned attr, CUdeviceptr p) {
    if (attr != 6 || !v || !find((uintptr_t)p)) return INVALID_VALUE;
    return OK;
}

/* Device memory: a memfd of its own, so a peer process can map the same pages through an
 * IPC handle. mmap gives page alignment (the real driver aligns to far more). */
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    if (!cur()) return INVALID_CONTEXT;
    if (n == 0) return INVALID_VALUE;
    int fd = memfd_create("mock-cuda-vram", MFD_CLOEXEC);
    if (fd < 0) return OUT_OF_MEMORY;
    void *m = MAP_FAILED;
    if (ftruncate(fd, (off_t)n) == 0) m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    struct alloc *a = m == MAP_FAILED ? NULL : add_alloc_kind((uintptr_t)m, n, 2, 1, K_DEVICE);
    if (!a) {
        if (m != MAP_FAILED) munmap(m, n);
        close(fd);
        return OUT_OF_MEMORY;
    }
    a->fd = fd;
    *p = (uintptr_t)m;
    return OK;
}
/* Only our own allocations: an IPC mapping is closed with cuIpcCloseMemHandle. */
CUresult cuMemFree_v2(CUdeviceptr p) { if (!cur()) return INVALID_CONTEXT; return remove_alloc_kind(p, K_DEVICE) ? INVALID_VALUE : OK; }
CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags) {
    (void)flags;
    if (!cur()) return INVALID_CONTEXT;
    void *m = malloc(n);
    if (!m || add_alloc((uintptr_t)m, n, 1, 1)) { free(m); return OUT_OF_MEMORY; }
    memset(m, 0xee, n); /* not zeroed, like the real one */
    *p = m;
    return OK;
}
CUresult cuMemFreeHost(void *p) { if (!cur()) return INVALID_CONTEXT; return remove_alloc_kind((uintptr_t)p, K_HOST) ? INVALID_VALUE : OK; }
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned flags) {
    (void)flags;
    if (!cur()) return INVALID_CONTEXT;
    if (find((uintptr_t)p)) return INVALID_VALUE;
    return add_alloc((uintptr_t)p, n, 1, 0) ? OUT_OF_MEMORY : OK;
}
CUresult cuMemHostUnregister(void *p) { if (!cur()) return INVALID_CONTEXT; return remove_alloc_kind((uintptr_t)p, K_HOSTREG) ? INVALID_VALUE : OK; }

/* Whether [p, p+n) lies in one known allocation, or in VMM mappings that follow each other
 * without a gap (the real driver copies across the chunks of one reserved range); a VMM
 * mapping whose access was never set (cuMemSetAccess) is not usable. */
static int span_ok(CUdeviceptr p, size_t n, int device_only) {
    uintptr_t at = (uintptr_t)p, end = (uintptr_t)p + n;
    for (;;) {
        struct alloc *a = find(at);
        if (!a) return 0;
        if (device_only && a->kind != K_DEVICE && a->kind != K_IPC && a->kind != K_VMM) return 0;
        if (a->kind == K_VMM && !a->owned) return 0; /* mapped, no access granted */
        if (end <= a->base + a->size) return 1;
        if (a->kind != K_VMM) return 0;
        at = a->base + a->size;
    }
}
static int known_range(CUdeviceptr p, size_t n) { return span_ok(p, n, 0); }
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n) {
    if (!cur()) return INVALID_CONTEXT;
    if (!known_range(d, n)) return INVALID_VALUE;
    memcpy((void *)(uintptr_t)d, s, n);
    return OK;
}
CUresult cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n) {
    if (!cur()) return INVALID_CONTEXT;
    if (!known_range(s, n)) return INVALID_VALUE;
    memcpy(d, (void *)(uintptr_t)s, n);
    return OK;
}
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) {
    if (!cur()) return INVALID_CONTEXT;
    if (!known_range(d, n) || !known_range(s, n)) return INVALID_VALUE;
    memmove((void *)(uintptr_t)d, (void *)(uintptr_t)s, n);
    return OK;
}
CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) {
    if (!cur()) return INVALID_CONTEXT;
    if (!known_range(d, n)) return INVALID_VALUE;
    memset((void *)(uintptr_t)d, v, n);
    return OK;
}

static CUresult stream_ok(CUstream s) {
    if (!cur()) return INVALID_CONTEXT;
    if (s == NULL) return OK; /* legacy default stream */
    return s->ctx == cur() ? OK : INVALID_CONTEXT;
}
CUresult cuCtxSynchronize(void) { return cur() ? OK : INVALID_CONTEXT; }
CUresult cuStreamCreate(CUstream *s, unsigned flags) {
    if (flags != 1) return INVALID_VALUE; /* we always ask for NON_BLOCKING */
    if (!cur()) return INVALID_CONTEXT;
    *s = malloc(sizeof **s);
    (*s)->ctx = cur();
    return OK;
}
CUresult cuStreamSynchronize(CUstream s) { return stream_ok(s); }
CUresult cuStreamQuery(CUstream s) { return stream_ok(s); }
CUresult cuStreamDestroy_v2(CUstream s) { if (!s || !cur()) return INVALID_HANDLE; free(s); return OK; }
static CUresult counted(CUresult r) {
    if (r == OK) __atomic_add_fetch(&n_copy, 1, __ATOMIC_RELAXED);
    return r;
}
static CUresult counted_n(CUresult r, size_t n) {
    if (r == OK) moved(n);
    return counted(r);
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, CUstream st) {
    CUresult r = stream_ok(st);
    return r ? r : counted_n(cuMemcpyHtoD_v2(d, s, n), n);
}
CUresult cuMemcpyDtoHAsync_v2(void *d, CUdeviceptr s, size_t n, CUstream st) {
    CUresult r = stream_ok(st);
    return r ? r : counted_n(cuMemcpyDtoH_v2(d, s, n), n);
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) {
    CUresult r = stream_ok(st);
    return r ? r : counted_n(cuMemcpyDtoD_v2(d, s, n), n);
}

/* A unified-addressing pointer: one inside a known allocation (device, pinned, registered,
 * IPC-mapped) must have its whole range inside it; anything else is pageable host memory,
 * which the real driver also accepts for cuMemcpy and the batch copy. */
static int range_ok(CUdeviceptr p, size_t n) {
    struct alloc *a = find((uintptr_t)p);
    return !a || span_ok(p, n, 0);
}
CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) {
    CUresult r = stream_ok(st);
    if (r) return r;
    if (!range_ok(d, n) || !range_ok(s, n)) return INVALID_VALUE;
    memmove((void *)(uintptr_t)d, (void *)(uintptr_t)s, n);
    return counted_n(OK, n);
}

/* The batch copy: the checks the driver documents, then each copy in order. The legacy
 * NULL stream (and CU_STREAM_LEGACY) is refused, as the real driver does. */
static CUresult batch(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, CUmemcpyAttributes *attrs,
                      size_t *attrsIdxs, size_t numAttrs, CUstream st) {
    if (getenv("MOCK_CUDA_NO_BATCH") && strcmp(getenv("MOCK_CUDA_NO_BATCH"), "1") == 0) return NOT_SUPPORTED;
    if (!cur()) return INVALID_CONTEXT;
    if (st == NULL || st == (CUstream)0x1) return INVALID_VALUE;
    CUresult r = stream_ok(st);
    if (r) return r;
    if (count == 0 || !dsts || !srcs || !sizes || !attrs || !attrsIdxs || numAttrs < 1 || numAttrs > count) return INVALID_VALUE;
    if (attrsIdxs[0] != 0) return INVALID_VALUE;
    for (size_t i = 0; i < numAttrs; i++) {
        if (i > 0 && attrsIdxs[i] <= attrsIdxs[i - 1]) return INVALID_VALUE;
        if (attrsIdxs[i] >= count) return INVALID_VALUE;
        if (attrs[i].srcAccessOrder < 1 || attrs[i].srcAccessOrder > 3) return INVALID_VALUE;
    }
    for (size_t i = 0; i < count; i++)
        if (!range_ok(dsts[i], sizes[i]) || !range_ok(srcs[i], sizes[i])) return INVALID_VALUE;
    for (size_t i = 0; i < count; i++) {
        memmove((void *)(uintptr_t)dsts[i], (void *)(uintptr_t)srcs[i], sizes[i]);
        moved(sizes[i]);
    }
    __atomic_add_fetch(&n_batch, 1, __ATOMIC_RELAXED);
    return OK;
}
/* CUDA 13 form (no failIdx). */
CUresult cuMemcpyBatchAsync_v2(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, CUmemcpyAttributes *attrs,
                               size_t *attrsIdxs, size_t numAttrs, CUstream st) {
    return batch(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, st);
}
/* CUDA 12.8 form: *failIdx is SIZE_MAX on success and for errors not tied to one copy. */
CUresult cuMemcpyBatchAsync(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count, CUmemcpyAttributes *attrs,
                            size_t *attrsIdxs, size_t numAttrs, size_t *failIdx, CUstream st) {
    CUresult r = batch(dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, st);
    if (failIdx) *failIdx = SIZE_MAX;
    return r;
}

/* ---- the gather-copy kernel ------------------------------------------------------------ */
/* cuModuleLoadData accepts only our kernel's PTX (entry nf_gather, one byte-array parameter
 * named nf_p); "running" it performs the copies its parameter block lists, after the checks
 * a real launch would fail or corrupt memory on: the module's context current, a stream of
 * that context, a grid that covers every range, and both ends of every range in device
 * memory (ours or IPC-mapped) or pinned host memory from cuMemHostAlloc (a kernel cannot
 * touch pageable host memory).
 * MOCK_CUDA_NO_KERNEL=1: the module API refuses (a driver without JIT);
 * MOCK_CUDA_SMALL_PARAMS=1: parameter blocks over 4352 bytes are refused (an old driver);
 * MOCK_CUDA_LAUNCH_LIMIT=N: after N more launches (counted from when this value is first
 * seen) every launch is refused with LAUNCH_OUT_OF_RESOURCES (a refusal mid-request). */
typedef struct mmodule { CUcontext ctx; size_t param_bytes; int magic; } *CUmodule;
typedef CUmodule CUfunction;
#define MODULE_MAGIC 0x6a7e1
enum { INVALID_PTX = 218, NOT_FOUND = 500, LAUNCH_OUT_OF_RESOURCES = 701 };
static long n_kernel; /* successful launches */
long mock_kernel_launches(void) { return __atomic_load_n(&n_kernel, __ATOMIC_RELAXED); }
static int env_is(const char *name) { const char *v = getenv(name); return v && strcmp(v, "1") == 0; }

CUresult cuModuleLoadData(CUmodule *m, const void *image) {
    if (env_is("MOCK_CUDA_NO_KERNEL")) return NOT_SUPPORTED;
    if (!cur()) return INVALID_CONTEXT;
    if (!m || !image) return INVALID_VALUE;
    const char *ptx = image, *p = strstr(ptx, ".param .align 8 .b8 nf_p[");
    if (!strstr(ptx, ".visible .entry nf_gather(") || !p) return INVALID_PTX;
    size_t bytes = strtoul(p + strlen(".param .align 8 .b8 nf_p["), NULL, 10);
    if (bytes < 8 || bytes > 32764) return INVALID_PTX;
    if (bytes > 4352 && env_is("MOCK_CUDA_SMALL_PARAMS")) return INVALID_PTX;
    *m = malloc(sizeof **m);
    **m = (struct mmodule){ cur(), bytes, MODULE_MAGIC };
    return OK;
}
CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
    if (!cur()) return INVALID_CONTEXT;
    if (!f || !m || m->magic != MODULE_MAGIC || !name) return INVALID_HANDLE;
    if (strcmp(name, "nf_gather") != 0) return NOT_FOUND;
    *f = m;
    return OK;
}
CUresult cuModuleUnload(CUmodule m) {
    if (!m || m->magic != MODULE_MAGIC) return INVALID_HANDLE;
    if (cur() != m->ctx) return INVALID_CONTEXT;
    m->magic = 0;
    free(m);
    return OK;
}
/* What a kernel may touch: device memory, and page-locked memory from cuMemHostAlloc,
 * which unified addressing maps into every device at its host address (staging gathers
 * into and scatters out of its bounce slots that way). Registered (cuMemHostRegister) and
 * pageable host memory stay out of reach. */
static int device_range(CUdeviceptr p, size_t n) {
    struct alloc *a = find((uintptr_t)p);
    if (a && a->kind == K_HOST) return (uintptr_t)p + n <= a->base + a->size;
    return span_ok(p, n, 1);
}
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, CUstream st, void **params, void **extra) {
    if (!f || f->magic != MODULE_MAGIC) return INVALID_HANDLE;
    if (!cur() || cur() != f->ctx) return INVALID_CONTEXT;
    CUresult r = stream_ok(st);
    if (r) return r;
    if (st && st->ctx != f->ctx) return INVALID_CONTEXT;
    if (!params || !params[0] || extra || gx == 0 || gy == 0 || gz != 1 || bx == 0 || bx > 1024 || by != 1 || bz != 1 || shared)
        return INVALID_VALUE;
    {
        static char seen[32];
        static long refuse_from = -1;
        const char *lim = getenv("MOCK_CUDA_LAUNCH_LIMIT");
        if (!lim) {
            seen[0] = 0;
        } else {
            if (strncmp(seen, lim, sizeof seen - 1) != 0) {
                snprintf(seen, sizeof seen, "%s", lim);
                refuse_from = __atomic_load_n(&n_kernel, __ATOMIC_RELAXED) + atol(lim);
            }
            if (__atomic_load_n(&n_kernel, __ATOMIC_RELAXED) >= refuse_from) return LAUNCH_OUT_OF_RESOURCES;
        }
    }
    const unsigned char *blk = params[0];
    uint32_t count, shift;
    memcpy(&count, blk, 4);
    memcpy(&shift, blk + 4, 4);
    if (count == 0 || 8 + (size_t)count * 24 > f->param_bytes || gy < count || shift < 4 || shift > 30) return INVALID_VALUE;
    for (uint32_t i = 0; i < count; i++) {
        uint64_t e[3];
        memcpy(e, blk + 8 + 24 * (size_t)i, sizeof e);
        if (((uint64_t)gx << shift) < e[2]) return INVALID_VALUE; /* part of the range never copied */
        if (e[2] && (!device_range(e[0], e[2]) || !device_range(e[1], e[2]))) return INVALID_VALUE;
    }
    for (uint32_t i = 0; i < count; i++) {
        uint64_t e[3];
        memcpy(e, blk + 8 + 24 * (size_t)i, sizeof e);
        memmove((void *)(uintptr_t)e[0], (void *)(uintptr_t)e[1], e[2]);
        moved(e[2]);
    }
    __atomic_add_fetch(&n_kernel, 1, __ATOMIC_RELAXED);
    return OK;
}

/* ---- IPC ------------------------------------------------------------------------------ */
/* Handle layout (ours; the engine must treat it as opaque): magic, owner pid, owner's memfd
 * number, allocation size, owner's device ordinal, and the memfd's inode so that a handle
 * naming a reused fd number is refused rather than mapping someone else's memory. */
struct ipc_wire { char magic[8]; int32_t pid; int32_t fd; uint64_t size; int32_t dev; int32_t pad; uint64_t ino; };
_Static_assert(sizeof(struct ipc_wire) <= sizeof(CUipcMemHandle), "fits the handle");
static const char IPC_MAGIC[8] = { 'M', 'O', 'C', 'K', 'I', 'P', 'C', '1' };

CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
    if (!h) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    struct alloc *a = NULL;
    for (int i = 0; i < NALLOC; i++)
        if (allocs[i].used && p >= allocs[i].base && p < allocs[i].base + allocs[i].size) a = &allocs[i];
    if (!a || a->kind != K_DEVICE) { pthread_mutex_unlock(&lock); return INVALID_VALUE; }
    struct ipc_wire w = { { 0 }, (int32_t)getpid(), a->fd, a->size, a->ctx ? a->ctx->dev : 0, 0, 0 };
    memcpy(w.magic, IPC_MAGIC, 8);
    struct stat st;
    if (fstat(a->fd, &st) == 0) w.ino = (uint64_t)st.st_ino;
    pthread_mutex_unlock(&lock);
    memset(h, 0, sizeof *h);
    memcpy(h, &w, sizeof w);
    return OK;
}

static CUresult ipc_open(CUdeviceptr *p, CUipcMemHandle h, unsigned flags) {
    if (!cur()) return INVALID_CONTEXT;
    if (!p || (flags != 0 && flags != 1)) return INVALID_VALUE; /* 1: CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS */
    const char *fail = getenv("MOCK_CUDA_IPC_OPEN_FAIL");
    if (fail && strcmp(fail, "1") == 0) return INVALID_VALUE;
    struct ipc_wire w;
    memcpy(&w, &h, sizeof w);
    if (memcmp(w.magic, IPC_MAGIC, 8) != 0 || w.size == 0 || w.pid <= 0 || w.fd < 0) return INVALID_VALUE;
    if (w.pid == (int32_t)getpid()) return INVALID_CONTEXT; /* the driver refuses the exporting process */
    pthread_mutex_lock(&lock);
    for (int i = 0; i < NALLOC; i++)
        if (allocs[i].used && allocs[i].kind == K_IPC && allocs[i].peer_pid == w.pid && allocs[i].peer_fd == w.fd &&
            allocs[i].ino == (ino_t)w.ino) {
            pthread_mutex_unlock(&lock);
            return ALREADY_MAPPED;
        }
    pthread_mutex_unlock(&lock);
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)w.pid, (int)w.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) return INVALID_HANDLE;
    struct stat st;
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_size != w.size || (w.ino && (uint64_t)st.st_ino != w.ino)) {
        close(fd);
        return INVALID_HANDLE;
    }
    void *m = mmap(NULL, w.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd); /* the mapping keeps the pages */
    if (m == MAP_FAILED) return OUT_OF_MEMORY;
    struct alloc *a = add_alloc_kind((uintptr_t)m, w.size, 2, 0, K_IPC);
    if (!a) { munmap(m, w.size); return OUT_OF_MEMORY; }
    a->peer_pid = w.pid;
    a->peer_fd = w.fd;
    a->ino = (ino_t)w.ino;
    *p = (uintptr_t)m;
    return OK;
}
/* The handle is passed by value (a 64-byte struct), as in cuda.h. */
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned flags) { return ipc_open(p, h, flags); }
CUresult cuIpcOpenMemHandle(CUdeviceptr *p, CUipcMemHandle h, unsigned flags) { return ipc_open(p, h, flags); }
CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
    if (!cur()) return INVALID_CONTEXT;
    return remove_alloc_kind(p, K_IPC) ? INVALID_VALUE : OK;
}

/* The same UUID for an ordinal in every process: peers compare them to find one GPU. */
CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d) {
    if (!inited) return NOT_INITIALIZED;
    if (!u) return INVALID_VALUE;
    if (d < 0 || d >= NDEV) return INVALID_DEVICE;
    memcpy(u->bytes, "mock-gpu-uuid-0", 15);
    u->bytes[15] = (char)d;
    return OK;
}
CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d) { return cuDeviceGetUuid_v2(u, d); }
/* Events created so far (tests: the staging pool records done copies' events again). */
static long n_events_created;
long mock_events_created(void) { return __atomic_load_n(&n_events_created, __ATOMIC_RELAXED); }
CUresult cuEventCreate(CUevent *e, unsigned flags) {
    if (flags != 2) return INVALID_VALUE; /* we always ask for DISABLE_TIMING */
    if (!cur()) return INVALID_CONTEXT;
    __atomic_add_fetch(&n_events_created, 1, __ATOMIC_RELAXED);
    *e = malloc(sizeof **e);
    (*e)->ctx = cur();
    (*e)->pending = 0;
    return OK;
}
CUresult cuEventRecord(CUevent e, CUstream s) {
    CUresult r = stream_ok(s);
    if (r) return r;
    if (e->ctx != cur()) return INVALID_HANDLE;
    e->pending = 1;
    return OK;
}
CUresult cuEventQuery(CUevent e) {
    if (!cur() || e->ctx != cur()) return INVALID_CONTEXT;
    if (e->pending) { e->pending--; return NOT_READY; }
    return OK;
}
CUresult cuEventSynchronize(CUevent e) { if (!cur() || e->ctx != cur()) return INVALID_CONTEXT; e->pending = 0; return OK; }
CUresult cuEventDestroy_v2(CUevent e) { if (!e || !cur()) return INVALID_HANDLE; free(e); return OK; }

/* ---- virtual memory management (cuMemCreate and friends) ------------------------------- */
/* A physical allocation is a memfd of its own (named after its device, so an imported fd
 * says which GPU it lives on); cuMemAddressReserve reserves PROT_NONE address space;
 * cuMemMap maps the memfd there, still PROT_NONE until cuMemSetAccess grants access (the
 * real driver faults on a mapping without access too). A mapping is an allocation record
 * of kind K_VMM: it belongs to no context (CU_POINTER_ATTRIBUTE_CONTEXT is NULL), cannot
 * be exported with cuIpcGetMemHandle, and cuMemGetAddressRange / the range attributes
 * report the mapping (one chunk), not the reservation. Exporting to a POSIX fd works only
 * when the allocation asked for that handle type at creation. Granularity: 64 KiB
 * (MOCK_CUDA_VMM_GRANULARITY overrides), and every size, offset and address must be a
 * multiple of it; cuMemMap's offset must be 0. MOCK_CUDA_VMM_IMPORT_FAIL=1: imports fail. Handles are counted: the creation,
 * each cuMemRetainAllocationHandle and each mapping hold a reference; cuMemRelease and
 * cuMemUnmap drop one; the memfd closes with the last. */
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct {
    int type;                 /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
    int requestedHandleTypes; /* bit 0x1: CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */
    struct { int type; int id; } location; /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
    void *win32HandleMetaData;
    struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage; unsigned char reserved[4]; } allocFlags;
} CUmemAllocationProp;
typedef struct { struct { int type; int id; } location; int flags; } CUmemAccessDesc;
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp is 32 bytes");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc is 12 bytes");

#define NPHYS 1024
#define NRESV 256
#define HANDLE_TAG 0x7e3d000000000000ULL
static struct phys { int used, fd, dev, types, refs, imported; size_t size; } phys[NPHYS];
static struct resv { int used, imported; uintptr_t base; size_t size; } resv[NRESV];

static size_t gran(void) {
    const char *g = getenv("MOCK_CUDA_VMM_GRANULARITY");
    size_t v = g ? strtoull(g, NULL, 0) : 0;
    return v && (v & (v - 1)) == 0 && v >= 4096 ? v : (64 << 10);
}
static int alloc_dev(const struct alloc *a) {
    if (a->kind == K_VMM && a->phys >= 0) return phys[a->phys].dev;
    return a->ctx ? a->ctx->dev : 0;
}
/* Index of the live physical allocation `h` names, or -1. Called with `lock` held. */
static int phys_of(CUmemGenericAllocationHandle h) {
    if ((h & 0xffff000000000000ULL) != HANDLE_TAG) return -1;
    unsigned long long i = (h & 0xffffffffULL) - 1;
    return i < NPHYS && phys[i].used ? (int)i : -1;
}
static CUmemGenericAllocationHandle handle_of(int i) { return HANDLE_TAG | (unsigned long long)(i + 1); }
static void phys_unref(int i) { /* lock held */
    if (--phys[i].refs == 0) { close(phys[i].fd); phys[i].used = 0; }
}
static int phys_new(int fd, size_t size, int dev, int types, int imported) { /* lock held */
    for (int i = 0; i < NPHYS; i++)
        if (!phys[i].used) { phys[i] = (struct phys){ 1, fd, dev, types, 1, imported, size }; return i; }
    return -1;
}
/* Test hooks: physical allocations alive in this process that were imported from an fd,
 * and reservations that hold (or held) imported memory and are not freed yet. */
int mock_vmm_imported_handles(void) {
    int n = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < NPHYS; i++) n += phys[i].used && phys[i].imported;
    pthread_mutex_unlock(&lock);
    return n;
}
int mock_vmm_imported_ranges(void) {
    int n = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < NRESV; i++) n += resv[i].used && resv[i].imported;
    pthread_mutex_unlock(&lock);
    return n;
}

CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *prop, int option) {
    if (!g || !prop || (option != 0 && option != 1)) return INVALID_VALUE;
    if (prop->type != 1 || prop->location.type != 1 || prop->location.id < 0 || prop->location.id >= NDEV) return INVALID_VALUE;
    *g = gran();
    return OK;
}
CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop, unsigned long long flags) {
    if (!cur()) return INVALID_CONTEXT;
    if (!h || !prop || flags || size == 0 || size % gran()) return INVALID_VALUE;
    if (prop->type != 1 || prop->location.type != 1 || prop->location.id < 0 || prop->location.id >= NDEV) return INVALID_VALUE;
    if (prop->requestedHandleTypes & ~0x1) return NOT_SUPPORTED; /* only POSIX fds here */
    char name[32];
    snprintf(name, sizeof name, "mock-cuda-vmm-dev%d", prop->location.id);
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0) return OUT_OF_MEMORY;
    if (ftruncate(fd, (off_t)size) != 0) { close(fd); return OUT_OF_MEMORY; }
    pthread_mutex_lock(&lock);
    int i = phys_new(fd, size, prop->location.id, prop->requestedHandleTypes, 0);
    pthread_mutex_unlock(&lock);
    if (i < 0) { close(fd); return OUT_OF_MEMORY; }
    *h = handle_of(i);
    return OK;
}
CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    pthread_mutex_lock(&lock);
    int i = phys_of(h);
    if (i >= 0) phys_unref(i);
    pthread_mutex_unlock(&lock);
    return i < 0 ? INVALID_VALUE : OK;
}
CUresult cuMemAddressReserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
    size_t g = gran();
    (void)addr; /* a hint only */
    if (!p || flags || size == 0 || size % g || (align && (align & (align - 1)))) return INVALID_VALUE;
    if (align < g) align = g;
    void *m = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return OUT_OF_MEMORY;
    uintptr_t b = ((uintptr_t)m + align - 1) & ~(uintptr_t)(align - 1);
    if (b > (uintptr_t)m) munmap(m, b - (uintptr_t)m);
    if ((uintptr_t)m + size + align > b + size) munmap((void *)(b + size), (uintptr_t)m + size + align - b - size);
    pthread_mutex_lock(&lock);
    int k = -1;
    for (int i = 0; i < NRESV && k < 0; i++)
        if (!resv[i].used) { resv[i] = (struct resv){ 1, 0, b, size }; k = i; }
    pthread_mutex_unlock(&lock);
    if (k < 0) { munmap((void *)b, size); return OUT_OF_MEMORY; }
    *p = b;
    return OK;
}
/* Only a whole reservation, and only once nothing is mapped in it any more. */
CUresult cuMemAddressFree(CUdeviceptr p, size_t size) {
    pthread_mutex_lock(&lock);
    int k = -1;
    for (int i = 0; i < NRESV; i++)
        if (resv[i].used && resv[i].base == p && resv[i].size == size) k = i;
    for (int i = 0; k >= 0 && i < NALLOC; i++)
        if (allocs[i].used && allocs[i].kind == K_VMM && allocs[i].base >= p && allocs[i].base < p + size) k = -2;
    if (k >= 0) resv[k].used = 0;
    pthread_mutex_unlock(&lock);
    if (k < 0) return INVALID_VALUE;
    munmap((void *)(uintptr_t)p, size);
    return OK;
}
CUresult cuMemMap(CUdeviceptr p, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags) {
    if (!cur()) return INVALID_CONTEXT;
    size_t g = gran();
    if (flags || offset || size == 0 || size % g || p % g) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    int i = phys_of(h), k = -1;
    for (int r = 0; r < NRESV; r++)
        if (resv[r].used && p >= resv[r].base && p + size <= resv[r].base + resv[r].size) k = r;
    CUresult res = i < 0 ? INVALID_HANDLE : k < 0 || size > phys[i].size ? INVALID_VALUE : OK;
    for (int a = 0; res == OK && a < NALLOC; a++)
        if (allocs[a].used && allocs[a].base < p + size && p < allocs[a].base + allocs[a].size) res = ALREADY_MAPPED;
    if (res == OK && mmap((void *)(uintptr_t)p, size, PROT_NONE, MAP_SHARED | MAP_FIXED, phys[i].fd, 0) == MAP_FAILED) res = OUT_OF_MEMORY;
    if (res == OK) {
        int a = 0;
        while (a < NALLOC && allocs[a].used) a++;
        if (a == NALLOC) {
            mmap((void *)(uintptr_t)p, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
            res = OUT_OF_MEMORY;
        } else {
            allocs[a] = (struct alloc){ (uintptr_t)p, size, NULL, 2, 0, 1, K_VMM, -1, 0, -1, 0, i };
            phys[i].refs++;
            if (phys[i].imported) resv[k].imported = 1;
        }
    }
    pthread_mutex_unlock(&lock);
    return res;
}
/* [p, p+size) must be covered exactly by whole mappings. */
CUresult cuMemUnmap(CUdeviceptr p, size_t size) {
    if (!cur()) return INVALID_CONTEXT;
    pthread_mutex_lock(&lock);
    size_t covered = 0;
    for (int a = 0; a < NALLOC; a++) {
        struct alloc *x = &allocs[a];
        if (!x->used || x->base + x->size <= p || x->base >= p + size) continue;
        if (x->kind != K_VMM || x->base < p || x->base + x->size > p + size) { pthread_mutex_unlock(&lock); return INVALID_VALUE; }
        covered += x->size;
    }
    if (covered != size || size == 0) { pthread_mutex_unlock(&lock); return INVALID_VALUE; }
    for (int a = 0; a < NALLOC; a++) {
        struct alloc *x = &allocs[a];
        if (x->used && x->kind == K_VMM && x->base >= p && x->base < p + size) {
            x->used = 0;
            phys_unref(x->phys);
        }
    }
    mmap((void *)(uintptr_t)p, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    pthread_mutex_unlock(&lock);
    return OK;
}
/* Every byte of the range must be mapped; access for one device, read or read-write. */
CUresult cuMemSetAccess(CUdeviceptr p, size_t size, const CUmemAccessDesc *desc, size_t count) {
    if (!cur()) return INVALID_CONTEXT;
    if (!desc || count == 0 || size == 0) return INVALID_VALUE;
    int prot = 0;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != 1 || desc[i].location.id < 0 || desc[i].location.id >= NDEV) return INVALID_DEVICE;
        if (desc[i].flags != 1 && desc[i].flags != 3) return INVALID_VALUE;
        prot |= desc[i].flags == 3 ? PROT_READ | PROT_WRITE : PROT_READ;
    }
    pthread_mutex_lock(&lock);
    size_t covered = 0;
    for (int a = 0; a < NALLOC; a++) {
        struct alloc *x = &allocs[a];
        if (x->used && x->kind == K_VMM && x->base >= p && x->base + x->size <= p + size) covered += x->size;
    }
    CUresult res = covered == size ? OK : INVALID_VALUE;
    if (res == OK && mprotect((void *)(uintptr_t)p, size, prot) != 0) res = INVALID_VALUE;
    for (int a = 0; res == OK && a < NALLOC; a++) {
        struct alloc *x = &allocs[a];
        if (x->used && x->kind == K_VMM && x->base >= p && x->base + x->size <= p + size) x->owned = 1; /* access granted */
    }
    pthread_mutex_unlock(&lock);
    return res;
}
/* Any address inside a mapping names its allocation; one more reference to release. */
CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr) {
    if (!h) return INVALID_VALUE;
    struct alloc *a = find((uintptr_t)addr);
    if (!a || a->kind != K_VMM) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    phys[a->phys].refs++;
    *h = handle_of(a->phys);
    pthread_mutex_unlock(&lock);
    return OK;
}
CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h) {
    if (!prop) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    int i = phys_of(h);
    if (i >= 0) {
        memset(prop, 0, sizeof *prop);
        prop->type = 1;
        prop->requestedHandleTypes = phys[i].types;
        prop->location.type = 1;
        prop->location.id = phys[i].dev;
    }
    pthread_mutex_unlock(&lock);
    return i < 0 ? INVALID_VALUE : OK;
}
/* A POSIX fd (a dup of the memfd) for an allocation created to allow it. */
CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type, unsigned long long flags) {
    if (!cur()) return INVALID_CONTEXT;
    if (!out || flags || type != 1) return INVALID_VALUE;
    pthread_mutex_lock(&lock);
    int i = phys_of(h);
    CUresult res = i < 0 ? INVALID_VALUE : !(phys[i].types & 1) ? NOT_SUPPORTED : OK;
    int fd = res == OK ? fcntl(phys[i].fd, F_DUPFD_CLOEXEC, 0) : -1;
    pthread_mutex_unlock(&lock);
    if (res == OK && fd < 0) return OUT_OF_MEMORY;
    if (res == OK) *(int *)out = fd;
    return res;
}
/* The fd is the caller's to close afterwards; the imported handle holds its own reference. */
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os_handle, int type) {
    if (!cur()) return INVALID_CONTEXT;
    if (!h || type != 1) return INVALID_VALUE;
    if (env_is("MOCK_CUDA_VMM_IMPORT_FAIL")) return NOT_SUPPORTED; /* e.g. another driver instance */
    int fd = (int)(intptr_t)os_handle, dev = -1;
    char path[64], target[128] = "";
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n > 0) target[n] = 0;
    if (n <= 0 || sscanf(target, "/memfd:mock-cuda-vmm-dev%d", &dev) != 1 || dev < 0 || dev >= NDEV) return INVALID_HANDLE;
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size <= 0 || (size_t)st.st_size % gran()) return INVALID_HANDLE;
    int mine = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (mine < 0) return OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    int i = phys_new(mine, (size_t)st.st_size, dev, 1, 1);
    pthread_mutex_unlock(&lock);
    if (i < 0) { close(mine); return OUT_OF_MEMORY; }
    *h = handle_of(i);
    return OK;
}
/* The allocation holding dptr: for VMM memory the one mapping (chunk) that contains it. */
CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    if (!inited) return NOT_INITIALIZED;
    struct alloc *a = find((uintptr_t)p);
    if (!a || (a->kind != K_DEVICE && a->kind != K_IPC && a->kind != K_VMM)) return NOT_FOUND;
    if (base) *base = a->base;
    if (size) *size = a->size;
    return OK;
}

/* ---- dma-buf export (cuDeviceGetAttribute, cuMemGetHandleForAddressRange) ---------------
 * The only device attribute known is CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (124): 1, or 0
 * with MOCK_CUDA_NO_DMABUF=1. cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
 * = 1) hands out a new fd of the memfd behind the range (our device memory, or the
 * physical allocation of one VMM mapping), so reading the fd at offset k reads the
 * device byte at dptr + k, as a real dma-buf of [dptr, dptr + size) would. A memfd's offset
 * 0 cannot be moved, so only ranges that start where their allocation (or VMM chunk)
 * starts and stay inside it are exported: others get CUDA_ERROR_INVALID_VALUE (the real
 * driver's rule for ranges over several chunks is what the GPU host shows). Like the real
 * call: dptr and size must be multiples of the host page size, a context must be current,
 * and MOCK_CUDA_DMABUF_FAIL=1 makes every export fail with CUDA_ERROR_NOT_SUPPORTED. */
static long n_dmabuf; /* successful exports */
long mock_dmabuf_exports(void) { return __atomic_load_n(&n_dmabuf, __ATOMIC_RELAXED); }
CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
    if (!inited) return NOT_INITIALIZED;
    if (!v || d < 0 || d >= NDEV) return INVALID_VALUE;
    if (attr != 124) return INVALID_VALUE;
    *v = env_is("MOCK_CUDA_NO_DMABUF") ? 0 : 1;
    return OK;
}
CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr p, size_t size, int type, unsigned long long flags) {
    long page = sysconf(_SC_PAGESIZE);
    if (!cur()) return INVALID_CONTEXT;
    if (!handle || type != 1 || flags || size == 0 || p % (unsigned long long)page || size % (size_t)page) return INVALID_VALUE;
    if (env_is("MOCK_CUDA_NO_DMABUF") || env_is("MOCK_CUDA_DMABUF_FAIL")) return NOT_SUPPORTED;
    pthread_mutex_lock(&lock);
    struct alloc *a = NULL;
    for (int i = 0; i < NALLOC; i++)
        if (allocs[i].used && p >= allocs[i].base && p < allocs[i].base + allocs[i].size) a = &allocs[i];
    int fd = -1;
    if (a && a->base == p && size <= a->size) {
        if (a->kind == K_DEVICE) fd = a->fd;
        else if (a->kind == K_VMM && a->phys >= 0) fd = phys[a->phys].fd;
    }
    int out = fd >= 0 ? fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1;
    pthread_mutex_unlock(&lock);
    if (out < 0) return INVALID_VALUE;
    *(int *)handle = out;
    __atomic_fetch_add(&n_dmabuf, 1, __ATOMIC_RELAXED);
    return OK;
}
