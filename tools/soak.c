/* nixl-fabric soak: mixed WRITE/READ traffic (4 KiB .. 16 MiB, with notifications) from
 * one initiator engine to a peer process that is killed (SIGKILL) and respawned every
 * SOAK_RESTART_S seconds. After each restart the initiator loads the new peer's connection
 * info and memory descriptor under the same peer name and carries on.
 *
 * Uses only include/nixl_fabric.h (and the C harness helpers in plugin_tests/harness_util.c).
 *
 *   nf_soak                     run (the initiator)
 *   nf_soak --peer <fd>         the peer process (started by the initiator)
 *
 * Environment: SOAK_SECONDS (600), SOAK_RESTART_S (60), SOAK_PROVIDER (tcp),
 * SOAK_TIMEOUT_MS (2000: the engine's timeout_ms, how fast a dead peer is noticed),
 * SOAK_INFLIGHT (4, requests in flight at once), SOAK_SEED, HARNESS_WAIT_S (30: bound of
 * every wait).
 *
 * Checks: every WRITE carries a notification and the peer verifies the bytes when it
 * arrives; every READ is compared with the peer's known pattern. Exit status 1 when data
 * was wrong, when an operation failed while its peer was alive, when a wait ran out, when
 * the peer could not be restarted, or when a request caught by a kill ended with a status
 * other than NIXL_ERR_REMOTE_DISCONNECT; those failures themselves are expected and counted. */
#include "harness.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <dirent.h>
#include <malloc.h>
#include <unistd.h>

#define MAX_XFER (16 * MiB)
#define MIN_XFER (4 * KiB)
#define MAX_SLOTS 16
#define READ_SEED 0x5eedf00d5eedULL
#define PEER_NAME "soak-peer"
#define INIT_NAME "soak-initiator"

static double env_num(const char *k, double d) {
    const char *v = getenv(k);
    return v && *v && atof(v) > 0 ? atof(v) : d;
}

/* ---- /proc ------------------------------------------------------------------------- */
static long proc_kb(const char *key) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f)
        return -1;
    char line[256];
    long v = -1;
    size_t kl = strlen(key);
    while (fgets(line, sizeof line, f))
        if (strncmp(line, key, kl) == 0 && line[kl] == ':') {
            v = atol(line + kl + 1);
            break;
        }
    fclose(f);
    return v;
}

/* Bytes malloc'd and not freed, over every glibc arena (mallinfo2 sees only the main one;
 * the engine's threads allocate from their own): parsed from malloc_info's totals. */
static long heap_kb(void) {
    char *doc = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&doc, &len);
    if (!f)
        return -1;
    malloc_info(0, f);
    fclose(f);
    long long fast = 0, rest = 0, mmap_sz = 0, cur = 0, v;
    /* The totals over all arenas are the last occurrences, after the per-arena sections. */
    for (char *p = doc; p && *p; p = strchr(p + 1, '<')) {
        if (sscanf(p, "<total type=\"fast\" count=\"%*d\" size=\"%lld\"", &v) == 1)
            fast = v;
        else if (sscanf(p, "<total type=\"rest\" count=\"%*d\" size=\"%lld\"", &v) == 1)
            rest = v;
        else if (sscanf(p, "<total type=\"mmap\" count=\"%*d\" size=\"%lld\"", &v) == 1)
            mmap_sz = v;
        else if (sscanf(p, "<system type=\"current\" size=\"%lld\"", &v) == 1)
            cur = v;
    }
    free(doc);
    return (long)((cur - fast - rest + mmap_sz) / 1024);
}

static int fd_count(void) {
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return -1;
    int n = 0;
    while (readdir(d))
        n++;
    closedir(d);
    return n - 3; /* ".", ".." and the DIR's own fd */
}

/* ---- peer -------------------------------------------------------------------------- */
typedef struct {
    int fd;
    uint8_t *buf;
    size_t cap;
    unsigned long notifs;
} peer_t;

#define preply(p, ...) msg_sendf((p)->fd, __VA_ARGS__)

/* In nf_notif_cb: a WRITE's bytes must be in place when its notification arrives. */
static void peer_cb(void *ctx, const char *sender, size_t sl, const uint8_t *msg, size_t len) {
    (void)sender;
    (void)sl;
    peer_t *p = ctx;
    p->notifs++;
    char cmd[128];
    size_t cl = len < sizeof cmd - 1 ? len : sizeof cmd - 1;
    memcpy(cmd, msg, cl);
    cmd[cl] = 0;
    unsigned long long id = 0, seed = 0, off = 0, n = 0;
    if (cmd[0] == 'W' && sscanf(cmd, "W %llu %llx %llu %llu", &id, &seed, &off, &n) == 4 && off + n <= p->cap) {
        size_t bad = verify_pattern(p->buf + off, n, seed);
        if (bad == SIZE_MAX)
            preply(p, "OK %llu", id);
        else
            preply(p, "BAD %llu %zu", id, bad);
    } else if (cmd[0] == 'R' && sscanf(cmd, "R %llu", &id) == 1) {
        preply(p, "NR %llu", id);
    } else {
        preply(p, "BADCMD %s", cmd);
    }
}

static int peer_main(int fd, size_t slots) {
    g_quiet = true;
    snprintf(g_ctx, sizeof g_ctx, "soak-peer");
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() == 1)
        return 9;
    const char *prov = getenv("SOAK_PROVIDER") ? getenv("SOAK_PROVIDER") : "tcp";
    hx_mode m = {prov, true};
    peer_t p = {.fd = fd, .cap = slots * MAX_XFER + MAX_XFER};
    int s;
    nf_engine *e = hx_engine(PEER_NAME, &m, (uint64_t)env_num("SOAK_TIMEOUT_MS", 2000), &s);
    if (!e) {
        preply(&p, "ERR nf_engine_create %s", st_name(s));
        return 3;
    }
    p.buf = xalloc(p.cap);
    /* The last MAX_XFER bytes are the READ source: a fixed pattern, never written. */
    fill_pattern(p.buf + slots * MAX_XFER, MAX_XFER, READ_SEED);
    nf_mem *mem = NULL;
    nf_blob ci = {0}, md = {0};
    if ((s = nf_mem_register(e, (uint64_t)(uintptr_t)p.buf, p.cap, NF_MEM_DRAM, 0, &mem)) != NF_SUCCESS ||
        (s = nf_engine_conn_info(e, &ci)) != NF_SUCCESS || (s = nf_mem_public_data(e, mem, &md)) != NF_SUCCESS) {
        preply(&p, "ERR setup %s", st_name(s));
        return 3;
    }
    char base[64];
    int bl = snprintf(base, sizeof base, "BASE %llx", (unsigned long long)(uintptr_t)p.buf);
    if (!msg_send(fd, ci.data, ci.len) || !msg_send(fd, md.data, md.len) || !msg_send(fd, base, (size_t)bl))
        return 4;
    nf_blob_free(&ci);
    nf_blob_free(&md);
    size_t pl = 0;
    uint8_t *pci = msg_recv(fd, &pl, wait_limit_s());
    if (!pci)
        return 5;
    s = nf_engine_load_conn_info(e, INIT_NAME, pci, pl);
    preply(&p, "LOADED %s", st_name(s));
    free(pci);
    /* Serve until the initiator closes the socket (or kills us). */
    for (unsigned it = 0;; it++) {
        nf_engine_get_notifs(e, peer_cb, &p);
        struct pollfd pf = {fd, POLLIN, 0};
        if (poll(&pf, 1, 0) > 0 && (pf.revents & (POLLIN | POLLHUP | POLLERR))) {
            char c;
            ssize_t r = recv(fd, &c, 1, MSG_DONTWAIT);
            if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR))
                break;
        }
        hx_pause(it % 2000 + 200);
    }
    nf_mem_deregister(e, mem);
    nf_engine_destroy(e);
    free(p.buf);
    return 0;
}

/* ---- initiator --------------------------------------------------------------------- */
typedef struct {
    nf_request *req;
    bool active;       /* posted, status not yet final */
    bool awaiting;     /* done, the peer's answer to its notification not yet received */
    bool answered;     /* the peer answered (possibly before we saw the request finish) */
    bool read, notif;
    unsigned gen;      /* peer generation it was posted against */
    unsigned long long id;
    uint64_t seed;
    size_t off, len, roff;
    double t_post, t_done;
} slot_t;

typedef struct {
    const char *prov;
    nf_engine *e;
    nf_mem *mem;
    uint8_t *buf, *ref;
    size_t nslots;
    slot_t slots[MAX_SLOTS];
    /* current peer */
    int pid, fd;
    unsigned gen;
    nf_rmem *rm;
    uint64_t rbase;
    double peer_since;
    /* figures */
    unsigned long long next_id;
    unsigned long ops, writes, reads, notifs_sent, notif_acks, verified, bad_data, read_ok, read_bad;
    unsigned long notif_unsent, kill_wrong_status;
    unsigned long errs_live, errs_kill, lost_verif, wait_timeouts, restarts, restart_fail, release_refused;
    unsigned long long bytes;
    double lat_sum, lat_max; /* seconds from post to final status, successful requests */
    unsigned long st_count[16]; /* by -status, NF_ERR_* are -1..-11 */
    unsigned long st_other;
    uint64_t rng;
} soak_t;

static uint64_t rnd(soak_t *s) {
    s->rng ^= s->rng << 13;
    s->rng ^= s->rng >> 7;
    s->rng ^= s->rng << 17;
    return s->rng;
}

static void count_status(soak_t *s, int st) {
    if (st < 0 && st > -16)
        s->st_count[-st]++;
    else
        s->st_other++;
}

/* Sizes: log-uniform over 4 KiB .. 16 MiB, odd lengths and offsets included. */
static size_t pick_len(soak_t *s) {
    unsigned sh = 12 + (unsigned)(rnd(s) % 13); /* 2^12 .. 2^24 */
    size_t len = (size_t)1 << sh;
    if (rnd(s) % 2)
        len += rnd(s) % len; /* between powers of two */
    if (len > MAX_XFER)
        len = MAX_XFER;
    return len;
}

static bool start_peer(soak_t *s) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
        return false;
    char fdarg[16], slots[16];
    snprintf(fdarg, sizeof fdarg, "%d", sv[1]);
    snprintf(slots, sizeof slots, "%zu", s->nslots);
    char *argv[] = {"nf_soak", "--peer", fdarg, slots, NULL};
    s->pid = spawn_self(argv, sv[1]);
    close(sv[1]);
    s->fd = sv[0];
    if (s->pid <= 0) {
        close(s->fd);
        return false;
    }
    size_t cl = 0, ml = 0, bl = 0;
    uint8_t *ci = msg_recv(s->fd, &cl, wait_limit_s());
    uint8_t *md = ci ? msg_recv(s->fd, &ml, wait_limit_s()) : NULL;
    uint8_t *base = md ? msg_recv(s->fd, &bl, wait_limit_s()) : NULL;
    unsigned long long rb = 0;
    bool ok = ci && md && base && sscanf((char *)base, "BASE %llx", &rb) == 1;
    int st = NF_ERR_UNKNOWN, st2 = NF_ERR_UNKNOWN;
    if (ok) {
        /* The same peer name, new incarnation: replaces the old connection. */
        st = nf_engine_load_conn_info(s->e, PEER_NAME, ci, cl);
        st2 = st == NF_SUCCESS ? nf_rmem_load(s->e, PEER_NAME, md, ml, &s->rm) : st;
        ok = st == NF_SUCCESS && st2 == NF_SUCCESS;
    }
    if (ok) {
        nf_blob mine = {0};
        ok = nf_engine_conn_info(s->e, &mine) == NF_SUCCESS && msg_send(s->fd, mine.data, mine.len);
        nf_blob_free(&mine);
        size_t n = 0;
        char *rep = ok ? (char *)msg_recv(s->fd, &n, wait_limit_s()) : NULL;
        ok = rep && strcmp(rep, "LOADED NIXL_SUCCESS") == 0;
        if (!ok)
            fprintf(stderr, "soak: peer did not load our conn info: %s\n", rep ? rep : "no reply");
        free(rep);
    } else {
        fprintf(stderr, "soak: peer start failed: %s, load conn info %s, rmem load %s\n",
                ci && ci[0] == 'E' ? (char *)ci : ok ? "" : "no/short setup messages", st_name(st), st_name(st2));
    }
    free(ci);
    free(md);
    free(base);
    s->rbase = rb;
    s->gen++;
    s->peer_since = now_s();
    if (!ok) {
        kill(s->pid, SIGKILL);
        wait_child(s->pid, wait_limit_s());
        close(s->fd);
        s->pid = -1;
        s->fd = -1;
        if (s->rm) {
            nf_rmem_unload(s->e, s->rm);
            s->rm = NULL;
        }
    }
    return ok;
}

static void finish_slot(soak_t *s, slot_t *sl) {
    int rs = nf_request_release(s->e, sl->req);
    if (rs == NF_ERR_REPOST_ACTIVE) {
        s->release_refused++;
        rs = nf_request_release(s->e, sl->req);
    }
    sl->req = NULL;
    sl->active = false;
}

/* A final status for slot `sl`; `killed`: its peer was killed while it was in flight. */
static void settle(soak_t *s, slot_t *sl, int st, bool killed) {
    sl->t_done = now_s();
    s->ops++;
    if (st == NF_SUCCESS) {
        s->bytes += sl->len;
        double lat = sl->t_done - sl->t_post;
        s->lat_sum += lat;
        if (lat > s->lat_max)
            s->lat_max = lat;
        if (sl->read) {
            if (memcmp(s->buf + sl->off, s->ref + sl->roff, sl->len) == 0) {
                s->read_ok++;
            } else {
                s->read_bad++;
                fprintf(stderr, "soak: READ id %llu (%zu B from peer offset %zu) returned wrong bytes (first at %zu)\n",
                        sl->id, sl->len, sl->roff, first_diff(s->buf + sl->off, s->ref + sl->roff, sl->len));
            }
        }
        /* WRITEs and READs with a notification wait for the peer's answer (which may
         * already be here: the notification leaves as the request completes). */
        sl->awaiting = sl->notif && !killed && !sl->answered;
        if (sl->notif && killed && !sl->answered)
            s->lost_verif++;
    } else {
        count_status(s, st);
        if (st == HX_TIMEOUT)
            s->wait_timeouts++;
        if (sl->notif)
            s->notif_unsent++; /* a failed request sends no notification */
        if (killed) {
            s->errs_kill++;
            /* A dead peer is NIXL_ERR_REMOTE_DISCONNECT (README: timeout_ms, flushed ops);
             * nobody cancelled these requests. */
            if (st != NF_ERR_REMOTE_DISCONNECT) {
                s->kill_wrong_status++;
                fprintf(stderr, "soak: %s id %llu (%zu B%s) in flight at a kill ended with %s (%d), expected "
                                "NIXL_ERR_REMOTE_DISCONNECT\n", sl->read ? "READ" : "WRITE", sl->id, sl->len,
                        sl->notif ? " + notification" : "", st_name(st), st);
            }
        } else {
            s->errs_live++;
            fprintf(stderr, "soak: %s id %llu (%zu B) failed with a live peer: %s (%d)\n", sl->read ? "READ" : "WRITE",
                    sl->id, sl->len, st_name(st), st);
        }
    }
    finish_slot(s, sl);
}

/* Reads the peer's answers (non-blocking). */
static void drain_replies(soak_t *s, double wait) {
    for (;;) {
        size_t n = 0;
        char *r = s->fd >= 0 ? (char *)msg_recv(s->fd, &n, wait) : NULL;
        if (!r)
            return;
        wait = 0;
        unsigned long long id = 0, bad = 0;
        bool ok = sscanf(r, "OK %llu", &id) == 1, nr = !ok && sscanf(r, "NR %llu", &id) == 1;
        bool bd = !ok && !nr && sscanf(r, "BAD %llu %llu", &id, &bad) == 2;
        slot_t *hit = NULL;
        for (size_t i = 0; i < s->nslots; i++)
            if ((s->slots[i].awaiting || (s->slots[i].active && s->slots[i].notif && !s->slots[i].answered)) &&
                s->slots[i].id == id)
                hit = &s->slots[i];
        if (!hit || !(ok || nr || bd)) {
            fprintf(stderr, "soak: unexpected peer reply '%s'\n", r);
            s->bad_data++;
        } else {
            hit->awaiting = false;
            hit->answered = true;
            s->notif_acks++;
            if (ok)
                s->verified++;
            if (bd) {
                s->bad_data++;
                fprintf(stderr, "soak: WRITE id %llu (%zu B): peer found wrong bytes at offset %llu when the "
                                "notification arrived\n", id, hit->len, bad);
            }
        }
        free(r);
    }
}

static void post_slot(soak_t *s, slot_t *sl, size_t idx) {
    memset(sl, 0, sizeof *sl);
    sl->id = ++s->next_id;
    sl->gen = s->gen;
    sl->read = rnd(s) % 2;
    sl->len = pick_len(s);
    sl->off = idx * MAX_XFER + (size_t)(rnd(s) % (MAX_XFER - sl->len + 1));
    size_t roff = sl->read ? s->nslots * MAX_XFER : idx * MAX_XFER; /* peer: read source or this slot */
    size_t rin = (size_t)(rnd(s) % (MAX_XFER - sl->len + 1));
    sl->roff = rin;
    roff += rin;
    sl->notif = !sl->read || rnd(s) % 2;
    char tag[128];
    int tl;
    if (sl->read) {
        memset(s->buf + sl->off, 0, sl->len);
        tl = snprintf(tag, sizeof tag, "R %llu", sl->id);
    } else {
        sl->seed = rnd(s);
        fill_pattern(s->buf + sl->off, sl->len, sl->seed);
        tl = snprintf(tag, sizeof tag, "W %llu %llx %zu %zu", sl->id, (unsigned long long)sl->seed, roff, sl->len);
    }
    /* 1..4 descriptor pairs over the range (contiguous pieces). */
    nf_xfer_desc l[4], r[4];
    size_t nd = 1 + (size_t)(rnd(s) % 4), done = 0;
    if (sl->len < nd * 8)
        nd = 1;
    for (size_t i = 0; i < nd; i++) {
        size_t piece = i + 1 == nd ? sl->len - done : sl->len / nd;
        l[i] = (nf_xfer_desc){(uint64_t)(uintptr_t)(s->buf + sl->off + done), piece, s->mem};
        r[i] = (nf_xfer_desc){s->rbase + roff + done, piece, s->rm};
        done += piece;
    }
    if (sl->read)
        s->reads++;
    else
        s->writes++;
    int st = nf_request_create(s->e, sl->read ? NF_OP_READ : NF_OP_WRITE, l, r, nd, PEER_NAME, &sl->req);
    sl->t_post = now_s();
    if (st != NF_SUCCESS) {
        sl->req = NULL;
        s->ops++;
        count_status(s, st);
        s->errs_live++;
        fprintf(stderr, "soak: nf_request_create (%zu B) -> %s\n", sl->len, st_name(st));
        return;
    }
    if (sl->notif)
        s->notifs_sent++;
    st = nf_request_post(s->e, sl->req, (const uint8_t *)tag, (size_t)tl, sl->notif);
    sl->active = true;
    if (st != NF_IN_PROG)
        settle(s, sl, st, false);
}

/* Checks an active slot once: settles it when its request ended, or with HX_TIMEOUT past
 * `deadline`; `at_kill` says whether it was in flight when a peer was killed. Returns
 * whether it is still in flight. */
static bool poll_slot(soak_t *s, slot_t *sl, double deadline, bool at_kill) {
    int st = nf_request_check(s->e, sl->req);
    if (st != NF_IN_PROG)
        settle(s, sl, st, at_kill);
    else if (now_s() > deadline)
        settle(s, sl, HX_TIMEOUT, at_kill);
    else
        return true;
    return false;
}

/* Polls every active slot once. */
static void poll_slots(soak_t *s) {
    double lim = wait_limit_s();
    for (size_t i = 0; i < s->nslots; i++) {
        slot_t *sl = &s->slots[i];
        if (sl->active)
            poll_slot(s, sl, sl->t_post + lim, sl->gen != s->gen);
    }
    for (size_t i = 0; i < s->nslots; i++) {
        slot_t *sl = &s->slots[i];
        if (sl->awaiting && now_s() - sl->t_done > lim) {
            sl->awaiting = false;
            s->wait_timeouts++;
            fprintf(stderr, "soak: no answer from the peer for notification of id %llu within %.0f s\n", sl->id, lim);
        }
    }
}

static void status_line(soak_t *s, const char *what, double t0) {
    printf("soak %7.1f s  %-18s ops %lu (W %lu R %lu)  %.2f GiB  verified %lu  errors: live %lu, at kill %lu  "
           "RSS %ld KiB  heap %ld KiB  fds %d\n",
           now_s() - t0, what, s->ops, s->writes, s->reads, (double)s->bytes / (1 << 30), s->verified, s->errs_live,
           s->errs_kill, proc_kb("VmRSS"), heap_kb(), fd_count());
    fflush(stdout);
}

/* SIGKILLs the peer with whatever is in flight, settles those requests (bounded), then
 * starts a new peer and loads its conn info. */
static bool restart_peer(soak_t *s) {
    kill(s->pid, SIGKILL);
    int ws = wait_child(s->pid, wait_limit_s());
    (void)ws;
    unsigned dead_gen = s->gen;
    /* Answers the dead peer sent before it died still count. */
    drain_replies(s, 0);
    for (size_t i = 0; i < s->nslots; i++)
        if (s->slots[i].awaiting) {
            s->slots[i].awaiting = false;
            s->lost_verif++;
        }
    close(s->fd);
    s->fd = -1;
    /* In-flight requests against the dead peer: wait for their final status (bounded). */
    double end = now_s() + wait_limit_s();
    for (;;) {
        bool any = false;
        for (size_t i = 0; i < s->nslots; i++) {
            slot_t *sl = &s->slots[i];
            if (sl->active && poll_slot(s, sl, end, sl->gen == dead_gen))
                any = true;
        }
        if (!any)
            break;
        sleep_ms(1);
    }
    if (s->rm) {
        int us = nf_rmem_unload(s->e, s->rm);
        if (us != NF_SUCCESS)
            fprintf(stderr, "soak: nf_rmem_unload of the dead peer's descriptor -> %s\n", st_name(us));
        s->rm = NULL;
    }
    s->restarts++;
    for (int attempt = 0; attempt < 3; attempt++) {
        if (start_peer(s))
            return true;
        s->restart_fail++;
        sleep_ms(500);
    }
    return false;
}

static int soak_main(void) {
    soak_t s;
    memset(&s, 0, sizeof s);
    s.prov = getenv("SOAK_PROVIDER") && *getenv("SOAK_PROVIDER") ? getenv("SOAK_PROVIDER") : "tcp";
    double secs = env_num("SOAK_SECONDS", 600), every = env_num("SOAK_RESTART_S", 60);
    s.nslots = (size_t)env_num("SOAK_INFLIGHT", 4);
    if (s.nslots > MAX_SLOTS)
        s.nslots = MAX_SLOTS;
    s.rng = (uint64_t)env_num("SOAK_SEED", 0x2545f4914f6cdd1dULL) | 1;
    uint64_t tmo = (uint64_t)env_num("SOAK_TIMEOUT_MS", 2000);
    s.fd = s.pid = -1;
    snprintf(g_ctx, sizeof g_ctx, "soak");
    printf("nixl-fabric soak: library %s, provider %s, %.0f s, peer SIGKILLed and respawned every %.0f s, %zu in "
           "flight, sizes 4 KiB..16 MiB, engine timeout_ms %llu, wait bound %.0f s\n",
           nf_version(), s.prov, secs, every, s.nslots, (unsigned long long)tmo, wait_limit_s());
    hx_mode m = {s.prov, true};
    int st;
    s.e = hx_engine(INIT_NAME, &m, tmo, &st);
    if (!s.e) {
        printf("soak: nf_engine_create -> %s\n", st_name(st));
        return 1;
    }
    size_t cap = s.nslots * MAX_XFER;
    s.buf = xalloc(cap);
    s.ref = xalloc(MAX_XFER);
    fill_pattern(s.ref, MAX_XFER, READ_SEED);
    if ((st = nf_mem_register(s.e, (uint64_t)(uintptr_t)s.buf, cap, NF_MEM_DRAM, 0, &s.mem)) != NF_SUCCESS) {
        printf("soak: nf_mem_register -> %s\n", st_name(st));
        return 1;
    }
    if (!start_peer(&s)) {
        printf("soak: could not start the peer\n");
        return 1;
    }
    double t0 = now_s();
    long rss0 = proc_kb("VmRSS"), heap0 = heap_kb();
    int fds0 = fd_count();
    printf("soak: start RSS %ld KiB (VmHWM %ld KiB), %d open fds, peer pid %d\n", rss0, proc_kb("VmHWM"), fds0, s.pid);
    status_line(&s, "start", t0);
    double next_kill = t0 + every, next_line = t0 + 10, end = t0 + secs;
    long rss_warm = 0, heap_warm = 0; /* at the first 10 s line: the engine's pools are warm */
    unsigned long ops_warm = 0;
    bool fatal = false;
    unsigned it = 0;
    while (now_s() < end) {
        drain_replies(&s, 0);
        poll_slots(&s);
        bool posted = false;
        for (size_t i = 0; i < s.nslots; i++)
            if (!s.slots[i].active && !s.slots[i].awaiting && s.rm) {
                post_slot(&s, &s.slots[i], i);
                posted = true;
            }
        if (now_s() >= next_kill && now_s() < end - 1) {
            char what[48];
            snprintf(what, sizeof what, "kill peer %d", s.pid);
            status_line(&s, what, t0);
            if (!restart_peer(&s)) {
                printf("soak: could not restart the peer; stopping\n");
                fatal = true;
                break;
            }
            snprintf(what, sizeof what, "new peer %d", s.pid);
            status_line(&s, what, t0);
            next_kill = now_s() + every;
        }
        if (now_s() >= next_line) {
            status_line(&s, "", t0);
            if (!ops_warm) {
                rss_warm = proc_kb("VmRSS");
                heap_warm = heap_kb();
                ops_warm = s.ops ? s.ops : 1;
            }
            next_line += 10;
        }
        if (!posted)
            hx_pause(it < 1800 ? 200 + it++ : 2000); /* short sleeps: the progress threads need the cores */
        else
            it = 0;
    }
    /* Let what is in flight finish against the live peer (bounded). */
    double stop = now_s() + wait_limit_s();
    for (;;) {
        drain_replies(&s, 0.001);
        poll_slots(&s);
        bool busy = false;
        for (size_t i = 0; i < s.nslots; i++)
            busy |= s.slots[i].active || s.slots[i].awaiting;
        if (!busy || now_s() > stop)
            break;
    }
    for (size_t i = 0; i < s.nslots; i++)
        if (s.slots[i].active)
            settle(&s, &s.slots[i], HX_TIMEOUT, false);
    double dur = now_s() - t0;
    long rss1 = proc_kb("VmRSS"), heap1 = heap_kb();
    int fds1 = fd_count();
    nf_counters c;
    memset(&c, 0, sizeof c);
    nf_engine_counters(s.e, &c);
    status_line(&s, "end", t0);
    /* Peer: close the socket, it leaves on its own (bounded; killed if not). */
    if (s.pid > 0) {
        close(s.fd);
        s.fd = -1;
        int ws = wait_child(s.pid, wait_limit_s());
        if (ws == -1 || !WIFEXITED(ws) || WEXITSTATUS(ws) != 0)
            printf("soak: last peer did not exit cleanly (%s %d)\n", ws == -1 ? "killed after the wait bound" : "status",
                   ws);
    }
    if (s.rm)
        nf_rmem_unload(s.e, s.rm);
    nf_mem_deregister(s.e, s.mem);
    double td = now_s();
    nf_engine_destroy(s.e);
    td = now_s() - td;
    printf("---- soak summary (%.1f s, provider %s)\n", dur, s.prov);
    printf("operations:     %lu (%lu WRITE, %lu READ), %.2f GiB moved, %.0f ops/s, %.2f GiB/s\n", s.ops, s.writes,
           s.reads, (double)s.bytes / (1 << 30), s.ops / dur, (double)s.bytes / (1 << 30) / dur);
    unsigned long okn = s.ops - s.errs_live - s.errs_kill;
    printf("latency:        mean %.2f ms, max %.2f ms (post to success)\n", okn ? 1e3 * s.lat_sum / okn : 0.0,
           1e3 * s.lat_max);
    printf("verified:       %lu WRITEs byte-exact at notification arrival, %lu READs byte-exact; wrong data: %lu "
           "WRITE, %lu READ\n", s.verified, s.read_ok, s.bad_data, s.read_bad);
    printf("notifications:  %lu attached to requests: %lu answered by the peer, %lu lost with a killed peer, %lu "
           "not sent (their request failed)\n", s.notifs_sent, s.notif_acks, s.lost_verif, s.notif_unsent);
    printf("peer restarts:  %lu (failed starts %lu)\n", s.restarts, s.restart_fail);
    printf("errors:         %lu with a live peer, %lu of requests in flight at a kill (%lu of them not "
           "NIXL_ERR_REMOTE_DISCONNECT), %lu wait timeouts, %lu releases refused once\n", s.errs_live, s.errs_kill,
           s.kill_wrong_status, s.wait_timeouts, s.release_refused);
    printf("errors by status:");
    bool anyst = false;
    for (int i = 1; i < 16; i++)
        if (s.st_count[i]) {
            printf(" %s=%lu", st_name(-i), s.st_count[i]);
            anyst = true;
        }
    if (s.st_other) {
        printf(" other=%lu", s.st_other);
        anyst = true;
    }
    printf("%s\n", anyst ? "" : " none");
    printf("engine counters: requests posted %" PRIu64 " completed %" PRIu64 " failed %" PRIu64 ", ops posted %" PRIu64
           " completed %" PRIu64 " failed %" PRIu64 ", retries %" PRIu64 ", notifs sent %" PRIu64 "\n",
           c.requests_posted, c.requests_completed, c.requests_failed, c.ops_posted, c.ops_completed, c.ops_failed,
           c.retries, c.notifs_sent);
    printf("RSS:            start %ld KiB, end %ld KiB (%+ld KiB), VmHWM %ld KiB (from /proc/self/status)\n", rss0,
           rss1, rss1 - rss0, proc_kb("VmHWM"));
    printf("heap in use:    start %ld KiB, end %ld KiB (%+ld KiB); all glibc arenas (malloc_info), before teardown\n",
           heap0, heap1, heap1 - heap0);
    if (ops_warm)
        printf("after warm-up:  from 10 s (%lu ops) to the end: RSS %+ld KiB, heap %+ld KiB (%.1f B per operation)\n",
               ops_warm, rss1 - rss_warm, heap1 - heap_warm,
               s.ops > ops_warm ? 1024.0 * (double)(heap1 - heap_warm) / (double)(s.ops - ops_warm) : 0.0);
    printf("open fds:       start %d, end %d; nf_engine_destroy %.2f s\n", fds0, fds1, td);
    bool ok = !fatal && s.bad_data == 0 && s.read_bad == 0 && s.errs_live == 0 && s.wait_timeouts == 0 &&
              s.kill_wrong_status == 0 && s.ops > 0;
    printf("soak: %s\n", ok ? "PASS" : "FAIL");
    free(s.buf);
    free(s.ref);
    return ok ? 0 : 1;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    signal(SIGPIPE, SIG_IGN);
    if (argc >= 4 && strcmp(argv[1], "--peer") == 0)
        return peer_main(atoi(argv[2]), (size_t)atoi(argv[3]));
    return soak_main();
}
