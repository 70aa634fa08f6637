/* One unary gRPC client call on the C core's completion-queue API: the six operations of a
 * unary call started as one batch, and their cleanup. Header-only, shared by the C master
 * client and the master benchmark's bare-gRPC ceiling. */
#ifndef LMCACHE_BASE_GRPCU_H
#define LMCACHE_BASE_GRPCU_H

#include <grpc/grpc.h>
#include <grpc/support/time.h>
#include <string.h>

struct grpcu_call {
    grpc_call *call;
    grpc_byte_buffer *req, *resp; /* req: set it before grpcu_start; both owned by the call */
    grpc_metadata_array md_init, md_trail;
    grpc_status_code status;
    grpc_slice details;
    grpc_op ops[6];
};

/* Starts the call on cq with tag; its completion carries the status, details and reply. The
 * call must be cleaned up with grpcu_cleanup whatever this returns. 0 ok, -1 not started. */
static inline int grpcu_start(struct grpcu_call *u, grpc_channel *ch, grpc_completion_queue *cq,
                              grpc_slice method, gpr_timespec deadline, void *tag) {
    grpc_metadata_array_init(&u->md_init);
    grpc_metadata_array_init(&u->md_trail);
    u->call = grpc_channel_create_call(ch, NULL, GRPC_PROPAGATE_DEFAULTS, cq, method, NULL,
                                       deadline, NULL);
    grpc_op *o = u->ops;
    memset(o, 0, sizeof(u->ops));
    o[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    o[1].op = GRPC_OP_SEND_MESSAGE;
    o[1].data.send_message.send_message = u->req;
    o[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    o[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    o[3].data.recv_initial_metadata.recv_initial_metadata = &u->md_init;
    o[4].op = GRPC_OP_RECV_MESSAGE;
    o[4].data.recv_message.recv_message = &u->resp;
    o[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    o[5].data.recv_status_on_client.trailing_metadata = &u->md_trail;
    o[5].data.recv_status_on_client.status = &u->status;
    o[5].data.recv_status_on_client.status_details = &u->details;
    if (!u->call || grpc_call_start_batch(u->call, o, 6, tag, NULL) != GRPC_CALL_OK) return -1;
    return 0;
}

/* Releases everything the call holds and zeroes it. */
static inline void grpcu_cleanup(struct grpcu_call *u) {
    if (u->call) grpc_call_unref(u->call);
    if (u->req) grpc_byte_buffer_destroy(u->req);
    if (u->resp) grpc_byte_buffer_destroy(u->resp);
    grpc_metadata_array_destroy(&u->md_init);
    grpc_metadata_array_destroy(&u->md_trail);
    grpc_slice_unref(u->details);
    memset(u, 0, sizeof(*u));
}

#endif
