/* Stack traces of every thread: the requesting thread sends a real-time signal to
 * each thread in turn (tgkill); the handler records backtrace() into one shared
 * slot and posts a semaphore. Only one report runs at a time. Symbol names come
 * from backtrace_symbols() in the requesting thread (the binary links -rdynamic). */
#include "base/stackdump.h"

#include <dirent.h>
#include <errno.h>
#include <execinfo.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "base/strbuf.h"

#define MAX_FRAMES    64
#define SAMPLE_SIGNAL (SIGRTMIN + 3)

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static sem_t g_done;
static void *g_frames[MAX_FRAMES];
static _Atomic int g_nframes;
static _Atomic pid_t g_target;
static int g_ready;

static void on_sample(int sig, siginfo_t *si, void *uc) {
    (void)sig;
    (void)si;
    (void)uc;
    int saved = errno;
    /* A late signal for an earlier request (the requester timed out) is ignored. */
    if ((pid_t)syscall(SYS_gettid) == atomic_load(&g_target)) {
        atomic_store(&g_nframes, backtrace(g_frames, MAX_FRAMES));
        atomic_store(&g_target, 0);
        sem_post(&g_done);
    }
    errno = saved;
}

int stackdump_init(void) {
    if (g_ready) return 0;
    if (sem_init(&g_done, 0, 0) < 0) return -1;
    /* backtrace() loads libgcc on first use, which is not async-signal-safe: do it now. */
    void *warm[4];
    backtrace(warm, 4);
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_sample;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SAMPLE_SIGNAL, &sa, NULL) < 0) return -1;
    g_ready = 1;
    return 0;
}

static void read_comm(pid_t tid, char *name, size_t len) {
    char path[64];
    snprintf(path, sizeof(path), "/proc/self/task/%d/comm", (int)tid);
    FILE *fp = fopen(path, "r");
    name[0] = 0;
    if (fp) {
        if (fgets(name, (int)len, fp)) name[strcspn(name, "\n")] = 0;
        fclose(fp);
    }
}

/* Reads the thread's scheduler state letter and whether its mask blocks the sampling signal.
 * -1 when the thread is gone. */
static int read_status(pid_t tid, char *state, int *blocked) {
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/self/task/%d/status", (int)tid);
    FILE *fp = fopen(path, "r");
    if (!fp) return -1;
    unsigned long long mask = 0;
    *state = '?';
    while (fgets(line, sizeof(line), fp)) {
        if (strncmp(line, "SigBlk:", 7) == 0) mask = strtoull(line + 7, NULL, 16);
        if (strncmp(line, "State:", 6) == 0) {
            const char *c = line + 6;
            while (*c == ' ' || *c == '\t') c++;
            *state = *c;
        }
    }
    fclose(fp);
    *blocked = (int)((mask >> (SAMPLE_SIGNAL - 1)) & 1ULL);
    return 0;
}

/* 1 when the thread blocks the sampling signal for good (library I/O threads block every
 * signal). Threads also block it for moments: while the handler of the previous sample still
 * runs (the kernel blocks a signal during its own handler, and the handler's sem_post wakes the
 * requester before it returns), and inside pthread_create, fork or posix_spawn (glibc and the
 * sanitizers block every signal while a thread or child starts). A thread in such a moment is
 * running or runnable (or in uninterruptible sleep), so while it is, look again for up to
 * TRANSIENT_BLOCK_MS; a thread asleep with the signal blocked is reported at once. */
#define TRANSIENT_BLOCK_MS 1000
static int blocks_signal(pid_t tid) {
    for (int waited_ms = 0;; waited_ms++) {
        char state;
        int blocked;
        if (read_status(tid, &state, &blocked) < 0) return 1;
        if (!blocked) return 0;
        if ((state != 'R' && state != 'D') || waited_ms >= TRANSIENT_BLOCK_MS) return 1;
        struct timespec ms = {0, 1000000L};
        nanosleep(&ms, NULL);
    }
}

static int cmp_pid(const void *a, const void *b) {
    pid_t x = *(const pid_t *)a, y = *(const pid_t *)b;
    return (x > y) - (x < y);
}

static void sample(struct strbuf *out, pid_t tid, pid_t self) {
    if (tid == self) {
        void *frames[MAX_FRAMES];
        int n = backtrace(frames, MAX_FRAMES);
        char **syms = backtrace_symbols(frames, n);
        for (int i = 0; i < n; i++) sb_printf(out, "  #%d %s\n", i, syms ? syms[i] : "?");
        free(syms);
        return;
    }
    if (!g_ready || blocks_signal(tid)) {
        sb_puts(out, "  (stack unavailable: the thread blocks the sampling signal)\n");
        return;
    }
    while (sem_trywait(&g_done) == 0) {
    }
    atomic_store(&g_target, tid);
    if (syscall(SYS_tgkill, getpid(), tid, SAMPLE_SIGNAL) < 0) {
        atomic_store(&g_target, 0);
        sb_puts(out, "  (stack unavailable: thread exited)\n");
        return;
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 200 * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    int rc;
    while ((rc = sem_timedwait(&g_done, &ts)) < 0 && errno == EINTR) {
    }
    if (rc < 0) {
        atomic_store(&g_target, 0);
        sb_puts(out, "  (stack unavailable: the thread did not answer in time)\n");
        return;
    }
    int n = atomic_load(&g_nframes);
    char **syms = backtrace_symbols(g_frames, n);
    /* Frames 0-1 are the handler and the signal trampoline. */
    for (int i = 2; i < n; i++) sb_printf(out, "  #%d %s\n", i - 2, syms ? syms[i] : "?");
    free(syms);
}

int stackdump_report(struct strbuf *out, const char *name_filter, pid_t tid_filter) {
    pid_t tids[1024];
    int n = 0;
    DIR *d = opendir("/proc/self/task");
    if (!d) return -1;
    struct dirent *e;
    while ((e = readdir(d)) && n < 1024)
        if (e->d_name[0] != '.') tids[n++] = (pid_t)atoi(e->d_name);
    closedir(d);
    qsort(tids, (size_t)n, sizeof(tids[0]), cmp_pid);

    struct strbuf body = STRBUF_INIT;
    pid_t self = (pid_t)syscall(SYS_gettid);
    int shown = 0;
    pthread_mutex_lock(&g_lock);
    for (int i = 0; i < n; i++) {
        char name[64];
        read_comm(tids[i], name, sizeof(name));
        if (tid_filter > 0 && tids[i] != tid_filter) continue;
        if (name_filter && *name_filter && !strcasestr(name, name_filter)) continue;
        shown++;
        sb_printf(&body, "\nThread: %s (ident: %d)%s\n", name, (int)tids[i],
                  tids[i] == getpid() ? " [main]" : "");
        sample(&body, tids[i], self);
    }
    pthread_mutex_unlock(&g_lock);
    sb_printf(out, "Total threads: %d (showing %d)\n", n, shown);
    if (body.len) sb_append(out, body.buf, body.len);
    sb_free(&body);
    return shown;
}
