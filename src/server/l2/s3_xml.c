/* expat-based readers for the S3 XML documents: ListObjectsV2 pages and error bodies. */
#include "server/l2/s3_xml.h"

#include <errno.h>
#include <expat.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/errbuf.h"

#define S3_XML_DEPTH_MAX 32

enum field { F_NONE, F_KEY, F_SIZE, F_TOKEN, F_TRUNC, F_CODE, F_MSG };

struct pstate {
    XML_Parser p;
    bool is_list; /* the root we expect: ListBucketResult or Error */
    int depth;
    bool root_ok;
    bool in_contents;
    enum field field;
    char text[S3_XML_TEXT_MAX + 1];
    size_t tlen;
    bool overflow;
    /* current <Contents> */
    char *key;
    bool have_size, size_bad;
    uint64_t size;
    /* results */
    struct s3_xml_list *list;
    char code[256], msg[1024];
    bool have_code;
    int fail; /* 0, or an error we raised (XML_StopParser) */
    char why[128];
};

/* Copies src into dst[cap], cutting it when too long. */
static void copy_trunc(char *dst, size_t cap, const char *src) {
    size_t n = strlen(src);
    if (n >= cap) n = cap - 1;
    memcpy(dst, src, n);
    dst[n] = '\0';
}

static void stop(struct pstate *ps, const char *why) {
    if (ps->fail) return;
    ps->fail = 1;
    snprintf(ps->why, sizeof(ps->why), "%s", why);
    XML_StopParser(ps->p, XML_FALSE);
}

static bool parse_u64(const char *s, uint64_t *out) {
    if (!*s) return false;
    uint64_t v = 0;
    for (; *s; s++) {
        if (*s < '0' || *s > '9') return false;
        unsigned d = (unsigned)(*s - '0');
        if (v > (UINT64_MAX - d) / 10) return false;
        v = v * 10 + d;
    }
    *out = v;
    return true;
}

static void XMLCALL on_start(void *ud, const XML_Char *name, const XML_Char **attrs) {
    (void)attrs;
    struct pstate *ps = ud;
    if (ps->fail) return;
    ps->depth++;
    if (ps->depth > S3_XML_DEPTH_MAX) {
        stop(ps, "XML nested too deeply");
        return;
    }
    ps->field = F_NONE;
    ps->tlen = 0;
    ps->overflow = false;
    if (ps->depth == 1) {
        const char *want = ps->is_list ? "ListBucketResult" : "Error";
        ps->root_ok = strcmp(name, want) == 0;
        if (!ps->root_ok && ps->is_list) stop(ps, "root element is not ListBucketResult");
        return;
    }
    if (!ps->root_ok) return;
    if (ps->is_list) {
        if (ps->depth == 2 && strcmp(name, "Contents") == 0) {
            ps->in_contents = true;
            free(ps->key);
            ps->key = NULL;
            ps->have_size = ps->size_bad = false;
        } else if (ps->depth == 2 && strcmp(name, "NextContinuationToken") == 0) {
            ps->field = F_TOKEN;
        } else if (ps->depth == 2 && strcmp(name, "IsTruncated") == 0) {
            ps->field = F_TRUNC;
        } else if (ps->depth == 3 && ps->in_contents && strcmp(name, "Key") == 0) {
            ps->field = F_KEY;
        } else if (ps->depth == 3 && ps->in_contents && strcmp(name, "Size") == 0) {
            ps->field = F_SIZE;
        }
    } else if (ps->depth == 2) {
        if (strcmp(name, "Code") == 0)
            ps->field = F_CODE;
        else if (strcmp(name, "Message") == 0)
            ps->field = F_MSG;
    }
}

static void XMLCALL on_text(void *ud, const XML_Char *s, int len) {
    struct pstate *ps = ud;
    if (ps->fail || ps->field == F_NONE || len <= 0) return;
    if (ps->tlen + (size_t)len > S3_XML_TEXT_MAX) {
        ps->overflow = true;
        return;
    }
    memcpy(ps->text + ps->tlen, s, (size_t)len);
    ps->tlen += (size_t)len;
}

static int push_item(struct pstate *ps) {
    struct s3_xml_list *l = ps->list;
    if (l->count >= S3_XML_ITEMS_MAX) return -1;
    if (l->count % 64 == 0) {
        struct s3_xml_item *n = realloc(l->items, (l->count + 64) * sizeof(*n));
        if (!n) return -1;
        l->items = n;
    }
    l->items[l->count].key = ps->key;
    l->items[l->count].size = ps->size;
    l->count++;
    ps->key = NULL;
    return 0;
}

static void XMLCALL on_end(void *ud, const XML_Char *name) {
    struct pstate *ps = ud;
    if (ps->fail) return;
    ps->text[ps->tlen] = '\0';
    enum field f = ps->field;
    ps->field = F_NONE;
    if (f != F_NONE && ps->overflow) {
        stop(ps, "XML element text too long");
        return;
    }
    switch (f) {
    case F_KEY:
        if (ps->tlen > S3_XML_KEY_MAX) {
            stop(ps, "object key longer than 1024 bytes");
            return;
        }
        free(ps->key);
        ps->key = strdup(ps->text);
        if (!ps->key) stop(ps, "out of memory");
        break;
    case F_SIZE:
        ps->have_size = parse_u64(ps->text, &ps->size);
        ps->size_bad = !ps->have_size;
        break;
    case F_TOKEN:
        free(ps->list->next_token);
        ps->list->next_token = ps->tlen ? strdup(ps->text) : NULL;
        if (ps->tlen && !ps->list->next_token) stop(ps, "out of memory");
        break;
    case F_TRUNC:
        ps->list->truncated = strcmp(ps->text, "true") == 0;
        break;
    case F_CODE:
        copy_trunc(ps->code, sizeof(ps->code), ps->text);
        ps->have_code = true;
        break;
    case F_MSG:
        copy_trunc(ps->msg, sizeof(ps->msg), ps->text);
        break;
    case F_NONE:
        break;
    }
    if (ps->is_list && ps->depth == 2 && ps->in_contents && strcmp(name, "Contents") == 0) {
        ps->in_contents = false;
        if (ps->key && ps->have_size && !ps->size_bad && push_item(ps) != 0)
            stop(ps, "too many entries in one listing");
        free(ps->key);
        ps->key = NULL;
    }
    ps->depth--;
}

/* A DOCTYPE could declare entities (expansion attacks); S3 never sends one. */
static void XMLCALL on_doctype(void *ud, const XML_Char *name, const XML_Char *sysid,
                               const XML_Char *pubid, int has_internal) {
    (void)name, (void)sysid, (void)pubid, (void)has_internal;
    stop(ud, "DOCTYPE not allowed");
}

static int run(struct pstate *ps, const char *doc, size_t len, char *err, size_t errlen) {
    if (len > (size_t)INT32_MAX) {
        errbuf_set(err, errlen, "XML document too large");
        return -1;
    }
    ps->p = XML_ParserCreate("UTF-8");
    if (!ps->p) {
        errbuf_set(err, errlen, "out of memory");
        return -1;
    }
    XML_SetUserData(ps->p, ps);
    XML_SetElementHandler(ps->p, on_start, on_end);
    XML_SetCharacterDataHandler(ps->p, on_text);
    XML_SetStartDoctypeDeclHandler(ps->p, on_doctype);
    enum XML_Status st = XML_Parse(ps->p, doc, (int)len, XML_TRUE);
    int rc = 0;
    if (ps->fail) {
        errbuf_set(err, errlen, "%s", ps->why);
        rc = -1;
    } else if (st != XML_STATUS_OK) {
        errbuf_set(err, errlen, "malformed XML at line %lu: %s",
                   (unsigned long)XML_GetCurrentLineNumber(ps->p),
                   XML_ErrorString(XML_GetErrorCode(ps->p)));
        rc = -1;
    } else if (!ps->root_ok) {
        errbuf_set(err, errlen, "unexpected root element");
        rc = -1;
    }
    XML_ParserFree(ps->p);
    free(ps->key);
    ps->key = NULL;
    return rc;
}

int s3_xml_parse_list(const char *doc, size_t len, struct s3_xml_list *out, char *err,
                      size_t errlen) {
    memset(out, 0, sizeof(*out));
    struct pstate *ps = calloc(1, sizeof(*ps));
    if (!ps) {
        errbuf_set(err, errlen, "out of memory");
        return -1;
    }
    ps->is_list = true;
    ps->list = out;
    int rc = run(ps, doc, len, err, errlen);
    free(ps);
    if (rc != 0) s3_xml_list_free(out);
    return rc;
}

void s3_xml_list_free(struct s3_xml_list *l) {
    if (!l) return;
    for (size_t i = 0; i < l->count; i++) free(l->items[i].key);
    free(l->items);
    free(l->next_token);
    memset(l, 0, sizeof(*l));
}

int s3_xml_parse_error(const char *doc, size_t len, char *code, size_t codelen, char *msg,
                       size_t msglen) {
    if (codelen) code[0] = '\0';
    if (msglen) msg[0] = '\0';
    if (!doc || len == 0) return -1;
    struct pstate *ps = calloc(1, sizeof(*ps));
    if (!ps) return -1;
    char err[128];
    int rc = run(ps, doc, len, err, sizeof(err));
    if (rc == 0 && ps->have_code) {
        snprintf(code, codelen, "%s", ps->code);
        snprintf(msg, msglen, "%s", ps->msg);
    } else {
        rc = -1;
    }
    free(ps);
    return rc;
}
