/* nixl-fabric C harness: tests the engine through include/nixl_fabric.h only.
 *
 *   nf_harness                 runs every provider in HARNESS_PROVIDERS (default
 *                              tcp,sockets,shm,udp), each in its own process, and ends
 *                              with "N passed, M failed" (exit 1 when M > 0)
 *   nf_harness --suite <prov>  one provider's suite (used by the above)
 *   nf_harness --target ...    the target process of the two-process tests
 *
 * Environment: HARNESS_PROVIDERS, HARNESS_WAIT_S (bound of every wait, default 30),
 * HARNESS_SUITE_S (bound of one provider's suite, default 100), HARNESS_ONLY (groups
 * pair,fork and modes thread,poll to run; default all, except udp runs only with the
 * progress thread unless HARNESS_ONLY is set), HARNESS_TRY_PROVIDERS (providers whose
 * results are reported but left out of the final count; default udp, empty counts all;
 * their suites are bounded by HARNESS_TRY_SUITE_S, default 40),
 * HARNESS_DEBUG=1 (target processes trace what they receive on stderr). */
#include "harness.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* HARNESS_ONLY: a comma list of groups (pair, fork) and modes (thread, poll) to run;
 * empty runs everything. A group or mode not named in a non-empty list is left out. */
static bool selected(const char *what) {
    const char *only = getenv("HARNESS_ONLY");
    if (!only || !*only)
        return true;
    bool names_kind = false;
    bool is_mode = strcmp(what, "thread") == 0 || strcmp(what, "poll") == 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", only);
    for (char *sv = NULL, *t = strtok_r(buf, ", ", &sv); t; t = strtok_r(NULL, ", ", &sv)) {
        if (strcmp(t, what) == 0)
            return true;
        bool t_mode = strcmp(t, "thread") == 0 || strcmp(t, "poll") == 0;
        if (t_mode == is_mode)
            names_kind = true;
    }
    return !names_kind;
}

static int suite_main(const char *prov) {
    hx_mode on = {prov, true}, off = {prov, false};
    snprintf(g_ctx, sizeof g_ctx, "%s", prov);
    int s;
    nf_engine *probe = hx_engine("probe", &on, 0, &s);
    if (!probe) {
        if (strcmp(prov, "udp") == 0) {
            skip("provider udp: nf_engine_create failed (%s); udp skipped", st_name(s));
        } else {
            check_st(s, NF_SUCCESS, "provider %s: nf_engine_create", prov);
        }
        return g_fail ? 1 : 0;
    }
    info("provider %s: engine created, %u rail(s)", prov, nf_engine_rail_count(probe));
    nf_engine_destroy(probe);
    const hx_mode *modes[2] = {&on, &off};
    for (int i = 0; i < 2; i++) {
        const hx_mode *m = modes[i];
        snprintf(g_ctx, sizeof g_ctx, "%s/%s", prov, m->thread ? "thread" : "poll");
        const char *mname = m->thread ? "thread" : "poll";
        if (!selected(mname))
            continue;
        /* udp (udp;ofi_rxd) is slow here (tens of MB/s): by default it is only tried with
         * the progress thread, to keep the whole run well under two minutes. */
        const char *only = getenv("HARNESS_ONLY");
        if (!m->thread && strcmp(prov, "udp") == 0 && (!only || !*only)) {
            skip("udp with the progress thread off is not run by default (slow provider; HARNESS_ONLY=poll runs it)");
            continue;
        }
        double t0 = now_s();
        if (selected("pair"))
            run_pair_suite(m, m->thread);
        double t1 = now_s();
        if (selected("fork"))
            run_fork_suite(m);
        info("in-process %.1f s, two-process %.1f s", t1 - t0, now_s() - t1);
    }
    return g_fail ? 1 : 0;
}

typedef struct {
    char name[32];
    int pass, fail, skip;
    const char *why;
    double secs;
} prov_result;

static void run_provider(const char *prov, prov_result *res, double limit) {
    int pfd[2];
    memset(res, 0, sizeof *res);
    snprintf(res->name, sizeof res->name, "%s", prov);
    if (pipe2(pfd, O_CLOEXEC) != 0) {
        res->fail = 1;
        res->why = "pipe failed";
        return;
    }
    char fdarg[16];
    snprintf(fdarg, sizeof fdarg, "%d", pfd[1]);
    char *argv[] = {"nf_harness", "--suite", (char *)prov, fdarg, NULL};
    double t0 = now_s();
    int pid = spawn_self(argv, pfd[1]);
    close(pfd[1]);
    if (pid <= 0) {
        close(pfd[0]);
        res->fail = 1;
        res->why = "could not start the suite process";
        return;
    }
    bool killed = false;
    for (;;) {
        double left = t0 + limit - now_s();
        if (left <= 0) {
            kill(pid, SIGKILL);
            killed = true;
            break;
        }
        struct pollfd p = {pfd[0], POLLIN, 0};
        int pr = poll(&p, 1, (int)(left * 1000) + 1);
        if (pr < 0 && errno == EINTR)
            continue;
        if (pr <= 0)
            continue;
        char buf[256];
        ssize_t n = read(pfd[0], buf, sizeof buf);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        for (ssize_t i = 0; i < n; i++) {
            if (buf[i] == 'P')
                res->pass++;
            else if (buf[i] == 'F')
                res->fail++;
            else if (buf[i] == 'S')
                res->skip++;
        }
    }
    close(pfd[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    res->secs = now_s() - t0;
    if (killed) {
        res->fail++;
        res->why = "suite ran past HARNESS_SUITE_S and was killed";
    } else if (WIFSIGNALED(st)) {
        res->fail++;
        static char why[64];
        snprintf(why, sizeof why, "suite process died of signal %d (%s)", WTERMSIG(st), strsignal(WTERMSIG(st)));
        res->why = why;
    } else if (WIFEXITED(st) && WEXITSTATUS(st) != 0 && res->fail == 0) {
        res->fail++;
        res->why = "suite process exited non-zero without a failed check";
    }
    if (res->why) {
        printf("FAIL %s: %s\n", prov, res->why);
        fflush(stdout);
    }
}

static bool in_list(const char *list, const char *name) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s", list);
    for (char *sv = NULL, *t = strtok_r(buf, ", ", &sv); t; t = strtok_r(NULL, ", ", &sv))
        if (strcmp(t, name) == 0)
            return true;
    return false;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    signal(SIGPIPE, SIG_IGN);
    if (argc >= 2 && strcmp(argv[1], "--target") == 0)
        return target_main(argc, argv);
    if (argc >= 4 && strcmp(argv[1], "--suite") == 0) {
        g_report_fd = atoi(argv[3]);
        fcntl(g_report_fd, F_SETFD, FD_CLOEXEC); /* not inherited by target processes */
        return suite_main(argv[2]);
    }
    if (argc >= 3 && strcmp(argv[1], "--suite") == 0) {
        int rc = suite_main(argv[2]);
        printf("%d passed, %d failed\n", g_pass, g_fail);
        return rc;
    }
    const char *list = getenv("HARNESS_PROVIDERS");
    if (!list || !*list)
        list = "tcp,sockets,shm,udp";
    const char *ls = getenv("HARNESS_SUITE_S");
    double limit = ls && atof(ls) > 0 ? atof(ls) : 100.0;
    printf("nixl-fabric C harness: library %s, providers %s, wait bound %.0f s, suite bound %.0f s\n", nf_version(),
           list, wait_limit_s(), limit);
    /* Providers that are only tried: reported, but left out of the total (udp;ofi_rxd is
     * not one we ship on; it stalls now and then on this host). Empty: all count. */
    const char *tried = getenv("HARNESS_TRY_PROVIDERS");
    if (!tried)
        tried = "udp";
    const char *tl = getenv("HARNESS_TRY_SUITE_S");
    double try_limit = tl && atof(tl) > 0 ? atof(tl) : 40.0;
    char *copy = strdup(list);
    prov_result res[16];
    bool counted[16];
    int np = 0, pass = 0, fail = 0;
    double t0 = now_s();
    for (char *save = NULL, *tok = strtok_r(copy, ", ", &save); tok && np < 16; tok = strtok_r(NULL, ", ", &save)) {
        counted[np] = !in_list(tried, tok);
        run_provider(tok, &res[np], counted[np] ? limit : (limit < try_limit ? limit : try_limit));
        if (counted[np]) {
            pass += res[np].pass;
            fail += res[np].fail;
        }
        np++;
    }
    free(copy);
    printf("---- summary (%.1f s)\n", now_s() - t0);
    for (int i = 0; i < np; i++)
        printf("provider %-8s %s: %d passed, %d failed, %d skipped (%.1f s)%s%s%s\n", res[i].name,
               res[i].fail ? "FAILS" : res[i].pass ? "works" : "skipped", res[i].pass, res[i].fail, res[i].skip,
               res[i].secs, counted[i] ? "" : " [tried only: not in the total, HARNESS_TRY_PROVIDERS]",
               res[i].why ? " - " : "", res[i].why ? res[i].why : "");
    printf("%d passed, %d failed\n", pass, fail);
    return fail > 0 ? 1 : 0;
}
