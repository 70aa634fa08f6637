/* /run_script: the nearest true C equivalent of the anchor's in-process exec.
 * The daemon cannot exec Python in its own address space, so the script runs in
 * a child interpreter (isolated mode) with the documented restricted builtins
 * and import allow-list; `app` is a small client of this server's admin API.
 * The script's `result` comes back on fd 3; its prints go to the server log. */
#include "server/admin/run_script.h"

#include <errno.h>
#include <fcntl.h>
#include <microhttpd.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/strbuf.h"
#include "server/admin/http.h"
#include "server/engine.h"

extern char **environ;

/* argv: prelude, admin base URL, allowed imports (comma separated). */
static const char PRELUDE[] =
    "import sys, os, json, builtins, urllib.request\n"
    "base, allowed = sys.argv[1], [m for m in sys.argv[2].split(',') if m]\n"
    "out = os.fdopen(3, 'w')\n"
    "class App:\n"
    "    '''Client of this server's admin API, the `app` of the script globals.'''\n"
    "    def request(self, method, path, body=None):\n"
    "        data = None if body is None else json.dumps(body).encode()\n"
    "        req = urllib.request.Request(base + path, data=data, method=method,\n"
    "                                     headers={'Content-Type': 'application/json'})\n"
    "        try:\n"
    "            with urllib.request.urlopen(req, timeout=10) as r: raw = r.read().decode()\n"
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

static int write_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static void fail(struct http_resp *resp, const char *what) {
    char msg[512];
    snprintf(msg, sizeof(msg), "Error executing script: %s", what);
    http_text(resp, 500, msg);
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
    snprintf(base, sizeof(base), strchr(host, ':') ? "http://[%s]:%ld" : "http://%s:%ld", host,
             cfg->http_port);
    size_t i;
    json_t *m;
    json_array_foreach(cfg->script_allowed_imports, i, m) {
        size_t l = strlen(allowed);
        snprintf(allowed + l, sizeof(allowed) - l, "%s%s", l ? "," : "", json_string_value(m));
    }

    int in[2] = {-1, -1}, res[2] = {-1, -1};
    if (pipe2(in, O_CLOEXEC) < 0 || pipe2(res, O_CLOEXEC) < 0) {
        sb_free(&u.script);
        fail(resp, strerror(errno));
        return;
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, 2, 1);
    posix_spawn_file_actions_adddup2(&fa, res[1], 3);
    char *argv[] = {RUN_SCRIPT_PYTHON, "-I", "-c", (char *)PRELUDE, base, allowed, NULL};
    pid_t pid;
    int rc = posix_spawn(&pid, RUN_SCRIPT_PYTHON, &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(in[0]);
    close(res[1]);
    if (rc != 0) {
        close(in[1]);
        close(res[0]);
        sb_free(&u.script);
        fail(resp, strerror(rc));
        return;
    }
    /* The child reads all of stdin before writing anything to fd 3. */
    int wfail = write_all(in[1], u.script.buf ? u.script.buf : "", u.script.len);
    close(in[1]);
    sb_free(&u.script);

    struct strbuf out = STRBUF_INIT;
    double deadline = clock_mono() + RUN_SCRIPT_TIMEOUT_S;
    int timed_out = 0;
    for (;;) {
        double left = deadline - clock_mono();
        if (left <= 0) {
            timed_out = 1;
            break;
        }
        struct pollfd pfd = {res[0], POLLIN, 0};
        int pr = poll(&pfd, 1, (int)(left * 1000) + 1);
        if (pr < 0 && errno == EINTR) continue;
        if (pr <= 0) continue;
        char buf[4096];
        ssize_t n = read(res[0], buf, sizeof(buf));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        if (out.len < (1u << 20)) sb_append(&out, buf, (size_t)n);
    }
    close(res[0]);
    if (timed_out) kill(pid, SIGKILL);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (timed_out) {
        sb_free(&out);
        fail(resp, "timed out after 30 s");
    } else if (wfail && out.len == 0) {
        sb_free(&out);
        fail(resp, "the interpreter exited before reading the script");
    } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fail(resp, out.len ? out.buf : "the interpreter failed");
        sb_free(&out);
    } else {
        size_t len = 0;
        char *body = sb_detach(&out, &len);
        http_text_own(resp, 200, body ? body : strdup(""), body ? len : 0);
    }
}
