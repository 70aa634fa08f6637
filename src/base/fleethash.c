/* Placement hashes (see fleethash.h for the recipe). */
#include "base/fleethash.h"

#include <openssl/evp.h>
#include <pthread.h>
#include <string.h>

/* One SHA-256 implementation fetched once and one digest context per thread: the data path
 * computes a placement hash per admitted and removed chunk, and a context allocated and an
 * algorithm looked up per call cost more than the digest of these ~100 bytes. */
static EVP_MD *g_sha256;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static pthread_key_t g_ctx_key;

static void ctx_free(void *ctx) { EVP_MD_CTX_free(ctx); }

static void fleethash_init(void) {
    g_sha256 = EVP_MD_fetch(NULL, "SHA256", NULL);
    if (pthread_key_create(&g_ctx_key, ctx_free) != 0) {
        EVP_MD_free(g_sha256);
        g_sha256 = NULL;
    }
}

/* This thread's digest context (freed when the thread exits), or NULL. */
static EVP_MD_CTX *thread_ctx(void) {
    pthread_once(&g_once, fleethash_init);
    if (!g_sha256) return NULL;
    EVP_MD_CTX *ctx = pthread_getspecific(g_ctx_key);
    if (!ctx) {
        ctx = EVP_MD_CTX_new();
        if (ctx && pthread_setspecific(g_ctx_key, ctx) != 0) {
            EVP_MD_CTX_free(ctx);
            ctx = NULL;
        }
    }
    return ctx;
}

int fleethash_compute(const char *model_name, const char *cache_salt, uint32_t kv_rank,
                      const uint8_t *chunk_hash, size_t chunk_hash_len,
                      uint8_t out[FLEETHASH_LEN]) {
    static const uint8_t zero = 0;
    uint8_t rank[4] = {(uint8_t)(kv_rank >> 24), (uint8_t)(kv_rank >> 16), (uint8_t)(kv_rank >> 8),
                       (uint8_t)kv_rank};
    EVP_MD_CTX *ctx = thread_ctx();
    unsigned int n = 0;
    int ok = ctx && EVP_DigestInit_ex(ctx, g_sha256, NULL) == 1 &&
             EVP_DigestUpdate(ctx, FLEETHASH_DOMAIN, strlen(FLEETHASH_DOMAIN)) == 1 &&
             EVP_DigestUpdate(ctx, &zero, 1) == 1 &&
             EVP_DigestUpdate(ctx, model_name, strlen(model_name)) == 1 &&
             EVP_DigestUpdate(ctx, &zero, 1) == 1 &&
             EVP_DigestUpdate(ctx, cache_salt, strlen(cache_salt)) == 1 &&
             EVP_DigestUpdate(ctx, &zero, 1) == 1 && EVP_DigestUpdate(ctx, rank, 4) == 1 &&
             EVP_DigestUpdate(ctx, chunk_hash, chunk_hash_len) == 1 &&
             EVP_DigestFinal_ex(ctx, out, &n) == 1 && n == FLEETHASH_LEN;
    return ok ? 0 : -1;
}

long fleethash_chunks(const char *seed_string, const uint32_t *tokens, size_t ntokens,
                      size_t chunk_size, uint8_t (*out)[FLEETHASH_LEN], size_t max_out) {
    if (!chunk_size) return -1;
    uint8_t prev[FLEETHASH_LEN];
    unsigned int n = 0;
    EVP_MD_CTX *ctx = thread_ctx();
    if (!ctx || EVP_Digest(seed_string, strlen(seed_string), prev, &n, g_sha256, NULL) != 1)
        return -1;
    size_t nc = ntokens / chunk_size;
    if (nc > max_out) nc = max_out;
    for (size_t c = 0; c < nc; c++) {
        if (EVP_DigestInit_ex(ctx, g_sha256, NULL) != 1 ||
            EVP_DigestUpdate(ctx, prev, FLEETHASH_LEN) != 1)
            return -1;
        uint8_t buf[4 * 256];
        const uint32_t *t = tokens + c * chunk_size;
        for (size_t off = 0; off < chunk_size;) {
            size_t b = chunk_size - off < 256 ? chunk_size - off : 256;
            for (size_t i = 0; i < b; i++) {
                uint32_t v = t[off + i];
                buf[4 * i] = (uint8_t)(v >> 24);
                buf[4 * i + 1] = (uint8_t)(v >> 16);
                buf[4 * i + 2] = (uint8_t)(v >> 8);
                buf[4 * i + 3] = (uint8_t)v;
            }
            if (EVP_DigestUpdate(ctx, buf, 4 * b) != 1) return -1;
            off += b;
        }
        if (EVP_DigestFinal_ex(ctx, prev, &n) != 1) return -1;
        memcpy(out[c], prev, FLEETHASH_LEN);
    }
    return (long)nc;
}
