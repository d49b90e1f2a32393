/* nixl-fabric C harness: two processes. The parent initiates; the child (this binary
 * again, started with --target) is a target that only calls nf_engine_get_notifs (and
 * nf_engine_progress when its progress thread is off). Connection info and memory
 * descriptors travel over a socketpair; so do the child's verdicts, one reply per
 * notification it receives. */
#include "harness.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define FCAP (32 * MiB)
#define READ_OFF (20 * MiB)
#define READ_LEN (4 * MiB)
#define READ_SEED 0x4242424242ULL
#define DEAD_PEER_MS 1500 /* the parent engine's timeout_ms */

/* ---- child ------------------------------------------------------------------------ */
typedef struct {
    int fd;
    uint8_t *buf;
    const char *parent;
    int count;
    bool quit;
    double last;
} child_t;

#define reply(c, ...) msg_sendf((c)->fd, __VA_ARGS__)

/* Runs inside nf_notif_cb: the data is checked at the moment the notification arrives. */
static void child_cb(void *ctx, const char *sender, size_t sl, const uint8_t *msg, size_t len) {
    child_t *c = ctx;
    c->count++;
    c->last = now_s();
    if (getenv("HARNESS_DEBUG"))
        fprintf(stderr, "[target %d] notification #%d from %.*s, %zu B: %.*s\n", (int)getpid(), c->count, (int)sl,
                sender, len, (int)(len < 40 && len && msg[0] != 'S' ? len : 8),
                len < 40 && len && msg[0] != 'S' ? (const char *)msg : "(binary)");
    bool sender_ok = c->parent && strlen(c->parent) == sl && memcmp(sender, c->parent, sl) == 0;
    char cmd[128];
    size_t cl = len < sizeof cmd - 1 ? len : sizeof cmd - 1;
    memcpy(cmd, msg, cl);
    cmd[cl] = 0;
    if (!sender_ok) {
        reply(c, "BADSENDER %.*s", (int)(sl < 100 ? sl : 100), sender);
        return;
    }
    if (len > 0 && msg[0] == 'W') {
        unsigned long long seed = 0, off = 0, n = 0;
        if (sscanf(cmd, "W %llx %llu %llu", &seed, &off, &n) != 3 || off + n > FCAP) {
            reply(c, "BADCMD %s", cmd);
            return;
        }
        size_t bad = verify_pattern(c->buf + off, n, seed);
        if (bad == SIZE_MAX)
            reply(c, "OK W %llx", seed);
        else
            reply(c, "BAD W %llx first wrong byte at %zu of %llu", seed, bad, n);
    } else if (len > 0 && msg[0] == 'S') {
        reply(c, "S %zu %016" PRIx64, len, fnv64(msg, len));
    } else if (len == 1 && msg[0] == 'Q') {
        c->quit = true;
    } else {
        reply(c, "BADCMD %s", cmd);
    }
}

int target_main(int argc, char **argv) {
    /* argv: --target <prov> <thread 0|1> <fd> <name> */
    if (argc < 6)
        return 2;
    hx_mode m = {argv[2], argv[3][0] == '1'};
    child_t c;
    memset(&c, 0, sizeof c);
    c.fd = atoi(argv[4]);
    g_quiet = true;
    snprintf(g_ctx, sizeof g_ctx, "%s/%s/child", m.prov, m.thread ? "thread" : "poll");
    int s;
    nf_engine *e = hx_engine(argv[5], &m, 0, &s);
    if (!e) {
        reply(&c, "ERR nf_engine_create %s", st_name(s));
        return 3;
    }
    c.buf = xalloc(FCAP);
    fill_pattern(c.buf + READ_OFF, READ_LEN, READ_SEED);
    nf_mem *mem = NULL;
    nf_blob ci = {0}, md = {0};
    if ((s = nf_mem_register(e, (uint64_t)(uintptr_t)c.buf, FCAP, NF_MEM_DRAM, 0, &mem)) != NF_SUCCESS ||
        (s = nf_engine_conn_info(e, &ci)) != NF_SUCCESS || (s = nf_mem_public_data(e, mem, &md)) != NF_SUCCESS) {
        reply(&c, "ERR setup %s", st_name(s));
        return 3;
    }
    char base[64];
    int bl = snprintf(base, sizeof base, "BASE %llx", (unsigned long long)(uintptr_t)c.buf);
    if (!msg_send(c.fd, ci.data, ci.len) || !msg_send(c.fd, md.data, md.len) || !msg_send(c.fd, base, (size_t)bl))
        return 4;
    nf_blob_free(&ci);
    nf_blob_free(&md);
    size_t pl = 0, nl = 0;
    uint8_t *pci = msg_recv(c.fd, &pl, wait_limit_s());
    uint8_t *pname = msg_recv(c.fd, &nl, wait_limit_s());
    if (!pci || !pname)
        return 5;
    c.parent = (const char *)pname;
    s = nf_engine_load_conn_info(e, c.parent, pci, pl);
    reply(&c, "LOADED %s", st_name(s));
    c.last = now_s();
    int rc = 0;
    for (unsigned it = 0; !c.quit; it++) {
        nf_engine_get_notifs(e, child_cb, &c);
        if (!m.thread)
            nf_engine_progress(e);
        else
            hx_pause(it % 4000 + 200);
        if (now_s() - c.last > wait_limit_s()) {
            rc = 6; /* the parent stopped talking: leave instead of hanging */
            break;
        }
    }
    reply(&c, "BYE %d", c.count);
    nf_mem_deregister(e, mem);
    nf_engine_destroy(e);
    free(pci);
    free(pname);
    free(c.buf);
    return rc;
}

/* ---- parent ----------------------------------------------------------------------- */
typedef struct {
    const hx_mode *m;
    int fd, pid;
    nf_engine *e;
    char name[64], cname[64];
    uint8_t *buf;
    nf_mem *mem;
    nf_rmem *rm;
    uint64_t rbase;
} fork_t;

/* Reads the child's next reply; returns a malloc'd string or NULL. */
static char *child_reply(fork_t *f) {
    size_t n = 0;
    return (char *)msg_recv(f->fd, &n, wait_limit_s());
}

/* Sends `msg` as a standalone notification and drives our engine while waiting for the
 * child's reply. */
static char *notif_and_reply(fork_t *f, const void *msg, size_t len, int *st) {
    *st = nf_engine_send_notif(f->e, f->cname, msg, len);
    if (*st != NF_SUCCESS)
        return NULL;
    if (!f->m->thread) {
        /* Our engine must progress for the message to leave: poll until the reply. */
        double end = now_s() + wait_limit_s();
        for (;;) {
            nf_engine_progress(f->e);
            size_t n = 0;
            uint8_t *r = msg_recv(f->fd, &n, 0.001);
            if (r)
                return (char *)r;
            if (now_s() > end)
                return NULL;
        }
    }
    return child_reply(f);
}

/* Waits for the child's reply while (with the thread off) progressing our engine. */
static char *reply_progress(fork_t *f) {
    if (f->m->thread)
        return child_reply(f);
    double end = now_s() + wait_limit_s();
    for (;;) {
        nf_engine_progress(f->e);
        size_t n = 0;
        uint8_t *r = msg_recv(f->fd, &n, 0.001);
        if (r || now_s() > end)
            return (char *)r;
    }
}

static void f_write(fork_t *f, size_t off, size_t len, bool attach) {
    uint64_t seed = next_seed();
    fill_pattern(f->buf + off, len, seed);
    char tag[96];
    int tl = snprintf(tag, sizeof tag, "W %llx %zu %zu", (unsigned long long)seed, off, len);
    nf_xfer_desc l = {(uint64_t)(uintptr_t)(f->buf + off), len, f->mem}, r = {f->rbase + off, len, f->rm};
    nf_request *req = NULL;
    int s = nf_request_create(f->e, NF_OP_WRITE, &l, &r, 1, f->cname, &req);
    if (!check_st(s, NF_SUCCESS, "2-proc WRITE %zu B: nf_request_create", len))
        return;
    s = post_wait(f->e, req, NULL, tag, (size_t)tl, attach, f->m->thread);
    check_st(s, NF_SUCCESS, "2-proc WRITE %zu B%s: request status", len, attach ? " + notification" : "");
    char *rep = NULL;
    int ns = NF_SUCCESS;
    if (attach) {
        rep = reply_progress(f);
    } else if (s == NF_SUCCESS) {
        /* Done means delivered: right after our success, ask the child to look. */
        rep = notif_and_reply(f, tag, (size_t)tl, &ns);
        check_st(ns, NF_SUCCESS, "2-proc: standalone notification after the WRITE");
    }
    char want[64];
    snprintf(want, sizeof want, "OK W %llx", (unsigned long long)seed);
    check(rep && strcmp(rep, want) == 0, "2-proc WRITE %zu B: child verified the bytes %s: %s", len,
          attach ? "when the notification arrived" : "after the initiator's first success",
          rep ? rep : "NO REPLY (timeout)");
    free(rep);
    int rs = nf_request_release(f->e, req);
    if (rs == NF_ERR_REPOST_ACTIVE)
        rs = nf_request_release(f->e, req);
    check_st(rs, NF_SUCCESS, "2-proc: nf_request_release");
}

static void f_read(fork_t *f) {
    uint8_t *dst = f->buf + READ_OFF;
    memset(dst, 0, READ_LEN);
    nf_xfer_desc l = {(uint64_t)(uintptr_t)dst, READ_LEN, f->mem}, r = {f->rbase + READ_OFF, READ_LEN, f->rm};
    nf_request *req = NULL;
    int s = nf_request_create(f->e, NF_OP_READ, &l, &r, 1, f->cname, &req);
    if (!check_st(s, NF_SUCCESS, "2-proc READ 4MiB: nf_request_create"))
        return;
    s = post_wait(f->e, req, NULL, NULL, 0, false, f->m->thread);
    size_t bad = s == NF_SUCCESS ? verify_pattern(dst, READ_LEN, READ_SEED) : 0;
    check(s == NF_SUCCESS && bad == SIZE_MAX, "2-proc READ 4MiB from the child: %s, data %s", st_name(s),
          s != NF_SUCCESS ? "not checked" : bad == SIZE_MAX ? "byte-exact" : "WRONG");
    nf_request_release(f->e, req);
}

static void f_descs(fork_t *f) {
    /* 4096 descriptors: contiguous on the child, scattered (reversed, with gaps) here. */
    enum { N = 4096, DL = 1024 };
    size_t roff = 0, loff0 = 8 * MiB;
    uint64_t seed = next_seed();
    uint8_t *tmp = xalloc((size_t)N * DL);
    fill_pattern(tmp, (size_t)N * DL, seed);
    nf_xfer_desc *l = calloc(N, sizeof *l), *r = calloc(N, sizeof *r);
    for (size_t i = 0; i < N; i++) {
        size_t lo = loff0 + (N - 1 - i) * (DL + 64);
        memcpy(f->buf + lo, tmp + i * DL, DL);
        l[i] = (nf_xfer_desc){(uint64_t)(uintptr_t)(f->buf + lo), DL, f->mem};
        r[i] = (nf_xfer_desc){f->rbase + roff + i * DL, DL, f->rm};
    }
    char tag[96];
    int tl = snprintf(tag, sizeof tag, "W %llx %zu %zu", (unsigned long long)seed, roff, (size_t)N * DL);
    nf_request *req = NULL;
    int s = nf_request_create(f->e, NF_OP_WRITE, l, r, N, f->cname, &req);
    if (check_st(s, NF_SUCCESS, "2-proc WRITE 4096 descriptors: nf_request_create")) {
        s = post_wait(f->e, req, NULL, tag, (size_t)tl, true, f->m->thread);
        check_st(s, NF_SUCCESS, "2-proc WRITE 4096 descriptors + notification: request status");
        char *rep = reply_progress(f);
        char want[64];
        snprintf(want, sizeof want, "OK W %llx", (unsigned long long)seed);
        check(rep && strcmp(rep, want) == 0, "2-proc WRITE 4096 descriptors: child verified 4MiB at arrival: %s",
              rep ? rep : "NO REPLY (timeout)");
        free(rep);
        nf_request_release(f->e, req);
    }
    free(l);
    free(r);
    free(tmp);
}

void run_fork_suite(const hx_mode *mode) {
    fork_t f;
    memset(&f, 0, sizeof f);
    f.m = mode;
    snprintf(f.name, sizeof f.name, "fparent-%s-%s", mode->prov, mode->thread ? "thr" : "poll");
    snprintf(f.cname, sizeof f.cname, "fchild-%s-%s", mode->prov, mode->thread ? "thr" : "poll");
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        check(false, "2-proc: socketpair");
        return;
    }
    char fdarg[16];
    snprintf(fdarg, sizeof fdarg, "%d", sv[1]);
    char *argv[] = {"nf_harness", "--target", (char *)mode->prov, mode->thread ? "1" : "0", fdarg, f.cname, NULL};
    f.pid = spawn_self(argv, sv[1]);
    close(sv[1]);
    f.fd = sv[0];
    if (!check(f.pid > 0, "2-proc: started the target process (pid %d)", f.pid)) {
        close(f.fd);
        return;
    }
    int s;
    /* A short engine timeout so the dead-peer check below is quick. */
    f.e = hx_engine(f.name, mode, DEAD_PEER_MS, &s);
    check_st(s, NF_SUCCESS, "2-proc: nf_engine_create '%s'", f.name);
    size_t cl = 0, ml = 0, bl = 0;
    uint8_t *cci = msg_recv(f.fd, &cl, wait_limit_s());
    uint8_t *cmd = cci ? msg_recv(f.fd, &ml, wait_limit_s()) : NULL;
    uint8_t *cbase = cmd ? msg_recv(f.fd, &bl, wait_limit_s()) : NULL;
    unsigned long long rb = 0;
    bool got = check(cci && cmd && cbase && sscanf((char *)cbase, "BASE %llx", &rb) == 1,
                     "2-proc: received the child's conn info (%zu B), memory descriptor (%zu B), base address%s%s", cl,
                     ml, cci && cci[0] == 'E' ? ": " : "", cci && cci[0] == 'E' ? (char *)cci : "");
    f.rbase = rb;
    if (!f.e || !got)
        goto done;
    f.buf = xalloc(FCAP);
    if (!check_st(nf_mem_register(f.e, (uint64_t)(uintptr_t)f.buf, FCAP, NF_MEM_DRAM, 0, &f.mem), NF_SUCCESS,
                  "2-proc: nf_mem_register"))
        goto done;
    {
        nf_blob ci = {0};
        s = nf_engine_conn_info(f.e, &ci);
        if (!check_st(s, NF_SUCCESS, "2-proc: own conn info") || !msg_send(f.fd, ci.data, ci.len) ||
            !msg_send(f.fd, f.name, strlen(f.name))) {
            nf_blob_free(&ci);
            goto done;
        }
        nf_blob_free(&ci);
    }
    check_loopback(cci, cl, mode->prov, "2-proc: target process");
    check_st(nf_engine_load_conn_info(f.e, f.cname, cci, cl), NF_SUCCESS, "2-proc: load the child's conn info");
    check_st(nf_rmem_load(f.e, f.cname, cmd, ml, &f.rm), NF_SUCCESS, "2-proc: nf_rmem_load the child's descriptor");
    {
        char *rep = child_reply(&f);
        check(rep && strcmp(rep, "LOADED NIXL_SUCCESS") == 0, "2-proc: child loaded our conn info: %s",
              rep ? rep : "NO REPLY");
        free(rep);
    }
    if (!f.rm)
        goto quit;
    f_write(&f, 0, 1, true);
    f_write(&f, 4096 + 5, 4 * KiB, true);
    f_write(&f, 0, MiB, true);
    f_write(&f, 0, 16 * MiB, true);
    f_write(&f, 3, MiB, false);
    f_read(&f);
    f_descs(&f);
    {
        size_t big = 64 * KiB;
        uint8_t *m = malloc(big);
        fill_pattern(m, big, next_seed());
        m[0] = 'S';
        char *rep = notif_and_reply(&f, m, big, &s);
        char want[64];
        snprintf(want, sizeof want, "S %zu %016" PRIx64, big, fnv64(m, big));
        check(s == NF_SUCCESS && rep && strcmp(rep, want) == 0,
              "2-proc: standalone 64KiB notification arrived byte-exact: send %s, child: %s", st_name(s),
              rep ? rep : "NO REPLY (timeout)");
        free(rep);
        free(m);
    }
quit:
    s = nf_engine_send_notif(f.e, f.cname, (const uint8_t *)"Q", 1);
    check_st(s, NF_SUCCESS, "2-proc: quit notification");
    {
        char *rep = reply_progress(&f);
        check(rep && strncmp(rep, "BYE", 3) == 0, "2-proc: child finished: %s", rep ? rep : "NO REPLY");
        free(rep);
    }
done:;
    int st = wait_child(f.pid, wait_limit_s());
    check(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "2-proc: child exited with %s %d",
          st == -1 ? "timeout/kill" : WIFSIGNALED(st) ? "signal" : "status",
          st == -1 ? -1 : WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
    /* Rule 2: a WRITE to the dead peer fails with a status in bounded time. */
    if (f.e && f.rm && mode->thread) {
        nf_xfer_desc l = {(uint64_t)(uintptr_t)f.buf, 4096, f.mem}, r = {f.rbase, 4096, f.rm};
        nf_request *req = NULL;
        s = nf_request_create(f.e, NF_OP_WRITE, &l, &r, 1, f.cname, &req);
        if (s == NF_SUCCESS) {
            double t0 = now_s();
            s = post_wait(f.e, req, NULL, NULL, 0, false, mode->thread);
            check_st(s, NF_ERR_REMOTE_DISCONNECT, "2-proc: WRITE to the exited target (engine timeout_ms=%d, %.2f s)",
                     DEAD_PEER_MS, now_s() - t0);
            t0 = now_s();
            int r1 = nf_request_release(f.e, req), r2 = NF_SUCCESS;
            double t1 = now_s();
            if (r1 == NF_ERR_REPOST_ACTIVE)
                r2 = nf_request_release(f.e, req);
            info("release of the failed request to the exited target: first call -> %s (%.2f s)%s%s (%.2f s)",
                 st_name(r1), t1 - t0, r1 == NF_ERR_REPOST_ACTIVE ? ", second call -> " : "",
                 r1 == NF_ERR_REPOST_ACTIVE ? st_name(r2) : "", now_s() - t1);
            (void)r2;
            /* Documented: "A request not in flight is always freed" (this one has failed). */
            check_st(r1, NF_SUCCESS, "2-proc: nf_request_release of the failed request to the exited target "
                                     "(not in flight) frees it on the first call (%.2f s)", t1 - t0);
        } else {
            check(s < 0, "2-proc: nf_request_create to the exited target -> %s", st_name(s));
        }
    }
    free(cci);
    free(cmd);
    free(cbase);
    if (f.rm)
        nf_rmem_unload(f.e, f.rm);
    if (f.mem)
        nf_mem_deregister(f.e, f.mem);
    if (f.e) {
        double t0 = now_s();
        nf_engine_destroy(f.e);
        check(now_s() - t0 < 10, "2-proc: nf_engine_destroy took %.2f s", now_s() - t0);
    }
    free(f.buf);
    close(f.fd);
}
