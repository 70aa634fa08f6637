/* POST /run_script when enabled: remote code execution by design. The uploaded Python script
 * runs in a child /usr/bin/python3 with a scrubbed environment, as an unprivileged user when the
 * server is root, under resource limits and a wall-clock kill of its process group. It is not a
 * sandbox: see docs/security.md, section /run_script. */
#ifndef LMCACHE_ADMIN_RUN_SCRIPT_H
#define LMCACHE_ADMIN_RUN_SCRIPT_H

#include <stddef.h>

struct http_req;
struct http_resp;

#define RUN_SCRIPT_PYTHON     "/usr/bin/python3"
#define RUN_SCRIPT_RESULT_MAX (1u << 20)  /* bytes of `result` kept */
#define RUN_SCRIPT_OUTPUT_MAX (64u << 10) /* bytes of the script's prints logged */

struct run_script_limits {
    double timeout_s;   /* wall clock; then SIGKILL to the whole process group */
    long cpu_s;         /* RLIMIT_CPU of each process */
    long memory_mb;     /* RLIMIT_AS */
    long max_processes; /* RLIMIT_NPROC (per user) */
    long max_files;     /* RLIMIT_NOFILE */
    long max_file_mb;   /* RLIMIT_FSIZE */
    const char *user;   /* name or uid to run as when the server is root (never root) */
};

/* Runs script (len bytes) in a child interpreter and fills *status (200 or 500) and *body
 * (malloc'd text, *len bytes; the `result`, or "Error executing script: ..."). base_url is the
 * admin API the script's `app` talks to; allowed_imports a comma-separated module list.
 * Blocks the calling thread for at most lim->timeout_s plus the time to kill and reap the
 * process group; the memory it keeps is bounded (RUN_SCRIPT_RESULT_MAX, RUN_SCRIPT_OUTPUT_MAX).
 * Thread-safe; meant for the admin API's worker threads, never a connection thread. */
void run_script_run(const struct run_script_limits *lim, const char *base_url,
                    const char *allowed_imports, const char *script, size_t len, int *status,
                    char **body, size_t *blen);

/* The route handler: reads the multipart field `script` and calls run_script_run with the
 * server's --run-script-* options. */
void run_script_handle(struct http_req *req, struct http_resp *resp);

#endif
