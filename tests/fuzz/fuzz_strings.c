/* libFuzzer driver for the string decoders we own: L2 object names, hex chunk hashes, size
 * strings. Round trips must be exact. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/size.h"
#include "server/keys.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char err[KEYS_ERR_MAX];
    char *s = malloc(size + 1);
    if (!s) return 0;
    memcpy(s, data, size);
    s[size] = 0;
    struct keys_object_key k;
    if (keys_l2_name_parse(s, size, &k, err, sizeof(err)) == 0) {
        char name[KEYS_L2_NAME_MAX];
        struct keys_object_key k2;
        int n = keys_l2_name(&k, name, sizeof(name));
        if (n < 0 || keys_l2_name_parse(name, (size_t)n, &k2, err, sizeof(err)) != 0 ||
            memcmp(k.hash, k2.hash, k.hash_len) != 0 || k.hash_len != k2.hash_len ||
            k.kv_rank != k2.kv_rank || k.object_group_id != k2.object_group_id ||
            strcmp(k.model_name, k2.model_name) != 0 || strcmp(k.cache_salt, k2.cache_salt) != 0)
            __builtin_trap();
    }
    uint8_t h[KEYS_HASH_MAX], hl = 0;
    if (keys_hash_from_hex(s, size, h, &hl, err, sizeof(err)) == 0 && (hl == 0 || hl * 2 != size))
        __builtin_trap();
    uint64_t v;
    if (size_parse(s, &v, err, sizeof(err)) == 0 && v == 0) __builtin_trap();
    free(s);
    return 0;
}
