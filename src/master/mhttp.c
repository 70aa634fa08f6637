/* Minimal HTTP/1.1 server for /metrics: one thread polling the listen socket and a wake
 * pipe; each connection is read once (bounded, with a timeout), answered and closed. */
#include "master/mhttp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
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

static void write_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return;
        p += w;
        n -= (size_t)w;
    }
}

static void respond_type(int fd, const char *status, const char *type, const char *body,
                         size_t len) {
    char hdr[256];
    int n = snprintf(hdr, sizeof(hdr),
                     "HTTP/1.1 %s\r\nContent-Type: %s\r\n"
                     "Content-Length: %zu\r\nConnection: close\r\n\r\n",
                     status, type, len);
    write_all(fd, hdr, (size_t)n);
    write_all(fd, body, len);
}

static void respond(int fd, const char *status, const char *body, size_t len) {
    respond_type(fd, status, "text/plain; version=0.0.4; charset=utf-8", body, len);
}

#define ROUTE_HEADER_MAX 8192
#define ROUTE_DEADLINE_S 5.0

/* POST /route (docs/master.md, "Routing query"): headers up to 8 KiB, a Content-Length body
 * up to MQUERY_MAX_BODY, the whole request within 5 s; the query itself is bounded by mquery.
 * got bytes of the request are in req already. */
static void serve_route(struct mhttp *h, int fd, const char *req, size_t got) {
    double deadline = clock_mono() + ROUTE_DEADLINE_S;
    char *buf = malloc(ROUTE_HEADER_MAX + 1);
    if (!buf) return;
    size_t n = got < ROUTE_HEADER_MAX ? got : ROUTE_HEADER_MAX;
    memcpy(buf, req, n);
    buf[n] = 0;
    char *end;
    while (!(end = strstr(buf, "\r\n\r\n")) && n < ROUTE_HEADER_MAX && clock_mono() < deadline) {
        ssize_t r = recv(fd, buf + n, ROUTE_HEADER_MAX - n, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        n += (size_t)r;
        buf[n] = 0;
    }
    const char *status = "400 Bad Request", *msg = "{\"error\":\"incomplete request\"}";
    if (!end) {
        if (n >= ROUTE_HEADER_MAX) msg = "{\"error\":\"headers exceed 8 KiB\"}";
        respond_type(fd, status, "application/json", msg, strlen(msg));
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
        respond_type(fd, "411 Length Required", "application/json", msg, strlen(msg));
        free(buf);
        return;
    }
    if (clen > (long long)MQUERY_MAX_BODY) {
        msg = "{\"error\":\"request body exceeds 1 MiB\"}";
        respond_type(fd, "413 Content Too Large", "application/json", msg, strlen(msg));
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
    while (have < (size_t)clen && clock_mono() < deadline) {
        ssize_t r = recv(fd, body + have, (size_t)clen - have, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        have += (size_t)r;
    }
    if (have < (size_t)clen) {
        respond_type(fd, status, "application/json", msg, strlen(msg));
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
    respond_type(fd, status, "application/json", sb.buf ? sb.buf : "", sb.len);
    sb_free(&sb);
}

static void serve(struct mhttp *h, int fd) {
    struct timeval tv = {2, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    char req[4096];
    size_t got = 0;
    /* Read until the request line is complete (or the buffer is full). */
    while (got < sizeof(req) - 1) {
        ssize_t r = recv(fd, req + got, sizeof(req) - 1 - got, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        got += (size_t)r;
        req[got] = 0;
        if (memchr(req, '\n', got)) break;
    }
    req[got] = 0;
    if (strncmp(req, "POST /route ", 12) == 0 || strncmp(req, "POST /route?", 12) == 0) {
        serve_route(h, fd, req, got);
        return;
    }
    if (strncmp(req, "GET /", 5) != 0) {
        respond(fd, "400 Bad Request", "Bad Request\n", 12);
        return;
    }
    const char *path = req + 4;
    size_t plen = strcspn(path, " ?\r\n");
    if (plen == 8 && strncmp(path, "/metrics", 8) == 0) {
        struct strbuf sb = STRBUF_INIT;
        if (h->render(h->arg, &sb) == 0 && !sb.oom) {
            respond(fd, "200 OK", sb.buf ? sb.buf : "", sb.len);
        } else {
            respond(fd, "500 Internal Server Error", "error\n", 6);
        }
        sb_free(&sb);
        return;
    }
    respond(fd, "404 Not Found", "Try GET /metrics\n", 17);
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
