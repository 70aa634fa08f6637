/* The bound on what libzmq buffers for one tcp connection of the data socket (connguard.h).
 *
 * libzmq's receive high-water mark counts complete messages, and the frames of a message are
 * handed to the socket only once its last frame has arrived; until then they sit in the
 * connection's pipe, uncounted. A peer that sends frames with the MORE flag forever therefore
 * makes libzmq's I/O thread buffer everything it sends while the loop sees nothing.
 *
 * No libzmq option bounds that, so the guard measures it from outside: for each tcp connection,
 * the bytes the kernel received on it (TCP_INFO tcpi_bytes_received) minus the bytes of the
 * frames delivered to the loop from it (ZMQ_SRCFD names the connection of a frame; each frame is
 * credited with its size and CONNGUARD_FRAME_SLACK of framing) is what libzmq and the kernel's
 * receive queue hold. Handshakes and heartbeats are received and never delivered: a connection
 * starts with CONNGUARD_BASE_SLACK of credit and earns CONNGUARD_HEARTBEAT_PER_S. The estimate
 * never goes below zero, so credit that exceeds the real framing cannot be saved up; and it is
 * never above the true figure, so a connection is cut only for bytes really held. Only when it
 * exceeds the limit is the kernel's receive queue (SIOCINQ) subtracted, and the connection is cut
 * if libzmq's part still does: shutdown(2), never close(2) (libzmq owns the descriptor; it sees
 * the peer gone, drops the partial message and reports the disconnection).
 *
 * Connections are learnt from a socket monitor on the router (accepted, disconnected, closed;
 * the event's value is the descriptor). The table is indexed by descriptor; descriptors are
 * reused, so an accepted event resets its entry, and before cutting, the peer and local
 * addresses are compared with those seen at accept time.
 *
 * Bytes received are not bytes held for tiny frames (64 bytes of message structure for an empty
 * frame of 2 wire bytes), so a second bound counts memory: with a heap limit, when the
 * connections hold anything worth it unread, each check reads what malloc holds and, over the
 * limit, cuts the connection holding the most; the heap then falls by what libzmq held for it
 * once libzmq has torn it down, so the next such cut waits CONNGUARD_HEAP_CUT_GAP_NS. */
#include "server/dataplane/connguard.h"

#include <arpa/inet.h>
#include <errno.h>
#include <linux/sockios.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include "base/clock.h"
#include "base/errbuf.h"
#include "base/heap.h"
#include "base/log.h"
#include "base/metrics.h"
#include "base/ratelimit.h"

enum { CG_FREE = 0, CG_LIVE, CG_CUT };

union cg_addr {
    struct sockaddr sa;
    struct sockaddr_in in;
    struct sockaddr_in6 in6;
};

struct cg_conn {
    uint8_t state;
    uint32_t pos;      /* index in connguard.live */
    uint64_t credit;   /* delivered frames (and allowances) since the last check */
    uint64_t received; /* tcpi_bytes_received at the last check */
    uint64_t held;     /* estimate at the last check: received and not delivered */
    uint64_t last_ns;  /* time of the last check (or of the accept) */
    union cg_addr peer, local;
    socklen_t peerlen, locallen;
};

struct connguard {
    void *router, *pair;
    uint64_t limit;
    struct logger *lg;
    struct metric *cut_total;
    struct cg_conn *conns; /* indexed by descriptor */
    size_t cap;
    int *live; /* descriptors of the entries not free, in no order */
    size_t nlive, livecap;
    uint64_t next_check_ns;
    uint64_t heap_limit; /* 0: none */
    struct metric *heap_cuts;
    uint64_t next_heap_cut_ns;
    connguard_replies_fn replies; /* unread replies per client, or NULL */
    void *replies_arg;
    struct ratelimit log_rl; /* cuts come at the rate peers choose */
};

uint64_t connguard_limit(uint64_t rcvhwm, uint64_t max_message_bytes) {
    /* framing of a message of many frames (chunk frames of a few KiB each): 1/16 of its size */
    uint64_t per_msg = max_message_bytes + max_message_bytes / 16 + (64u << 10);
    return (rcvhwm + 1) * per_msg + CONNGUARD_BASE_SLACK;
}

uint64_t connguard_estimate(uint64_t held, uint64_t prev_received, uint64_t received,
                            uint64_t credit, uint64_t elapsed_ns) {
    uint64_t in = received >= prev_received ? received - prev_received : 0;
    uint64_t out = credit + elapsed_ns / 1000000u * CONNGUARD_HEARTBEAT_PER_S / 1000u;
    return held + in > out ? held + in - out : 0;
}

struct connguard *connguard_start(void *zctx, void *router, uint64_t limit, struct logger *lg,
                                  struct metric *cut_total, char *err, size_t errlen) {
    struct connguard *g = calloc(1, sizeof(*g));
    if (!g) {
        errbuf_set(err, errlen, "out of memory");
        return NULL;
    }
    g->router = router;
    g->limit = limit;
    g->lg = lg;
    g->cut_total = cut_total;
    g->log_rl = (struct ratelimit)RATELIMIT_INIT(10.0, 10);
    char ep[64];
    snprintf(ep, sizeof(ep), "inproc://lmcache-connguard-%p", router);
    /* The monitor's PAIR sends blocking from libzmq's I/O thread: the connected end takes any
     * number of events (receive high-water mark 0), so a burst of connections never stalls it. */
    int zero = 0;
    if (zmq_socket_monitor(router, ep,
                           ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_CLOSED) < 0 ||
        !(g->pair = zmq_socket(zctx, ZMQ_PAIR)) ||
        zmq_setsockopt(g->pair, ZMQ_RCVHWM, &zero, sizeof(zero)) < 0 ||
        zmq_setsockopt(g->pair, ZMQ_LINGER, &zero, sizeof(zero)) < 0 ||
        zmq_connect(g->pair, ep) < 0) {
        errbuf_set(err, errlen, "cannot monitor the data socket: %s", zmq_strerror(errno));
        connguard_stop(g);
        return NULL;
    }
    return g;
}

void connguard_set_replies(struct connguard *g, connguard_replies_fn fn, void *arg) {
    g->replies = fn;
    g->replies_arg = arg;
}

void connguard_set_heap_limit(struct connguard *g, uint64_t limit, struct metric *heap_cuts) {
    g->heap_limit = limit;
    g->heap_cuts = heap_cuts;
}

void connguard_stop(struct connguard *g) {
    if (!g) return;
    (void)zmq_socket_monitor(g->router, NULL, 0); /* before the PAIR's peer goes */
    if (g->pair) zmq_close(g->pair);
    free(g->conns);
    free(g->live);
    free(g);
}

void *connguard_socket(const struct connguard *g) { return g->pair; }

static void untrack(struct connguard *g, int fd) {
    struct cg_conn *c = &g->conns[fd];
    if (c->state == CG_FREE) return;
    int last = g->live[--g->nlive];
    g->live[c->pos] = last;
    g->conns[last].pos = c->pos;
    c->state = CG_FREE;
}

/* Cuts a connection at once (its state cannot be kept: out of memory). */
static void cut_untracked(struct connguard *g, int fd) {
    (void)shutdown(fd, SHUT_RDWR);
    if (g->cut_total) metric_inc(g->cut_total, 1);
    log_error(g->lg, "out of memory: the data connection on descriptor %d was cut", fd);
}

static void opened(struct connguard *g, int fd, uint64_t now_ns) {
    if (fd < 0) return;
    if ((size_t)fd >= g->cap) {
        size_t cap = g->cap ? g->cap : 64;
        while (cap <= (size_t)fd) cap *= 2;
        struct cg_conn *n = realloc(g->conns, cap * sizeof(*n));
        if (!n) {
            cut_untracked(g, fd);
            return;
        }
        memset(n + g->cap, 0, (cap - g->cap) * sizeof(*n));
        g->conns = n;
        g->cap = cap;
    }
    struct cg_conn *c = &g->conns[fd];
    if (c->state == CG_FREE) {
        if (g->nlive == g->livecap) {
            size_t cap = g->livecap ? 2 * g->livecap : 64;
            int *n = realloc(g->live, cap * sizeof(*n));
            if (!n) {
                cut_untracked(g, fd);
                return;
            }
            g->live = n;
            g->livecap = cap;
        }
        c->pos = (uint32_t)g->nlive;
        g->live[g->nlive++] = fd;
    }
    /* A reused descriptor: frames of the old connection that libzmq delivers after this (it
     * still holds up to --zmq-rcvhwm of its messages) credit the new one; since the estimate
     * never goes below zero, that lets the new connection exceed the limit by those messages
     * until its next check at most. */
    c->state = CG_LIVE;
    c->credit = CONNGUARD_BASE_SLACK;
    c->received = 0;
    c->held = 0;
    c->last_ns = now_ns;
    c->peerlen = sizeof(c->peer);
    c->locallen = sizeof(c->local);
    if (getpeername(fd, &c->peer.sa, &c->peerlen) < 0) c->peerlen = 0;
    if (getsockname(fd, &c->local.sa, &c->locallen) < 0) c->locallen = 0;
}

void connguard_events(struct connguard *g, uint64_t now_ns) {
    for (;;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, g->pair, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            return;
        }
        uint16_t ev = 0;
        uint32_t val = 0;
        int ok = zmq_msg_size(&m) == sizeof(ev) + sizeof(val);
        if (ok) {
            memcpy(&ev, zmq_msg_data(&m), sizeof(ev));
            memcpy(&val, (char *)zmq_msg_data(&m) + sizeof(ev), sizeof(val));
        }
        int more = zmq_msg_more(&m);
        zmq_msg_close(&m);
        while (more) { /* the endpoint frame */
            zmq_msg_init(&m);
            more = zmq_msg_recv(&m, g->pair, 0) >= 0 && zmq_msg_more(&m);
            zmq_msg_close(&m);
        }
        if (!ok || val > (uint32_t)INT32_MAX) continue;
        int fd = (int)val;
        if (ev == ZMQ_EVENT_ACCEPTED)
            opened(g, fd, now_ns);
        else if ((size_t)fd < g->cap)
            untrack(g, fd); /* disconnected, or closed */
    }
}

static int tracked(const struct connguard *g, int fd) {
    return (size_t)fd < g->cap && g->conns[fd].state != CG_FREE;
}

void connguard_credit(struct connguard *g, zmq_msg_t *frame) {
    int fd = zmq_msg_get(frame, ZMQ_SRCFD);
    if (fd < 0) return; /* a frame the router made (the identity) */
    /* A connection's accept event is queued before its handshake starts, so it is normally read
     * before its first frame; if not, read it now: lost credit would count as held for good. */
    if (!tracked(g, fd)) connguard_events(g, clock_mono_ns());
    if (tracked(g, fd)) g->conns[fd].credit += zmq_msg_size(frame) + CONNGUARD_FRAME_SLACK;
}

static int same_addr(const union cg_addr *a, socklen_t alen, const union cg_addr *b,
                     socklen_t blen) {
    return alen > 0 && alen == blen && !memcmp(a, b, alen);
}

static void addr_str(const union cg_addr *a, socklen_t len, char *out, size_t outlen) {
    char ip[INET6_ADDRSTRLEN] = "?";
    if (len >= sizeof(a->in) && a->sa.sa_family == AF_INET) {
        inet_ntop(AF_INET, &a->in.sin_addr, ip, sizeof(ip));
        snprintf(out, outlen, "%s:%u", ip, (unsigned)ntohs(a->in.sin_port));
    } else if (len >= sizeof(a->in6) && a->sa.sa_family == AF_INET6) {
        inet_ntop(AF_INET6, &a->in6.sin6_addr, ip, sizeof(ip));
        snprintf(out, outlen, "[%s]:%u", ip, (unsigned)ntohs(a->in6.sin6_port));
    } else {
        snprintf(out, outlen, "an unknown address");
    }
}

/* Cuts the connection of fd, which holds `held` bytes in libzmq, when the descriptor is still
 * that connection (a descriptor whose close was not reported yet may belong to another socket
 * now). heap: what malloc held, for a cut for the heap limit; 0 for the per-connection limit.
 * 1 when it was cut. */
static int cut(struct connguard *g, int fd, uint64_t held, uint64_t heap, int replies) {
    struct cg_conn *c = &g->conns[fd];
    union cg_addr peer, local;
    socklen_t plen = sizeof(peer), llen = sizeof(local);
    if (getpeername(fd, &peer.sa, &plen) < 0 || getsockname(fd, &local.sa, &llen) < 0 ||
        !same_addr(&peer, plen, &c->peer, c->peerlen) ||
        !same_addr(&local, llen, &c->local, c->locallen)) {
        untrack(g, fd);
        return 0;
    }
    if (shutdown(fd, SHUT_RDWR) < 0) {
        untrack(g, fd);
        return 0;
    }
    c->state = CG_CUT; /* until libzmq reports it gone */
    if (g->cut_total) metric_inc(g->cut_total, 1);
    if (heap && g->heap_cuts) metric_inc(g->heap_cuts, 1);
    unsigned long dropped;
    if (ratelimit_allow(&g->log_rl, clock_mono(), &dropped)) {
        char who[INET6_ADDRSTRLEN + 16];
        addr_str(&c->peer, c->peerlen, who, sizeof(who));
        if (heap)
            log_warn(g->lg,
                     "data connection from %s cut: %llu bytes %s, the most of any connection, "
                     "while malloc held %llu bytes, over --max-heap-mb (%llu) (%lu similar cuts "
                     "not logged)",
                     who, (unsigned long long)held,
                     replies ? "of replies it has not read" : "received and not delivered",
                     (unsigned long long)heap, (unsigned long long)g->heap_limit, dropped);
        else
            log_warn(g->lg,
                     "data connection from %s cut: %llu bytes received and not delivered, over "
                     "the limit of %llu (--zmq-rcvhwm + 1 messages of --max-message-mb) (%lu "
                     "similar cuts not logged)",
                     who, (unsigned long long)held, (unsigned long long)g->limit, dropped);
    }
    return 1;
}

/* What the kernel still queues for fd is not libzmq's: held less that. */
static uint64_t held_by_zmq(int fd, uint64_t held) {
    int inq = 0;
    uint64_t queued = ioctl(fd, SIOCINQ, &inq) == 0 && inq > 0 ? (uint64_t)inq : 0;
    return held > queued ? held - queued : 0;
}

/* The heap is over its limit: cuts the live connection holding the most (at least a handshake's
 * allowance: below that, cutting frees next to nothing and the heap is someone else's), in
 * libzmq's receive buffers or in replies it has not read (rfd's, rmost bytes). */
static void heap_cut(struct connguard *g, uint64_t heap, uint64_t now_ns, int rfd, uint64_t rmost) {
    int victim = -1;
    uint64_t most = 0;
    for (size_t i = 0; i < g->nlive; i++) {
        int fd = g->live[i];
        if (g->conns[fd].state == CG_LIVE && g->conns[fd].held > most) {
            most = g->conns[fd].held;
            victim = fd;
        }
    }
    uint64_t held = victim >= 0 ? held_by_zmq(victim, most) : 0;
    unsigned long dropped;
    if (rmost > held && rmost > CONNGUARD_BASE_SLACK && tracked(g, rfd) &&
        g->conns[rfd].state == CG_LIVE) {
        if (cut(g, rfd, rmost, heap, 1)) g->next_heap_cut_ns = now_ns + CONNGUARD_HEAP_CUT_GAP_NS;
    } else if (held > CONNGUARD_BASE_SLACK) {
        if (cut(g, victim, held, heap, 0)) g->next_heap_cut_ns = now_ns + CONNGUARD_HEAP_CUT_GAP_NS;
    } else if (ratelimit_allow(&g->log_rl, clock_mono(), &dropped)) {
        log_warn(
            g->lg,
            "malloc holds %llu bytes, over --max-heap-mb (%llu), and no data connection "
            "holds over %u bytes unread, received or replied (%lu similar messages not logged)",
            (unsigned long long)heap, (unsigned long long)g->heap_limit, CONNGUARD_BASE_SLACK,
            dropped);
    }
}

static void check(struct connguard *g, uint64_t now_ns) {
    uint64_t total = 0;
    for (size_t i = 0; i < g->nlive;) {
        int fd = g->live[i];
        struct cg_conn *c = &g->conns[fd];
        struct tcp_info ti;
        socklen_t len = sizeof(ti);
        memset(&ti, 0, sizeof(ti));
        if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) < 0 ||
            len < offsetof(struct tcp_info, tcpi_bytes_received) + sizeof(ti.tcpi_bytes_received)) {
            untrack(g, fd); /* gone, or not a tcp socket: nothing to measure */
            continue;
        }
        i++;
        if (c->state != CG_LIVE) continue;
        uint64_t r = ti.tcpi_bytes_received;
        if (r < c->received) { /* the descriptor is another connection's, not reported yet */
            c->received = 0;
            c->held = 0;
            c->credit = CONNGUARD_BASE_SLACK;
        }
        c->held = connguard_estimate(c->held, c->received, r, c->credit, now_ns - c->last_ns);
        c->received = r;
        c->credit = 0;
        c->last_ns = now_ns;
        total += c->held;
        if (c->held <= g->limit) continue;
        /* Only now the kernel's queue is subtracted (one more call). */
        uint64_t held = held_by_zmq(fd, c->held);
        if (held > g->limit) {
            cut(g, fd, held, 0, 0);
            if (g->conns[fd].state == CG_FREE) i--; /* untracked: another one took slot i */
        }
    }
    if (!g->heap_limit || now_ns < g->next_heap_cut_ns) return;
    int rfd = -1;
    size_t rtotal = 0, rmost = g->replies ? g->replies(g->replies_arg, &rfd, &rtotal) : 0;
    if (total + rtotal >= CONNGUARD_HEAP_PROBE) {
        uint64_t heap = heap_in_use();
        if (heap > g->heap_limit) heap_cut(g, heap, now_ns, rfd, rmost);
    }
}

long connguard_tick(struct connguard *g, uint64_t now_ns, long max_wait_ms) {
    if (now_ns >= g->next_check_ns) {
        check(g, now_ns);
        g->next_check_ns = now_ns + CONNGUARD_CHECK_NS;
    }
    if (g->nlive == 0) return max_wait_ms;
    long ms = (long)((g->next_check_ns - now_ns + 999999u) / 1000000u);
    return ms < max_wait_ms ? ms : max_wait_ms;
}
