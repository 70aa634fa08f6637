/* Typed reads of optional fields of a JSON config object, with one wording for every error
 * ("<who>: \"<field>\" must be ..."), so adapters and other config readers agree. */
#ifndef LMCACHE_BASE_JFIELD_H
#define LMCACHE_BASE_JFIELD_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Each reader leaves *out unchanged when the field is absent or null (set the default first)
 * and returns 0; a value of the wrong type or range returns -1 with err filled, naming who (the
 * reader's prefix, e.g. "fs adapter") and the field. */
int jfield_bool(const json_t *obj, const char *field, bool *out, const char *who, char *err,
                size_t errlen);
/* An integer in [lo, hi]. */
int jfield_int(const json_t *obj, const char *field, long lo, long hi, long *out, const char *who,
               char *err, size_t errlen);
/* A string: *out (NULL or a malloc'ed default, freed when replaced) becomes a malloc'ed copy
 * that the caller frees; out of memory is -1 too. */
int jfield_str(const json_t *obj, const char *field, char **out, const char *who, char *err,
               size_t errlen);

/* A size value v (not a field look-up: v may be NULL): a JSON integer byte count or a string with
 * a base-1024 suffix (size_parse). Returns 0 and *out (> 0); -1 when v has the wrong JSON type
 * (HTTP 422 material); -2 when it does not resolve to a positive byte count (HTTP 400 material).
 * err names `field`. */
int jfield_size(const json_t *v, const char *field, uint64_t *out, char *err, size_t errlen);

/* The first key of obj that is not in allowed (a NULL-terminated list), or NULL when every key
 * is known. The returned string belongs to obj. */
const char *jfield_unknown(const json_t *obj, const char *const *allowed);

#endif
