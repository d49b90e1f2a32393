/* A stand-in libcuda.so.1 for CPU-only hosts: the stock UCX plugin of NIXL 0.7.x-0.9.x
 * links the CUDA driver (NEEDED libcuda.so.1) and cannot be dlopen'ed without one, although
 * DRAM transfers never reach it. These are the eight entry points it imports; each answers
 * "no device" (CUDA_ERROR_NO_DEVICE, 100), except that the current context is "none".
 * Used only for those stock UCX cases of the version matrix, never for our plugin (which
 * would then believe a driver exists). */
typedef int status_t;
enum { NO_DEVICE = 100 };

status_t cuCtxGetCurrent(void **ctx) {
    if (ctx)
        *ctx = 0;
    return 0;
}
status_t cuCtxPopCurrent_v2(void **ctx) { (void)ctx; return NO_DEVICE; }
status_t cuCtxPushCurrent_v2(void *ctx) { (void)ctx; return NO_DEVICE; }
status_t cuCtxSetCurrent(void *ctx) { (void)ctx; return NO_DEVICE; }
status_t cuDeviceGet(int *dev, int ordinal) { (void)dev; (void)ordinal; return NO_DEVICE; }
status_t cuDevicePrimaryCtxRelease_v2(int dev) { (void)dev; return NO_DEVICE; }
status_t cuDevicePrimaryCtxRetain(void **ctx, int dev) { (void)ctx; (void)dev; return NO_DEVICE; }
status_t cuPointerGetAttributes(unsigned n, void *attrs, void **data, unsigned long long ptr) {
    (void)n; (void)attrs; (void)data; (void)ptr;
    return NO_DEVICE;
}
/* The stock LIBFABRIC plugin of 1.5.x imports this one too (bench/notif_netns.sh). */
status_t cuDeviceGetPCIBusId(char *id, int len, int dev) {
    (void)id;
    (void)len;
    (void)dev;
    return NO_DEVICE;
}
