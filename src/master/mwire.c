/* MatchExternalKv request decoding and reply encoding on the protobuf wire format
 * (see mwire.h; reading through base/pbwire.h). */
#include "master/mwire.h"

#include "base/pbwire.h"
#include "base/utf8.h"

#include <protobuf-c/protobuf-c.h>
#include <stdlib.h>
#include <string.h>

int mwire_match_request(const uint8_t *d, size_t n, struct mstore_key **keys, size_t *nkeys,
                        bool *count_as_hit) {
    *keys = NULL;
    *nkeys = 0;
    *count_as_hit = false;
    /* First pass counts the hashes so the views are one allocation. */
    size_t cnt = 0;
    for (int pass = 0; pass < 2; pass++) {
        const uint8_t *p = d, *end = d + n;
        size_t k = 0;
        while (p < end) {
            uint64_t v;
            uint32_t field;
            unsigned wt;
            if (pbw_tag(&p, end, &field, &wt)) goto bad;
            if (field == 1) {
                if (wt != 2 || pbw_len(&p, end, &v)) goto bad;
                if (pass) (*keys)[k] = (struct mstore_key){(const char *)p, (size_t)v};
                k++;
                p += v;
            } else if (field == 2) {
                /* As protobuf-c reads a bool: any wire type, true when any byte of the
                 * field (after the tag) has a value bit set. */
                const uint8_t *f0 = p;
                if (pbw_skip(&p, end, wt)) goto bad;
                bool b = false;
                for (const uint8_t *x = f0; x < p; x++) b |= (*x & 0x7f) != 0;
                *count_as_hit = b;
            } else if (pbw_skip(&p, end, wt)) {
                goto bad;
            }
        }
        if (!pass) {
            cnt = k;
            if (!cnt) return MWIRE_OK;
            *keys = malloc(cnt * sizeof(**keys));
            if (!*keys) return MWIRE_NOMEM;
        }
    }
    *nkeys = cnt;
    return MWIRE_OK;
bad:
    free(*keys);
    *keys = NULL;
    *count_as_hit = false;
    return MWIRE_MALFORMED;
}

int mwire_text_check(const char *s, size_t n) {
    struct utf8_error e;
    if (utf8_check(s, n, UTF8_NO_NUL, &e) == n) return MWIRE_TEXT_OK;
    return e.reason == UTF8_NUL ? MWIRE_TEXT_NUL : MWIRE_TEXT_UTF8;
}

/* One message level; sub-messages recurse (umbp.proto has no recursive message, so the
 * depth is bounded by the schema). */
static int check_strings(const ProtobufCMessageDescriptor *desc, const uint8_t *d, size_t n,
                         const char **field) {
    const uint8_t *p = d, *end = d + n;
    while (p < end) {
        uint32_t num;
        unsigned wt;
        uint64_t v;
        if (pbw_tag(&p, end, &num, &wt)) return MWIRE_TEXT_UTF8;
        const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field(desc, num);
        if (!f || wt != 2 ||
            (f->type != PROTOBUF_C_TYPE_STRING && f->type != PROTOBUF_C_TYPE_MESSAGE)) {
            if (pbw_skip(&p, end, wt)) return MWIRE_TEXT_UTF8;
            continue;
        }
        if (pbw_len(&p, end, &v)) return MWIRE_TEXT_UTF8;
        int rc = f->type == PROTOBUF_C_TYPE_STRING
                     ? mwire_text_check((const char *)p, (size_t)v)
                     : check_strings(f->descriptor, p, (size_t)v, field);
        if (!rc && f->type == PROTOBUF_C_TYPE_STRING && v > MWIRE_MAX_NODE_ID &&
            !strcmp(f->name, "node_id"))
            rc = MWIRE_TEXT_LONG;
        if (rc) {
            if (f->type == PROTOBUF_C_TYPE_STRING) *field = f->name;
            return rc;
        }
        p += v;
    }
    return MWIRE_TEXT_OK;
}

int mwire_check_strings(const struct ProtobufCMessageDescriptor *desc, const uint8_t *d, size_t n,
                        const char **field) {
    *field = "?";
    return check_strings(desc, d, n, field);
}

static size_t varint_len(uint64_t v) {
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static uint8_t *put_varint(uint8_t *p, uint64_t v) {
    while (v >= 0x80) {
        *p++ = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    *p++ = (uint8_t)v;
    return p;
}

/* A length-delimited field: tag, length, and (for strings) the bytes. */
static size_t ld_len(size_t n) { return 1 + varint_len(n) + n; }

static uint8_t *put_bytes(uint8_t *p, uint8_t tag, const void *s, size_t n) {
    *p++ = tag;
    p = put_varint(p, n);
    memcpy(p, s, n);
    return p + n;
}

/* TierHashes { TierType tier = 1; repeated string hashes = 2; } */
static size_t tier_len(const struct mstore_match_tier *t, const struct mstore_key *keys) {
    size_t n = t->tier ? 1 + varint_len((uint64_t)t->tier) : 0; /* proto3 omits 0 */
    for (uint32_t k = 0; k < t->n; k++) n += ld_len(keys[t->idx[k]].n);
    return n;
}

/* ExternalKvNodeMatch { node_id = 1; peer_address = 2; repeated TierHashes = 3; } */
static size_t node_len(const struct mstore_match_node *mn, const struct mstore_key *keys,
                       size_t *tl) {
    size_t idl = strlen(mn->node_id), pl = strlen(mn->peer_address);
    size_t n = (idl ? ld_len(idl) : 0) + (pl ? ld_len(pl) : 0);
    for (uint32_t t = 0; t < mn->ntiers; t++) {
        tl[t] = tier_len(&mn->tiers[t], keys);
        n += ld_len(tl[t]);
    }
    return n;
}

int mwire_match_reply(const struct mstore_match *mt, const struct mstore_key *keys, uint8_t **buf,
                      size_t *len) {
    size_t total = 0, tl[MSTORE_NTIERS];
    for (uint32_t i = 0; i < mt->nnodes; i++) total += ld_len(node_len(&mt->nodes[i], keys, tl));
    uint8_t *b = malloc(total ? total : 1), *p = b;
    if (!b) return MWIRE_NOMEM;
    for (uint32_t i = 0; i < mt->nnodes; i++) {
        const struct mstore_match_node *mn = &mt->nodes[i];
        size_t nl = node_len(mn, keys, tl);
        *p++ = 0x0a; /* MatchExternalKvResponse.matches */
        p = put_varint(p, nl);
        size_t idl = strlen(mn->node_id), pl = strlen(mn->peer_address);
        if (idl) p = put_bytes(p, 0x0a, mn->node_id, idl);
        if (pl) p = put_bytes(p, 0x12, mn->peer_address, pl);
        for (uint32_t t = 0; t < mn->ntiers; t++) {
            const struct mstore_match_tier *th = &mn->tiers[t];
            *p++ = 0x1a; /* hashes_by_tier */
            p = put_varint(p, tl[t]);
            if (th->tier) {
                *p++ = 0x08;
                p = put_varint(p, (uint64_t)th->tier);
            }
            for (uint32_t k = 0; k < th->n; k++)
                p = put_bytes(p, 0x12, keys[th->idx[k]].p, keys[th->idx[k]].n);
        }
    }
    *buf = b;
    *len = (size_t)(p - b);
    return MWIRE_OK;
}
