/* Diagnostics routes: threads, periodic threads, environment, run_script. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/periodic.h"
#include "base/stackdump.h"
#include "base/strbuf.h"
#include "server/admin/http.h"
#include "server/admin/run_script.h"
#include "server/engine.h"

extern char **environ;

static void h_threads(struct http_req *req, struct http_resp *resp) {
    const char *name = http_query(req, "name");
    const char *tid_s = http_query(req, "thread_id");
    long tid = 0;
    if (tid_s && *tid_s) {
        char *end;
        tid = strtol(tid_s, &end, 10);
        if (*end || tid <= 0) {
            http_text(resp, 400, "thread_id must be a positive integer");
            return;
        }
    }
    struct strbuf sb = STRBUF_INIT;
    stackdump_report(&sb, name, (pid_t)tid);
    size_t len = 0;
    char *body = sb_detach(&sb, &len);
    http_text_own(resp, 200, body, len);
}

static int truthy(const char *v) {
    return v && (!strcasecmp(v, "true") || !strcmp(v, "1") || !strcasecmp(v, "yes") ||
                 !strcasecmp(v, "on"));
}

static void h_periodic(struct http_req *req, struct http_resp *resp) {
    const char *level = http_query(req, "level");
    int lvl = -1;
    if (level && *level) {
        lvl = periodic_level_parse(level);
        if (lvl < 0) {
            char msg[160];
            snprintf(msg, sizeof(msg),
                     "Invalid level: %.64s. Must be one of: critical, high, medium, low", level);
            http_error(resp, 400, "detail", msg);
            return;
        }
    }
    http_json(resp, 200,
              periodic_snapshot(req->engine->periodic, lvl, truthy(http_query(req, "running_only")),
                                truthy(http_query(req, "active_only")), clock_mono()));
}

static void h_periodic_one(struct http_req *req, struct http_resp *resp) {
    json_t *o = periodic_status(req->engine->periodic, req->params[0], clock_mono());
    if (!o) {
        char msg[320];
        snprintf(msg, sizeof(msg), "Thread not found: %s", req->params[0]);
        http_error(resp, 404, "error", msg);
        return;
    }
    http_json(resp, 200, o);
}

static void h_periodic_health(struct http_req *req, struct http_resp *resp) {
    http_json(resp, 200, periodic_health(req->engine->periodic, clock_mono()));
}

/* Names that usually carry credentials. */
static int looks_secret(const char *name, size_t len) {
    static const char *const WORDS[] = {"SECRET",     "TOKEN",      "PASSWORD", "PASSWD",
                                        "CREDENTIAL", "PRIVATE",    "API_KEY",  "ACCESS_KEY",
                                        "AUTH",       "SESSION_KEY"};
    char up[256];
    if (len >= sizeof(up)) len = sizeof(up) - 1;
    for (size_t i = 0; i < len; i++)
        up[i] = (char)(name[i] >= 'a' && name[i] <= 'z' ? name[i] - 32 : name[i]);
    up[len] = 0;
    for (size_t i = 0; i < sizeof(WORDS) / sizeof(WORDS[0]); i++)
        if (strstr(up, WORDS[i])) return 1;
    return 0;
}

static void h_env(struct http_req *req, struct http_resp *resp) {
    int unredacted = req->engine->cfg->env_api_unredacted;
    json_t *o = json_object();
    for (char **e = environ; *e; e++) {
        const char *eq = strchr(*e, '=');
        if (!eq) continue;
        char name[256];
        size_t len = (size_t)(eq - *e);
        if (len == 0 || len >= sizeof(name)) continue;
        memcpy(name, *e, len);
        name[len] = 0;
        const char *val = !unredacted && looks_secret(name, len) ? "<redacted>" : eq + 1;
        json_t *v = json_string(val);
        if (!v) v = json_string("<not valid UTF-8>");
        json_object_set_new(o, name, v);
    }
    char *s = json_dumps(o, JSON_INDENT(2) | JSON_SORT_KEYS);
    json_decref(o);
    if (!s) {
        http_error(resp, 500, "detail", "out of memory");
        return;
    }
    http_text_own(resp, 200, s, strlen(s));
}

static void h_run_script(struct http_req *req, struct http_resp *resp) {
    const struct server_config *cfg = req->engine->cfg;
    if (!cfg->run_script_api_enabled) {
        http_error(resp, 403, "detail",
                   "The /run_script API is disabled. Start the server with "
                   "--run-script-api-enabled to enable it.");
        return;
    }
    run_script_handle(req, resp);
}

const struct http_route DIAG_ROUTES[] = {
    {"GET", "/threads", h_threads, NULL, "Every thread of the process with its stack", HTTP_SLOW},
    {"GET", "/periodic-threads", h_periodic, NULL, "Periodic thread registry snapshot", 0},
    {"GET", "/periodic-threads/{thread_name}", h_periodic_one, NULL, "One periodic thread", 0},
    {"GET", "/periodic-threads-health", h_periodic_health, NULL, "Critical/high thread health", 0},
    {"GET", "/env", h_env, NULL, "Process environment (secrets redacted by default)", 0},
    {"POST", "/run_script", h_run_script, NULL, "Run an uploaded Python script (opt-in)",
     HTTP_SLOW},
    {NULL, NULL, NULL, NULL, NULL, 0},
};
