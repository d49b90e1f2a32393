/* A stand-in libcuda for the unit tests of src/cuda (built by the tests with the system C
 * compiler, loaded through NIXL_FABRIC_CUDA_LIB). "Device" memory is host memory that the
 * mock tracks; contexts are per-thread stacks. It is deliberately stricter than the real
 * driver: calls that need a context fail with CUDA_ERROR_INVALID_CONTEXT when none is
 * current, and stream/event calls fail when the current context is not their own. Events
 * report NOT_READY once after each record, to exercise polling.
 * Written from the public driver API reference; not part of the plugin. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct mctx { int magic; int dev; } *CUcontext;
typedef struct mstream { CUcontext ctx; } *CUstream;
typedef struct mevent { CUcontext ctx; int pending; } *CUevent;

enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, NO_DEVICE = 100,
       INVALID_DEVICE = 101, INVALID_CONTEXT = 201, INVALID_HANDLE = 400, NOT_READY = 600 };

#define NDEV 2
static struct mctx primary[NDEV] = { { 0x5ca1ab1e, 0 }, { 0x5ca1ab1e, 1 } };
static int primary_refs[NDEV];
static int inited;
static __thread CUcontext stack[16];
static __thread int depth;
static long n_get_current, n_set_current, n_push, n_pop;

struct alloc { uintptr_t base; size_t size; CUcontext ctx; unsigned type; int owned; int used; };
#define NALLOC 64
static struct alloc allocs[NALLOC];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static CUcontext cur(void) { return depth > 0 ? stack[depth - 1] : NULL; }

static int add_alloc(uintptr_t base, size_t size, unsigned type, int owned) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < NALLOC; i++) {
        if (!allocs[i].used) {
            allocs[i] = (struct alloc){ base, size, cur(), type, owned, 1 };
            pthread_mutex_unlock(&lock);
            return 0;
        }
    }
    pthread_mutex_unlock(&lock);
    return -1;
}

static struct alloc *find(uintptr_t p) {
    struct alloc *a = NULL;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < NALLOC; i++)
        if (allocs[i].used && p >= allocs[i].base && p < allocs[i].base + allocs[i].size) a = &allocs[i];
    pthread_mutex_unlock(&lock);
    return a;
}

static int remove_alloc(uintptr_t base) {
    struct alloc *a = find(base);
    if (!a || a->base != base) return -1;
    if (a->owned) free((void *)a->base);
    a->used = 0;
    return 0;
}

/* Test hooks. */
void mock_counters(long *get, long *set, long *push, long *pop) {
    *get = n_get_current; *set = n_set_current; *push = n_push; *pop = n_pop;
}
int mock_depth(void) { return depth; }

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
    { "201", "CUDA_ERROR_INVALID_CONTEXT" }, { "400", "CUDA_ERROR_INVALID_HANDLE" },
    { "600", "CUDA_ERROR_NOT_READY" },
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

static void put(void *slot, unsigned attr, struct alloc *a) {
    switch (attr) {
    case 1: *(void **)slot = a ? (void *)a->ctx : NULL; break;              /* CONTEXT */
    case 2: *(unsigned *)slot = a ? a->type : 0; break;                     /* MEMORY_TYPE */
    case 8: *(unsigned char *)slot = 0; break;                              /* IS_MANAGED (1 byte) */
    case 9: *(int *)slot = a ? (a->ctx ? a->ctx->dev : 0) : -2; break;      /* DEVICE_ORDINAL */
    case 11: *(CUdeviceptr *)slot = a ? a->base : 0; break;                 /* RANGE_START_ADDR */
    case 12: *(size_t *)slot = a ? a->size : 0; break;                      /* RANGE_SIZE */
    }
}
static int known_attr(unsigned a) { return a == 1 || a == 2 || a == 8 || a == 9 || a == 11 || a == 12; }

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

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    if (!cur()) return INVALID_CONTEXT;
    void *m = malloc(n);
    if (!m || add_alloc((uintptr_t)m, n, 2, 1)) { free(m); return OUT_OF_MEMORY; }
    *p = (uintptr_t)m;
    return OK;
}
CUresult cuMemFree_v2(CUdeviceptr p) { if (!cur()) return INVALID_CONTEXT; return remove_alloc(p) ? INVALID_VALUE : OK; }
CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags) {
    (void)flags;
    if (!cur()) return INVALID_CONTEXT;
    void *m = malloc(n);
    if (!m || add_alloc((uintptr_t)m, n, 1, 1)) { free(m); return OUT_OF_MEMORY; }
    memset(m, 0xee, n); /* not zeroed, like the real one */
    *p = m;
    return OK;
}
CUresult cuMemFreeHost(void *p) { if (!cur()) return INVALID_CONTEXT; return remove_alloc((uintptr_t)p) ? INVALID_VALUE : OK; }
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned flags) {
    (void)flags;
    if (!cur()) return INVALID_CONTEXT;
    if (find((uintptr_t)p)) return INVALID_VALUE;
    return add_alloc((uintptr_t)p, n, 1, 0) ? OUT_OF_MEMORY : OK;
}
CUresult cuMemHostUnregister(void *p) { if (!cur()) return INVALID_CONTEXT; return remove_alloc((uintptr_t)p) ? INVALID_VALUE : OK; }

static int known_range(CUdeviceptr p, size_t n) {
    struct alloc *a = find((uintptr_t)p);
    return a && (uintptr_t)p + n <= a->base + a->size;
}
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
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, CUstream st) {
    CUresult r = stream_ok(st);
    return r ? r : cuMemcpyHtoD_v2(d, s, n);
}
CUresult cuMemcpyDtoHAsync_v2(void *d, CUdeviceptr s, size_t n, CUstream st) {
    CUresult r = stream_ok(st);
    return r ? r : cuMemcpyDtoH_v2(d, s, n);
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) {
    CUresult r = stream_ok(st);
    return r ? r : cuMemcpyDtoD_v2(d, s, n);
}
CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) {
    CUresult r = stream_ok(st);
    if (r) return r;
    memmove((void *)(uintptr_t)d, (void *)(uintptr_t)s, n);
    return OK;
}
CUresult cuEventCreate(CUevent *e, unsigned flags) {
    if (flags != 2) return INVALID_VALUE; /* we always ask for DISABLE_TIMING */
    if (!cur()) return INVALID_CONTEXT;
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
