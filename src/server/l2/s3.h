/* The "s3" L2 adapter (type_name "S3L2Adapter"): KV objects as S3 objects, through libcurl multi
 * in one I/O thread with SigV4 signing, a size cache for lookups, ListObjectsV2 listing and a
 * circuit breaker that opens on connection failures and closes again when S3 answers a probe.
 * Configuration and behaviour: docs/l2-s3.md. The helpers below are exposed for unit tests. */
#ifndef LMCACHE_SERVER_L2_S3_H
#define LMCACHE_SERVER_L2_S3_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "server/keys.h"
#include "server/l2/adapter.h"

#define S3_TYPE_NAME "S3L2Adapter"

/* The factory ("type":"s3"). Returns L2_OK, or L2_ERR_INVAL / L2_ERR_NOMEM / L2_ERR_IO with a
 * message in err. */
int s3_adapter_create(const json_t *config, struct l2_adapter **out, char *err, size_t errlen);

/* RFC 3986 percent-encoding as SigV4 wants it: unreserved characters (A-Z a-z 0-9 - _ . ~) stay,
 * '/' stays when keep_slash, every other byte becomes %XX (upper-case hex). Writes a NUL-terminated
 * string and returns its length, or -1 when out (outlen bytes) is too small. */
long s3_uri_encode(const char *in, size_t len, bool keep_slash, char *out, size_t outlen);

/* Longest object key: the prefix (at most 512 bytes) and an escaped L2 object name. */
#define S3_KEY_MAX (512 + 3 * KEYS_L2_NAME_MAX)

/* The S3 key of an L2 object name (after the prefix): the name with every '%' written "%25" and
 * the dots of every dot segment ("." or ".." between slashes) written "%2E", so that no server,
 * proxy or file-system store that resolves dot segments can move the object out of the bucket
 * and prefix. Reversible; names without '%' and dot segments are unchanged. Returns the length,
 * or -1 when out (outlen bytes) is too small. */
long s3_key_escape(const char *name, char *out, size_t outlen);
/* The inverse: -1 for a key that s3_key_escape cannot have produced (not one of ours). */
long s3_key_unescape(const char *key, size_t len, char *out, size_t outlen);

/* The URL path of an object below the bucket: prefix + s3_key_escape(name), percent-encoded as
 * above with '/' kept. It is sent and signed as is (CURLOPT_PATH_AS_IS). Returns the length, or
 * -1 when the key is longer than S3_KEY_MAX or out is too small (3 * S3_KEY_MAX + 1 is enough). */
long s3_object_path(const char *prefix, const char *name, char *out, size_t outlen);

/* The opaque page token: base64url (no padding) of a version byte followed by S3's continuation
 * token. encode returns a malloc'd string or NULL (out of memory, or longer than
 * L2_PAGE_TOKEN_MAX); decode returns a malloc'd continuation token, or NULL for a malformed
 * token. */
char *s3_token_encode(const char *continuation);
char *s3_token_decode(const char *token);

/* The circuit breaker. Pure state: time is passed in (monotonic ns). Closed -> open after
 * `threshold` consecutive connection failures; open -> half-open when the cooldown has elapsed
 * and a probe is due; half-open -> closed when the probe gets any HTTP answer, -> open again (the
 * cooldown doubles, up to the maximum) when it fails. */
enum s3_breaker_state { S3_BREAKER_CLOSED = 0, S3_BREAKER_OPEN = 1, S3_BREAKER_HALF_OPEN = 2 };

struct s3_breaker {
    enum s3_breaker_state state;
    uint32_t threshold;
    uint32_t failures; /* consecutive connection failures */
    uint64_t cooldown_ns, cooldown_max_ns, cur_cooldown_ns;
    uint64_t opened_at_ns;
    uint64_t opens; /* times it opened (closed -> open) */
};

void s3_breaker_init(struct s3_breaker *b, uint32_t threshold, uint64_t cooldown_ns,
                     uint64_t cooldown_max_ns);
/* May a normal request go out? (closed only) */
bool s3_breaker_allow(const struct s3_breaker *b);
void s3_breaker_on_failure(struct s3_breaker *b, uint64_t now_ns);
void s3_breaker_on_success(struct s3_breaker *b);
/* True once per cooldown while open: the caller must then send one probe (the state becomes
 * half-open) and report its outcome with on_success / on_failure. */
bool s3_breaker_probe_due(struct s3_breaker *b, uint64_t now_ns);
const char *s3_breaker_state_name(enum s3_breaker_state s);

#endif
