/* Typed reads of optional JSON config fields (see jfield.h). */
#include "base/jfield.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/errbuf.h"
#include "base/size.h"

int jfield_bool(const json_t *obj, const char *field, bool *out, const char *who, char *err,
                size_t errlen) {
    const json_t *v = json_object_get(obj, field);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_boolean(v)) {
        errbuf_set(err, errlen, "%s: \"%s\" must be a boolean", who, field);
        return -1;
    }
    *out = json_is_true(v);
    return 0;
}

int jfield_int(const json_t *obj, const char *field, long lo, long hi, long *out, const char *who,
               char *err, size_t errlen) {
    const json_t *v = json_object_get(obj, field);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi) {
        errbuf_set(err, errlen, "%s: \"%s\" must be an integer in [%ld, %ld]", who, field, lo, hi);
        return -1;
    }
    *out = (long)json_integer_value(v);
    return 0;
}

int jfield_str(const json_t *obj, const char *field, char **out, const char *who, char *err,
               size_t errlen) {
    const json_t *v = json_object_get(obj, field);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_string(v)) {
        errbuf_set(err, errlen, "%s: \"%s\" must be a string", who, field);
        return -1;
    }
    char *s = strdup(json_string_value(v));
    if (!s) {
        errbuf_set(err, errlen, "out of memory");
        return -1;
    }
    free(*out);
    *out = s;
    return 0;
}

int jfield_size(const json_t *v, const char *field, uint64_t *out, char *err, size_t errlen) {
    if (json_is_integer(v)) {
        json_int_t n = json_integer_value(v);
        if (n <= 0) {
            errbuf_set(err, errlen, "%s must be positive", field);
            return -2;
        }
        *out = (uint64_t)n;
        return 0;
    }
    if (json_is_string(v)) {
        char e[160];
        if (size_parse(json_string_value(v), out, e, sizeof(e)) != 0 || *out == 0) {
            errbuf_set(err, errlen, "%s: %s", field, e);
            return -2;
        }
        return 0;
    }
    errbuf_set(err, errlen, "%s must be an integer byte count or a size string such as \"100GiB\"",
               field);
    return -1;
}

const char *jfield_unknown(const json_t *obj, const char *const *allowed) {
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)obj, k, v) {
        bool known = false;
        for (size_t i = 0; allowed[i] && !known; i++) known = strcmp(k, allowed[i]) == 0;
        if (!known) return k;
    }
    return NULL;
}
