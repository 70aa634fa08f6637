/* Option table: parsing, validation, help and JSON dump, all generated from SERVER_OPTIONS. */

#include "server/config.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "base/errbuf.h"
#include "base/heap.h"

#define DEF_ROW(field, flag, type, group, def, min, max, choices, flags, help)                     \
    {#field,                                                                                       \
     flag,                                                                                         \
     type,                                                                                         \
     group,                                                                                        \
     def,                                                                                          \
     min,                                                                                          \
     max,                                                                                          \
     choices,                                                                                      \
     flags,                                                                                        \
     help,                                                                                         \
     offsetof(struct server_config, field)},
const struct option_def SERVER_OPTION_DEFS[] = {SERVER_OPTIONS(DEF_ROW)};
const size_t SERVER_NOPTIONS = sizeof(SERVER_OPTION_DEFS) / sizeof(SERVER_OPTION_DEFS[0]);
#define COUNT_ROW(...) +1
enum { NOPTIONS = 0 SERVER_OPTIONS(COUNT_ROW) };
_Static_assert(sizeof(SERVER_OPTION_DEFS) / sizeof(SERVER_OPTION_DEFS[0]) == NOPTIONS,
               "one row per option");

static const char *const GROUPS[] = {"mp", "storage_manager", "observability"};

static void *slot(struct server_config *cfg, const struct option_def *d) {
    return (char *)cfg + d->offset;
}

static const void *cslot(const struct server_config *cfg, const struct option_def *d) {
    return (const char *)cfg + d->offset;
}

static int in_choices(const char *choices, const char *v) {
    size_t n = strlen(v);
    for (const char *p = choices; p && *p;) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && strncmp(p, v, n) == 0) return 1;
        p = bar ? bar + 1 : NULL;
    }
    return 0;
}

/* Sets one option from its string value; -1 with err on a bad value. */
static int set_value(struct server_config *cfg, const struct option_def *d, const char *v,
                     char *err, size_t errlen) {
    void *p = slot(cfg, d);
    char *end;
    switch (d->type) {
    case OPT_STR:
        free(*(char **)p);
        *(char **)p = strdup(v);
        return *(char **)p ? 0 : -1;
    case OPT_ENUM:
        if (!in_choices(d->choices, v)) {
            errbuf_set(err, errlen, "argument --%s: invalid choice: '%s' (choose from %s)", d->flag,
                       v, d->choices);
            return -1;
        }
        free(*(char **)p);
        *(char **)p = strdup(v);
        return *(char **)p ? 0 : -1;
    case OPT_INT: {
        errno = 0;
        long n = strtol(v, &end, 10);
        if (!*v || *end || errno) {
            errbuf_set(err, errlen, "argument --%s: invalid int value: '%s'", d->flag, v);
            return -1;
        }
        if (d->min <= d->max && (n < d->min || n > d->max)) {
            errbuf_set(err, errlen, "argument --%s: %ld is out of range [%.0f, %.0f]", d->flag, n,
                       d->min, d->max);
            return -1;
        }
        *(long *)p = n;
        return 0;
    }
    case OPT_FLOAT: {
        errno = 0;
        double x = strtod(v, &end);
        if (!*v || *end || errno || !isfinite(x)) {
            errbuf_set(err, errlen, "argument --%s: invalid float value: '%s'", d->flag, v);
            return -1;
        }
        if (d->min <= d->max && (x < d->min || x > d->max)) {
            errbuf_set(err, errlen, "argument --%s: %g is out of range [%g, %g]", d->flag, x,
                       d->min, d->max);
            return -1;
        }
        *(double *)p = x;
        return 0;
    }
    case OPT_BOOL:
        if (strcmp(v, "true") == 0 || strcmp(v, "1") == 0)
            *(int *)p = 1;
        else if (strcmp(v, "false") == 0 || strcmp(v, "0") == 0)
            *(int *)p = 0;
        else {
            errbuf_set(err, errlen, "argument --%s: invalid bool value: '%s'", d->flag, v);
            return -1;
        }
        return 0;
    case OPT_STRLIST:
        if (!*(json_t **)p) *(json_t **)p = json_array();
        return json_array_append_new(*(json_t **)p, json_string(v));
    case OPT_JSONLIST: {
        json_error_t je;
        json_t *o = json_loads(v, JSON_REJECT_DUPLICATES, &je);
        if (!o || !json_is_object(o)) {
            /* jansson's message ends with "near '<token>'", which may be a piece of a secret:
             * only the message's first part and the position are reported. */
            char *near = strstr(je.text, " near ");
            if (near) *near = '\0';
            if (o)
                errbuf_set(err, errlen, "argument --%s: not a JSON object", d->flag);
            else
                errbuf_set(err, errlen, "argument --%s: malformed JSON: %s (line %d, column %d)",
                           d->flag, je.text, je.line, je.column);
            json_decref(o);
            return -1;
        }
        if (!*(json_t **)p) *(json_t **)p = json_array();
        return json_array_append_new(*(json_t **)p, o);
    }
    }
    return -1;
}

static const struct option_def *find_flag(const char *flag, size_t len) {
    for (size_t i = 0; i < SERVER_NOPTIONS; i++)
        if (strlen(SERVER_OPTION_DEFS[i].flag) == len &&
            strncmp(SERVER_OPTION_DEFS[i].flag, flag, len) == 0)
            return &SERVER_OPTION_DEFS[i];
    return NULL;
}

/* L2 adapter specs are checked for shape now; each adapter validates its own fields. */
static int validate_l2(const json_t *list, char *err, size_t errlen) {
    static const char *const TYPES[] = {"fs", "s3", "dax"};
    size_t i;
    json_t *a;
    json_array_foreach(list, i, a) {
        const char *t = json_string_value(json_object_get(a, "type"));
        int ok = 0;
        for (size_t k = 0; t && k < sizeof(TYPES) / sizeof(TYPES[0]); k++)
            ok |= !strcmp(t, TYPES[k]);
        if (!ok) {
            errbuf_set(err, errlen,
                       "argument --l2-adapter: adapter %zu: \"type\" must be one of fs, s3, dax",
                       i);
            return -1;
        }
    }
    return 0;
}

int config_parse(struct server_config *cfg, int argc, char **argv, char *err, size_t errlen) {
    memset(cfg, 0, sizeof(*cfg));
    bool seen[NOPTIONS] = {0}; /* options given on the command line, by table row */
    for (size_t i = 0; i < SERVER_NOPTIONS; i++) {
        const struct option_def *d = &SERVER_OPTION_DEFS[i];
        if (d->def && set_value(cfg, d, d->def, err, errlen) < 0) return -1;
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            config_print_help(stdout);
            return 1;
        }
        if (strcmp(a, "--help-markdown") == 0) {
            config_print_markdown(stdout);
            return 1;
        }
        if (strncmp(a, "--", 2) != 0) {
            errbuf_set(err, errlen, "unrecognized arguments: %s", a);
            return -1;
        }
        const char *name = a + 2, *eq = strchr(name, '=');
        size_t nlen = eq ? (size_t)(eq - name) : strlen(name);
        const struct option_def *d = find_flag(name, nlen);
        if (!d) {
            errbuf_set(err, errlen, "unrecognized arguments: %s", a);
            return -1;
        }
        seen[d - SERVER_OPTION_DEFS] = true;
        if (d->type == OPT_BOOL) {
            if (set_value(cfg, d, eq ? eq + 1 : "true", err, errlen) < 0) return -1;
            continue;
        }
        if (d->type == OPT_STRLIST) {
            /* nargs='*': the values up to the next --flag; --x=a,b is also accepted. */
            if (!*(json_t **)slot(cfg, d)) *(json_t **)slot(cfg, d) = json_array();
            if (eq) {
                char *copy = strdup(eq + 1), *save = NULL;
                for (char *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save))
                    set_value(cfg, d, t, err, errlen);
                free(copy);
            }
            while (!eq && i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0)
                set_value(cfg, d, argv[++i], err, errlen);
            continue;
        }
        const char *v = eq ? eq + 1 : NULL;
        if (!v) {
            if (i + 1 >= argc) {
                errbuf_set(err, errlen, "argument --%s: expected one argument", d->flag);
                return -1;
            }
            v = argv[++i];
        }
        if (set_value(cfg, d, v, err, errlen) < 0) return -1;
    }
    char missing[256] = "";
    for (size_t i = 0; i < SERVER_NOPTIONS; i++) {
        const struct option_def *d = &SERVER_OPTION_DEFS[i];
        if ((d->flags & OPT_REQUIRED) && !seen[i]) {
            size_t l = strlen(missing);
            snprintf(missing + l, sizeof(missing) - l, "%s--%s", l ? ", " : "", d->flag);
        }
    }
    if (*missing) {
        errbuf_set(err, errlen, "the following arguments are required: %s", missing);
        return -1;
    }
    if (cfg->l2_adapter && validate_l2(cfg->l2_adapter, err, errlen) < 0) return -1;
    if (!cfg->script_allowed_imports) cfg->script_allowed_imports = json_array();
    if (!cfg->l2_adapter) cfg->l2_adapter = json_array();
    return 0;
}

/* ---- secrets ---- */

int config_is_secret_name(const char *name) {
    static const char *const WORDS[] = {"secret", "password", "passwd", "token", "private"};
    if (!name) return 0;
    if (!strcasecmp(name, "api_key") || !strcasecmp(name, "apikey")) return 1;
    for (const char *w = name; *w;) {
        size_t n = strcspn(w, "_-");
        for (size_t k = 0; k < sizeof(WORDS) / sizeof(WORDS[0]); k++)
            if (strlen(WORDS[k]) == n && !strncasecmp(w, WORDS[k], n)) return 1;
        w += n;
        if (*w) w++;
    }
    return 0;
}

/* scrub: 0 = replace the value by CONFIG_REDACTED, 1 = overwrite its bytes. */
static void walk_secrets(json_t *v, int scrub) {
    if (json_is_array(v)) {
        size_t i;
        json_t *e;
        json_array_foreach(v, i, e) walk_secrets(e, scrub);
        return;
    }
    if (!json_is_object(v)) return;
    const char *key;
    json_t *e;
    json_object_foreach(v, key, e) {
        if (!config_is_secret_name(key)) {
            walk_secrets(e, scrub);
        } else if (scrub) {
            /* jansson owns the bytes; they are about to be freed by the caller. */
            if (json_is_string(e))
                explicit_bzero((char *)json_string_value(e), json_string_length(e));
        } else if (!json_is_null(e)) {
            if (json_is_string(e))
                explicit_bzero((char *)json_string_value(e), json_string_length(e));
            json_object_set_new(v, key, json_string(CONFIG_REDACTED));
        }
    }
}

void config_redact(json_t *v) { walk_secrets(v, 0); }

void config_scrub(json_t *v) { walk_secrets(v, 1); }

void config_free(struct server_config *cfg) {
    for (size_t i = 0; i < SERVER_NOPTIONS; i++) {
        const struct option_def *d = &SERVER_OPTION_DEFS[i];
        void *p = slot(cfg, d);
        if (d->type == OPT_STR || d->type == OPT_ENUM) {
            char *s = *(char **)p;
            if (s && config_is_secret_name(d->field)) explicit_bzero(s, strlen(s));
            free(s);
        } else if (d->type == OPT_STRLIST || d->type == OPT_JSONLIST) {
            config_scrub(*(json_t **)p);
            json_decref(*(json_t **)p);
        }
    }
    memset(cfg, 0, sizeof(*cfg));
}

static json_t *value_json(const struct server_config *cfg, const struct option_def *d) {
    const void *p = cslot(cfg, d);
    switch (d->type) {
    case OPT_STR:
    case OPT_ENUM:
        return *(char *const *)p ? json_string(*(char *const *)p) : json_null();
    case OPT_INT:
        return json_integer(*(const long *)p);
    case OPT_FLOAT:
        return json_real(*(const double *)p);
    case OPT_BOOL:
        return json_boolean(*(const int *)p);
    case OPT_STRLIST:
    case OPT_JSONLIST:
        return *(json_t *const *)p ? json_deep_copy(*(json_t *const *)p) : json_array();
    }
    return json_null();
}

json_t *config_to_json(const struct server_config *cfg) {
    json_t *root = json_object();
    for (size_t g = 0; g < sizeof(GROUPS) / sizeof(GROUPS[0]); g++) {
        json_t *o = json_object();
        for (size_t i = 0; i < SERVER_NOPTIONS; i++) {
            const struct option_def *d = &SERVER_OPTION_DEFS[i];
            if (strcmp(d->group, GROUPS[g]) != 0) continue;
            /* The repeatable flag is singular; the parsed value is the list. */
            const char *key = d->type == OPT_JSONLIST ? "l2_adapters" : d->field;
            json_object_set_new(o, key, value_json(cfg, d));
        }
        json_object_set_new(root, GROUPS[g], o);
    }
    config_redact(root);
    return root;
}

void config_print_help(FILE *f) {
    fprintf(f, "usage: lmcache server --l1-size-gb GIB --eviction-policy {LRU,IsolatedLRU} "
               "[options]\n\noptions:\n");
    for (size_t i = 0; i < SERVER_NOPTIONS; i++) {
        const struct option_def *d = &SERVER_OPTION_DEFS[i];
        char lhs[64];
        static const char *META[] = {"STR", "INT", "FLOAT", "", "CHOICE", "VALUE...", "JSON"};
        snprintf(lhs, sizeof(lhs), "--%s %s", d->flag, d->type == OPT_ENUM ? "" : META[d->type]);
        fprintf(f, "  %-36s %s", lhs, d->help);
        if (d->choices) fprintf(f, " {%s}", d->choices);
        if (d->flags & OPT_REQUIRED)
            fprintf(f, " (required)");
        else if (d->def && d->type != OPT_BOOL)
            fprintf(f, " (default: %s)", d->def);
        fprintf(f, "\n");
    }
}

void config_print_markdown(FILE *f) {
    static const char *TYPES[] = {"string", "int", "float", "flag", "choice", "list", "JSON"};
    fprintf(f, "| option | type | default | group in `GET /config` | description |\n");
    fprintf(f, "|---|---|---|---|---|\n");
    for (size_t i = 0; i < SERVER_NOPTIONS; i++) {
        const struct option_def *d = &SERVER_OPTION_DEFS[i];
        fprintf(f, "| `--%s` | %s", d->flag, TYPES[d->type]);
        if (d->choices) {
            fputs(" (`", f);
            for (const char *c = d->choices; *c; c++)
                fputs(*c == '|' ? "`, `" : (char[]){*c, 0}, f);
            fputs("`)", f);
        } else if (d->min <= d->max) {
            fprintf(f, " [%.10g, %.10g]", d->min, d->max);
        }
        if (d->flags & OPT_REQUIRED)
            fprintf(f, " | required");
        else if (d->def)
            fprintf(f, " | `%s`", *d->def ? d->def : "\"\"");
        else
            fprintf(f, " | none");
        fprintf(f, " | `%s.%s` | ", d->group, d->type == OPT_JSONLIST ? "l2_adapters" : d->field);
        for (const char *h = d->help; *h; h++) fputs(*h == '|' ? "\\|" : (char[]){*h, 0}, f);
        fprintf(f, " |\n");
    }
}

uint64_t config_max_heap_bytes(const struct server_config *cfg) {
    if (cfg->max_heap_mb >= 0) return (uint64_t)cfg->max_heap_mb << 20;
    uint64_t mem = heap_memory_limit();
    if (!mem) return 0;
    uint64_t l1 = (uint64_t)(cfg->l1_size_gb * (double)(1ull << 30));
    uint64_t workers = cfg->max_workers > 0 ? (uint64_t)cfg->max_workers : 1;
    uint64_t floor = 2 * workers * ((uint64_t)cfg->worker_queue_mb << 20) + (256ull << 20);
    uint64_t half = mem > l1 ? (mem - l1) / 2 : 0;
    return half > floor ? half : floor;
}
