/* nixl-fabric C harness: checks, timing, data patterns, engines, notifications, processes. */
#include "harness.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

int g_pass, g_fail, g_skip;
char g_ctx[96] = "harness";
int g_report_fd = -1;
bool g_quiet = false;

/* A suite process also reports every result to the orchestrator as one byte, so the
 * results of a suite that crashes part-way are still counted. */
static void report_byte(char c) {
    if (g_report_fd < 0)
        return;
    ssize_t w;
    do
        w = write(g_report_fd, &c, 1);
    while (w < 0 && errno == EINTR);
}

static void vline(const char *tag, const char *fmt, va_list ap) {
    char buf[1024];
    vsnprintf(buf, sizeof buf, fmt, ap);
    printf("%s %s: %s\n", tag, g_ctx, buf);
    fflush(stdout);
}

bool check(bool ok, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vline(ok ? "PASS" : "FAIL", fmt, ap);
    va_end(ap);
    if (ok)
        g_pass++;
    else
        g_fail++;
    report_byte(ok ? 'P' : 'F');
    return ok;
}

bool check_st(int got, int want, const char *fmt, ...) {
    char buf[900];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (got == want)
        return check(true, "%s -> %s", buf, st_name(got));
    return check(false, "%s -> got %s (%d), expected %s (%d)", buf, st_name(got), got, st_name(want), want);
}

void info(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vline("INFO", fmt, ap);
    va_end(ap);
}

void skip(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vline("SKIP", fmt, ap);
    va_end(ap);
    g_skip++;
    report_byte('S');
}

const char *st_name(int st) {
    if (st == HX_TIMEOUT)
        return "HARNESS_TIMEOUT(no completion within the harness deadline)";
    return nf_status_str((nf_status)st);
}

double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

double wait_limit_s(void) {
    static double v = 0;
    if (v == 0) {
        const char *e = getenv("HARNESS_WAIT_S");
        v = e ? atof(e) : 30.0;
        if (v <= 0)
            v = 30.0;
    }
    return v;
}

void sleep_ms(unsigned ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

void hx_pause(unsigned iter) {
    if (iter < 200) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, iter < 2000 ? 20000 : 200000};
    nanosleep(&ts, NULL);
}

void *xalloc(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 4096, n ? n : 1) != 0 || !p) {
        fprintf(stderr, "harness: out of memory allocating %zu bytes\n", n);
        abort();
    }
    memset(p, 0, n);
    return p;
}

uint64_t next_seed(void) {
    static uint64_t s = 0x243f6a8885a308d3ULL;
    s += 0x9e3779b97f4a7c15ULL;
    s ^= (uint64_t)getpid() << 17;
    return s;
}

static inline uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static inline uint8_t pat_byte(uint64_t seed, size_t i) {
    return (uint8_t)(mix(seed + (uint64_t)(i / 8) * 0x9e3779b97f4a7c15ULL) >> (8 * (i % 8)));
}

void fill_pattern(void *buf, size_t n, uint64_t seed) {
    uint8_t *b = buf;
    size_t words = n / 8;
    for (size_t w = 0; w < words; w++) {
        uint64_t v = mix(seed + (uint64_t)w * 0x9e3779b97f4a7c15ULL);
        memcpy(b + 8 * w, &v, 8); /* little-endian hosts: byte k of v is pattern byte 8w+k */
    }
    for (size_t i = words * 8; i < n; i++)
        b[i] = pat_byte(seed, i);
}

size_t verify_pattern(const void *buf, size_t n, uint64_t seed) {
    const uint8_t *b = buf;
    size_t words = n / 8;
    for (size_t w = 0; w < words; w++) {
        uint64_t v = mix(seed + (uint64_t)w * 0x9e3779b97f4a7c15ULL), g;
        memcpy(&g, b + 8 * w, 8);
        if (g != v) {
            for (size_t i = 8 * w; i < 8 * w + 8; i++)
                if (b[i] != pat_byte(seed, i))
                    return i;
        }
    }
    for (size_t i = words * 8; i < n; i++)
        if (b[i] != pat_byte(seed, i))
            return i;
    return SIZE_MAX;
}

size_t first_diff(const void *a, const void *b, size_t n) {
    if (memcmp(a, b, n) == 0)
        return SIZE_MAX;
    const uint8_t *x = a, *y = b;
    for (size_t i = 0; i < n; i++)
        if (x[i] != y[i])
            return i;
    return SIZE_MAX;
}

uint64_t fnv64(const void *buf, size_t n) {
    const uint8_t *b = buf;
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

/* ---- engines ------------------------------------------------------------------------ */
bool prov_uses_iface(const char *prov) {
    return strcmp(prov, "tcp") == 0 || strcmp(prov, "sockets") == 0 || strcmp(prov, "udp") == 0 ||
           strncmp(prov, "tcp;", 4) == 0 || strncmp(prov, "udp;", 4) == 0;
}

/* Environment fallback, used only when the nf_config API itself is broken (reported as a
 * failure once per process), so the rest of the engine still gets tested. */
static nf_engine *hx_engine_env(const char *name, const hx_mode *mode, uint64_t timeout_ms, int *st) {
    char v[32];
    setenv("NIXL_FABRIC_PROVIDER", mode->prov, 1);
    setenv("NIXL_FABRIC_IFACE", prov_uses_iface(mode->prov) ? "lo" : "", 1);
    setenv("NIXL_FABRIC_PROGRESS_THREAD", mode->thread ? "true" : "false", 1);
    snprintf(v, sizeof v, "%llu", (unsigned long long)(timeout_ms ? timeout_ms : 5000));
    setenv("NIXL_FABRIC_TIMEOUT_MS", v, 1);
    nf_engine *e = NULL;
    *st = nf_engine_create(name, NULL, &e);
    return *st == NF_SUCCESS ? e : NULL;
}

nf_engine *hx_engine(const char *name, const hx_mode *mode, uint64_t timeout_ms, int *st) {
    static bool cfg_broken = false;
    if (cfg_broken)
        return hx_engine_env(name, mode, timeout_ms, st);
    nf_config *cfg = NULL;
    nf_engine *e = NULL;
    const char *what = "nf_config_new";
    int s = nf_config_new(&cfg);
    if (s != NF_SUCCESS)
        goto cfg_fail;
    what = "nf_config_set(provider)";
    if ((s = nf_config_set(cfg, "provider", mode->prov)) != NF_SUCCESS)
        goto cfg_fail;
    /* The Makefile exports NIXL_FABRIC_IFACE=lo; providers without interfaces get none. */
    what = "nf_config_set(iface)";
    if ((s = nf_config_set(cfg, "iface", prov_uses_iface(mode->prov) ? "lo" : "")) != NF_SUCCESS)
        goto cfg_fail;
    what = "nf_config_set(progress_thread)";
    if ((s = nf_config_set(cfg, "progress_thread", mode->thread ? "true" : "false")) != NF_SUCCESS)
        goto cfg_fail;
    if (timeout_ms) {
        char v[32];
        snprintf(v, sizeof v, "%llu", (unsigned long long)timeout_ms);
        what = "nf_config_set(timeout_ms)";
        if ((s = nf_config_set(cfg, "timeout_ms", v)) != NF_SUCCESS)
            goto cfg_fail;
    }
    {
        char buf[64];
        size_t len = 0;
        what = "nf_config_get(provider)";
        if ((s = nf_config_get(cfg, "provider", buf, sizeof buf, &len)) != NF_SUCCESS)
            goto cfg_fail;
        if (strcmp(buf, mode->prov) != 0 || len != strlen(mode->prov)) {
            s = NF_ERR_MISMATCH;
            goto cfg_fail;
        }
    }
    s = nf_engine_create(name, cfg, &e);
    nf_config_free(cfg);
    *st = s;
    return s == NF_SUCCESS ? e : NULL;
cfg_fail:
    nf_config_free(cfg);
    cfg_broken = true;
    if (!g_quiet)
        check(false, "%s on a fresh config -> %s; using the NIXL_FABRIC_* environment and a NULL config "
                     "for the rest of this process", what, st_name(s));
    return hx_engine_env(name, mode, timeout_ms, st);
}

/* Parses the documented connection-info layout (README, "Wire formats") far enough to see
 * each rail's endpoint address; for the socket providers every one must be loopback. */
bool check_loopback(const uint8_t *ci, size_t len, const char *prov, const char *who) {
    size_t o = 32;
    uint16_t n;
    char shown[256] = "";
    bool ok = true, parsed = len >= o + 2;
#define RD16(v)                                                                                              \
    do {                                                                                                     \
        if (o + 2 > len) {                                                                                   \
            parsed = false;                                                                                  \
            goto out;                                                                                        \
        }                                                                                                    \
        memcpy(&(v), ci + o, 2);                                                                             \
        o += 2;                                                                                              \
    } while (0)
    if (!parsed)
        goto out;
    RD16(n);
    o += n; /* agent name */
    uint16_t rails;
    RD16(rails);
    for (unsigned r = 0; r < rails; r++) {
        uint16_t pl, al;
        RD16(pl);
        o += pl;
        RD16(al);
        if (o + al > len) {
            parsed = false;
            goto out;
        }
        const uint8_t *a = ci + o;
        o += al;
        uint16_t fam = al >= 2 ? (uint16_t)(a[0] | a[1] << 8) : 0;
        char one[80];
        if (fam == 2 && al >= 8) { /* AF_INET */
            snprintf(one, sizeof one, "%u.%u.%u.%u:%u", a[4], a[5], a[6], a[7], (unsigned)(a[2] << 8 | a[3]));
            ok &= a[4] == 127;
        } else if (fam == 10 && al >= 24) { /* AF_INET6: ::1 or ::ffff:127.x.x.x */
            static const uint8_t lo6[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
            static const uint8_t v4m[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
            bool lo = memcmp(a + 8, lo6, 16) == 0 || (memcmp(a + 8, v4m, 12) == 0 && a[20] == 127);
            snprintf(one, sizeof one, "ipv6%s", lo ? " loopback" : " NOT loopback");
            ok &= lo;
        } else {
            size_t k = 0;
            while (k < al && a[k] >= 0x20 && a[k] < 0x7f)
                k++;
            if (k > 0 && (k == al || a[k] == 0))
                snprintf(one, sizeof one, "name '%.*s'", (int)(k < 60 ? k : 60), (const char *)a);
            else
                snprintf(one, sizeof one, "%u-byte address, family %u", al, fam);
            ok &= !prov_uses_iface(prov);
        }
        size_t sl = strlen(shown);
        snprintf(shown + sl, sizeof shown - sl, "%s%s", r ? ", " : "", one);
    }
out:
#undef RD16
    if (!parsed)
        return check(false, "%s: connection info does not follow the documented layout", who);
    if (!prov_uses_iface(prov)) {
        info("%s: rail address(es): %s", who, shown);
        return true;
    }
    return check(ok, "%s: every rail listens on loopback (%s)", who, shown);
}

bool hx_exchange(nf_engine *a, const char *aname, nf_engine *b, const char *bname) {
    nf_blob ba = {0}, bb = {0};
    int s1 = nf_engine_conn_info(a, &ba);
    int s2 = nf_engine_conn_info(b, &bb);
    bool ok = check(s1 == NF_SUCCESS && s2 == NF_SUCCESS && ba.len > 0 && bb.len > 0,
                    "nf_engine_conn_info of both engines (%s %zu B, %s %zu B)", st_name(s1), ba.len,
                    st_name(s2), bb.len);
    if (ok) {
        s1 = nf_engine_load_conn_info(a, bname, bb.data, bb.len);
        s2 = nf_engine_load_conn_info(b, aname, ba.data, ba.len);
        ok = check_st(s1, NF_SUCCESS, "%s loads conn info of %s", aname, bname) &
             check_st(s2, NF_SUCCESS, "%s loads conn info of %s", bname, aname);
    }
    nf_blob_free(&ba);
    nf_blob_free(&bb);
    return ok;
}

int wait_req(nf_engine *e, nf_request *r, nf_engine *drive, bool thread) {
    double end = now_s() + wait_limit_s();
    for (unsigned it = 0;; it++) {
        int s = nf_request_check(e, r);
        if (s != NF_IN_PROG)
            return s;
        if (now_s() > end)
            return HX_TIMEOUT;
        if (!thread) {
            nf_engine_progress(e);
            if (drive)
                nf_engine_progress(drive);
            if (it > 2000)
                hx_pause(200);
        } else {
            hx_pause(it);
        }
    }
}

int post_wait(nf_engine *e, nf_request *r, nf_engine *drive, const void *notif, size_t nlen,
              bool has_notif, bool thread) {
    int s = nf_request_post(e, r, notif, nlen, has_notif);
    if (s != NF_IN_PROG)
        return s;
    return wait_req(e, r, drive, thread);
}

/* ---- notifications ------------------------------------------------------------------ */
void notifq_init(hx_notifq *q) {
    memset(q, 0, sizeof *q);
    q->watch_bad = SIZE_MAX;
}

void notifq_clear(hx_notifq *q) {
    for (int i = 0; i < q->n; i++)
        free(q->items[i].msg);
    q->n = 0;
    q->dropped = 0;
    q->on_arrival = NULL;
    q->watch_tag = NULL;
    q->watch_buf = q->watch_ref = NULL;
    q->watch_len = 0;
    q->watch_hits = q->watch_ok = 0;
    q->watch_bad = SIZE_MAX;
}

void hx_notif_cb(void *ctx, const char *sender, size_t sender_len, const uint8_t *msg, size_t msg_len) {
    hx_notifq *q = ctx;
    hx_notif n;
    memset(&n, 0, sizeof n);
    size_t sl = sender_len < sizeof n.sender - 1 ? sender_len : sizeof n.sender - 1;
    if (sender && sl)
        memcpy(n.sender, sender, sl);
    n.sender[sl] = 0;
    n.msg = malloc(msg_len + 1);
    if (msg_len && msg)
        memcpy(n.msg, msg, msg_len);
    n.msg[msg_len] = 0;
    n.len = msg_len;
    if (q->on_arrival)
        q->on_arrival(q, &n);
    if (q->n < HX_MAXQ) {
        q->items[q->n++] = n;
    } else {
        q->dropped++;
        free(n.msg);
    }
}

void hx_watch_arrival(hx_notifq *q, const hx_notif *n) {
    if (!q->watch_tag || n->len != strlen(q->watch_tag) || memcmp(n->msg, q->watch_tag, n->len) != 0)
        return;
    q->watch_hits++;
    size_t d = first_diff(q->watch_buf, q->watch_ref, q->watch_len);
    if (d == SIZE_MAX)
        q->watch_ok++;
    else if (q->watch_bad == SIZE_MAX)
        q->watch_bad = d;
}

bool notifq_wait(nf_engine *e, hx_notifq *q, int want, nf_engine *also, bool thread, double limit_s) {
    double end = now_s() + limit_s;
    for (unsigned it = 0;; it++) {
        nf_engine_get_notifs(e, hx_notif_cb, q);
        if (q->n >= want)
            return true;
        if (now_s() > end)
            return false;
        if (!thread) {
            nf_engine_progress(e);
            if (also)
                nf_engine_progress(also);
            if (it > 2000)
                hx_pause(200);
        } else {
            hx_pause(it);
        }
    }
}

/* ---- processes ---------------------------------------------------------------------- */
int spawn_self(char *const argv[], int keep) {
    static char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0)
        return -1;
    exe[n] = 0;
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        /* Only async-signal-safe calls between fork and exec (the parent has threads). */
        int fl = fcntl(keep, F_GETFD);
        if (fl >= 0)
            fcntl(keep, F_SETFD, fl & ~FD_CLOEXEC);
        execv(exe, argv);
        _exit(127);
    }
    return pid;
}

int wait_child(int pid, double limit_s) {
    double end = now_s() + limit_s;
    int status = 0;
    for (;;) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid)
            return status;
        if (r < 0 && errno != EINTR)
            return -1;
        if (now_s() > end) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            return -1;
        }
        sleep_ms(5);
    }
}

static bool write_all(int fd, const void *buf, size_t len) {
    const uint8_t *p = buf;
    while (len) {
        ssize_t w = write(fd, p, len);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return false;
        p += w;
        len -= (size_t)w;
    }
    return true;
}

static bool read_all(int fd, void *buf, size_t len, double end) {
    uint8_t *p = buf;
    while (len) {
        double left = end - now_s();
        if (left <= 0)
            return false;
        struct pollfd pfd = {fd, POLLIN, 0};
        int pr = poll(&pfd, 1, (int)(left * 1000) + 1);
        if (pr < 0 && errno == EINTR)
            continue;
        if (pr <= 0)
            return false;
        ssize_t r = read(fd, p, len);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return false;
        p += r;
        len -= (size_t)r;
    }
    return true;
}

bool msg_send(int fd, const void *buf, size_t len) {
    uint32_t l = (uint32_t)len;
    uint8_t *b = malloc(len + 4);
    if (!b)
        return false;
    memcpy(b, &l, 4);
    memcpy(b + 4, buf, len);
    bool ok = write_all(fd, b, len + 4); /* one write: a reader never sees half a header */
    free(b);
    return ok;
}

bool msg_sendf(int fd, const char *fmt, ...) {
    char b[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b, sizeof b, fmt, ap);
    va_end(ap);
    if (n < 0)
        return false;
    return msg_send(fd, b, (size_t)n < sizeof b ? (size_t)n : sizeof b - 1);
}

uint8_t *msg_recv(int fd, size_t *len, double limit_s) {
    uint32_t l;
    /* Only the wait for a message to start is bounded by limit_s (which may be tiny, for
     * polling); once it has started the rest is read with the full bound, so a short poll
     * never drops half a message and desynchronises the stream. */
    struct pollfd pfd = {fd, POLLIN, 0};
    int ms = limit_s <= 0 ? 0 : (int)(limit_s * 1000);
    int pr;
    do
        pr = poll(&pfd, 1, ms);
    while (pr < 0 && errno == EINTR);
    if (pr <= 0)
        return NULL;
    double end = now_s() + wait_limit_s();
    if (!read_all(fd, &l, 4, end))
        return NULL;
    if (l > (64u << 20))
        return NULL;
    uint8_t *b = malloc((size_t)l + 1);
    if (!b)
        return NULL;
    if (!read_all(fd, b, l, end)) {
        free(b);
        return NULL;
    }
    b[l] = 0;
    *len = l;
    return b;
}
