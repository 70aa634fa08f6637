/* Placement hashes (see fleethash.h for the recipe). */
#include "server/fleethash.h"

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
