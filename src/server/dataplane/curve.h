/* CURVE on the data socket: Z85 key files, the ZAP handler that admits the client public keys
 * of an allow-list, and `lmcache curve-keygen`. */
#ifndef LMCACHE_DATAPLANE_CURVE_H
#define LMCACHE_DATAPLANE_CURVE_H

#include <stddef.h>

#define CURVE_Z85_LEN 40 /* a 32-byte key in Z85 */

struct dp_zap;

/* Reads the first Z85 key (40 characters; blank lines and '#' comments skipped) of a file.
 * 0, or -1 with a message. */
int curve_read_key(const char *path, char out[CURVE_Z85_LEN + 1], char *err, size_t errlen);

/* Loads the allowed client public keys (a file, or every regular file of a directory) and
 * starts the ZAP handler of zctx; call it before binding a socket that uses CURVE. NULL with a
 * message when the list cannot be read or is empty. */
struct dp_zap *dp_zap_start(void *zctx, const char *allowed, char *err, size_t errlen);
/* Stops the handler and closes its socket (before the context is terminated). */
void dp_zap_stop(struct dp_zap *z);

/* `lmcache curve-keygen PREFIX`: writes PREFIX.key (secret, mode 0600) and PREFIX.pub. */
int curve_keygen_main(int argc, char **argv);

#endif
