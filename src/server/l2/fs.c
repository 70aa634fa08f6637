/* The `fs` L2 adapter: one file per object, io_uring (or I/O threads) for the bytes, an in-memory
 * index (name -> size, lookup locks) rebuilt from the directory at start.
 *
 * File: payload ‖ L2 name ‖ zero padding ‖ 24-byte trailer. The trailer is "LMCL2FS1", the
 * payload size (u64 LE), the name length (u32 LE) and CRC32C(payload ‖ name) (u32 LE). Padding is
 * empty unless o_direct, which rounds the file to 4 KiB. A file is written as
 * base_path/.tmp-<seq>.kv and renamed to its final name, so a reader never sees a partial file;
 * leftover .tmp- files are removed by the rescan.
 *
 * File name: the L2 object name (keys_l2_name) with '/', '%', control bytes and 0x7f written as
 * %XX, plus ".kv"; names whose encoding exceeds FS_NAME_MAX become "h-<sha256 of the name>.kv"
 * (the trailer holds the real name either way). The mapping is reversible and never creates a
 * directory.
 *
 * Threads: one `l2-fs-uring` thread owning the ring (it opens, prepares SQEs, computes CRCs,
 * reaps CQEs, verifies, renames), or `io_threads` `l2-fs-io` threads doing pwrite/pread. Locks:
 * q_mu (pending job list) and idx_mu (index, capacity reservation; rename/unlink happen under it so
 * index and directory agree) are never nested; idx_mu is held while notifying listeners, so the
 * order is idx_mu -> base acct_mu -> listener locks. */
#include "server/l2/fs.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <limits.h>
#include <openssl/sha.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "base/errbuf.h"
#include "base/hash.h"
#include "base/htab.h"
#include "base/jfield.h"
#include "base/log.h"
#include "server/l2/crc32c.h"

#define FS_MAGIC       "LMCL2FS1"
#define FS_TRAILER_LEN 24
#define FS_ALIGN       4096
#define FS_NAME_MAX    200 /* longest encoded file name before hashing (NAME_MAX is 255) */
#define FS_PATH_MAX    (PATH_MAX + 64)
#define FS_TMP_PREFIX  ".tmp-"
#define FS_SUFFIX      ".kv"
#define FS_WAKE_UD     0 /* user_data of the wakeup poll */

struct fs_entry {
    struct htab_node hn;
    uint64_t size;
    uint32_t locks;
    uint32_t h;
    char name[]; /* the L2 object name */
};

/* One contiguous file range moved to or from one buffer. */
struct fs_seg {
    uint8_t *buf;
    uint64_t off, len, done;
    struct iovec iov; /* io_uring: the part still to move (readv/writev work on kernels 5.1+) */
};

/* One key of a store or load. The file is split in two segments: the head, payload bytes moved
 * directly from/to bufs[i].data (all of the payload when buffered; with o_direct the largest
 * 4 KiB multiple, only when bufs[i].data is 4 KiB aligned), and the tail, an aligned buffer of the
 * job holding the rest (payload remainder ‖ name ‖ padding ‖ trailer). So the payload is never
 * copied when it is aligned, and the head of a store is written while its CRC is computed. */
struct fs_job {
    struct fs_job *next;
    struct fs *fs;
    struct l2_task *t;
    size_t i;
    int fd;
    bool reserved;
    bool io;     /* the job reached I/O (its bytes count as transferred on success) */
    int pending; /* io_uring: segments in flight */
    int err;     /* first segment error (L2_ERR_*) */
    uint64_t file_size;
    uint64_t head_len;
    struct fs_seg seg[2]; /* [0] head, [1] tail; a segment with len 0 is skipped */
    uint8_t *tail;
    size_t tail_len;
    char tmp[64];
    char name[KEYS_L2_NAME_MAX];
    size_t name_len;
};

struct fs {
    struct l2_adapter base; /* first */
    struct logger *lg;
    char base_path[PATH_MAX];
    bool o_direct;
    uint64_t capacity;
    /* index */
    pthread_mutex_t idx_mu;
    struct htab index; /* of fs_entry by name_hash */
    uint64_t reserved_bytes;
    /* pending jobs */
    pthread_mutex_t q_mu;
    pthread_cond_t q_cv;
    struct fs_job *q_head, *q_tail;
    bool closing;
    /* engine */
    bool uring;
    char uring_error[128];
    struct io_uring ring;
    unsigned qd;
    int wake_fd;
    pthread_t *threads;
    size_t nthreads;
    _Atomic uint32_t tmp_seq;
    /* health and counters */
    _Atomic int healthy;
    _Atomic uint64_t write_errors, read_errors, checksum_failures, enospc, rescanned,
        rescan_removed;
    /* test hooks */
    pthread_mutex_t inj_mu;
    int inj_err[3], inj_count[3];
};

static struct fs *FS(struct l2_adapter *a) { return (struct fs *)a; }

/* ---- names ------------------------------------------------------------------------------------
 */

static uint32_t name_hash(const char *s) { return fnv1a32_str(s); }

static bool needs_escape(unsigned char c) { return c == '/' || c == '%' || c < 0x20 || c == 0x7f; }

/* File name (without directory) of an L2 name. */
static void file_name(const char *name, char *out, size_t outlen) {
    static const char hex[] = "0123456789ABCDEF";
    size_t o = 0;
    bool fits = true;
    for (const unsigned char *p = (const unsigned char *)name; *p; p++) {
        if (o + 4 > FS_NAME_MAX) {
            fits = false;
            break;
        }
        if (needs_escape(*p)) {
            out[o++] = '%';
            out[o++] = hex[*p >> 4];
            out[o++] = hex[*p & 15];
        } else {
            out[o++] = (char)*p;
        }
    }
    if (fits) {
        out[o] = 0;
        snprintf(out + o, outlen - o, "%s", FS_SUFFIX);
        return;
    }
    uint8_t d[SHA256_DIGEST_LENGTH];
    SHA256((const unsigned char *)name, strlen(name), d);
    char hx[2 * SHA256_DIGEST_LENGTH + 1];
    keys_hex_encode(d, sizeof(d), hx);
    snprintf(out, outlen, "h-%s%s", hx, FS_SUFFIX);
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

static int object_path(struct fs *fs, const char *name, char *out, size_t outlen) {
    char fn[FS_NAME_MAX + 80];
    file_name(name, fn, sizeof(fn));
    int w = snprintf(out, outlen, "%s/%s", fs->base_path, fn);
    return w < 0 || (size_t)w >= outlen ? -1 : 0;
}

int fs_adapter_object_path(struct l2_adapter *a, const struct keys_object_key *k, char *out,
                           size_t outlen) {
    char name[KEYS_L2_NAME_MAX];
    if (keys_l2_name(k, name, sizeof(name)) < 0) return -1;
    return object_path(FS(a), name, out, outlen);
}

/* ---- index (caller holds idx_mu) --------------------------------------------------------------
 */

#define ENTRY(n) HTAB_ENTRY(n, struct fs_entry, hn)

static uint64_t entry_hash(const struct htab_node *n, void *arg) {
    (void)arg;
    return ENTRY(n)->h;
}

static struct fs_entry *do_find(struct fs *fs, const char *name, uint32_t h) {
    for (struct htab_node *n = *htab_bucket(&fs->index, h); n; n = n->next)
        if (ENTRY(n)->h == h && strcmp(ENTRY(n)->name, name) == 0) return ENTRY(n);
    return NULL;
}

/* Inserts name (absent) and accounts it. Returns the entry or NULL (out of memory). */
static struct fs_entry *do_insert(struct fs *fs, const char *name, uint32_t h, uint64_t size,
                                  const struct keys_object_key *k) {
    size_t len = strlen(name);
    struct fs_entry *e = malloc(sizeof(*e) + len + 1);
    if (!e) return NULL;
    e->size = size;
    e->locks = 0;
    e->h = h;
    memcpy(e->name, name, len + 1);
    htab_insert(&fs->index, &e->hn, h);
    l2_adapter_notify_stored(&fs->base, k, size);
    return e;
}

/* Unlinks e from the index (does not free the key's file) and accounts it. */
static void do_remove(struct fs *fs, struct fs_entry *e, const struct keys_object_key *k) {
    htab_remove(&fs->index, &e->hn, e->h);
    l2_adapter_notify_deleted(&fs->base, k, e->size);
    free(e);
}

/* Removes a corrupt or vanished object: index entry and file (only if the file is still the
 * inode we read, so a fresh store of the same key is not destroyed). */
static void drop_bad(struct fs *fs, const char *name, const struct keys_object_key *k, int fd) {
    char path[FS_PATH_MAX];
    if (object_path(fs, name, path, sizeof(path)) < 0) return;
    pthread_mutex_lock(&fs->idx_mu);
    struct stat a, b;
    if (fd >= 0 && fstat(fd, &a) == 0 && stat(path, &b) == 0 && a.st_ino == b.st_ino &&
        a.st_dev == b.st_dev) {
        if (unlink(path) != 0 && errno != ENOENT)
            log_warn(fs->lg, "unlink %s: %s", path, strerror(errno));
    }
    struct fs_entry *e = do_find(fs, name, name_hash(name));
    if (e) do_remove(fs, e, k);
    pthread_mutex_unlock(&fs->idx_mu);
}

/* ---- jobs -------------------------------------------------------------------------------------
 */

static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get_u32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--) v = v << 8 | p[i];
    return v;
}
static uint64_t get_u64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static uint64_t align_up(uint64_t v) { return (v + FS_ALIGN - 1) & ~(uint64_t)(FS_ALIGN - 1); }

static int errno_to_l2(int e) {
    switch (e) {
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
        return L2_ERR_NOSPC;
    case ENOMEM:
        return L2_ERR_NOMEM;
    default:
        return L2_ERR_IO;
    }
}

/* Writes the trailer for a payload of size bytes and a name into p[0..FS_TRAILER_LEN). */
static void make_trailer(uint8_t *p, uint64_t size, const char *name, size_t name_len,
                         uint32_t crc) {
    memcpy(p, FS_MAGIC, 8);
    put_u64(p + 8, size);
    put_u32(p + 16, (uint32_t)name_len);
    put_u32(p + 20, crc);
    (void)name;
}

static void job_release(struct fs_job *j) {
    if (j->fd >= 0) close(j->fd);
    j->fd = -1;
    if (j->tmp[0]) { /* a store that did not reach its rename */
        char tpath[FS_PATH_MAX];
        snprintf(tpath, sizeof(tpath), "%s/%s", j->fs->base_path, j->tmp);
        unlink(tpath);
        j->tmp[0] = 0;
    }
    free(j->tail);
    j->tail = NULL;
}

/* Records key i's outcome; the last job of a task completes the task. */
static void job_finish(struct fs_job *j, int rc, bool ok) {
    struct fs *fs = j->fs;
    struct l2_task *t = j->t;
    job_release(j);
    if (j->reserved) {
        pthread_mutex_lock(&fs->idx_mu);
        fs->reserved_bytes -= t->bufs[j->i].size;
        pthread_mutex_unlock(&fs->idx_mu);
        j->reserved = false;
    }
    t->ok[j->i] = ok ? 1 : 0;
    if (ok && j->io) __atomic_add_fetch(&t->bytes, t->bufs[j->i].size, __ATOMIC_RELAXED);
    if (rc != L2_OK) {
        int expected = L2_OK;
        __atomic_compare_exchange_n(&t->status, &expected, rc, false, __ATOMIC_RELAXED,
                                    __ATOMIC_RELAXED);
    }
    if (__atomic_sub_fetch(&t->priv_u64, 1, __ATOMIC_ACQ_REL) == 0) {
        free(t->priv);
        t->priv = NULL;
        l2_adapter_complete(&fs->base, t);
    }
}

/* Splits the file range [0, end) of key i into head and tail (struct fs_job) and allocates the
 * tail. Returns 0 or -1 (out of memory). */
static int job_layout(struct fs_job *j, uint64_t end) {
    struct fs *fs = j->fs;
    struct l2_buf *b = &j->t->bufs[j->i];
    if (!fs->o_direct)
        j->head_len = b->size;
    else if (((uintptr_t)b->data & (FS_ALIGN - 1)) == 0)
        j->head_len = b->size & ~(uint64_t)(FS_ALIGN - 1);
    else
        j->head_len = 0; /* unaligned source: the whole file goes through the tail buffer */
    j->tail_len = end - j->head_len;
    if (fs->o_direct) {
        if (posix_memalign((void **)&j->tail, FS_ALIGN, align_up(j->tail_len)) != 0) j->tail = NULL;
    } else {
        j->tail = malloc(j->tail_len);
    }
    if (!j->tail) return -1;
    j->seg[0] = (struct fs_seg){.buf = b->data, .off = 0, .len = j->head_len};
    j->seg[1] = (struct fs_seg){.buf = j->tail, .off = j->head_len, .len = j->tail_len};
    j->io = true;
    return 0;
}

/* Store: fills the tail (payload remainder, name, padding, trailer with the CRC). Runs after the
 * head write was queued, so the CRC pass overlaps the device writing the head. */
static void job_seal(struct fs_job *j) {
    struct l2_buf *b = &j->t->bufs[j->i];
    const uint8_t *src = b->data;
    uint64_t rest = b->size - j->head_len;
    uint32_t crc = crc32c(0, src, b->size);
    crc = crc32c(crc, j->name, j->name_len);
    memcpy(j->tail, src + j->head_len, rest);
    memcpy(j->tail + rest, j->name, j->name_len);
    uint64_t pad_from = rest + j->name_len;
    memset(j->tail + pad_from, 0, j->tail_len - FS_TRAILER_LEN - pad_from);
    make_trailer(j->tail + j->tail_len - FS_TRAILER_LEN, b->size, j->name, j->name_len, crc);
}

/* Prepares a job for I/O: returns 1 when I/O is needed (fd open, segments set; a store still
 * needs job_seal before its tail is written), 0 when the job finished without I/O (job_finish
 * already called). */
static int job_start(struct fs_job *j) {
    struct fs *fs = j->fs;
    struct l2_task *t = j->t;
    const struct keys_object_key *k = &t->keys[j->i];
    struct l2_buf *b = &t->bufs[j->i];
    int nl = keys_l2_name(k, j->name, sizeof(j->name));
    if (nl < 0) {
        job_finish(j, L2_ERR_INVAL, false);
        return 0;
    }
    j->name_len = (size_t)nl;
    char path[FS_PATH_MAX];
    if (object_path(fs, j->name, path, sizeof(path)) < 0) {
        job_finish(j, L2_ERR_INVAL, false);
        return 0;
    }
    int dflag = fs->o_direct ? O_DIRECT : 0;
    if (t->op == L2_OP_STORE) {
        uint32_t h = name_hash(j->name);
        pthread_mutex_lock(&fs->idx_mu);
        bool present = do_find(fs, j->name, h) != NULL;
        bool full = !present && fs->capacity &&
                    fs->base.bytes_used + fs->reserved_bytes + b->size > fs->capacity;
        if (!present && !full) {
            fs->reserved_bytes += b->size;
            j->reserved = true;
        }
        pthread_mutex_unlock(&fs->idx_mu);
        if (present) {
            job_finish(j, L2_OK, true);
            return 0;
        }
        if (full) {
            atomic_fetch_add(&fs->enospc, 1);
            job_finish(j, L2_ERR_NOSPC, false);
            return 0;
        }
        snprintf(j->tmp, sizeof(j->tmp), FS_TMP_PREFIX "%u" FS_SUFFIX,
                 atomic_fetch_add(&fs->tmp_seq, 1));
        char tpath[FS_PATH_MAX];
        snprintf(tpath, sizeof(tpath), "%s/%s", fs->base_path, j->tmp);
        j->fd = open(tpath, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | dflag, 0644);
        if (j->fd < 0) {
            int e = errno;
            atomic_fetch_add(&fs->write_errors, 1);
            if (e == ENOSPC) atomic_fetch_add(&fs->enospc, 1);
            log_warn(fs->lg, "open %s: %s", tpath, strerror(e));
            job_finish(j, errno_to_l2(e), false);
            return 0;
        }
        uint64_t raw = b->size + j->name_len + FS_TRAILER_LEN;
        if (job_layout(j, fs->o_direct ? align_up(raw) : raw) != 0) {
            job_finish(j, L2_ERR_NOMEM, false);
            return 0;
        }
        return 1;
    }
    /* load */
    j->fd = open(path, O_RDONLY | O_CLOEXEC | dflag);
    if (j->fd < 0) {
        int e = errno;
        if (e != ENOENT) {
            atomic_fetch_add(&fs->read_errors, 1);
            log_warn(fs->lg, "open %s: %s", path, strerror(e));
        }
        /* the file vanished behind the index: forget it */
        if (e == ENOENT) drop_bad(fs, j->name, k, -1);
        job_finish(j, e == ENOENT ? L2_OK : errno_to_l2(e), false);
        return 0;
    }
    struct stat st;
    if (fstat(j->fd, &st) != 0 || (uint64_t)st.st_size < b->size + j->name_len + FS_TRAILER_LEN) {
        atomic_fetch_add(&fs->checksum_failures, 1);
        log_warn(fs->lg, "%s: short or unreadable file, removed", path);
        drop_bad(fs, j->name, k, j->fd);
        job_finish(j, L2_OK, false);
        return 0;
    }
    j->file_size = (uint64_t)st.st_size;
    /* with o_direct the last read covers the whole 4 KiB block and stops short at EOF */
    if (job_layout(j, fs->o_direct ? align_up(j->file_size) : j->file_size) != 0) {
        job_finish(j, L2_ERR_NOMEM, false);
        return 0;
    }
    return 1;
}

/* Accounts an I/O result of segment s: 1 = more to do, 0 = segment complete, < 0 = failed
 * (L2_ERR_*). */
static int seg_advance(struct fs_job *j, struct fs_seg *s, long res) {
    struct fs *fs = j->fs;
    int op = j->t->op;
    if (res >= 0) {
        pthread_mutex_lock(&fs->inj_mu);
        if (fs->inj_count[op] > 0) {
            fs->inj_count[op]--;
            res = -fs->inj_err[op];
        }
        pthread_mutex_unlock(&fs->inj_mu);
    }
    if (res < 0) {
        int e = (int)-res;
        if (op == L2_OP_STORE) {
            atomic_fetch_add(&fs->write_errors, 1);
            if (e == ENOSPC) atomic_fetch_add(&fs->enospc, 1);
        } else {
            atomic_fetch_add(&fs->read_errors, 1);
        }
        if (e != ENOSPC) atomic_store(&fs->healthy, 0);
        log_warn(fs->lg, "%s %s: %s", op == L2_OP_STORE ? "write" : "read", j->name, strerror(e));
        return errno_to_l2(e);
    }
    if (res == 0) {
        if (op == L2_OP_LOAD && s->off + s->done >= j->file_size) return 0; /* tail past EOF */
        return L2_ERR_IO;
    }
    s->done += (uint64_t)res;
    if (s->done >= s->len) return 0;
    if (op == L2_OP_LOAD && s->off + s->done >= j->file_size) return 0;
    return 1;
}

/* After the transfer: store -> rename into place and index; load -> verify. */
static void job_complete_io(struct fs_job *j) {
    struct fs *fs = j->fs;
    struct l2_task *t = j->t;
    const struct keys_object_key *k = &t->keys[j->i];
    struct l2_buf *b = &t->bufs[j->i];
    if (t->op == L2_OP_STORE) {
        char tpath[FS_PATH_MAX], path[FS_PATH_MAX];
        snprintf(tpath, sizeof(tpath), "%s/%s", fs->base_path, j->tmp);
        if (object_path(fs, j->name, path, sizeof(path)) < 0) {
            unlink(tpath);
            job_finish(j, L2_ERR_INVAL, false);
            return;
        }
        if (close(j->fd) != 0) {
            j->fd = -1;
            int e = errno;
            unlink(tpath);
            atomic_fetch_add(&fs->write_errors, 1);
            job_finish(j, errno_to_l2(e), false);
            return;
        }
        j->fd = -1;
        uint32_t h = name_hash(j->name);
        pthread_mutex_lock(&fs->idx_mu);
        int rc = rename(tpath, path);
        int e = errno;
        if (rc == 0) j->tmp[0] = 0;
        if (rc == 0 && !do_find(fs, j->name, h) && !do_insert(fs, j->name, h, b->size, k)) {
            unlink(path);
            e = ENOMEM;
            rc = -1;
        }
        pthread_mutex_unlock(&fs->idx_mu);
        if (rc != 0) {
            unlink(tpath);
            atomic_fetch_add(&fs->write_errors, 1);
            log_warn(fs->lg, "rename %s: %s", path, strerror(e));
            job_finish(j, errno_to_l2(e), false);
            return;
        }
        atomic_store(&fs->healthy, 1);
        job_finish(j, L2_OK, true);
        return;
    }
    /* load: the payload is bufs[i].data[0, head_len) ‖ tail[0, rest); name and trailer follow */
    uint64_t rest = b->size - j->head_len;
    const uint8_t *name = j->tail + rest;
    const uint8_t *tr = j->tail + (j->file_size - FS_TRAILER_LEN - j->head_len);
    bool good = memcmp(tr, FS_MAGIC, 8) == 0 && get_u64(tr + 8) == b->size &&
                get_u32(tr + 16) == j->name_len && memcmp(name, j->name, j->name_len) == 0;
    if (good) {
        uint32_t crc = crc32c(0, b->data, j->head_len);
        crc = crc32c(crc, j->tail, rest);
        good = crc32c(crc, name, j->name_len) == get_u32(tr + 20);
    }
    if (!good) {
        atomic_fetch_add(&fs->checksum_failures, 1);
        log_warn(fs->lg, "%s: checksum or trailer mismatch, removed", j->name);
        drop_bad(fs, j->name, k, j->fd);
        job_finish(j, L2_OK, false);
        return;
    }
    memcpy((uint8_t *)b->data + j->head_len, j->tail, rest);
    atomic_store(&fs->healthy, 1);
    job_finish(j, L2_OK, true);
}

/* ---- queue ------------------------------------------------------------------------------------
 */

static struct fs_job *pop_job(struct fs *fs) {
    struct fs_job *j = fs->q_head;
    if (j) {
        fs->q_head = j->next;
        if (!fs->q_head) fs->q_tail = NULL;
        j->next = NULL;
    }
    return j;
}

static void wake(struct fs *fs) {
    if (fs->uring) {
        uint64_t one = 1;
        while (write(fs->wake_fd, &one, sizeof(one)) < 0 && errno == EINTR) {
        }
    } else {
        pthread_cond_broadcast(&fs->q_cv);
    }
}

/* ---- io_uring engine --------------------------------------------------------------------------
 * A store queues its head write, then computes the CRC and fills the tail (job_seal) while the
 * device writes, then queues the tail; a load queues both reads at once. The user_data of an SQE
 * is the job with the segment index in bit 0 (jobs are at least 8-byte aligned). */

/* One SQE moves at most 1 GiB (its length is 32 bits); a short result resubmits the rest. */
static unsigned seg_chunk(const struct fs_seg *s) {
    uint64_t left = s->len - s->done;
    return (unsigned)(left < (1u << 30) ? left : (1u << 30));
}

static void prep_seg(struct fs *fs, struct fs_job *j, int si) {
    /* the ring has qd entries and at most qd - 1 segments plus the wakeup poll are in flight */
    struct io_uring_sqe *sqe = io_uring_get_sqe(&fs->ring);
    struct fs_seg *s = &j->seg[si];
    s->iov = (struct iovec){s->buf + s->done, seg_chunk(s)};
    if (j->t->op == L2_OP_STORE)
        io_uring_prep_writev(sqe, j->fd, &s->iov, 1, s->off + s->done);
    else
        io_uring_prep_readv(sqe, j->fd, &s->iov, 1, s->off + s->done);
    io_uring_sqe_set_data(sqe, (void *)((uintptr_t)j | (uintptr_t)si));
}

/* Queues the job's segments; returns how many SQEs it used. */
static unsigned start_segs(struct fs *fs, struct fs_job *j) {
    unsigned used = 0;
    if (j->seg[0].len) {
        prep_seg(fs, j, 0);
        j->pending++;
        used++;
    }
    if (j->t->op == L2_OP_STORE) {
        if (used) {
            int rc = io_uring_submit(&fs->ring);
            if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY)
                log_error(fs->lg, "io_uring_submit: %s", strerror(-rc));
        }
        job_seal(j);
    }
    prep_seg(fs, j, 1); /* the tail is never empty: it holds at least the trailer */
    j->pending++;
    return used + 1;
}

static void *uring_main(void *arg) {
    struct fs *fs = arg;
    bool armed = false;
    unsigned inflight = 0;
    for (;;) {
        if (!armed) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(&fs->ring);
            io_uring_prep_poll_add(sqe, fs->wake_fd, POLLIN);
            io_uring_sqe_set_data64(sqe, FS_WAKE_UD);
            armed = true;
        }
        bool closing;
        for (;;) {
            if (inflight + 3 > fs->qd) break; /* room for two segments and the wakeup poll */
            pthread_mutex_lock(&fs->q_mu);
            struct fs_job *j = pop_job(fs);
            pthread_mutex_unlock(&fs->q_mu);
            if (!j) break;
            if (job_start(j) == 1) inflight += start_segs(fs, j);
        }
        pthread_mutex_lock(&fs->q_mu);
        closing = fs->closing && !fs->q_head;
        pthread_mutex_unlock(&fs->q_mu);
        if (closing && inflight == 0) break;
        int rc = io_uring_submit_and_wait(&fs->ring, 1);
        if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
            log_error(fs->lg, "io_uring_submit_and_wait: %s", strerror(-rc));
        }
        struct io_uring_cqe *cqe;
        unsigned head, seen = 0;
        io_uring_for_each_cqe(&fs->ring, head, cqe) {
            seen++;
            if (io_uring_cqe_get_data64(cqe) == FS_WAKE_UD) {
                uint64_t v;
                while (read(fs->wake_fd, &v, sizeof(v)) < 0 && errno == EINTR) {
                }
                armed = false;
                continue;
            }
            uintptr_t ud = (uintptr_t)io_uring_cqe_get_data(cqe);
            struct fs_job *j = (struct fs_job *)(ud & ~(uintptr_t)1);
            int si = (int)(ud & 1);
            int r = j->err ? j->err : seg_advance(j, &j->seg[si], cqe->res);
            if (r == 1) {
                prep_seg(fs, j, si);
                continue;
            }
            inflight--;
            if (r < 0 && !j->err) j->err = r;
            if (--j->pending > 0) continue;
            if (j->err)
                job_finish(j, j->err, false);
            else
                job_complete_io(j);
        }
        io_uring_cq_advance(&fs->ring, seen);
    }
    return NULL;
}

/* ---- thread engine ----------------------------------------------------------------------------
 */

/* Transfers segment s with pwrite/pread: 0 or L2_ERR_*. */
static int seg_sync(struct fs_job *j, struct fs_seg *s) {
    while (s->len) {
        ssize_t res =
            j->t->op == L2_OP_STORE
                ? pwrite(j->fd, s->buf + s->done, s->len - s->done, (off_t)(s->off + s->done))
                : pread(j->fd, s->buf + s->done, s->len - s->done, (off_t)(s->off + s->done));
        if (res < 0 && errno == EINTR) continue;
        int r = seg_advance(j, s, res < 0 ? -errno : (long)res);
        if (r != 1) return r;
    }
    return 0;
}

static void *thread_main(void *arg) {
    struct fs *fs = arg;
    for (;;) {
        pthread_mutex_lock(&fs->q_mu);
        while (!fs->q_head && !fs->closing) pthread_cond_wait(&fs->q_cv, &fs->q_mu);
        struct fs_job *j = pop_job(fs);
        pthread_mutex_unlock(&fs->q_mu);
        if (!j) return NULL; /* closing and empty */
        if (job_start(j) != 1) continue;
        if (j->t->op == L2_OP_STORE) job_seal(j);
        int r = seg_sync(j, &j->seg[0]);
        if (r == 0) r = seg_sync(j, &j->seg[1]);
        if (r == 0)
            job_complete_io(j);
        else
            job_finish(j, r, false);
    }
}

/* ---- vtable -----------------------------------------------------------------------------------
 */

static int fs_submit(struct l2_adapter *a, struct l2_task *t) {
    struct fs *fs = FS(a);
    if (t->op == L2_OP_LOOKUP) {
        char name[KEYS_L2_NAME_MAX];
        for (size_t i = 0; i < t->n; i++) {
            if (keys_l2_name(&t->keys[i], name, sizeof(name)) < 0) continue;
            pthread_mutex_lock(&fs->idx_mu);
            struct fs_entry *e = do_find(fs, name, name_hash(name));
            if (e) {
                e->locks++;
                t->ok[i] = 1;
                t->sizes[i] = e->size;
            }
            pthread_mutex_unlock(&fs->idx_mu);
            if (e) l2_adapter_notify_accessed(a, &t->keys[i]);
        }
        l2_adapter_complete(a, t);
        return L2_OK;
    }
    pthread_mutex_lock(&fs->q_mu);
    bool closing = fs->closing;
    pthread_mutex_unlock(&fs->q_mu);
    if (closing) return L2_ERR_CLOSED;
    if (t->n == 0) {
        l2_adapter_complete(a, t);
        return L2_OK;
    }
    struct fs_job *jobs = calloc(t->n, sizeof(*jobs));
    if (!jobs) return L2_ERR_NOMEM;
    t->priv = jobs;
    t->priv_u64 = t->n;
    for (size_t i = 0; i < t->n; i++) {
        jobs[i].fs = fs;
        jobs[i].t = t;
        jobs[i].i = i;
        jobs[i].fd = -1;
        jobs[i].next = i + 1 < t->n ? &jobs[i + 1] : NULL;
    }
    pthread_mutex_lock(&fs->q_mu);
    if (fs->q_tail)
        fs->q_tail->next = &jobs[0];
    else
        fs->q_head = &jobs[0];
    fs->q_tail = &jobs[t->n - 1];
    pthread_mutex_unlock(&fs->q_mu);
    wake(fs);
    return L2_OK;
}

static void fs_unlock(struct l2_adapter *a, const struct keys_object_key *keys, size_t n) {
    struct fs *fs = FS(a);
    char name[KEYS_L2_NAME_MAX];
    for (size_t i = 0; i < n; i++) {
        if (keys_l2_name(&keys[i], name, sizeof(name)) < 0) continue;
        pthread_mutex_lock(&fs->idx_mu);
        struct fs_entry *e = do_find(fs, name, name_hash(name));
        if (e && e->locks) e->locks--;
        pthread_mutex_unlock(&fs->idx_mu);
    }
}

static int fs_delete(struct l2_adapter *a, const struct keys_object_key *keys, size_t n,
                     uint8_t *deleted, size_t *skipped) {
    struct fs *fs = FS(a);
    char name[KEYS_L2_NAME_MAX], path[FS_PATH_MAX];
    int rc = L2_OK;
    for (size_t i = 0; i < n; i++) {
        if (keys_l2_name(&keys[i], name, sizeof(name)) < 0 ||
            object_path(fs, name, path, sizeof(path)) < 0) {
            if (rc == L2_OK) rc = L2_ERR_INVAL;
            continue;
        }
        pthread_mutex_lock(&fs->idx_mu);
        struct fs_entry *e = do_find(fs, name, name_hash(name));
        if (e && e->locks) {
            (*skipped)++;
        } else if (e) {
            if (unlink(path) != 0 && errno != ENOENT) {
                log_warn(fs->lg, "unlink %s: %s", path, strerror(errno));
                if (rc == L2_OK) rc = L2_ERR_IO;
            } else {
                do_remove(fs, e, &keys[i]);
                if (deleted) deleted[i] = 1;
            }
        }
        pthread_mutex_unlock(&fs->idx_mu);
    }
    return rc;
}

struct cand {
    const char *name;
    uint64_t size;
};

static int cand_cmp(const void *x, const void *y) {
    return strcmp(((const struct cand *)x)->name, ((const struct cand *)y)->name);
}

static void cand_swap(struct cand *h, size_t a, size_t b) {
    struct cand t = h[a];
    h[a] = h[b];
    h[b] = t;
}

/* h[0..n) is a max-heap by name with h[i] perhaps out of place below its children: moves it down.
 */
static void cand_sift_down(struct cand *h, size_t n, size_t i) {
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && strcmp(h[l].name, h[m].name) > 0) m = l;
        if (r < n && strcmp(h[r].name, h[m].name) > 0) m = r;
        if (m == i) return;
        cand_swap(h, i, m);
        i = m;
    }
}

static void cand_push(struct cand *h, size_t *n, struct cand c) {
    size_t i = (*n)++;
    h[i] = c;
    for (; i > 0 && strcmp(h[(i - 1) / 2].name, h[i].name) < 0; i = (i - 1) / 2)
        cand_swap(h, i, (i - 1) / 2);
}

/* Listing in name order; the token is the hex of the last name returned. */
static int fs_list(struct l2_adapter *a, const char *model_filter, size_t page_size,
                   const char *token, struct l2_list_page *out, char *err, size_t errlen) {
    struct fs *fs = FS(a);
    char after[KEYS_L2_NAME_MAX] = "";
    if (token && *token) {
        size_t tl = strlen(token);
        if (tl % 2 || tl / 2 >= sizeof(after)) {
            errbuf_set(err, errlen, "malformed page_token");
            return L2_ERR_BAD_TOKEN;
        }
        for (size_t i = 0; i < tl / 2; i++) {
            int hi = hexval(token[2 * i]), lo = hexval(token[2 * i + 1]);
            if (hi < 0 || lo < 0 || (hi | lo) == 0) {
                errbuf_set(err, errlen, "malformed page_token");
                return L2_ERR_BAD_TOKEN;
            }
            after[i] = (char)(hi << 4 | lo);
        }
        after[tl / 2] = 0;
    }
    size_t mlen = model_filter ? strlen(model_filter) : 0;
    /* The page's names, the first page_size after the token: a max-heap of that many keeps the
     * smallest seen (one pass, no copy or sort of the whole index under the lock). */
    size_t cap = page_size ? page_size : 1;
    struct cand *c = malloc(cap * sizeof(*c));
    if (!c) {
        errbuf_set(err, errlen, "out of memory");
        return L2_ERR_NOMEM;
    }
    pthread_mutex_lock(&fs->idx_mu);
    size_t nc = 0, kept = 0;
    for (size_t b = 0; b < fs->index.nb; b++) {
        for (struct htab_node *n = fs->index.b[b]; n; n = n->next) {
            const struct fs_entry *e = ENTRY(n);
            if (model_filter && (strncmp(e->name, model_filter, mlen) != 0 || e->name[mlen] != '@'))
                continue;
            if (after[0] && strcmp(e->name, after) <= 0) continue;
            nc++;
            if (kept < page_size) {
                cand_push(c, &kept, (struct cand){e->name, e->size});
            } else if (kept && strcmp(e->name, c[0].name) < 0) {
                c[0] = (struct cand){e->name, e->size};
                cand_sift_down(c, kept, 0);
            }
        }
    }
    qsort(c, kept, sizeof(*c), cand_cmp);
    size_t take = kept;
    out->entries = calloc(take ? take : 1, sizeof(*out->entries));
    int rc = out->entries ? L2_OK : L2_ERR_NOMEM;
    char last[KEYS_L2_NAME_MAX] = "";
    for (size_t i = 0; rc == L2_OK && i < take; i++) {
        char perr[KEYS_ERR_MAX];
        snprintf(last, sizeof(last), "%s", c[i].name);
        struct l2_list_entry *le = &out->entries[out->count];
        if (keys_l2_name_parse(c[i].name, strlen(c[i].name), &le->key, perr, sizeof(perr)) != 0)
            continue; /* cannot happen for names we indexed; skip rather than fail the page */
        le->size = c[i].size;
        out->count++;
    }
    pthread_mutex_unlock(&fs->idx_mu);
    free(c);
    if (rc != L2_OK) {
        errbuf_set(err, errlen, "out of memory");
        return rc;
    }
    if (nc > take) {
        size_t ll = strlen(last);
        out->next_token = malloc(2 * ll + 1);
        if (!out->next_token) {
            l2_list_page_free(out);
            errbuf_set(err, errlen, "out of memory");
            return L2_ERR_NOMEM;
        }
        keys_hex_encode((const uint8_t *)last, ll, out->next_token);
    }
    return L2_OK;
}

static json_t *fs_status(struct l2_adapter *a) {
    struct fs *fs = FS(a);
    json_t *s = json_object();
    json_object_set_new(s, "is_healthy", json_boolean(atomic_load(&fs->healthy)));
    json_object_set_new(s, "base_path", json_string(fs->base_path));
    json_object_set_new(s, "io_engine", json_string(fs->uring ? "io_uring" : "threads"));
    if (!fs->uring) json_object_set_new(s, "io_uring_unavailable", json_string(fs->uring_error));
    json_object_set_new(s, "o_direct", json_boolean(fs->o_direct));
    json_object_set_new(s, "max_capacity_bytes", json_integer((json_int_t)fs->capacity));
    pthread_mutex_lock(&fs->idx_mu);
    json_object_set_new(s, "files", json_integer((json_int_t)fs->index.count));
    pthread_mutex_unlock(&fs->idx_mu);
    json_object_set_new(s, "write_errors",
                        json_integer((json_int_t)atomic_load(&fs->write_errors)));
    json_object_set_new(s, "read_errors", json_integer((json_int_t)atomic_load(&fs->read_errors)));
    json_object_set_new(s, "checksum_failures",
                        json_integer((json_int_t)atomic_load(&fs->checksum_failures)));
    json_object_set_new(s, "enospc", json_integer((json_int_t)atomic_load(&fs->enospc)));
    json_object_set_new(s, "rescanned_files",
                        json_integer((json_int_t)atomic_load(&fs->rescanned)));
    json_object_set_new(s, "rescan_removed",
                        json_integer((json_int_t)atomic_load(&fs->rescan_removed)));
    return s;
}

static void fs_destroy(struct l2_adapter *a) {
    struct fs *fs = FS(a);
    pthread_mutex_lock(&fs->q_mu);
    fs->closing = true;
    struct fs_job *pending = fs->q_head;
    fs->q_head = fs->q_tail = NULL;
    pthread_mutex_unlock(&fs->q_mu);
    for (struct fs_job *j = pending, *next; j; j = next) {
        next = j->next;
        job_finish(j, L2_ERR_CLOSED, false);
    }
    wake(fs);
    for (size_t i = 0; i < fs->nthreads; i++) pthread_join(fs->threads[i], NULL);
    free(fs->threads);
    if (fs->uring) io_uring_queue_exit(&fs->ring);
    if (fs->wake_fd >= 0) close(fs->wake_fd);
    for (size_t b = 0; b < fs->index.nb; b++) {
        for (struct htab_node *n = fs->index.b[b], *next; n; n = next) {
            next = n->next;
            free(ENTRY(n));
        }
    }
    htab_fini(&fs->index);
    pthread_mutex_destroy(&fs->idx_mu);
    pthread_mutex_destroy(&fs->q_mu);
    pthread_cond_destroy(&fs->q_cv);
    pthread_mutex_destroy(&fs->inj_mu);
    l2_adapter_base_fini(a);
    free(fs);
}

static const struct l2_adapter_ops fs_ops = {
    .type_name = FS_TYPE_NAME,
    .submit = fs_submit,
    .unlock = fs_unlock,
    .delete_keys = fs_delete,
    .list = fs_list,
    .status = fs_status,
    .destroy = fs_destroy,
};

/* ---- creation and rescan ----------------------------------------------------------------------
 */

/* Reads one object file's trailer and name; indexes it or removes it. */
static void rescan_one(struct fs *fs, int dfd, const char *fname) {
    char l2name[KEYS_L2_NAME_MAX];
    int fd = openat(dfd, fname, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    struct stat st;
    uint8_t tr[FS_TRAILER_LEN];
    bool good = fstat(fd, &st) == 0 && st.st_size >= FS_TRAILER_LEN &&
                pread(fd, tr, sizeof(tr), st.st_size - FS_TRAILER_LEN) == FS_TRAILER_LEN &&
                memcmp(tr, FS_MAGIC, 8) == 0;
    uint64_t size = good ? get_u64(tr + 8) : 0;
    uint32_t nl = good ? get_u32(tr + 16) : 0;
    good = good && nl > 0 && nl < sizeof(l2name) &&
           size + nl + FS_TRAILER_LEN <= (uint64_t)st.st_size &&
           pread(fd, l2name, nl, (off_t)size) == (ssize_t)nl;
    close(fd);
    struct keys_object_key k;
    char perr[KEYS_ERR_MAX], expect[FS_NAME_MAX + 80];
    if (good) {
        l2name[nl] = 0;
        good = strlen(l2name) == nl && keys_l2_name_parse(l2name, nl, &k, perr, sizeof(perr)) == 0;
    }
    if (good) {
        file_name(l2name, expect, sizeof(expect));
        good = strcmp(expect, fname) == 0;
    }
    if (!good) {
        log_warn(fs->lg, "rescan: %s/%s is not a valid object file, removed", fs->base_path, fname);
        if (unlinkat(dfd, fname, 0) == 0) atomic_fetch_add(&fs->rescan_removed, 1);
        return;
    }
    uint32_t h = name_hash(l2name);
    pthread_mutex_lock(&fs->idx_mu);
    if (!do_find(fs, l2name, h) && do_insert(fs, l2name, h, size, &k))
        atomic_fetch_add(&fs->rescanned, 1);
    pthread_mutex_unlock(&fs->idx_mu);
}

static int rescan(struct fs *fs, char *err, size_t errlen) {
    DIR *d = opendir(fs->base_path);
    if (!d) {
        errbuf_set(err, errlen, "opendir %s: %s", fs->base_path, strerror(errno));
        return L2_ERR_IO;
    }
    struct dirent *de;
    size_t sl = strlen(FS_SUFFIX);
    while ((de = readdir(d)) != NULL) {
        const char *n = de->d_name;
        size_t len = strlen(n);
        if (strncmp(n, FS_TMP_PREFIX, strlen(FS_TMP_PREFIX)) == 0) {
            unlinkat(dirfd(d), n, 0); /* an interrupted write */
            continue;
        }
        if (len <= sl || strcmp(n + len - sl, FS_SUFFIX) != 0) continue;
        rescan_one(fs, dirfd(d), n);
    }
    closedir(d);
    return L2_OK;
}

static int mkdirs(const char *path) {
    char buf[PATH_MAX];
    snprintf(buf, sizeof(buf), "%s", path);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
    return 0;
}

int fs_adapter_create(const json_t *config, struct l2_adapter **out, char *err, size_t errlen) {
    *out = NULL;
    const char *base = json_string_value(json_object_get(config, "base_path"));
    if (!base || !*base) {
        errbuf_set(err, errlen, "fs adapter: \"base_path\" (a non-empty string) is required");
        return L2_ERR_INVAL;
    }
    if (strlen(base) >= PATH_MAX - FS_NAME_MAX - 80) {
        errbuf_set(err, errlen, "fs adapter: \"base_path\" is too long");
        return L2_ERR_INVAL;
    }
    bool o_direct = false, use_uring = true;
    long qd = 64, nthreads = 4;
    uint64_t cap;
    static const char who[] = "fs adapter";
    if (jfield_bool(config, "o_direct", &o_direct, who, err, errlen) < 0 ||
        jfield_bool(config, "io_uring", &use_uring, who, err, errlen) < 0 ||
        jfield_int(config, "queue_depth", 4, 4096, &qd, who, err, errlen) < 0 ||
        jfield_int(config, "io_threads", 1, 256, &nthreads, who, err, errlen) < 0)
        return L2_ERR_INVAL;
    if (l2_config_capacity(config, "max_capacity_gb", &cap, err, errlen) != L2_OK)
        return L2_ERR_INVAL;
    if (mkdirs(base) != 0) {
        errbuf_set(err, errlen, "fs adapter: cannot create %s: %s", base, strerror(errno));
        return L2_ERR_IO;
    }
    struct fs *fs = calloc(1, sizeof(*fs));
    if (!fs) {
        errbuf_set(err, errlen, "out of memory");
        return L2_ERR_NOMEM;
    }
    int rc = l2_adapter_base_init(&fs->base, &fs_ops, config, err, errlen);
    if (rc != L2_OK) {
        free(fs);
        return rc;
    }
    fs->lg = log_get("lmcache.l2.fs");
    snprintf(fs->base_path, sizeof(fs->base_path), "%s", base);
    fs->o_direct = o_direct;
    fs->capacity = cap;
    fs->base.capacity_bytes = cap;
    fs->wake_fd = -1;
    fs->qd = (unsigned)qd;
    atomic_store(&fs->healthy, 1);
    pthread_mutex_init(&fs->idx_mu, NULL);
    pthread_mutex_init(&fs->q_mu, NULL);
    pthread_cond_init(&fs->q_cv, NULL);
    pthread_mutex_init(&fs->inj_mu, NULL);
    if (htab_init(&fs->index, 1024, entry_hash, NULL) != 0) {
        errbuf_set(err, errlen, "out of memory");
        fs_destroy(&fs->base);
        return L2_ERR_NOMEM;
    }
    rc = rescan(fs, err, errlen);
    if (rc != L2_OK) {
        fs_destroy(&fs->base);
        return rc;
    }
    const char *env = getenv("LMCACHE_L2_FS_NO_IO_URING");
    if (env && *env && strcmp(env, "0") != 0) use_uring = false;
    if (!use_uring) {
        snprintf(fs->uring_error, sizeof(fs->uring_error), "disabled by configuration");
    } else {
        int r = io_uring_queue_init(fs->qd, &fs->ring, 0);
        if (r == 0) {
            fs->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
            if (fs->wake_fd < 0) {
                io_uring_queue_exit(&fs->ring);
                snprintf(fs->uring_error, sizeof(fs->uring_error), "eventfd: %s", strerror(errno));
            } else {
                fs->uring = true;
            }
        } else {
            snprintf(fs->uring_error, sizeof(fs->uring_error), "io_uring_queue_init: %s",
                     strerror(-r));
        }
    }
    if (!fs->uring)
        log_warn(fs->lg, "io_uring unavailable (%s): using %ld I/O threads", fs->uring_error,
                 nthreads);
    fs->nthreads = fs->uring ? 1 : (size_t)nthreads;
    fs->threads = calloc(fs->nthreads, sizeof(*fs->threads));
    if (!fs->threads) {
        fs->nthreads = 0;
        errbuf_set(err, errlen, "out of memory");
        fs_destroy(&fs->base);
        return L2_ERR_NOMEM;
    }
    for (size_t i = 0; i < fs->nthreads; i++) {
        int e = pthread_create(&fs->threads[i], NULL, fs->uring ? uring_main : thread_main, fs);
        if (e != 0) {
            fs->nthreads = i;
            errbuf_set(err, errlen, "pthread_create: %s", strerror(e));
            fs_destroy(&fs->base);
            return L2_ERR_NOMEM;
        }
        pthread_setname_np(fs->threads[i], fs->uring ? "l2-fs-uring" : "l2-fs-io");
    }
    log_info(fs->lg, "fs adapter on %s: %zu objects, %s%s", fs->base_path, fs->index.count,
             fs->uring ? "io_uring" : "I/O threads", fs->o_direct ? ", O_DIRECT" : "");
    *out = &fs->base;
    return L2_OK;
}

bool fs_adapter_uses_io_uring(struct l2_adapter *a) { return FS(a)->uring; }

void fs_adapter_inject_error(struct l2_adapter *a, int op, int err, int count) {
    struct fs *fs = FS(a);
    if (op < 0 || op > 2) return;
    pthread_mutex_lock(&fs->inj_mu);
    fs->inj_err[op] = err;
    fs->inj_count[op] = count;
    pthread_mutex_unlock(&fs->inj_mu);
}
