/* The bound on what libzmq buffers for one tcp connection of the data socket. libzmq counts
 * --zmq-rcvhwm in whole messages and hands a multipart message over only once its last frame
 * has arrived, so a peer that sends frames without end would make it buffer without limit. The
 * guard learns the connections from a socket monitor, estimates the bytes libzmq holds for each
 * (what the kernel received on it minus what was delivered to the loop) and shuts down a
 * connection that holds more than the limit. Used by the `dp-loop` thread only. */
#ifndef LMCACHE_DATAPLANE_CONNGUARD_H
#define LMCACHE_DATAPLANE_CONNGUARD_H

#include <stddef.h>
#include <stdint.h>
#include <zmq.h>

struct connguard;
struct logger;
struct metric;

/* Allowance for each delivered frame over its size: the ZMTP frame header (at most 9 bytes) and
 * the CURVE MESSAGE box (33 bytes and its own header). */
#define CONNGUARD_FRAME_SLACK 64u
/* Allowance of a new connection: its handshake (greeting, READY or the CURVE commands). */
#define CONNGUARD_BASE_SLACK (64u << 10)
/* Allowance per second of a connection's age: ZMTP heartbeats are received, never delivered. */
#define CONNGUARD_HEARTBEAT_PER_S 1024u
/* How often every connection is checked. */
#define CONNGUARD_CHECK_NS (50u * 1000u * 1000u)
/* The heap is read only while the connections hold at least this much unread in all. */
#define CONNGUARD_HEAP_PROBE (1u << 20)
/* After a cut for the heap, the next one waits this long: libzmq frees the cut connection's
 * messages only once its threads have seen it gone. */
#define CONNGUARD_HEAP_CUT_GAP_NS (250ull * 1000u * 1000u)

/* Bytes libzmq may hold for one connection: --zmq-rcvhwm requests it holds plus the one it is
 * reading, each of at most --max-message-mb and its framing. */
uint64_t connguard_limit(uint64_t rcvhwm, uint64_t max_message_bytes);

/* Monitors `router` (call it before the socket binds) through a PAIR socket of zctx. NULL with
 * a message on failure. cut_total (may be NULL) counts the connections cut. */
struct connguard *connguard_start(void *zctx, void *router, uint64_t limit, struct logger *lg,
                                  struct metric *cut_total, char *err, size_t errlen);
/* Bytes are not memory: libzmq keeps each frame of a message in a 64-byte structure, so a peer
 * sending empty frames (2 bytes on the wire) makes it hold 32 times what it sent. With a limit
 * set, while the connections hold at least CONNGUARD_HEAP_PROBE unread, each check reads what
 * malloc holds (heap_in_use) and, over `limit` bytes, cuts the connection holding the most
 * unread bytes (one per CONNGUARD_HEAP_CUT_GAP_NS), counted in heap_cuts (may be NULL) as well
 * as in cut_total. 0: no limit (the default). */
void connguard_set_heap_limit(struct connguard *g, uint64_t limit, struct metric *heap_cuts);
/* The unread replies of the router's clients: the most one tcp client has (*fd its connection,
 * -1 when none) and *total, all clients' together. */
typedef size_t (*connguard_replies_fn)(void *arg, int *fd, size_t *total);
/* With a heap limit, the connection cut is the one holding the most, counting the replies fn
 * reports unread as well as the bytes libzmq received and has not delivered. */
void connguard_set_replies(struct connguard *g, connguard_replies_fn fn, void *arg);
/* Stops the monitor and closes the PAIR socket; call it before closing `router`. */
void connguard_stop(struct connguard *g);
/* The socket to poll for monitor events. */
void *connguard_socket(const struct connguard *g);
/* Reads the pending monitor events (connections accepted or gone). Call it before reading the
 * router, so a connection is known before its first frame is delivered. */
void connguard_events(struct connguard *g, uint64_t now_ns);
/* A frame of the router was delivered to the loop: credits the connection it came from. */
void connguard_credit(struct connguard *g, zmq_msg_t *frame);
/* Checks every connection when CONNGUARD_CHECK_NS has passed since the last check (O(tracked
 * connections): one getsockopt each); cuts those over the limit. Returns the milliseconds until
 * the next check is due (a poll timeout), at most max_wait_ms. */
long connguard_tick(struct connguard *g, uint64_t now_ns, long max_wait_ms);

/* The estimate of one connection, exposed for tests: the bytes received and not delivered after
 * `received` bytes in all (TCP_INFO), given the estimate `held` when `prev_received` had been
 * received, the credit of the frames delivered since, and the time passed. Never below 0: a
 * connection cannot bank credit (overestimated framing, heartbeat allowance) for a later
 * flood, and it never exceeds the true figure while credits are at least the bytes that carried
 * the delivered frames. */
uint64_t connguard_estimate(uint64_t held, uint64_t prev_received, uint64_t received,
                            uint64_t credit, uint64_t elapsed_ns);

#endif
