/* S3 adapter configuration: the JSON fields (base/jfield), endpoint and addressing, the SigV4
 * scope, and credentials from the config or the environment (wiped from memory when dropped). */
#include "server/l2/s3_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/errbuf.h"
#include "base/jfield.h"

static char *env_dup(const char *name) {
    const char *v = getenv(name);
    return v && v[0] ? strdup(v) : NULL;
}

int s3_configure(struct s3 *s, const json_t *cfg, char *err, size_t errlen) {
    char *addressing = NULL, *akid = NULL, *secret = NULL, *token = NULL;
    int rc = -1;
    long threshold = 3, cooldown_ms = 1000, cooldown_max_ms = 30000;
    if (jfield_str(cfg, "bucket", &s->bucket, "s3", err, errlen) ||
        jfield_str(cfg, "endpoint", &s->endpoint, "s3", err, errlen) ||
        jfield_str(cfg, "region", &s->region, "s3", err, errlen) ||
        jfield_str(cfg, "prefix", &s->prefix, "s3", err, errlen) ||
        jfield_str(cfg, "addressing", &addressing, "s3", err, errlen) ||
        jfield_str(cfg, "access_key_id", &akid, "s3", err, errlen) ||
        jfield_str(cfg, "secret_access_key", &secret, "s3", err, errlen) ||
        jfield_str(cfg, "session_token", &token, "s3", err, errlen))
        goto out;
    s->max_in_flight = 64;
    s->connect_timeout_ms = 3000;
    s->request_timeout_ms = 30000;
    if (jfield_int(cfg, "max_in_flight", 1, 4096, &s->max_in_flight, "s3", err, errlen) ||
        jfield_int(cfg, "connect_timeout_ms", 1, 600000, &s->connect_timeout_ms, "s3", err,
                   errlen) ||
        jfield_int(cfg, "request_timeout_ms", 1, 3600000, &s->request_timeout_ms, "s3", err,
                   errlen) ||
        jfield_int(cfg, "breaker_threshold", 1, 1000000, &threshold, "s3", err, errlen) ||
        jfield_int(cfg, "breaker_cooldown_ms", 1, 3600000, &cooldown_ms, "s3", err, errlen) ||
        jfield_int(cfg, "breaker_cooldown_max_ms", 1, 3600000, &cooldown_max_ms, "s3", err, errlen))
        goto out;
    s->sign_payload = true;
    if (jfield_bool(cfg, "sign_payload", &s->sign_payload, "s3", err, errlen)) goto out;
    uint64_t cap = 0;
    if (l2_config_capacity(cfg, "max_capacity_gb", &cap, err, errlen) != L2_OK) goto out;
    s->base.capacity_bytes = cap;

    if (!s->bucket || !s->bucket[0]) {
        errbuf_set(err, errlen, "s3: \"bucket\" is required");
        goto out;
    }
    for (const char *c = s->bucket; *c; c++) {
        if (!((*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') || *c == '-' || *c == '.' ||
              *c == '_')) {
            errbuf_set(err, errlen, "s3: bucket \"%s\" has a character S3 does not allow",
                       s->bucket);
            goto out;
        }
    }
    if (!s->prefix && !(s->prefix = strdup(""))) goto oom;
    if (strlen(s->prefix) > 512) {
        errbuf_set(err, errlen, "s3: \"prefix\" is longer than 512 bytes");
        goto out;
    }
    if (!s->region && !(s->region = env_dup("AWS_REGION")) &&
        !(s->region = env_dup("AWS_DEFAULT_REGION")) && !(s->region = strdup("us-east-1")))
        goto oom;
    if (!s->region[0] || strpbrk(s->region, ":/ ")) {
        errbuf_set(err, errlen, "s3: region \"%s\" is not valid", s->region);
        goto out;
    }
    bool custom = s->endpoint != NULL;
    if (!custom) {
        struct strbuf sb = STRBUF_INIT;
        sb_printf(&sb, "https://s3.%s.amazonaws.com", s->region);
        if (sb.oom) goto oom;
        s->endpoint = sb_detach(&sb, NULL);
    }
    size_t el = strlen(s->endpoint);
    while (el > 0 && s->endpoint[el - 1] == '/') s->endpoint[--el] = '\0';
    const char *host = NULL;
    if (strncmp(s->endpoint, "http://", 7) == 0)
        host = s->endpoint + 7;
    else if (strncmp(s->endpoint, "https://", 8) == 0)
        host = s->endpoint + 8;
    if (!host || !host[0] || strpbrk(host, "?#@ ")) {
        errbuf_set(err, errlen, "s3: endpoint \"%s\" must be http://host[:port] or https://...",
                   s->endpoint);
        goto out;
    }
    if (!addressing)
        s->virtual_host = !custom;
    else if (strcmp(addressing, "path") == 0)
        s->virtual_host = false;
    else if (strcmp(addressing, "virtual") == 0)
        s->virtual_host = true;
    else {
        errbuf_set(err, errlen, "s3: \"addressing\" must be \"path\" or \"virtual\"");
        goto out;
    }
    struct strbuf sb = STRBUF_INIT;
    if (s->virtual_host)
        sb_printf(&sb, "%.*s%s.%s", (int)(host - s->endpoint), s->endpoint, s->bucket, host);
    else
        sb_printf(&sb, "%s/%s", s->endpoint, s->bucket);
    if (sb.oom) goto oom;
    s->base_url = sb_detach(&sb, NULL);
    sb_printf(&sb, "aws:amz:%s:s3", s->region);
    if (sb.oom) goto oom;
    s->sigv4 = sb_detach(&sb, NULL);

    if ((akid == NULL) != (secret == NULL)) {
        errbuf_set(err, errlen,
                   "s3: set both \"access_key_id\" and \"secret_access_key\", or "
                   "neither (then AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY are used)");
        goto out;
    }
    if (akid) {
        s->cred_source = "config";
        s->akid = akid;
        s->secret = secret;
        akid = secret = NULL;
    } else {
        s->cred_source = "environment";
        s->akid = env_dup("AWS_ACCESS_KEY_ID");
        s->secret = env_dup("AWS_SECRET_ACCESS_KEY");
        if (!token) token = env_dup("AWS_SESSION_TOKEN");
        if (!s->akid || !s->secret) {
            errbuf_set(err, errlen,
                       "s3: no credentials: set \"access_key_id\" and "
                       "\"secret_access_key\", or AWS_ACCESS_KEY_ID and "
                       "AWS_SECRET_ACCESS_KEY");
            goto out;
        }
    }
    if (token && token[0]) {
        if (strpbrk(token, "\r\n")) {
            errbuf_set(err, errlen, "s3: \"session_token\" must be one line");
            goto out;
        }
        sb_printf(&sb, "x-amz-security-token: %s", token);
        if (sb.oom) goto oom;
        s->token_hdr = sb_detach(&sb, NULL);
    }
    s3_breaker_init(&s->br, (uint32_t)threshold, (uint64_t)cooldown_ms * 1000000u,
                    (uint64_t)cooldown_max_ms * 1000000u);
    rc = 0;
    goto out;
oom:
    errbuf_set(err, errlen, "out of memory");
out:
    free(addressing);
    free(akid);
    if (secret) explicit_bzero(secret, strlen(secret));
    free(secret);
    if (token) explicit_bzero(token, strlen(token));
    free(token);
    return rc;
}
