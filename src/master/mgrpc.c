/* gRPC server on the C core. Each call is a small state machine driven by completion-queue
 * tags: REQUESTED (payload already read) -> handler -> SENT (status, message and close in
 * one batch) -> freed. Slots are re-armed before a call is handled so accepts never
 * serialise. See docs/master.md for the shutdown order. */
#include "master/mgrpc.h"

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/errbuf.h"
#include "base/log.h"
#include "master/mrpc.h"

/* gRPC's C core is not built with ThreadSanitizer and synchronises through absl::Mutex and its
 * own atomics, which ThreadSanitizer cannot see: a call handed to gRPC by one worker (its tag,
 * with the fields written before) comes back from the completion queue on another. That
 * hand-over is declared to it: TAG_OUT before a tag goes to gRPC, TAG_IN when the queue returns
 * it. Without them every call's fields would be reported as racing (gRPC's own accesses are
 * left out by tests/tsan.supp). No-ops in other builds. */
#if defined(__SANITIZE_THREAD__)
#define MGRPC_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define MGRPC_TSAN 1
#endif
#endif
#ifdef MGRPC_TSAN
#include <sanitizer/tsan_interface.h>
void __tsan_ignore_thread_begin(void);
void __tsan_ignore_thread_end(void);
#define TAG_OUT(tag)     __tsan_release(tag)
#define TAG_IN(tag)      __tsan_acquire(tag)
#define GRPC_OWNED_BEGIN __tsan_ignore_thread_begin()
#define GRPC_OWNED_END   __tsan_ignore_thread_end()
#else
#define TAG_OUT(tag)     ((void)(tag))
#define TAG_IN(tag)      ((void)(tag))
#define GRPC_OWNED_BEGIN ((void)0)
#define GRPC_OWNED_END   ((void)0)
#endif

#define SLOTS_PER_METHOD 16
#define GENERIC_SLOTS    4
#define CALL_MAGIC       0x4d43414cu

enum stage { ST_REQUESTED, ST_SENT };

struct mcall {
    uint32_t magic;
    enum stage stage;
    int method; /* -1: generic (unimplemented) */
    struct mgrpc *g;
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_call_details details;
    grpc_byte_buffer *payload;
    grpc_byte_buffer *resp;
    grpc_slice details_slice;
    int has_details;
    int cancelled;
};

struct mgrpc {
    struct master *m;
    grpc_server *server;
    grpc_completion_queue *cq;
    void *rm[32]; /* registered method handles, parallel to MRPC_METHODS */
    pthread_t *threads;
    int nthreads;
    atomic_int stopping;
    atomic_int outstanding;   /* request slots armed and not yet completed */
    atomic_int shutdown_done; /* the shutdown tag came back: no call is left */
    int shutdown_tag;
    /* Handlers running, and whether new ones may start. gRPC's shutdown tag can come back
     * while a worker is still inside a handler (its call cancelled): that worker then starts
     * its reply batch and re-arms a slot, both on the completion queue, which must not be shut
     * down before. mgrpc_stop closes the gate and waits for the count to reach zero. */
    pthread_mutex_t gate_mu;
    pthread_cond_t gate_cv;
    int running;
    bool gate_closed;
};

static void call_free(struct mcall *c) {
    /* These free gRPC's own objects (the status details slice, metadata, byte buffers), which
     * gRPC's threads may have read through abseil or libstdc++ (outside tests/tsan.supp's
     * ignored libraries), ordered by gRPC's reference counts. Some frees are tail calls out
     * of gRPC and would count as ours, so ThreadSanitizer records none of them (the call's
     * own fields are read before, and still checked). */
    grpc_call *call = c->call;
    grpc_byte_buffer *payload = c->payload, *resp = c->resp;
    int generic = c->method < 0, has_details = c->has_details;
    grpc_slice details = c->details_slice;
    GRPC_OWNED_BEGIN;
    if (call) grpc_call_unref(call);
    grpc_metadata_array_destroy(&c->md);
    if (generic) grpc_call_details_destroy(&c->details);
    if (payload) grpc_byte_buffer_destroy(payload);
    if (resp) grpc_byte_buffer_destroy(resp);
    if (has_details) grpc_slice_unref(details);
    GRPC_OWNED_END;
    c->magic = 0;
    free(c);
}

/* Arms one request slot for method (or a generic slot when method < 0). */
static int arm(struct mgrpc *g, int method) {
    if (atomic_load(&g->stopping)) return 0;
    struct mcall *c = calloc(1, sizeof(*c));
    if (!c) return -1;
    c->magic = CALL_MAGIC;
    c->g = g;
    c->method = method;
    c->stage = ST_REQUESTED;
    grpc_metadata_array_init(&c->md);
    grpc_call_error e;
    atomic_fetch_add(&g->outstanding, 1);
    TAG_OUT(c);
    if (method >= 0) {
        e = grpc_server_request_registered_call(g->server, g->rm[method], &c->call, &c->deadline,
                                                &c->md, &c->payload, g->cq, g->cq, c);
    } else {
        grpc_call_details_init(&c->details);
        e = grpc_server_request_call(g->server, &c->call, &c->details, &c->md, g->cq, g->cq, c);
    }
    if (e != GRPC_CALL_OK) {
        atomic_fetch_sub(&g->outstanding, 1);
        call_free(c);
        return -1;
    }
    return 0;
}

/* buf (malloc'd, may be NULL) is owned by finish from here on. */
static void finish(struct mcall *c, grpc_status_code code, const char *msg, uint8_t *buf,
                   size_t len) {
    grpc_op ops[4];
    memset(ops, 0, sizeof(ops));
    size_t n = 0;
    ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
    n++;
    if (code == GRPC_STATUS_OK) {
        /* The slice takes the reply buffer over (no copy); SEND_MESSAGE consumes it. */
        grpc_slice s = buf ? grpc_slice_new(buf, len, free) : grpc_empty_slice();
        buf = NULL;
        c->resp = grpc_raw_byte_buffer_create(&s, 1);
        grpc_slice_unref(s);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = c->resp;
        n++;
    }
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = code;
    if (code != GRPC_STATUS_OK && msg) {
        c->details_slice = grpc_slice_from_copied_string(msg);
        c->has_details = 1;
        ops[n].data.send_status_from_server.status_details = &c->details_slice;
    }
    n++;
    ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[n].data.recv_close_on_server.cancelled = &c->cancelled;
    n++;
    free(buf);
    c->stage = ST_SENT;
    grpc_call *call = c->call; /* before TAG_OUT: this thread is done with c from there on */
    TAG_OUT(c);
    if (grpc_call_start_batch(call, ops, n, c, NULL) != GRPC_CALL_OK) call_free(c);
}

static void handle(struct mcall *c) {
    struct mgrpc *g = c->g;
    if (c->method < 0) {
        finish(c, GRPC_STATUS_UNIMPLEMENTED, "Method not found", NULL, 0);
        return;
    }
    if (!c->payload) {
        finish(c, GRPC_STATUS_INVALID_ARGUMENT, "missing request message", NULL, 0);
        return;
    }
    grpc_byte_buffer_reader rd;
    if (!grpc_byte_buffer_reader_init(&rd, c->payload)) {
        finish(c, GRPC_STATUS_INVALID_ARGUMENT, "request could not be read", NULL, 0);
        return;
    }
    grpc_slice in = grpc_byte_buffer_reader_readall(&rd);
    grpc_byte_buffer_reader_destroy(&rd);
    struct mrpc_reply r;
    mrpc_dispatch(g->m, (size_t)c->method, GRPC_SLICE_START_PTR(in), GRPC_SLICE_LENGTH(in), &r);
    grpc_slice_unref(in);
    finish(c, (grpc_status_code)r.status, r.msg, r.buf, r.len);
}

/* false once mgrpc_stop has closed the gate: the call must then be dropped unanswered. */
static bool gate_enter(struct mgrpc *g) {
    pthread_mutex_lock(&g->gate_mu);
    bool open = !g->gate_closed;
    if (open) g->running++;
    pthread_mutex_unlock(&g->gate_mu);
    return open;
}

static void gate_leave(struct mgrpc *g) {
    pthread_mutex_lock(&g->gate_mu);
    if (--g->running == 0 && g->gate_closed) pthread_cond_broadcast(&g->gate_cv);
    pthread_mutex_unlock(&g->gate_mu);
}

static void *worker(void *arg) {
    struct mgrpc *g = arg;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(g->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
        if (ev.type != GRPC_OP_COMPLETE) continue;
        if (ev.tag == &g->shutdown_tag) {
            atomic_store(&g->shutdown_done, 1);
            continue;
        }
        TAG_IN(ev.tag);
        struct mcall *c = ev.tag;
        if (c->magic != CALL_MAGIC) abort();
        if (c->stage == ST_REQUESTED) {
            atomic_fetch_sub(&g->outstanding, 1);
            if (!ev.success || !gate_enter(g)) { /* server shutting down */
                call_free(c);
                continue;
            }
            if (arm(g, c->method) && !atomic_load(&g->stopping))
                log_error(g->m->lg, "[Master] could not re-arm a request slot");
            handle(c);
            gate_leave(g);
        } else {
            call_free(c);
        }
    }
    return NULL;
}

struct mgrpc *mgrpc_start(struct master *m, const char *addr, int nthreads, int *port, char *err,
                          size_t errlen) {
    struct mgrpc *g = calloc(1, sizeof(*g));
    if (!g || MRPC_NMETHODS > sizeof(g->rm) / sizeof(g->rm[0])) {
        errbuf_set(err, errlen, "out of memory");
        free(g);
        return NULL;
    }
    g->m = m;
    pthread_mutex_init(&g->gate_mu, NULL);
    pthread_cond_init(&g->gate_cv, NULL);
    grpc_arg args[2];
    args[0].type = args[1].type = GRPC_ARG_INTEGER;
    args[0].key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[1].key = (char *)GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    args[0].value.integer = args[1].value.integer = 64 << 20;
    grpc_channel_args ca = {2, args};
    g->server = grpc_server_create(&ca, NULL);
    g->cq = grpc_completion_queue_create_for_next(NULL);
    for (size_t i = 0; i < MRPC_NMETHODS; i++)
        g->rm[i] = grpc_server_register_method(g->server, MRPC_METHODS[i].path, NULL,
                                               GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    grpc_server_register_completion_queue(g->server, g->cq, NULL);
    grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
    *port = grpc_server_add_http2_port(g->server, addr, creds);
    grpc_server_credentials_release(creds);
    if (*port <= 0) {
        errbuf_set(err, errlen, "cannot listen on %s", addr);
        grpc_server_destroy(g->server);
        grpc_completion_queue_shutdown(g->cq);
        while (grpc_completion_queue_next(g->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
               GRPC_QUEUE_SHUTDOWN) {
        }
        grpc_completion_queue_destroy(g->cq);
        pthread_mutex_destroy(&g->gate_mu);
        pthread_cond_destroy(&g->gate_cv);
        free(g);
        return NULL;
    }
    grpc_server_start(g->server);
    int bad = 0;
    for (size_t i = 0; i < MRPC_NMETHODS; i++)
        for (int k = 0; k < SLOTS_PER_METHOD; k++) bad |= arm(g, (int)i);
    for (int k = 0; k < GENERIC_SLOTS; k++) bad |= arm(g, -1);
    g->threads = calloc((size_t)nthreads, sizeof(pthread_t));
    for (int i = 0; !bad && g->threads && i < nthreads; i++) {
        if (pthread_create(&g->threads[i], NULL, worker, g)) break;
        g->nthreads++;
    }
    if (bad || g->nthreads != nthreads) {
        errbuf_set(err, errlen, "cannot start the gRPC workers");
        mgrpc_stop(g, 0);
        return NULL;
    }
    return g;
}

void mgrpc_stop(struct mgrpc *g, int grace_sec) {
    if (!g) return;
    atomic_store(&g->stopping, 1);
    grpc_server_shutdown_and_notify(g->server, g->cq, &g->shutdown_tag);
    /* In-flight calls get grace_sec to finish before they are cancelled. */
    gpr_timespec until =
        gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_seconds(grace_sec, GPR_TIMESPAN));
    if (!g->nthreads) {
        grpc_server_cancel_all_calls(g->server);
        for (;;) {
            grpc_event ev =
                grpc_completion_queue_next(g->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
            if (ev.type != GRPC_OP_COMPLETE) continue;
            if (ev.tag == &g->shutdown_tag) break;
            TAG_IN(ev.tag);
            struct mcall *c = ev.tag;
            if (c->stage == ST_REQUESTED) atomic_fetch_sub(&g->outstanding, 1);
            call_free(c);
        }
    } else {
        /* Workers keep serving; calls still open after the grace period are cancelled. */
        while (!atomic_load(&g->shutdown_done) &&
               gpr_time_cmp(gpr_now(GPR_CLOCK_MONOTONIC), until) < 0)
            gpr_sleep_until(
                gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(2, GPR_TIMESPAN)));
        grpc_server_cancel_all_calls(g->server);
        while (!atomic_load(&g->shutdown_done))
            gpr_sleep_until(
                gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(2, GPR_TIMESPAN)));
        /* A handler still running (say, waiting on an unresponsive Redis: bounded by the
         * store's socket timeouts) finishes before the queue is shut down; its reply goes
         * nowhere, its call being cancelled. */
        pthread_mutex_lock(&g->gate_mu);
        g->gate_closed = true;
        if (g->running)
            log_warn(g->m->lg, "[Master] waiting for %d running call(s) to return", g->running);
        while (g->running) pthread_cond_wait(&g->gate_cv, &g->gate_mu);
        pthread_mutex_unlock(&g->gate_mu);
    }
    grpc_server_destroy(g->server);
    grpc_completion_queue_shutdown(g->cq);
    for (int i = 0; i < g->nthreads; i++) pthread_join(g->threads[i], NULL);
    if (!g->nthreads)
        while (grpc_completion_queue_next(g->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
               GRPC_QUEUE_SHUTDOWN) {
        }
    grpc_completion_queue_destroy(g->cq);
    pthread_mutex_destroy(&g->gate_mu);
    pthread_cond_destroy(&g->gate_cv);
    free(g->threads);
    free(g);
}
