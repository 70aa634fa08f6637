/* `lmcache server` options: one declarative table drives parsing, validation,
 * --help, GET /config and docs/configuration.md. */
#ifndef LMCACHE_SERVER_CONFIG_H
#define LMCACHE_SERVER_CONFIG_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

enum opt_type {
    OPT_STR,      /* char * */
    OPT_INT,      /* long */
    OPT_FLOAT,    /* double */
    OPT_BOOL,     /* int; a flag without a value */
    OPT_ENUM,     /* char *, one of the choices ("a|b|c") */
    OPT_STRLIST,  /* json_t * array of strings; every value after the flag until the next --flag */
    OPT_JSONLIST, /* json_t * array of objects; the flag may repeat, one JSON object each */
};

#define OPT_REQUIRED 1

/* X(field, flag, type, group, default, min, max, choices, flags, help)
 * default is a string (NULL = no default); min/max bound numbers (min > max = unbounded). */
#define SERVER_OPTIONS(X)                                                                          \
    X(host, "host", OPT_STR, "mp", "localhost", 0, -1, NULL, 0,                                    \
      "Bind address of the ZMQ data socket")                                                       \
    X(port, "port", OPT_INT, "mp", "5555", 1, 65535, NULL, 0, "Port of the ZMQ data socket")       \
    X(ipc_path, "ipc-path", OPT_STR, "mp", "", 0, -1, NULL, 0,                                     \
      "Also bind the data socket on this Unix socket (ipc://PATH); its clients are identified by " \
      "their uid (SO_PEERCRED)")                                                                   \
    X(shm_allowed_uids, "shm-allowed-uids", OPT_STRLIST, "mp", NULL, 0, -1, NULL, 0,               \
      "Owner uids of shared memory that tcp clients may register (default: the daemon's "          \
      "effective uid)")                                                                            \
    X(shm_name_prefixes, "shm-name-prefixes", OPT_STRLIST, "mp", NULL, 0, -1, NULL, 0,             \
      "Only shm_names starting with one of these prefixes may be registered (default: any)")       \
    X(shm_proof, "shm-proof", OPT_ENUM, "mp", "tcp", 0, -1, "tcp|always|never", 0,                 \
      "Who must prove write access to a registered object by writing a server nonce into its "     \
      "proof page: tcp clients, every client, or nobody")                                          \
    X(curve_secret_key_file, "curve-secret-key-file", OPT_STR, "mp", "", 0, -1, NULL, 0,           \
      "Encrypt and authenticate the tcp data socket with CURVE: file holding the server's Z85 "    \
      "secret key (lmcache curve-keygen)")                                                         \
    X(curve_allowed_clients, "curve-allowed-clients", OPT_STR, "mp", "", 0, -1, NULL, 0,           \
      "With CURVE: file of allowed client public keys (Z85, one per line), or a directory of "     \
      "such files")                                                                                \
    X(http_host, "http-host", OPT_STR, "mp", "0.0.0.0", 0, -1, NULL, 0,                            \
      "Host to bind the HTTP admin server")                                                        \
    X(http_port, "http-port", OPT_INT, "mp", "8080", 1, 65535, NULL, 0,                            \
      "Port to bind the HTTP admin server")                                                        \
    X(http_tls_cert, "http-tls-cert", OPT_STR, "mp", "", 0, -1, NULL, 0,                           \
      "PEM certificate (chain) file: serve the admin API over HTTPS (with --http-tls-key)")        \
    X(http_tls_key, "http-tls-key", OPT_STR, "mp", "", 0, -1, NULL, 0,                             \
      "PEM private key file of --http-tls-cert")                                                   \
    X(admin_token_file, "admin-token-file", OPT_STR, "mp", "", 0, -1, NULL, 0,                     \
      "File holding the bearer token every admin route except /, /healthcheck and /metrics "       \
      "requires (empty: no authentication)")                                                       \
    X(admin_token_protects_metrics, "admin-token-protects-metrics", OPT_BOOL, "mp", "false", 0,    \
      -1, NULL, 0, "GET /metrics also requires the --admin-token-file token")                      \
    X(admin_workers, "admin-workers", OPT_INT, "mp", "4", 2, 64, NULL, 0,                          \
      "Admin API threads that run the handlers which may wait (all but /, /healthcheck, "          \
      "/metrics); long-running routes may occupy all but one of them")                             \
    X(admin_queue_size, "admin-queue-size", OPT_INT, "mp", "64", 1, 4096, NULL, 0,                 \
      "Admin requests waiting for a worker; beyond it they get 503 with Retry-After")              \
    X(http_max_connections, "http-max-connections", OPT_INT, "mp", "512", 16, 65536, NULL, 0,      \
      "Admin API connections; a new one beyond it replaces the oldest one not running a "          \
      "handler")                                                                                   \
    X(http_max_connections_per_ip, "http-max-connections-per-ip", OPT_INT, "mp", "32", 1, 65536,   \
      NULL, 0, "Admin API connections one client address may hold open")                           \
    X(http_idle_timeout_seconds, "http-idle-timeout-seconds", OPT_INT, "mp", "15", 1, 86400, NULL, \
      0, "Close an admin connection that sends or accepts nothing for this long")                  \
    X(http_request_timeout_seconds, "http-request-timeout-seconds", OPT_INT, "mp", "30", 1, 86400, \
      NULL, 0,                                                                                     \
      "Close an admin connection whose request (headers and body) is not complete this long "      \
      "after it connected or its previous answer, or that takes longer to read an answer")         \
    X(chunk_size, "chunk-size", OPT_INT, "mp", "256", 1, 1048576, NULL, 0,                         \
      "Tokens per cached chunk")                                                                   \
    X(max_workers, "max-workers", OPT_INT, "mp", "1", 1, 256, NULL, 0,                             \
      "Worker threads of the data plane")                                                          \
    X(copy_threads, "copy-threads", OPT_INT, "mp", "-1", -1, 64, NULL, 0,                          \
      "Helper threads (dp-copy-N) that split large shared-memory and bytes-path copies with the "  \
      "data-plane workers; 0: every copy on its worker; -1: one per CPU beyond the first, at "     \
      "most 8")                                                                                    \
    X(copy_threads_always, "copy-threads-always", OPT_BOOL, "mp", "false", 0, -1, NULL, 0,         \
      "Hand copies to the --copy-threads helpers even when no core is free (by default a copy "    \
      "stays on its worker while the machine's runnable threads, from /proc/loadavg, fill every "  \
      "CPU)")                                                                                      \
    X(max_message_mb, "max-message-mb", OPT_INT, "mp", "1024", 1, 65536, NULL, 0,                  \
      "Largest data-plane request payload in MiB")                                                 \
    X(max_reply_mb, "max-reply-mb", OPT_INT, "mp", "0", 0, 65536, NULL, 0,                         \
      "Largest data-plane reply (retrieve_bytes) in MiB; 0: the same as --max-message-mb")         \
    X(max_unread_reply_mb, "max-unread-reply-mb", OPT_INT, "mp", "1024", 0, 1048576, NULL, 0,      \
      "Reply bytes one data-plane client may leave unread (built, not yet written to its "         \
      "connection) before its next requests are refused with too_large; 0: no limit")              \
    X(max_kv_registrations_per_client, "max-kv-registrations-per-client", OPT_INT, "mp", "64", 1,  \
      65536, NULL, 0, "Shared-memory KV caches one data-plane connection may have registered")     \
    X(max_kv_registrations, "max-kv-registrations", OPT_INT, "mp", "1024", 1, 65536, NULL, 0,      \
      "Shared-memory KV caches registered in all (each is a mapping of the server's)")             \
    X(session_mb_per_client, "session-mb-per-client", OPT_INT, "mp", "256", 1, 1048576, NULL, 0,   \
      "Memory the open lookup sessions of one connection may hold (MiB); a lookup past it is "     \
      "too_large")                                                                                 \
    X(session_mb, "session-mb", OPT_INT, "mp", "1024", 1, 1048576, NULL, 0,                        \
      "Memory all open lookup sessions may hold (MiB)")                                            \
    X(max_request_objects, "max-request-objects", OPT_INT, "mp", "65536", 1, 16777216, NULL, 0,    \
      "Objects (chunks of the range x ranks) one data-plane request may name")                     \
    X(worker_queue_mb, "worker-queue-mb", OPT_INT, "mp", "256", 1, 65536, NULL, 0,                 \
      "Request and reply bytes one data-plane worker may hold before the data socket stops "       \
      "reading (backpressure)")                                                                    \
    X(zmq_rcvhwm, "zmq-rcvhwm", OPT_INT, "mp", "16", 1, 100000, NULL, 0,                           \
      "Requests libzmq buffers per data-socket client while the server is not reading")            \
    X(max_heap_mb, "max-heap-mb", OPT_INT, "mp", "-1", -1, 16777216, NULL, 0,                      \
      "Memory malloc may hold (requests libzmq buffers, worker queues, replies; MiB) before the "  \
      "data connection holding the most unread bytes is cut; -1: half of what L1 leaves of the "   \
      "machine's or cgroup's memory; 0: no limit")                                                 \
    X(worker_reap_timeout_seconds, "worker-reap-timeout-seconds", OPT_FLOAT, "mp", "120", 0, 1e9,  \
      NULL, 0, "Drop KV registrations of pinged engines silent this long (0 disables)")            \
    X(worker_registration_grace_seconds, "worker-registration-grace-seconds", OPT_FLOAT, "mp",     \
      "3600", 0, 1e9, NULL, 0, "Same for engines that never pinged")                               \
    X(session_ttl_seconds, "session-ttl-seconds", OPT_FLOAT, "mp", "600", 1, 1e9, NULL, 0,         \
      "Lookup sessions never ended are dropped (and their locks released) after this long")        \
    X(hash_seed, "hash-seed", OPT_STR, "mp", "", 0, -1, NULL, 0,                                   \
      "Seed string of the chunk-hash chain (empty: the built-in lmcache-chunk-hash-v1)")           \
    X(hash_algorithm, "hash-algorithm", OPT_ENUM, "mp", "sha256", 0, -1, "sha256", 0,              \
      "Chunk hash of the token prefix chain")                                                      \
    X(instance_id, "instance-id", OPT_STR, "mp", "", 0, -1, NULL, 0,                               \
      "Server identity (a random UUID when empty)")                                                \
    X(master_address, "master-address", OPT_STR, "mp", "", 0, -1, NULL, 0,                         \
      "Report this node's cached objects to the cluster master at HOST:PORT (gRPC; off when "      \
      "empty; docs/fleet.md)")                                                                     \
    X(node_id, "node-id", OPT_STR, "mp", "", 0, -1, NULL, 0,                                       \
      "Node id registered with the master (default: the instance id)")                             \
    X(node_address, "node-address", OPT_STR, "mp", "", 0, -1, NULL, 0,                             \
      "Data endpoint the master tells peers and routers (default: tcp://<host>:<port>)")           \
    X(kv_events_endpoint, "kv-events-endpoint", OPT_STR, "mp", "", 0, -1, NULL, 0,                 \
      "Publish placements as a vLLM-style KV-event stream on this ZMQ PUB endpoint (bound when "   \
      "it has '*', '::', ipc:// or inproc://, else connected; off when empty; docs/fleet.md)")     \
    X(kv_events_format, "kv-events-format", OPT_ENUM, "mp", "current", 0, -1, "current|legacy", 0, \
      "KV events as maps tagged \"type\" (current vLLM) or as tagged positional arrays (legacy)")  \
    X(kv_events_hash_format, "kv-events-hash-format", OPT_ENUM, "mp", "bytes", 0, -1,              \
      "bytes|int64", 0,                                                                            \
      "Block hashes in KV events: the 32-byte placement hash, or its last 8 bytes read "           \
      "big-endian as an unsigned 64-bit integer")                                                  \
    X(kv_events_replay_endpoint, "kv-events-replay-endpoint", OPT_STR, "mp", "", 0, -1, NULL, 0,   \
      "Bind a ZMQ ROUTER here that replays the last 10000 KV-event batches from a requested "      \
      "sequence (needs --kv-events-endpoint; off when empty; docs/fleet.md)")                      \
    X(master_report_interval_ms, "master-report-interval-ms", OPT_INT, "mp", "100", 10, 60000,     \
      NULL, 0, "How often queued placement changes are sent to the master, in one batch")          \
    X(run_script_api_enabled, "run-script-api-enabled", OPT_BOOL, "mp", "false", 0, -1, NULL, 0,   \
      "Enable POST /run_script (remote code execution; keep off on untrusted networks)")           \
    X(script_allowed_imports, "script-allowed-imports", OPT_STRLIST, "mp", NULL, 0, -1, NULL, 0,   \
      "Modules a /run_script script may import (a convenience, not a security boundary)")          \
    X(run_script_user, "run-script-user", OPT_STR, "mp", "nobody", 0, -1, NULL, 0,                 \
      "User (name or uid) /run_script scripts run as when the server runs as root; never root; "   \
      "best one that runs nothing else")                                                           \
    X(run_script_timeout_seconds, "run-script-timeout-seconds", OPT_FLOAT, "mp", "30", 0.1, 3600,  \
      NULL, 0, "Wall-clock limit of a /run_script script; then its process group is killed")       \
    X(run_script_cpu_seconds, "run-script-cpu-seconds", OPT_INT, "mp", "10", 1, 3600, NULL, 0,     \
      "CPU-time limit (RLIMIT_CPU) of each /run_script process")                                   \
    X(run_script_memory_mb, "run-script-memory-mb", OPT_INT, "mp", "512", 64, 1048576, NULL, 0,    \
      "Address-space limit (RLIMIT_AS) of each /run_script process, in MiB")                       \
    X(run_script_max_processes, "run-script-max-processes", OPT_INT, "mp", "16", 1, 65536, NULL,   \
      0, "Process limit (RLIMIT_NPROC) of the user /run_script scripts run as")                    \
    X(run_script_max_files, "run-script-max-files", OPT_INT, "mp", "64", 16, 65536, NULL, 0,       \
      "Open-file limit (RLIMIT_NOFILE) of each /run_script process")                               \
    X(run_script_max_file_mb, "run-script-max-file-mb", OPT_INT, "mp", "16", 0, 65536, NULL, 0,    \
      "Largest file a /run_script process may write (RLIMIT_FSIZE), in MiB")                       \
    X(env_api_unredacted, "env-api-unredacted", OPT_BOOL, "mp", "false", 0, -1, NULL, 0,           \
      "Show secret-looking values in GET /env instead of redacting them")                          \
    X(l1_size_gb, "l1-size-gb", OPT_FLOAT, "storage_manager", NULL, 0.001, 1048576, NULL,          \
      OPT_REQUIRED, "Size of the L1 DRAM cache in GiB")                                            \
    X(l1_use_hugepages, "l1-use-hugepages", OPT_BOOL, "storage_manager", "false", 0, -1, NULL, 0,  \
      "Back L1 with 2 MiB huge pages (falls back to normal pages when none are available)")        \
    X(l1_prefault, "l1-prefault", OPT_BOOL, "storage_manager", "true", 0, -1, NULL, 0,             \
      "Fault the whole L1 arena in, in the background after start-up (--l1-prefault=false: "       \
      "on first use)")                                                                             \
    X(eviction_policy, "eviction-policy", OPT_ENUM, "storage_manager", NULL, 0, -1,                \
      "LRU|IsolatedLRU", OPT_REQUIRED, "L1 eviction policy")                                       \
    X(eviction_trigger_watermark, "eviction-trigger-watermark", OPT_FLOAT, "storage_manager",      \
      "0.8", 0.01, 1, NULL, 0, "L1 usage ratio above which the background evictor runs")           \
    X(l1_read_ttl_seconds, "l1-read-ttl-seconds", OPT_FLOAT, "storage_manager", "300", 0.001,      \
      31536000, NULL, 0, "Lease of an L1 read lock")                                               \
    X(l1_write_ttl_seconds, "l1-write-ttl-seconds", OPT_FLOAT, "storage_manager", "600", 0.001,    \
      31536000, NULL, 0, "Lease of an L1 write lock")                                              \
    X(l1_pinned_reply_ratio, "l1-pinned-reply-ratio", OPT_FLOAT, "storage_manager", "0.25", 0, 1,  \
      NULL, 0,                                                                                     \
      "Share of L1 that retrieve_bytes replies sent as chunk frames may pin until the client has " \
      "read them (past it chunks are copied; 0: always copy)")                                     \
    X(l2_adapter, "l2-adapter", OPT_JSONLIST, "storage_manager", NULL, 0, -1, NULL, 0,             \
      "L2 adapter as a JSON object (repeatable), e.g. '{\"type\":\"fs\",\"base_path\":\"/d\"}'")   \
    X(l2_store_policy, "l2-store-policy", OPT_ENUM, "storage_manager", "default", 0, -1,           \
      "default|skip_l1", 0,                                                                        \
      "default: stored objects stay in L1 and go to every L2 adapter; skip_l1: dropped from L1 "   \
      "once every adapter has them")                                                               \
    X(l2_prefetch_policy, "l2-prefetch-policy", OPT_ENUM, "storage_manager", "default", 0, -1,     \
      "default|retain", 0,                                                                         \
      "default: objects loaded from L2 for a lookup are freed after their last read; retain: "     \
      "they stay in L1")                                                                           \
    X(l2_prefetch_max_in_flight, "l2-prefetch-max-in-flight", OPT_INT, "storage_manager", "8", 1,  \
      4096, NULL, 0, "L2 prefetch requests in their lookup/load phases at once")                   \
    X(l2_prefetch_max_keys, "l2-prefetch-max-keys", OPT_INT, "storage_manager", "262144", 65536,   \
      16777216, NULL, 0,                                                                           \
      "Objects the queued and running L2 prefetches may name together (about 1.5 KiB each); a "    \
      "lookup past it is answered from L1 alone, a warm prefetch gets 503")                        \
    X(log_level, "log-level", OPT_ENUM, "observability", NULL, 0, -1,                              \
      "DEBUG|INFO|WARNING|ERROR|CRITICAL", 0,                                                      \
      "Level of the lmcache loggers (default: $LMCACHE_LOG_LEVEL, else INFO)")

#define CFG_FIELD_OPT_STR(f)      char *f;
#define CFG_FIELD_OPT_INT(f)      long f;
#define CFG_FIELD_OPT_FLOAT(f)    double f;
#define CFG_FIELD_OPT_BOOL(f)     int f;
#define CFG_FIELD_OPT_ENUM(f)     char *f;
#define CFG_FIELD_OPT_STRLIST(f)  json_t *f;
#define CFG_FIELD_OPT_JSONLIST(f) json_t *f;
#define CFG_FIELD(field, flag, type, group, def, min, max, choices, flags, help)                   \
    CFG_FIELD_##type(field)

struct server_config {
    SERVER_OPTIONS(CFG_FIELD)
};

struct option_def {
    const char *field;
    const char *flag;
    enum opt_type type;
    const char *group;
    const char *def;
    double min, max;
    const char *choices;
    int flags;
    const char *help;
    size_t offset;
};

extern const struct option_def SERVER_OPTION_DEFS[];
extern const size_t SERVER_NOPTIONS;

/* Parses argv (argv[0] is the subcommand name). Returns 0 on success, 1 when
 * --help was printed, -1 with a one-line message in err (naming the option). */
int config_parse(struct server_config *cfg, int argc, char **argv, char *err, size_t errlen);
void config_free(struct server_config *cfg);
/* {"mp": {...}, "storage_manager": {...}, "observability": {...}} from the parsed values. */
json_t *config_to_json(const struct server_config *cfg);
void config_print_help(FILE *f);

/* Secrets in the configuration. A field (an option or a member of an adapter's JSON, at any
 * depth) holds a secret when one of its '_'/'-'-separated words is secret, password, passwd,
 * token or private, or it is api_key: secret_access_key, session_token, password, private_key.
 * Every place that shows configuration (GET /config, adapter status, logs, error messages)
 * goes through config_redact, so adding a secret field means naming it this way. */
#define CONFIG_REDACTED "<redacted>"
int config_is_secret_name(const char *name);
/* Replaces, in place, the value of every secret-named member of v (any depth) with
 * CONFIG_REDACTED (null stays null). */
void config_redact(json_t *v);
/* Overwrites, in place, the bytes of every secret-named string value (explicit_bzero) so that
 * freeing v does not leave the secret in freed memory. */
void config_scrub(json_t *v);
/* --max-heap-mb in bytes: -1 is half of what L1 leaves of the memory the process may use
 * (heap_memory_limit), at least twice what the --max-workers queues (--worker-queue-mb) may hold
 * plus 256 MiB; 0 when there is no limit. */
uint64_t config_max_heap_bytes(const struct server_config *cfg);
/* The option table as a Markdown table (docs/configuration.md embeds it). */
void config_print_markdown(FILE *f);

#endif
