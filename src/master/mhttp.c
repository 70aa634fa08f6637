/* Minimal HTTP/1.1 server for /metrics and /route: one thread polling the listen socket and
 * a wake pipe; each connection is read once (bounded), answered and closed, all within one
 * deadline from its accept. */
#include "master/mhttp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/errbuf.h"
#include "base/strbuf.h"
#include "master/mquery.h"
#include "master/mrpc.h"

struct mhttp {
    int lfd;
    int wake[2];
    pthread_t thr;
    mhttp_render_fn render;
    void *arg;
};

/* A connection has this long from its accept to send its request and read the answer: the
 * port has one thread, so a client trickling bytes or reading slowly must not hold it. */
#define CONN_DEADLINE_S 5.0

/* Waits (poll, the time left) until fd is ready for ev: false once the deadline has passed. */
static bool wait_fd(int fd, short ev, double deadline) {
    for (;;) {
        double left = deadline - clock_mono();
        if (left <= 0) return false;
        struct pollfd p = {fd, ev, 0};
        int r = poll(&p, 1, (int)(left * 1000.0) + 1);
        if (r < 0 && errno == EINTR) continue;
        return r > 0;
    }
}

/* recv that gives up at the deadline (-1). */
static ssize_t recv_by(int fd, char *buf, size_t n, double deadline) {
    for (;;) {
        if (!wait_fd(fd, POLLIN, deadline)) return -1;
        ssize_t r = recv(fd, buf, n, MSG_DONTWAIT);
        if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
        return r;
    }
}

static void write_all(int fd, const char *p, size_t n, double deadline) {
    while (n) {
        if (!wait_fd(fd, POLLOUT, deadline)) return;
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) continue;
        if (w <= 0) return;
        p += w;
        n -= (size_t)w;
    }
}

static void respond_type(int fd, double deadline, const char *status, const char *type,
                         const char *body, size_t len) {
    char hdr[256];
    int n = snprintf(hdr, sizeof(hdr),
                     "HTTP/1.1 %s\r\nContent-Type: %s\r\n"
                     "Content-Length: %zu\r\nConnection: close\r\n\r\n",
                     status, type, len);
    write_all(fd, hdr, (size_t)n, deadline);
    write_all(fd, body, len, deadline);
}

static void respond(int fd, double deadline, const char *status, const char *body, size_t len) {
    respond_type(fd, deadline, status, "text/plain; version=0.0.4; charset=utf-8", body, len);
}

#define ROUTE_HEADER_MAX 8192

/* POST /route (docs/master.md, "Routing query"): headers up to 8 KiB, a Content-Length body
 * up to MQUERY_MAX_BODY, all within the connection's deadline; the query itself is bounded by
 * mquery. got bytes of the request are in req already. */
static void serve_route(struct mhttp *h, int fd, double deadline, const char *req, size_t got) {
    char *buf = malloc(ROUTE_HEADER_MAX + 1);
    if (!buf) return;
    size_t n = got < ROUTE_HEADER_MAX ? got : ROUTE_HEADER_MAX;
    memcpy(buf, req, n);
    buf[n] = 0;
    char *end;
    while (!(end = strstr(buf, "\r\n\r\n")) && n < ROUTE_HEADER_MAX) {
        ssize_t r = recv_by(fd, buf + n, ROUTE_HEADER_MAX - n, deadline);
        if (r <= 0) break;
        n += (size_t)r;
        buf[n] = 0;
    }
    const char *status = "400 Bad Request", *msg = "{\"error\":\"incomplete request\"}";
    if (!end) {
        if (n >= ROUTE_HEADER_MAX) msg = "{\"error\":\"headers exceed 8 KiB\"}";
        respond_type(fd, deadline, status, "application/json", msg, strlen(msg));
        free(buf);
        return;
    }
    size_t hlen = (size_t)(end - buf) + 4;
    long long clen = -1;
    for (char *line = strstr(buf, "\r\n"); line && line < end; line = strstr(line + 2, "\r\n")) {
        if (strncasecmp(line + 2, "Content-Length:", 15) == 0) {
            char *e2;
            clen = strtoll(line + 17, &e2, 10);
            if (e2 == line + 17) clen = -1;
        }
    }
    if (clen < 0) {
        msg = "{\"error\":\"Content-Length is required\"}";
        respond_type(fd, deadline, "411 Length Required", "application/json", msg, strlen(msg));
        free(buf);
        return;
    }
    if (clen > (long long)MQUERY_MAX_BODY) {
        msg = "{\"error\":\"request body exceeds 1 MiB\"}";
        respond_type(fd, deadline, "413 Content Too Large", "application/json", msg, strlen(msg));
        free(buf);
        return;
    }
    char *body = malloc((size_t)clen + 1);
    if (!body) {
        free(buf);
        return;
    }
    size_t have = n - hlen < (size_t)clen ? n - hlen : (size_t)clen;
    memcpy(body, buf + hlen, have);
    free(buf);
    while (have < (size_t)clen) {
        ssize_t r = recv_by(fd, body + have, (size_t)clen - have, deadline);
        if (r <= 0) break;
        have += (size_t)r;
    }
    if (have < (size_t)clen) {
        respond_type(fd, deadline, status, "application/json", msg, strlen(msg));
        free(body);
        return;
    }
    struct strbuf sb = STRBUF_INIT;
    /* mhttp serves the master (master.c passes it the master as the render argument). */
    int code = mquery_route(((struct master *)h->arg)->store, body, have, &sb);
    free(body);
    status = code == 200   ? "200 OK"
             : code == 400 ? "400 Bad Request"
             : code == 413 ? "413 Content Too Large"
                           : "500 Internal Server Error";
    respond_type(fd, deadline, status, "application/json", sb.buf ? sb.buf : "", sb.len);
    sb_free(&sb);
}

static void serve(struct mhttp *h, int fd) {
    double deadline = clock_mono() + CONN_DEADLINE_S;
    char req[4096];
    size_t got = 0;
    /* Read until the request line is complete (or the buffer is full). */
    while (got < sizeof(req) - 1) {
        ssize_t r = recv_by(fd, req + got, sizeof(req) - 1 - got, deadline);
        if (r <= 0) break;
        got += (size_t)r;
        req[got] = 0;
        if (memchr(req, '\n', got)) break;
    }
    req[got] = 0;
    if (strncmp(req, "POST /route ", 12) == 0 || strncmp(req, "POST /route?", 12) == 0) {
        serve_route(h, fd, deadline, req, got);
        return;
    }
    if (strncmp(req, "GET /", 5) != 0) {
        respond(fd, deadline, "400 Bad Request", "Bad Request\n", 12);
        return;
    }
    const char *path = req + 4;
    size_t plen = strcspn(path, " ?\r\n");
    if (plen == 8 && strncmp(path, "/metrics", 8) == 0) {
        struct strbuf sb = STRBUF_INIT;
        if (h->render(h->arg, &sb) == 0 && !sb.oom) {
            respond(fd, deadline, "200 OK", sb.buf ? sb.buf : "", sb.len);
        } else {
            respond(fd, deadline, "500 Internal Server Error", "error\n", 6);
        }
        sb_free(&sb);
        return;
    }
    respond(fd, deadline, "404 Not Found", "Try GET /metrics\n", 17);
}

static void *loop(void *arg) {
    struct mhttp *h = arg;
    for (;;) {
        struct pollfd p[2] = {{h->lfd, POLLIN, 0}, {h->wake[0], POLLIN, 0}};
        int r = poll(p, 2, -1);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 || p[1].revents) break;
        if (!(p[0].revents & POLLIN)) continue;
        int fd = accept(h->lfd, NULL, NULL);
        if (fd < 0) continue;
        serve(h, fd);
        close(fd);
    }
    return NULL;
}

struct mhttp *mhttp_start(const char *host, int port, mhttp_render_fn render, void *arg, char *err,
                          size_t errlen) {
    struct mhttp *h = calloc(1, sizeof(*h));
    if (!h) {
        errbuf_set(err, errlen, "out of memory");
        return NULL;
    }
    h->render = render;
    h->arg = arg;
    h->wake[0] = h->wake[1] = -1;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) {
        errbuf_set(err, errlen, "invalid metrics host '%s'", host);
        free(h);
        return NULL;
    }
    int one = 1;
    h->lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (h->lfd < 0 || setsockopt(h->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) ||
        bind(h->lfd, (struct sockaddr *)&sa, sizeof(sa)) || listen(h->lfd, 16) ||
        pipe2(h->wake, O_CLOEXEC)) {
        errbuf_set(err, errlen, "metrics port %s:%d: %s", host, port, strerror(errno));
        goto fail;
    }
    if (pthread_create(&h->thr, NULL, loop, h)) {
        errbuf_set(err, errlen, "cannot start the metrics thread");
        goto fail;
    }
    return h;
fail:
    if (h->lfd >= 0) close(h->lfd);
    if (h->wake[0] >= 0) close(h->wake[0]);
    if (h->wake[1] >= 0) close(h->wake[1]);
    free(h);
    return NULL;
}

void mhttp_stop(struct mhttp *h) {
    if (!h) return;
    ssize_t w;
    do w = write(h->wake[1], "x", 1);
    while (w < 0 && errno == EINTR);
    pthread_join(h->thr, NULL);
    close(h->lfd);
    close(h->wake[0]);
    close(h->wake[1]);
    free(h);
}
