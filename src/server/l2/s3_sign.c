/* S3 request signing and naming (SigV4): RFC 3986 encoding, object keys that cannot leave the
 * bucket and prefix, object URLs, and the libcurl SigV4 set-up with the payload hash header. */
#include "server/l2/s3_internal.h"

#include <openssl/sha.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

long s3_uri_encode(const char *in, size_t len, bool keep_slash, char *out, size_t outlen) {
    static const char hex[] = "0123456789ABCDEF";
    size_t o = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)in[i];
        bool keep = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                    c == '-' || c == '_' || c == '.' || c == '~' || (keep_slash && c == '/');
        if (keep) {
            if (o + 1 >= outlen) return -1;
            out[o++] = (char)c;
        } else {
            if (o + 3 >= outlen) return -1;
            out[o++] = '%';
            out[o++] = hex[c >> 4];
            out[o++] = hex[c & 15];
        }
    }
    if (o >= outlen) return -1;
    out[o] = '\0';
    return (long)o;
}

/* A segment of the name (between slashes, or at either end) that is "." or "..". */
static bool dot_segment(const char *seg, size_t n) {
    return (n == 1 && seg[0] == '.') || (n == 2 && seg[0] == '.' && seg[1] == '.');
}

long s3_key_escape(const char *name, char *out, size_t outlen) {
    size_t o = 0;
    for (const char *seg = name;;) {
        size_t n = strcspn(seg, "/");
        bool dots = dot_segment(seg, n);
        for (size_t i = 0; i < n; i++) {
            const char *rep = seg[i] == '%' ? "%25" : dots ? "%2E" : NULL;
            size_t rl = rep ? 3 : 1;
            if (o + rl >= outlen) return -1;
            if (rep)
                memcpy(out + o, rep, 3);
            else
                out[o] = seg[i];
            o += rl;
        }
        if (!seg[n]) break;
        if (o + 1 >= outlen) return -1;
        out[o++] = '/';
        seg += n + 1;
    }
    out[o] = '\0';
    return (long)o;
}

long s3_key_unescape(const char *key, size_t len, char *out, size_t outlen) {
    size_t o = 0;
    for (size_t i = 0; i < len; i++) {
        char c = key[i];
        if (c == '%') {
            if (i + 2 >= len || key[i + 1] != '2') return -1;
            if (key[i + 2] == '5')
                c = '%';
            else if (key[i + 2] == 'E')
                c = '.';
            else
                return -1;
            i += 2;
        }
        if (o + 1 >= outlen) return -1;
        out[o++] = c;
    }
    out[o] = '\0';
    /* Only the escaper's output is accepted: a dot segment written with plain dots, or an
     * escaped dot outside a dot segment, is not a name of ours. */
    char again[S3_KEY_MAX + 1];
    long n = s3_key_escape(out, again, sizeof(again));
    if (n < 0 || (size_t)n != len || memcmp(again, key, len) != 0) return -1;
    return (long)o;
}

long s3_object_path(const char *prefix, const char *name, char *out, size_t outlen) {
    size_t plen = strlen(prefix);
    char full[S3_KEY_MAX + 1];
    if (plen >= sizeof(full)) return -1;
    memcpy(full, prefix, plen);
    long n = s3_key_escape(name, full + plen, sizeof(full) - plen);
    if (n < 0) return -1;
    return s3_uri_encode(full, plen + (size_t)n, true, out, outlen);
}

/* The URL of one object. Its path is sent and signed exactly as built here (CURLOPT_PATH_AS_IS in
 * req_start), and the key holds no dot segment of the model name, so no request and no object
 * ever leaves the configured bucket and prefix. */
char *s3_object_url(struct s3 *s, const char *name) {
    char enc[3 * S3_KEY_MAX + 1];
    if (s3_object_path(s->prefix, name, enc, sizeof(enc)) < 0) return NULL;
    struct strbuf sb = STRBUF_INIT;
    sb_printf(&sb, "%s/%s", s->base_url, enc);
    if (sb.oom) {
        sb_free(&sb);
        return NULL;
    }
    return sb_detach(&sb, NULL);
}

static void sha256_hex(const uint8_t *d, size_t n, char out[65]) {
    unsigned char md[SHA256_DIGEST_LENGTH];
    SHA256(d, n, md);
    keys_hex_encode(md, sizeof(md), out);
}

int s3_sign_request(struct s3 *s, CURL *e, const struct s3_req *r, struct curl_slist **h) {
    if (curl_easy_setopt(e, CURLOPT_AWS_SIGV4, s->sigv4) != CURLE_OK ||
        curl_easy_setopt(e, CURLOPT_USERNAME, s->akid) != CURLE_OK ||
        curl_easy_setopt(e, CURLOPT_PASSWORD, s->secret) != CURLE_OK)
        return -1;
    const char *payload = S3_EMPTY_SHA256;
    char digest[65], hdr[256];
    if (r->method == M_PUT) {
        if (s->sign_payload) {
            sha256_hex(r->src, (size_t)r->src_len, digest);
            payload = digest;
        } else {
            payload = "UNSIGNED-PAYLOAD";
        }
    }
    struct curl_slist *t;
    snprintf(hdr, sizeof(hdr), "x-amz-content-sha256: %s", payload);
    if (!(t = curl_slist_append(*h, hdr))) return -1;
    *h = t;
    if (s->token_hdr) {
        if (!(t = curl_slist_append(*h, s->token_hdr))) return -1;
        *h = t;
    }
    return 0;
}
