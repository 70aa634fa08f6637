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

#include "base/errbuf.h"
#include "base/strbuf.h"

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

static void respond(int fd, const char *status, const char *body, size_t len) {
    char hdr[256];
    int n = snprintf(hdr, sizeof(hdr),
                     "HTTP/1.1 %s\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                     "Content-Length: %zu\r\nConnection: close\r\n\r\n",
                     status, len);
    write_all(fd, hdr, (size_t)n);
    write_all(fd, body, len);
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
