/* /run_script: remote code execution, opt-in (--run-script-api-enabled). The daemon cannot run
 * Python in its own address space, so the script runs in a child interpreter (isolated mode);
 * `app` is a small client of this server's admin API. The restricted builtins and the import
 * allow-list of the prelude are a convenience that keeps honest scripts short, not a security
 * boundary: Python escapes them trivially. What bounds a script is the process around it:
 * - a scrubbed environment (no AWS_* or other secret of the daemon), every other fd closed;
 * - when the daemon is root: setgroups/setgid/setuid to --run-script-user (nobody), verified;
 * - PR_SET_NO_NEW_PRIVS, a seccomp filter refusing setsid/setpgid/ptrace/process_vm_* (so the
 *   script cannot leave its process group or inspect other processes of its user);
 * - RLIMIT_CPU/AS/NPROC/NOFILE/FSIZE, no core dumps, and SIGKILL to its whole process group at
 *   the wall-clock limit (and when the group leader exits).
 * The script's `result` comes back on fd 3; its prints, bounded, go to the server log. */
#include "server/admin/run_script.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <microhttpd.h>
#include <poll.h>
#include <pwd.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/errbuf.h"
#include "base/log.h"
#include "base/strbuf.h"
#include "server/admin/http.h"
#include "server/engine.h"

static struct logger *lg(void) {
    static struct logger *l;
    if (!l) l = log_get("lmcache.run_script");
    return l;
}

/* argv: prelude, admin base URL, allowed imports (comma separated). */
static const char PRELUDE[] =
    "import sys, os, json, builtins, ssl, urllib.request\n"
    "base, allowed = sys.argv[1], [m for m in sys.argv[2].split(',') if m]\n"
    "out = os.fdopen(3, 'w')\n"
    "# The first line of stdin says how to get in: the bearer token (or null).\n"
    "auth = json.loads(sys.stdin.readline())\n"
    "hdrs = {'Content-Type': 'application/json'}\n"
    "if auth.get('token'): hdrs['Authorization'] = 'Bearer ' + auth['token']\n"
    "# HTTPS to this very server on loopback: its certificate names its public host, not\n"
    "# 127.0.0.1, and nothing else can listen on its port, so the name is not checked.\n"
    "tls = ssl._create_unverified_context() if base.startswith('https:') else None\n"
    "class App:\n"
    "    '''Client of this server's admin API, the `app` of the script globals.'''\n"
    "    def request(self, method, path, body=None):\n"
    "        data = None if body is None else json.dumps(body).encode()\n"
    "        req = urllib.request.Request(base + path, data=data, method=method, headers=hdrs)\n"
    "        try:\n"
    "            with urllib.request.urlopen(req, timeout=10, context=tls) as r:\n"
    "                raw = r.read().decode()\n"
    "        except urllib.error.HTTPError as e: raw = e.read().decode()\n"
    "        try: return json.loads(raw)\n"
    "        except ValueError: return raw\n"
    "    def get(self, path): return self.request('GET', path)\n"
    "    def post(self, path, body=None): return self.request('POST', path, body)\n"
    "    def put(self, path, body=None): return self.request('PUT', path, body)\n"
    "    def delete(self, path, body=None): return self.request('DELETE', path, body)\n"
    "real_import = builtins.__import__\n"
    "def guarded_import(name, globals=None, locals=None, fromlist=(), level=0):\n"
    "    if level != 0 or name.split('.')[0] not in allowed:\n"
    "        raise ImportError(f\"Import of '{name}' is not allowed\")\n"
    "    return real_import(name, globals, locals, fromlist, level)\n"
    "safe = {n: getattr(builtins, n) for n in\n"
    "        ('print', 'str', 'int', 'float', 'list', 'dict', 'tuple', 'set')}\n"
    "safe['__import__'] = guarded_import\n"
    "src = sys.stdin.read()\n"
    "g = {'__builtins__': safe, 'app': App(), '__name__': '__script__'}\n"
    "try:\n"
    "    exec(compile(src, 'script', 'exec'), g)\n"
    "except BaseException as e:\n"
    "    out.write(f'{type(e).__name__}: {e}'); out.flush(); os._exit(1)\n"
    "out.write(str(g['result']) if 'result' in g else 'Script executed successfully')\n"
    "out.flush()\n";

struct upload {
    struct strbuf script;
    int found;
};

static enum MHD_Result on_field(void *cls, enum MHD_ValueKind kind, const char *key,
                                const char *filename, const char *content_type,
                                const char *transfer_encoding, const char *data, uint64_t off,
                                size_t size) {
    (void)kind;
    (void)filename;
    (void)content_type;
    (void)transfer_encoding;
    (void)off;
    struct upload *u = cls;
    if (key && strcmp(key, "script") == 0) {
        u->found = 1;
        if (size) sb_append(&u->script, data, size);
    }
    return MHD_YES;
}

/* The whole environment of the child: nothing of the daemon's (credentials live there). */
static char *const CHILD_ENV[] = {"PATH=/usr/bin:/bin",
                                  "LANG=C.UTF-8",
                                  "LC_ALL=C.UTF-8",
                                  "HOME=/",
                                  "TMPDIR=/tmp",
                                  "PYTHONDONTWRITEBYTECODE=1",
                                  NULL};

/* ---- the child, between vfork and execve ----------------------------------------------------
 * It shares the parent's memory until execve: it only makes system calls (raw ones for the
 * credential changes, which glibc would otherwise try to apply to every thread of the daemon)
 * and reports a failure through sp->stage and sp->err before _exit. */

struct spawn {
    int in_fd, out_fd, res_fd; /* become 0, 1 and 2, 3 */
    int drop;                  /* change credentials to uid/gid */
    uid_t uid;
    gid_t gid;
    struct rlimit cpu, as, nproc, nofile, fsize;
    char *const *argv;
    volatile int stage, err; /* set by the child when it fails */
};

enum stage {
    ST_NONE,
    ST_PGID,
    ST_FDS,
    ST_RLIMIT,
    ST_SETGROUPS,
    ST_SETGID,
    ST_SETUID,
    ST_VERIFY,
    ST_NNP,
    ST_SECCOMP,
    ST_EXEC,
};

static const char *stage_name(int st) {
    static const char *const N[] = {"",
                                    "setpgid",
                                    "fds",
                                    "setrlimit",
                                    "setgroups",
                                    "setgid",
                                    "setuid",
                                    "verify the credential change",
                                    "no_new_privs",
                                    "seccomp",
                                    "execve"};
    return st >= 0 && st < (int)(sizeof(N) / sizeof(N[0])) ? N[st] : "?";
}

#if defined(__x86_64__)
#define SECCOMP_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define SECCOMP_ARCH AUDIT_ARCH_AARCH64
#endif

#ifdef SECCOMP_ARCH
#define DENY(nr)                                                                                   \
    BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (nr), 0, 1),                                               \
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA))
static int install_seccomp(void) {
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SECCOMP_ARCH, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS), /* another ABI: no way around */
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
#if defined(__x86_64__)
        /* x32 system calls carry this bit and would bypass the numbers below. */
        BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000u, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
#endif
        DENY(__NR_setsid),
        DENY(__NR_setpgid),
        DENY(__NR_ptrace),
        DENY(__NR_process_vm_readv),
        DENY(__NR_process_vm_writev),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {(unsigned short)(sizeof(f) / sizeof(f[0])), f};
    return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0);
}
#else
static int install_seccomp(void) { return 0; } /* documented: no filter on this architecture */
#endif

static void child_fail(struct spawn *sp, int stage) {
    sp->err = errno;
    sp->stage = stage;
    _exit(127);
}

/* dup2, or, when the pipe already has the wanted number, clearing its close-on-exec flag (which
 * dup2 onto itself would leave set). */
static int move_fd(int from, int to) { return from == to ? fcntl(to, F_SETFD, 0) : dup2(from, to); }

static void child_main(struct spawn *sp) {
    /* Own process group: the wall-clock kill reaches every process the script starts. */
    if (setpgid(0, 0) < 0) child_fail(sp, ST_PGID);
    struct sigaction dfl;
    memset(&dfl, 0, sizeof(dfl));
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; sig++) sigaction(sig, &dfl, NULL); /* errors: KILL, STOP */
    if (move_fd(sp->in_fd, 0) < 0 || move_fd(sp->out_fd, 1) < 0 || move_fd(sp->out_fd, 2) < 0 ||
        move_fd(sp->res_fd, 3) < 0)
        child_fail(sp, ST_FDS);
    /* Nothing of the daemon's (sockets, shared memory, L2 files) stays open. */
    if (syscall(SYS_close_range, 4u, ~0u, 0u) < 0)
        for (int fd = 4; fd < 65536; fd++) close(fd);
    if (chdir("/") < 0) child_fail(sp, ST_FDS);
    umask(077);
    if (setrlimit(RLIMIT_CPU, &sp->cpu) < 0 || setrlimit(RLIMIT_AS, &sp->as) < 0 ||
        setrlimit(RLIMIT_NPROC, &sp->nproc) < 0 || setrlimit(RLIMIT_NOFILE, &sp->nofile) < 0 ||
        setrlimit(RLIMIT_FSIZE, &sp->fsize) < 0)
        child_fail(sp, ST_RLIMIT);
    struct rlimit zero = {0, 0};
    if (setrlimit(RLIMIT_CORE, &zero) < 0) child_fail(sp, ST_RLIMIT);
    if (sp->drop) {
        /* Groups, then group, then user: once the uid is gone nothing else can change. */
        if (syscall(SYS_setgroups, 0, NULL) < 0) child_fail(sp, ST_SETGROUPS);
        if (syscall(SYS_setresgid, sp->gid, sp->gid, sp->gid) < 0) child_fail(sp, ST_SETGID);
        if (syscall(SYS_setresuid, sp->uid, sp->uid, sp->uid) < 0) child_fail(sp, ST_SETUID);
        uid_t r, e, s;
        gid_t gr, ge, gs;
        errno = EPERM;
        if (syscall(SYS_getresuid, &r, &e, &s) < 0 || r != sp->uid || e != sp->uid ||
            s != sp->uid || syscall(SYS_getresgid, &gr, &ge, &gs) < 0 || gr != sp->gid ||
            ge != sp->gid || gs != sp->gid || syscall(SYS_getgroups, 0, NULL) != 0 ||
            syscall(SYS_setresuid, 0, 0, 0) == 0)
            child_fail(sp, ST_VERIFY);
    }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) child_fail(sp, ST_NNP);
    if (install_seccomp() < 0) child_fail(sp, ST_SECCOMP);
    /* After the credential change, which clears it: the script dies with the daemon thread. */
    prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    execve(RUN_SCRIPT_PYTHON, sp->argv, CHILD_ENV);
    child_fail(sp, ST_EXEC);
}

/* ---- the parent ----------------------------------------------------------------------------- */

/* uid/gid of name (or a decimal uid). 0 with *uid, *gid set; -1 with a message. */
static int resolve_user(const char *name, uid_t *uid, gid_t *gid, char *err, size_t errlen) {
    struct passwd pw, *res = NULL;
    char buf[4096];
    char *end;
    errno = 0;
    unsigned long n = strtoul(name, &end, 10);
    int numeric = *name && !*end && errno == 0;
    int rc = numeric ? getpwuid_r((uid_t)n, &pw, buf, sizeof(buf), &res)
                     : getpwnam_r(name, &pw, buf, sizeof(buf), &res);
    if (res) {
        *uid = pw.pw_uid;
        *gid = pw.pw_gid;
    } else if (numeric) {
        *uid = (uid_t)n; /* a uid without a passwd entry runs with the same group id */
        *gid = (gid_t)n;
    } else {
        errbuf_set(err, errlen, "unknown --run-script-user '%.64s'%s%s", name, rc ? ": " : "",
                   rc ? strerror(rc) : "");
        return -1;
    }
    if (*uid == 0 || *gid == 0) {
        errbuf_set(err, errlen, "--run-script-user '%.64s' is root: refusing to run as root", name);
        return -1;
    }
    return 0;
}

static void set_rl(struct rlimit *r, unsigned long long v) { r->rlim_cur = r->rlim_max = v; }

static int set_err_body(int *status, char **body, size_t *blen, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int set_err_body(int *status, char **body, size_t *blen, const char *fmt, ...) {
    struct strbuf sb = STRBUF_INIT;
    sb_printf(&sb, "Error executing script: ");
    va_list ap;
    va_start(ap, fmt);
    char msg[512];
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    sb_printf(&sb, "%s", msg);
    *status = 500;
    *body = sb_detach(&sb, blen);
    if (!*body) {
        *body = strdup("Error executing script: out of memory");
        *blen = *body ? strlen(*body) : 0;
    }
    return 0;
}

/* Appends up to the cap; counts what it drops. */
static void keep(struct strbuf *sb, size_t cap, size_t *dropped, const char *p, size_t n) {
    size_t room = sb->len < cap ? cap - sb->len : 0;
    size_t k = n < room ? n : room;
    if (k) sb_append(sb, p, k);
    *dropped += n - k;
}

static void log_output(const struct strbuf *out, size_t dropped) {
    if (!out->len && !dropped) return;
    log_info(lg(), "script output (%zu bytes%s):\n%.*s", out->len + dropped,
             dropped ? ", truncated" : "", (int)out->len, out->buf ? out->buf : "");
}

void run_script_run(const struct run_script_limits *lim, const char *base_url,
                    const char *allowed_imports, const char *script, size_t len, int *status,
                    char **body, size_t *blen) {
    *status = 500;
    *body = NULL;
    *blen = 0;
    struct spawn sp;
    memset(&sp, 0, sizeof(sp));
    char err[256];
    if (geteuid() == 0) {
        if (resolve_user(lim->user ? lim->user : "nobody", &sp.uid, &sp.gid, err, sizeof(err))) {
            set_err_body(status, body, blen, "%s", err);
            return;
        }
        sp.drop = 1;
    }
    set_rl(&sp.cpu, (unsigned long long)lim->cpu_s);
    sp.cpu.rlim_max += 1; /* SIGXCPU at the limit (reported as such), SIGKILL a second later */
    set_rl(&sp.as, (unsigned long long)lim->memory_mb << 20);
    set_rl(&sp.nproc, (unsigned long long)lim->max_processes);
    set_rl(&sp.nofile, (unsigned long long)lim->max_files);
    set_rl(&sp.fsize, (unsigned long long)lim->max_file_mb << 20);

    int in[2] = {-1, -1}, out[2] = {-1, -1}, res[2] = {-1, -1};
    if (pipe2(in, O_CLOEXEC) < 0 || pipe2(out, O_CLOEXEC) < 0 || pipe2(res, O_CLOEXEC) < 0) {
        set_err_body(status, body, blen, "pipe: %s", strerror(errno));
        goto close_all;
    }
    char *argv[] = {RUN_SCRIPT_PYTHON,       "-I", "-c", (char *)PRELUDE, (char *)base_url,
                    (char *)allowed_imports, NULL};
    sp.in_fd = in[0];
    sp.out_fd = out[1];
    sp.res_fd = res[1];
    sp.argv = argv;
    /* Orphans of the script are reparented to the daemon, which reaps them (see below). The
     * daemon starts no other child processes, so this process-wide setting affects only these. */
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    /* No signal handler of the daemon may run in the child while it shares our memory. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    pid_t pid = vfork();
    if (pid == 0) child_main(&sp); /* never returns */
    int fork_errno = errno;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    close(in[0]);
    close(out[1]);
    close(res[1]);
    in[0] = out[1] = res[1] = -1;
    if (pid < 0) {
        set_err_body(status, body, blen, "fork: %s", strerror(fork_errno));
        goto close_all;
    }
    if (sp.stage != ST_NONE) {
        /* The child failed before execve and has exited: reap it. */
        while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {
        }
        log_error(lg(), "cannot start the script's interpreter: %s: %s", stage_name(sp.stage),
                  strerror(sp.err));
        set_err_body(status, body, blen, "cannot start the interpreter (%s: %s)",
                     stage_name(sp.stage), strerror(sp.err));
        goto close_all;
    }

    fcntl(in[1], F_SETFL, O_NONBLOCK);
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    struct strbuf result = STRBUF_INIT, output = STRBUF_INIT;
    size_t rdrop = 0, odrop = 0, written = 0;
    double deadline = clock_mono() + lim->timeout_s;
    int timed_out = 0, exited = 0;
    siginfo_t si;
    memset(&si, 0, sizeof(si));
    for (;;) {
        if (!exited) {
            /* Exited, not yet reaped: its pid still names the process group. */
            memset(&si, 0, sizeof(si));
            if (waitid(P_PID, (id_t)pid, &si, WEXITED | WNOHANG | WNOWAIT) == 0 &&
                si.si_pid == pid) {
                exited = 1;
                kill(-pid, SIGKILL); /* whatever the script left behind */
            }
        }
        if (exited && in[1] < 0 && out[0] < 0 && res[0] < 0) break;
        double left = deadline - clock_mono();
        if (left <= 0) {
            if (!exited) timed_out = 1;
            break;
        }
        struct pollfd p[4];
        int np = 0, iin = -1, iout = -1, ires = -1, ipid = -1;
        if (in[1] >= 0) p[iin = np++] = (struct pollfd){in[1], POLLOUT, 0};
        if (out[0] >= 0) p[iout = np++] = (struct pollfd){out[0], POLLIN, 0};
        if (res[0] >= 0) p[ires = np++] = (struct pollfd){res[0], POLLIN, 0};
        if (!exited && pidfd >= 0) p[ipid = np++] = (struct pollfd){pidfd, POLLIN, 0};
        /* Without a pidfd (old kernel) the exit is noticed on the next tick. */
        int ms = (int)(left * 1000) + 1;
        if (!exited && pidfd < 0 && ms > 50) ms = 50;
        int pr = poll(p, (nfds_t)np, ms);
        if (pr < 0 && errno != EINTR) break;
        if (pr <= 0) continue;
        char buf[16384];
        if (iin >= 0 && p[iin].revents) {
            ssize_t w = len > written ? write(in[1], script + written, len - written) : 0;
            if (w > 0) written += (size_t)w;
            if ((w < 0 && errno != EAGAIN && errno != EINTR) || written >= len ||
                (p[iin].revents & (POLLERR | POLLHUP))) {
                close(in[1]);
                in[1] = -1;
            }
        }
        if (iout >= 0 && p[iout].revents) {
            ssize_t n = read(out[0], buf, sizeof(buf));
            if (n > 0)
                keep(&output, RUN_SCRIPT_OUTPUT_MAX, &odrop, buf, (size_t)n);
            else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
                close(out[0]);
                out[0] = -1;
            }
        }
        if (ires >= 0 && p[ires].revents) {
            ssize_t n = read(res[0], buf, sizeof(buf));
            if (n > 0)
                keep(&result, RUN_SCRIPT_RESULT_MAX, &rdrop, buf, (size_t)n);
            else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
                close(res[0]);
                res[0] = -1;
            }
        }
    }
    /* Past the deadline (or a poll failure): the whole group goes, leader included. Then every
     * member is reaped here: the daemon is their subreaper, so a member whose parent died is our
     * child by the time that parent can be reaped, and the loop ends when none is left. Zombies
     * left to init would keep counting against the user's RLIMIT_NPROC. */
    kill(-pid, SIGKILL);
    int wst = 0;
    for (;;) {
        int st;
        pid_t w = waitpid(-pid, &st, 0);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) break;
        if (w == pid) wst = st;
    }
    if (pidfd >= 0) close(pidfd);
    log_output(&output, odrop);
    sb_free(&output);
    if (timed_out) {
        log_warn(lg(), "script killed at the wall-clock limit of %g s", lim->timeout_s);
        set_err_body(status, body, blen,
                     "timed out after %g s (wall-clock limit, --run-script-timeout-seconds); "
                     "its process group was killed",
                     lim->timeout_s);
    } else if (WIFSIGNALED(wst)) {
        int sig = WTERMSIG(wst);
        if (sig == SIGXCPU)
            set_err_body(status, body, blen,
                         "killed at the CPU-time limit of %ld s (--run-script-cpu-seconds)",
                         lim->cpu_s);
        else if (sig == SIGXFSZ)
            set_err_body(status, body, blen,
                         "killed at the file-size limit of %ld MiB (--run-script-max-file-mb)",
                         lim->max_file_mb);
        else
            set_err_body(status, body, blen, "the interpreter was killed by signal %d (%s)", sig,
                         strsignal(sig));
    } else if (!WIFEXITED(wst) || WEXITSTATUS(wst) != 0) {
        if (result.len)
            set_err_body(status, body, blen, "%.*s", (int)result.len, result.buf);
        else if (written < len)
            set_err_body(status, body, blen, "the interpreter exited before reading the script");
        else
            set_err_body(status, body, blen, "the interpreter failed (exit status %d)",
                         WIFEXITED(wst) ? WEXITSTATUS(wst) : -1);
    } else {
        *status = 200;
        *body = sb_detach(&result, blen);
        if (!*body) {
            *body = strdup("");
            *blen = 0;
        }
    }
    sb_free(&result);
close_all:
    for (int i = 0; i < 2; i++) {
        if (in[i] >= 0) close(in[i]);
        if (out[i] >= 0) close(out[i]);
        if (res[i] >= 0) close(res[i]);
    }
}

void run_script_handle(struct http_req *req, struct http_resp *resp) {
    struct upload u = {STRBUF_INIT, 0};
    struct MHD_PostProcessor *pp = MHD_create_post_processor(req->conn, 64 * 1024, on_field, &u);
    if (pp) {
        MHD_post_process(pp, req->body, req->body_len);
        MHD_destroy_post_processor(pp);
    }
    if (!u.found) {
        sb_free(&u.script);
        http_error(resp, 400, "detail", "No script file provided");
        return;
    }
    const struct server_config *cfg = req->engine->cfg;
    char base[300], allowed[1024] = "";
    const char *host = cfg->http_host;
    if (!strcmp(host, "0.0.0.0") || !strcmp(host, "::") || !*host) host = "127.0.0.1";
    const char *scheme = req->admin_tls ? "https" : "http";
    snprintf(base, sizeof(base), strchr(host, ':') ? "%s://[%s]:%ld" : "%s://%s:%ld", scheme, host,
             cfg->http_port);
    size_t i;
    json_t *m;
    json_array_foreach(cfg->script_allowed_imports, i, m) {
        size_t l = strlen(allowed);
        snprintf(allowed + l, sizeof(allowed) - l, "%s%s", l ? "," : "", json_string_value(m));
    }
    struct run_script_limits lim = {
        .timeout_s = cfg->run_script_timeout_seconds,
        .cpu_s = cfg->run_script_cpu_seconds,
        .memory_mb = cfg->run_script_memory_mb,
        .max_processes = cfg->run_script_max_processes,
        .max_files = cfg->run_script_max_files,
        .max_file_mb = cfg->run_script_max_file_mb,
        .user = cfg->run_script_user,
    };
    /* stdin: one JSON line with the admin token (the script acts with the operator's
     * authority, which it has anyway: it is code run by the daemon), then the script. */
    struct strbuf in = STRBUF_INIT;
    json_t *auth = json_pack("{s:s?}", "token", req->admin_token);
    char *line = auth ? json_dumps(auth, JSON_COMPACT) : NULL;
    json_decref(auth);
    int status = 500;
    char *body = NULL;
    size_t blen = 0;
    if (line) {
        sb_append(&in, line, strlen(line));
        sb_append(&in, "\n", 1);
        if (u.script.len) sb_append(&in, u.script.buf, u.script.len);
        explicit_bzero(line, strlen(line));
        free(line);
        run_script_run(&lim, base, allowed, in.buf, in.len, &status, &body, &blen);
    }
    if (in.buf) explicit_bzero(in.buf, in.len);
    sb_free(&in);
    sb_free(&u.script);
    if (body)
        http_text_own(resp, status, body, blen);
    else
        http_text(resp, 500, "Error executing script: out of memory");
}
