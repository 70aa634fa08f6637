/* S3 listing: ListObjectsV2 pages (sorted, encoded query strings as SigV4 wants them), names
 * mapped back to keys, and the opaque page tokens that carry S3's continuation token. */
#include "server/l2/s3_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/errbuf.h"
#include "server/l2/s3_xml.h"

static const char b64url[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

char *s3_token_encode(const char *continuation) {
    size_t n = strlen(continuation) + 1;
    size_t outlen = (n * 4 + 2) / 3;
    if (outlen > L2_PAGE_TOKEN_MAX) return NULL;
    unsigned char *raw = malloc(n);
    char *out = malloc(outlen + 1);
    if (!raw || !out) {
        free(raw);
        free(out);
        return NULL;
    }
    raw[0] = S3_TOKEN_VERSION;
    memcpy(raw + 1, continuation, n - 1);
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)raw[i] << 16;
        if (i + 1 < n) v |= (uint32_t)raw[i + 1] << 8;
        if (i + 2 < n) v |= raw[i + 2];
        out[o++] = b64url[(v >> 18) & 63];
        out[o++] = b64url[(v >> 12) & 63];
        if (i + 1 < n) out[o++] = b64url[(v >> 6) & 63];
        if (i + 2 < n) out[o++] = b64url[v & 63];
    }
    out[o] = '\0';
    free(raw);
    return out;
}

static int b64url_val(char c) {
    const char *p = c ? strchr(b64url, c) : NULL;
    return p ? (int)(p - b64url) : -1;
}

char *s3_token_decode(const char *token) {
    size_t len = strlen(token);
    if (len < 2 || len > L2_PAGE_TOKEN_MAX || len % 4 == 1) return NULL;
    unsigned char *raw = malloc(len);
    if (!raw) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < len; i += 4) {
        size_t k = len - i < 4 ? len - i : 4;
        uint32_t v = 0;
        for (size_t j = 0; j < 4; j++) {
            int d = j < k ? b64url_val(token[i + j]) : 0;
            if (d < 0) {
                free(raw);
                return NULL;
            }
            v = v << 6 | (uint32_t)d;
        }
        raw[o++] = (unsigned char)(v >> 16);
        if (k > 2) raw[o++] = (unsigned char)(v >> 8);
        if (k > 3) raw[o++] = (unsigned char)v;
    }
    /* version byte, then a non-empty continuation token without NULs or control bytes */
    bool ok = o >= 2 && raw[0] == S3_TOKEN_VERSION;
    for (size_t i = 1; ok && i < o; i++) ok = raw[i] >= 0x20;
    char *out = ok ? malloc(o) : NULL;
    if (out) {
        memcpy(out, raw + 1, o - 1);
        out[o - 1] = '\0';
    }
    free(raw);
    return out;
}

static void list_done(struct s3 *s, struct s3_req *r) {
    (void)s;
    s3_sync_dec(r->owner);
}

/* One ListObjectsV2 request. Returns L2_OK with the parsed page, or an error with a message. */
static int list_once(struct s3 *s, const char *prefix, const char *cont, size_t max_keys,
                     struct s3_xml_list *out, char *err, size_t errlen) {
    struct strbuf q = STRBUF_INIT;
    char enc[4 * L2_PAGE_TOKEN_MAX + 3 * (KEYS_MODEL_NAME_MAX + 1024) + 64];
    /* SigV4 wants the parameters sorted by name and RFC 3986-encoded; curl signs them as is. */
    sb_printf(&q, "%s%s?", s->base_url, s->virtual_host ? "/" : "");
    if (cont) {
        if (s3_uri_encode(cont, strlen(cont), false, enc, sizeof(enc)) < 0) {
            sb_free(&q);
            errbuf_set(err, errlen, "continuation token too long");
            return L2_ERR_BAD_TOKEN;
        }
        sb_printf(&q, "continuation-token=%s&", enc);
    }
    sb_printf(&q, "list-type=2&max-keys=%zu", max_keys);
    if (prefix[0]) {
        if (s3_uri_encode(prefix, strlen(prefix), false, enc, sizeof(enc)) < 0) {
            sb_free(&q);
            errbuf_set(err, errlen, "prefix too long");
            return L2_ERR_INVAL;
        }
        sb_printf(&q, "&prefix=%s", enc);
    }
    if (q.oom) {
        sb_free(&q);
        errbuf_set(err, errlen, "out of memory");
        return L2_ERR_NOMEM;
    }
    struct s3_sync w;
    struct s3_req r;
    if (s3_sync_init(&w, 1) != 0) {
        sb_free(&q);
        errbuf_set(err, errlen, "out of memory");
        return L2_ERR_NOMEM;
    }
    s3_req_init(&r, M_LIST, list_done, &w, 0);
    r.url = sb_detach(&q, NULL);
    struct s3_req *rp = &r;
    int rc = s3_enqueue(s, &rp, 1);
    if (rc == L2_OK) s3_sync_wait(&w);
    s3_sync_fini(&w);
    if (rc != L2_OK) {
        errbuf_set(err, errlen, "adapter closed");
    } else if (s3_req_ok(&r) && !r.overflow) {
        char xerr[160];
        if (s3_xml_parse_list(r.body.buf ? r.body.buf : "", r.body.len, out, xerr, sizeof(xerr)) !=
            0) {
            errbuf_set(err, errlen, "ListObjectsV2: unreadable answer: %s", xerr);
            rc = L2_ERR_IO;
        }
    } else if (r.rejected) {
        errbuf_set(err, errlen, "S3 unavailable (circuit breaker open): %s", s->endpoint);
        rc = L2_ERR_IO;
    } else if (r.cc != CURLE_OK) {
        errbuf_set(err, errlen, "ListObjectsV2 %s: %s", s->endpoint,
                   r.overflow ? "answer too large"
                              : (r.curl_err[0] ? r.curl_err : curl_easy_strerror(r.cc)));
        rc = r.closed ? L2_ERR_CLOSED : L2_ERR_IO;
    } else {
        char code[128], msg[256];
        s3_xml_parse_error(r.body.buf, r.body.len, code, sizeof(code), msg, sizeof(msg));
        errbuf_set(err, errlen, "ListObjectsV2 %s: HTTP %ld %s%s%s", s->endpoint, r.http, code,
                   msg[0] ? ": " : "", msg);
        /* S3 answers 400 InvalidArgument for a continuation token it cannot read */
        rc = cont && r.http == 400 ? L2_ERR_BAD_TOKEN : L2_ERR_IO;
    }
    s3_req_release(&r);
    return rc;
}

int s3_list(struct l2_adapter *a, const char *model_filter, size_t page_size, const char *token,
            struct l2_list_page *out, char *err, size_t errlen) {
    struct s3 *s = (struct s3 *)a;
    memset(out, 0, sizeof(*out));
    char *cont = NULL;
    if (token && !(cont = s3_token_decode(token))) {
        errbuf_set(err, errlen, "malformed page token");
        return L2_ERR_BAD_TOKEN;
    }
    char prefix[S3_KEY_MAX + 2], mf[S3_KEY_MAX + 1] = "";
    if (model_filter && s3_key_escape(model_filter, mf, sizeof(mf)) < 0) {
        free(cont);
        errbuf_set(err, errlen, "model_name filter too long");
        return L2_ERR_INVAL;
    }
    snprintf(prefix, sizeof(prefix), "%s%s%s", s->prefix, mf, model_filter ? "@" : "");
    size_t plen = strlen(s->prefix);
    out->entries = calloc(page_size, sizeof(*out->entries));
    if (!out->entries) {
        free(cont);
        errbuf_set(err, errlen, "out of memory");
        return L2_ERR_NOMEM;
    }
    int rc = L2_OK;
    /* Names that are not ours are skipped, so one S3 page may yield fewer entries than asked:
     * ask again (a bounded number of times) until the page is full or the listing ends. */
    for (int round = 0; round < S3_LIST_ROUNDS_MAX && out->count < page_size; round++) {
        struct s3_xml_list l;
        size_t want = page_size - out->count;
        rc = list_once(s, prefix, cont, want > 1000 ? 1000 : want, &l, err, errlen);
        if (rc != L2_OK) break;
        for (size_t i = 0; i < l.count && out->count < page_size; i++) {
            const char *key = l.items[i].key;
            char kerr[KEYS_ERR_MAX];
            if (strncmp(key, s->prefix, plen) != 0) continue;
            struct l2_list_entry *en = &out->entries[out->count];
            char name[KEYS_L2_NAME_MAX + 1];
            long nl = s3_key_unescape(key + plen, strlen(key + plen), name, sizeof(name));
            if (nl < 0 || keys_l2_name_parse(name, (size_t)nl, &en->key, kerr, sizeof(kerr)) != 0)
                continue;
            if (model_filter && strcmp(en->key.model_name, model_filter) != 0) continue;
            en->size = l.items[i].size;
            out->count++;
        }
        free(cont);
        cont = NULL;
        if (l.truncated && l.next_token) {
            cont = l.next_token;
            l.next_token = NULL;
        }
        s3_xml_list_free(&l);
        if (!cont) break;
    }
    if (rc == L2_OK && cont && !(out->next_token = s3_token_encode(cont))) {
        errbuf_set(err, errlen, "S3 continuation token too long for a page token");
        rc = L2_ERR_IO;
    }
    free(cont);
    if (rc != L2_OK) l2_list_page_free(out);
    return rc;
}
