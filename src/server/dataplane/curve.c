/* CURVE key files and the ZAP handler. The handler is one thread with a REP socket on
 * inproc://zeromq.zap.01 of the data socket's context; libzmq asks it about every CURVE
 * handshake, and it answers 200 only for a client key of the allow-list. */
#include "server/dataplane/curve.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <openssl/crypto.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "base/clock.h"
#include "base/errbuf.h"
#include "base/log.h"
#include "base/ratelimit.h"

#define MAX_KEYS      100000
#define MAX_FILE_SIZE (16u << 20)

struct dp_zap {
    void *sock;
    pthread_t tid;
    _Atomic int stop;
    unsigned char (*keys)[32]; /* sorted */
    size_t nkeys;
    struct logger *lg;
    struct ratelimit refused_log; /* refused handshakes come at the rate a stranger chooses */
};

static int is_z85(char c) {
    return c > 0x20 && c < 0x7f && c != '"' && c != '\'' && c != ',' && c != ';' && c != '\\' &&
           c != '_' && c != '`' && c != '|' && c != '~';
}

/* Calls fn on every key line of a file's text. Returns the number of keys, or -1 with a message
 * when a line is not a key. */
static int scan_keys(const char *path, const char *text, int (*fn)(void *arg, const char *z85),
                     void *arg, char *err, size_t errlen) {
    int n = 0, lineno = 0;
    const char *p = text;
    while (*p) {
        const char *eol = strchr(p, '\n');
        size_t len = eol ? (size_t)(eol - p) : strlen(p);
        lineno++;
        while (len && (p[len - 1] == '\r' || p[len - 1] == ' ' || p[len - 1] == '\t')) len--;
        size_t skip = 0;
        while (skip < len && (p[skip] == ' ' || p[skip] == '\t')) skip++;
        if (len > skip && p[skip] != '#') {
            size_t klen = len - skip;
            int ok = klen == CURVE_Z85_LEN;
            for (size_t i = 0; ok && i < klen; i++) ok = is_z85(p[skip + i]);
            if (!ok) {
                errbuf_set(err, errlen, "%s:%d: not a Z85 key (40 characters)", path, lineno);
                return -1;
            }
            char key[CURVE_Z85_LEN + 1];
            memcpy(key, p + skip, CURVE_Z85_LEN);
            key[CURVE_Z85_LEN] = 0;
            if (fn(arg, key) < 0) {
                errbuf_set(err, errlen, "%s:%d: not a Z85 key", path, lineno);
                return -1;
            }
            n++;
        }
        p += eol ? (size_t)(eol - p) + 1 : strlen(p);
    }
    return n;
}

static char *slurp(const char *path, char *err, size_t errlen) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_size > MAX_FILE_SIZE) {
        errbuf_set(err, errlen, "%s: %s", path,
                   fd < 0 ? strerror(errno) : "not a regular file of at most 16 MiB");
        if (fd >= 0) close(fd);
        return NULL;
    }
    char *buf = malloc((size_t)st.st_size + 1);
    size_t got = 0;
    while (buf && got < (size_t)st.st_size) {
        ssize_t r = read(fd, buf + got, (size_t)st.st_size - got);
        if (r <= 0) break;
        got += (size_t)r;
    }
    close(fd);
    if (!buf) {
        errbuf_set(err, errlen, "%s: out of memory", path);
        return NULL;
    }
    buf[got] = 0;
    if (strlen(buf) != got) {
        errbuf_set(err, errlen, "%s: holds a NUL byte", path);
        free(buf);
        return NULL;
    }
    return buf;
}

static int take_first(void *arg, const char *z85) {
    char *out = arg;
    if (!out[0]) memcpy(out, z85, CURVE_Z85_LEN + 1);
    return 0;
}

int curve_read_key(const char *path, char out[CURVE_Z85_LEN + 1], char *err, size_t errlen) {
    char *text = slurp(path, err, errlen);
    if (!text) return -1;
    out[0] = 0;
    int n = scan_keys(path, text, take_first, out, err, errlen);
    OPENSSL_cleanse(text, strlen(text)); /* a secret key file */
    free(text);
    if (n < 0) return -1;
    if (n == 0) {
        errbuf_set(err, errlen, "%s: no key", path);
        return -1;
    }
    unsigned char bin[32];
    if (!zmq_z85_decode(bin, out)) {
        errbuf_set(err, errlen, "%s: not a Z85 key", path);
        return -1;
    }
    return 0;
}

static int add_key(void *arg, const char *z85) {
    struct dp_zap *z = arg;
    if (z->nkeys >= MAX_KEYS) return -1;
    if (!zmq_z85_decode(z->keys[z->nkeys], z85)) return -1;
    z->nkeys++;
    return 0;
}

static int load_file(struct dp_zap *z, const char *path, char *err, size_t errlen) {
    char *text = slurp(path, err, errlen);
    if (!text) return -1;
    int n = scan_keys(path, text, add_key, z, err, errlen);
    free(text);
    return n < 0 ? -1 : 0;
}

static int cmp_key(const void *a, const void *b) { return memcmp(a, b, 32); }

static int load_keys(struct dp_zap *z, const char *allowed, char *err, size_t errlen) {
    z->keys = calloc(MAX_KEYS, 32);
    if (!z->keys) {
        errbuf_set(err, errlen, "out of memory");
        return -1;
    }
    struct stat st;
    if (stat(allowed, &st) < 0) {
        errbuf_set(err, errlen, "--curve-allowed-clients %s: %s", allowed, strerror(errno));
        return -1;
    }
    if (S_ISDIR(st.st_mode)) {
        DIR *d = opendir(allowed);
        if (!d) {
            errbuf_set(err, errlen, "--curve-allowed-clients %s: %s", allowed, strerror(errno));
            return -1;
        }
        struct dirent *de;
        int rc = 0;
        while (rc == 0 && (de = readdir(d))) {
            if (de->d_name[0] == '.') continue;
            char path[4096];
            struct stat fst;
            snprintf(path, sizeof(path), "%s/%s", allowed, de->d_name);
            if (lstat(path, &fst) < 0 || !S_ISREG(fst.st_mode)) continue;
            rc = load_file(z, path, err, errlen);
        }
        closedir(d);
        if (rc < 0) return -1;
    } else if (load_file(z, allowed, err, errlen) < 0) {
        return -1;
    }
    if (z->nkeys == 0) {
        errbuf_set(err, errlen, "--curve-allowed-clients %s: no key", allowed);
        return -1;
    }
    qsort(z->keys, z->nkeys, 32, cmp_key);
    return 0;
}

/* One ZAP request: [version][request id][domain][address][identity][mechanism][credentials...].
 * Answers [version][request id][status][text][user id][metadata]. */
static void zap_serve(struct dp_zap *z) {
    zmq_msg_t f[8];
    int n = 0, more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, z->sock, 0) < 0) {
            zmq_msg_close(&m);
            break;
        }
        more = zmq_msg_more(&m);
        if (n < 8) {
            zmq_msg_init(&f[n]);
            zmq_msg_move(&f[n], &m);
            n++;
        }
        zmq_msg_close(&m);
    }
    const char *status = "400", *text = "unknown client key";
    char user[CURVE_Z85_LEN + 1] = "";
    if (n >= 6 && zmq_msg_size(&f[5]) == 5 && !memcmp(zmq_msg_data(&f[5]), "CURVE", 5) && n >= 7 &&
        zmq_msg_size(&f[6]) == 32) {
        const unsigned char *key = zmq_msg_data(&f[6]);
        if (bsearch(key, z->keys, z->nkeys, 32, cmp_key)) {
            status = "200";
            text = "OK";
            zmq_z85_encode(user, key, 32);
        } else {
            char shown[CURVE_Z85_LEN + 1];
            unsigned long dropped;
            zmq_z85_encode(shown, key, 32);
            if (ratelimit_allow(&z->refused_log, clock_mono(), &dropped))
                log_warn(z->lg,
                         "CURVE client key %s is not allowed (%lu similar refusals not logged)",
                         shown, dropped);
        }
    } else if (n >= 6 && zmq_msg_size(&f[5]) == 4 && !memcmp(zmq_msg_data(&f[5]), "NULL", 4)) {
        /* Sockets without CURVE (the ipc endpoint) are not this handler's to judge. */
        status = "200";
        text = "OK";
    }
    if (n >= 2) {
        zmq_send(z->sock, "1.0", 3, ZMQ_SNDMORE);
        zmq_send(z->sock, zmq_msg_data(&f[1]), zmq_msg_size(&f[1]), ZMQ_SNDMORE);
        zmq_send(z->sock, status, 3, ZMQ_SNDMORE);
        zmq_send(z->sock, text, strlen(text), ZMQ_SNDMORE);
        zmq_send(z->sock, user, strlen(user), ZMQ_SNDMORE);
        zmq_send(z->sock, "", 0, 0);
    }
    for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
}

static void *zap_main(void *arg) {
    struct dp_zap *z = arg;
    pthread_setname_np(pthread_self(), "dp-zap");
    zmq_pollitem_t item = {z->sock, 0, ZMQ_POLLIN, 0};
    while (!atomic_load(&z->stop)) {
        int n = zmq_poll(&item, 1, 100);
        if (n < 0 && errno != EINTR) break;
        if (n > 0 && (item.revents & ZMQ_POLLIN)) zap_serve(z);
    }
    return NULL;
}

struct dp_zap *dp_zap_start(void *zctx, const char *allowed, char *err, size_t errlen) {
    struct dp_zap *z = calloc(1, sizeof(*z));
    if (!z) {
        errbuf_set(err, errlen, "out of memory");
        return NULL;
    }
    z->refused_log = (struct ratelimit)RATELIMIT_INIT(10.0, 10);
    z->lg = log_get("lmcache.zmq");
    if (load_keys(z, allowed, err, errlen) < 0) goto fail;
    z->sock = zmq_socket(zctx, ZMQ_REP);
    int linger = 0;
    if (!z->sock || zmq_setsockopt(z->sock, ZMQ_LINGER, &linger, sizeof(linger)) < 0 ||
        zmq_bind(z->sock, "inproc://zeromq.zap.01") < 0) {
        errbuf_set(err, errlen, "cannot start the ZAP handler: %s", zmq_strerror(errno));
        goto fail;
    }
    int terr = pthread_create(&z->tid, NULL, zap_main, z);
    if (terr) {
        errbuf_set(err, errlen, "cannot start the ZAP handler: %s", strerror(terr));
        goto fail;
    }
    log_info(z->lg, "CURVE: %zu allowed client keys", z->nkeys);
    return z;
fail:
    if (z->sock) zmq_close(z->sock);
    free(z->keys);
    free(z);
    return NULL;
}

void dp_zap_stop(struct dp_zap *z) {
    if (!z) return;
    atomic_store(&z->stop, 1);
    pthread_join(z->tid, NULL);
    zmq_close(z->sock);
    free(z->keys);
    free(z);
}

static int write_file(const char *path, const char *text, mode_t mode) {
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, mode);
    if (fd < 0) return -1;
    size_t len = strlen(text);
    ssize_t w = write(fd, text, len);
    int rc = (w == (ssize_t)len && fsync(fd) == 0) ? 0 : -1;
    close(fd);
    return rc;
}

int curve_keygen_main(int argc, char **argv) {
    if (argc != 2 || argv[1][0] == '-') {
        fprintf(stderr,
                "usage: lmcache curve-keygen PREFIX\n"
                "  writes PREFIX.key (the secret key, mode 0600) and PREFIX.pub (the public\n"
                "  key), both Z85, for --curve-secret-key-file, --curve-allowed-clients and\n"
                "  the client's curve options (docs/security.md)\n");
        return argc == 2 ? 0 : 2;
    }
    char pub[CURVE_Z85_LEN + 1], sec[CURVE_Z85_LEN + 1];
    if (zmq_curve_keypair(pub, sec) != 0) {
        fprintf(stderr, "lmcache curve-keygen: %s (libzmq without CURVE?)\n", zmq_strerror(errno));
        return 1;
    }
    char kpath[4096], ppath[4096], ktext[128], ptext[128];
    snprintf(kpath, sizeof(kpath), "%s.key", argv[1]);
    snprintf(ppath, sizeof(ppath), "%s.pub", argv[1]);
    snprintf(ktext, sizeof(ktext), "# lmcache CURVE secret key: keep private\n%s\n", sec);
    snprintf(ptext, sizeof(ptext), "%s\n", pub);
    if (write_file(kpath, ktext, 0600) < 0) {
        fprintf(stderr, "lmcache curve-keygen: %s: %s\n", kpath, strerror(errno));
        return 1;
    }
    if (write_file(ppath, ptext, 0644) < 0) {
        fprintf(stderr, "lmcache curve-keygen: %s: %s\n", ppath, strerror(errno));
        unlink(kpath);
        return 1;
    }
    printf("%s\n", pub);
    return 0;
}
