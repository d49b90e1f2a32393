/* nixl-fabric C harness: shared helpers. Tests use only include/nixl_fabric.h. */
#ifndef NF_HARNESS_H
#define NF_HARNESS_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "nixl_fabric.h"

/* Status value the harness uses for "the bounded wait ran out" (not an nf_status). */
#define HX_TIMEOUT 1000

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

/* ---- results ---------------------------------------------------------------------- */
extern int g_pass, g_fail, g_skip;
extern int g_report_fd; /* suite processes: where results go, one byte each */
extern bool g_quiet; /* target processes: no result lines of their own */
extern char g_ctx[96]; /* prefix of every line: "<provider>/<thread|poll>" */

/* Prints "PASS ctx: what" or "FAIL ctx: what" and counts it; returns ok. */
bool check(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Checks got == want; the line names both statuses. */
bool check_st(int got, int want, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void info(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void skip(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
const char *st_name(int st);

/* ---- time --------------------------------------------------------------------------- */
double now_s(void);
double wait_limit_s(void); /* HARNESS_WAIT_S, default 30 */
void hx_pause(unsigned iter); /* yield while spinning, then short sleeps */
void sleep_ms(unsigned ms);

/* ---- data --------------------------------------------------------------------------- */
void *xalloc(size_t n); /* page aligned, zeroed, aborts on failure */
uint64_t next_seed(void);
/* Byte i of the pattern depends only on (seed, i): region checks need no reference copy. */
void fill_pattern(void *buf, size_t n, uint64_t seed);
/* Offset of the first byte that differs from the pattern, or SIZE_MAX when all match. */
size_t verify_pattern(const void *buf, size_t n, uint64_t seed);
size_t first_diff(const void *a, const void *b, size_t n);
uint64_t fnv64(const void *buf, size_t n);

/* ---- engines ------------------------------------------------------------------------ */
typedef struct {
    const char *prov; /* harness provider name: tcp, sockets, shm, udp, ... */
    bool thread;      /* progress thread on */
} hx_mode;

/* Creates an engine for `mode` (provider, iface=lo where it applies, progress_thread).
 * timeout_ms 0 keeps the default. Returns NULL and sets *st on failure. */
nf_engine *hx_engine(const char *name, const hx_mode *mode, uint64_t timeout_ms, int *st);
bool prov_uses_iface(const char *prov);

/* For tcp/sockets/udp: every rail address in the connection info is on 127.0.0.0/8 (or
 * ::1); other providers just print theirs. */
bool check_loopback(const uint8_t *ci, size_t len, const char *prov, const char *who);

/* Loads each engine's connection info into the other (b known to a as bname, and back). */
bool hx_exchange(nf_engine *a, const char *aname, nf_engine *b, const char *bname);

/* Posts `r` (with the notification if has_notif) and waits (bounded) for the first status
 * other than NF_IN_PROG. With the progress thread off, `drive` engines (may be NULL) get
 * nf_engine_progress between checks. Returns the status or HX_TIMEOUT. */
int post_wait(nf_engine *e, nf_request *r, nf_engine *drive, const void *notif, size_t nlen,
              bool has_notif, bool thread);
int wait_req(nf_engine *e, nf_request *r, nf_engine *drive, bool thread);

/* ---- notifications ------------------------------------------------------------------ */
#define HX_MAXQ 512
typedef struct {
    char sender[128];
    uint8_t *msg;
    size_t len;
} hx_notif;

struct hx_notifq;
/* Called inside the nf_notif_cb, at arrival, for every notification. */
typedef void (*hx_arrival_fn)(struct hx_notifq *q, const hx_notif *n);

typedef struct hx_notifq {
    hx_notif items[HX_MAXQ];
    int n;
    int dropped;
    hx_arrival_fn on_arrival;
    /* For on_arrival hooks that verify data at arrival. */
    const char *watch_tag;
    const uint8_t *watch_buf, *watch_ref;
    size_t watch_len;
    int watch_hits;   /* notifications with watch_tag seen */
    int watch_ok;     /* of those, how many found the data complete at arrival */
    size_t watch_bad; /* first bad offset seen */
} hx_notifq;

void notifq_init(hx_notifq *q);
void notifq_clear(hx_notifq *q);
void hx_notif_cb(void *ctx, const char *sender, size_t sender_len, const uint8_t *msg, size_t msg_len);
/* The arrival hook comparing watch_buf with watch_ref when a message equals watch_tag. */
void hx_watch_arrival(hx_notifq *q, const hx_notif *n);
/* Polls get_notifs on e (and progress where the thread is off) until q holds at least
 * `want` items or the deadline passes. `also` (may be NULL) is driven too. */
bool notifq_wait(nf_engine *e, hx_notifq *q, int want, nf_engine *also, bool thread, double limit_s);

/* ---- processes ---------------------------------------------------------------------- */
/* Starts this binary again with argv (argv[0] is replaced); returns the pid or -1. The
 * fd `keep` stays open in the child; every other harness fd is close-on-exec. */
int spawn_self(char *const argv[], int keep);
/* Waits for pid up to limit_s; kills it (SIGKILL) when it runs over. Returns the raw
 * wait status, or -1 when it had to be killed. */
int wait_child(int pid, double limit_s);

/* Length-prefixed messages over a stream socket. */
bool msg_send(int fd, const void *buf, size_t len);
/* One printf-formatted message (up to 511 bytes; longer text is cut, never overread). */
bool msg_sendf(int fd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Returns a malloc'd buffer (NUL-terminated beyond len) or NULL on EOF/timeout. */
uint8_t *msg_recv(int fd, size_t *len, double limit_s);

/* ---- test groups -------------------------------------------------------------------- */
void run_pair_suite(const hx_mode *mode, bool full);
void run_fork_suite(const hx_mode *mode);
int target_main(int argc, char **argv);

#endif
