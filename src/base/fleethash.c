/* Placement hashes (see fleethash.h for the recipe). */
#include "base/fleethash.h"

#include <openssl/evp.h>
#include <string.h>

int fleethash_compute(const char *model_name, const char *cache_salt, uint32_t kv_rank,
                      const uint8_t *chunk_hash, size_t chunk_hash_len,
                      uint8_t out[FLEETHASH_LEN]) {
    static const uint8_t zero = 0;
    uint8_t rank[4] = {(uint8_t)(kv_rank >> 24), (uint8_t)(kv_rank >> 16), (uint8_t)(kv_rank >> 8),
                       (uint8_t)kv_rank};
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    unsigned int n = 0;
    int ok = ctx && EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) == 1 &&
             EVP_DigestUpdate(ctx, FLEETHASH_DOMAIN, strlen(FLEETHASH_DOMAIN)) == 1 &&
             EVP_DigestUpdate(ctx, &zero, 1) == 1 &&
             EVP_DigestUpdate(ctx, model_name, strlen(model_name)) == 1 &&
             EVP_DigestUpdate(ctx, &zero, 1) == 1 &&
             EVP_DigestUpdate(ctx, cache_salt, strlen(cache_salt)) == 1 &&
             EVP_DigestUpdate(ctx, &zero, 1) == 1 && EVP_DigestUpdate(ctx, rank, 4) == 1 &&
             EVP_DigestUpdate(ctx, chunk_hash, chunk_hash_len) == 1 &&
             EVP_DigestFinal_ex(ctx, out, &n) == 1 && n == FLEETHASH_LEN;
    EVP_MD_CTX_free(ctx);
    return ok ? 0 : -1;
}

long fleethash_chunks(const char *seed_string, const uint32_t *tokens, size_t ntokens,
                      size_t chunk_size, uint8_t (*out)[FLEETHASH_LEN], size_t max_out) {
    if (!chunk_size) return -1;
    uint8_t prev[FLEETHASH_LEN];
    unsigned int n = 0;
    if (EVP_Digest(seed_string, strlen(seed_string), prev, &n, EVP_sha256(), NULL) != 1) return -1;
    size_t nc = ntokens / chunk_size;
    if (nc > max_out) nc = max_out;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (!ctx) return -1;
    for (size_t c = 0; c < nc; c++) {
        if (EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) != 1 ||
            EVP_DigestUpdate(ctx, prev, FLEETHASH_LEN) != 1) {
            EVP_MD_CTX_free(ctx);
            return -1;
        }
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
            if (EVP_DigestUpdate(ctx, buf, 4 * b) != 1) {
                EVP_MD_CTX_free(ctx);
                return -1;
            }
            off += b;
        }
        if (EVP_DigestFinal_ex(ctx, prev, &n) != 1) {
            EVP_MD_CTX_free(ctx);
            return -1;
        }
        memcpy(out[c], prev, FLEETHASH_LEN);
    }
    EVP_MD_CTX_free(ctx);
    return (long)nc;
}
