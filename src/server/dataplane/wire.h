/* Data-plane message codec: typed field access on a decoded msgpack map, and the reply
 * builder. Decoded strings and bins point into the received frame (no copies). */
#ifndef LMCACHE_DATAPLANE_WIRE_H
#define LMCACHE_DATAPLANE_WIRE_H

#include <msgpack.h>
#include <stddef.h>
#include <stdint.h>

/* Error codes of docs/protocol.md. */
#define DP_BAD_REQUEST       "bad_request"
#define DP_UNKNOWN_OPERATION "unknown_operation"
#define DP_TOO_LARGE         "too_large"
#define DP_NOT_REGISTERED    "not_registered"
#define DP_INVALID_BLOCKS    "invalid_blocks"
#define DP_NOT_FOUND         "not_found"
#define DP_OUT_OF_MEMORY     "out_of_memory"
#define DP_SHM_ERROR         "shm_error"
#define DP_PROOF_REQUIRED    "proof_required"
#define DP_INTERNAL          "internal"
#define DP_TOO_MANY_NAMES    "too_many_names"

/* A large integer array of the payload read where it lies (dp_decode): `token_ids` and
 * `block_ids` of at least DP_RAW_MIN elements, each a non-negative integer below 2^32 in
 * msgpack's unsigned forms. msgpack-c would make a 24-byte object of each element (a 32k-token
 * prompt: 0.8 MB and about half of a 128-chunk lookup's server time). */
#define DP_RAW_MIN 64
/* The other fields are then copied into a map of their own for msgpack-c: only while they take
 * at most this, or 16 times the arrays' bytes (else the payload is decoded whole). */
#define DP_RAW_REST_MAX (64u << 10)
struct dp_rawarr {
    const char *name;         /* "token_ids" or "block_ids" */
    const unsigned char *p;   /* the first element's bytes, in the received frame */
    const unsigned char *end; /* just past the last element's */
    uint32_t n;
    uint32_t *vals;      /* the n elements, converted while they were checked (malloc'd; NULL once
                          * dp_u32_array took them) */
    msgpack_object stub; /* an ARRAY of n elements with no element objects (ptr NULL) */
};

/* A decoded payload map. */
struct dp_map {
    const msgpack_object *obj; /* a MSGPACK_OBJECT_MAP, or NULL for an empty payload */
    struct dp_rawarr raw[2];   /* fields read in place (not in obj) */
    unsigned nraw;
    void *rest; /* with raw fields: the payload without them, which obj points into */
    size_t rest_len;
};

/* A failure: code + message, filled by the getters. */
struct dp_err {
    const char *code;
    char message[256];
};

/* Largest num_kv_readers of a lookup (read locks per object; L1 counts at most 65535 holders). */
#define DP_MAX_KV_READERS 1024

/* Chunks one request's prompt may have (chunk_hashes, or token_ids / chunk_size): bounds the
 * hashes a request makes the server compute and hold. */
#define DP_MAX_PROMPT_CHUNKS (1u << 20)

/* Elements (of any type) one payload may hold: bounds the decoder's memory (~24 B each). */
#define DP_MAX_ELEMENTS (16u << 20)

/* Checks a msgpack document's structure without allocating; 0 when it is well formed, fits len
 * and has at most max_elements elements. */
int dp_msgpack_check(const void *buf, size_t len, uint64_t max_elements);

/* Decodes a payload frame into a map. Returns 0, or -1 with err set (bad_request). The
 * unpacked object keeps pointers into buf and lives in up; release with dp_map_free (also after
 * a failure) before buf goes. A payload whose large integer arrays are all in the plain forms is
 * decoded with them read in place (struct dp_rawarr); anything else goes through msgpack-c
 * whole, so errors are reported the same either way. */
int dp_decode(const void *buf, size_t len, msgpack_unpacked *up, struct dp_map *out,
              struct dp_err *err);
void dp_map_free(struct dp_map *m);

/* The value of field name, or NULL when absent (nil counts as absent). For a field read in
 * place: its stub (type and size only: use dp_u32_array or dp_raw). */
const msgpack_object *dp_get(const struct dp_map *m, const char *name);
/* The field read in place, or NULL. */
const struct dp_rawarr *dp_raw(const struct dp_map *m, const char *name);
/* Its elements into out[0..r->n). */
void dp_raw_u32(const struct dp_rawarr *r, uint32_t *out);

/* Typed getters. `required`: absence is an error. They return 0 (found, *out set), 1 (absent,
 * *out untouched) or -1 (error set, naming the field). */
int dp_int(const struct dp_map *m, const char *name, int required, int64_t min, int64_t max,
           int64_t *out, struct dp_err *err);
int dp_bool(const struct dp_map *m, const char *name, int required, int *out, struct dp_err *err);
/* Length of the longest prefix of s[0..len) that is valid UTF-8 text without control characters
 * (U+0000-U+001F, U+007F-U+009F); len when the whole string is. */
size_t dp_text_check(const char *s, size_t len);

/* A string that must fit maxlen bytes and be valid UTF-8 text (dp_text_check: such strings reach
 * metric labels, logs, JSON and L2 object names); *s points into the frame (not
 * NUL-terminated). */
int dp_str(const struct dp_map *m, const char *name, int required, size_t maxlen, const char **s,
           size_t *len, struct dp_err *err);
/* A string copied NUL-terminated into out (cap bytes including the NUL). */
int dp_cstr(const struct dp_map *m, const char *name, int required, char *out, size_t cap,
            struct dp_err *err);
/* An array; *arr points at its elements (a field read in place has none: dp_raw). */
int dp_array(const struct dp_map *m, const char *name, int required, const msgpack_object **arr,
             uint32_t *n, struct dp_err *err);
/* Converts an array of non-negative ints into out (caller frees). A field read in place was
 * converted by dp_decode already: that array is handed over (m keeps no copy). */
int dp_u32_array(struct dp_map *m, const char *name, int required, uint32_t **out, uint32_t *n,
                 struct dp_err *err);

void dp_fail(struct dp_err *err, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* A frame sent after the reply map (retrieve_bytes with chunk_frames): libzmq sends it from
 * where it is and calls release(data, hint) once done with it, from any thread (libzmq's I/O
 * thread, or the sender when the send fails). */
struct dp_frame {
    void *data;
    size_t len;
    void (*release)(void *data, void *hint);
    void *hint;
};

/* Reply builder: a map whose entry count is fixed up at the end, and the frames that follow it
 * (none for every operation but retrieve_bytes with chunk_frames). */
struct dp_reply {
    msgpack_sbuffer buf;
    msgpack_packer pk;
    uint32_t nfields;
    size_t header;           /* bytes reserved for the map header */
    struct dp_frame *frames; /* malloc'd, nframes long; whoever takes them sets this NULL */
    uint32_t nframes;
};

/* Releases frames[0..n) and frees the array. */
void dp_frames_release(struct dp_frame *frames, uint32_t n);

void dp_reply_init(struct dp_reply *r);
void dp_reply_free(struct dp_reply *r);
/* Makes room for `extra` more bytes at once (a large reply then costs one allocation and no
 * regrowth copies). 0, or -1 when out of memory. */
int dp_reply_reserve(struct dp_reply *r, size_t extra);
/* Starts the next field; the caller packs exactly one value after it. */
void dp_key(struct dp_reply *r, const char *name);
void dp_put_bool(struct dp_reply *r, const char *name, int v);
void dp_put_int(struct dp_reply *r, const char *name, int64_t v);
void dp_put_double(struct dp_reply *r, const char *name, double v);
void dp_put_str(struct dp_reply *r, const char *name, const char *s);
/* Finishes the map (ok is added by dp_finish); returns the encoded bytes (owned by r). */
const char *dp_finish(struct dp_reply *r, int ok, const struct dp_err *err, size_t *len);

#endif
