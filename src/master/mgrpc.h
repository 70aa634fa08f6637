/* gRPC C-core plumbing for the master: one completion queue, N worker threads, every
 * UMBPMaster method registered with its payload read up front, a few generic slots
 * answering UNIMPLEMENTED for anything else. */
#ifndef LMCACHE_MASTER_MGRPC_H
#define LMCACHE_MASTER_MGRPC_H

#include <stddef.h>

struct master;
struct mgrpc;

/* Binds addr and starts nthreads workers. NULL with err filled on failure. *port gets the
 * bound port. */
struct mgrpc *mgrpc_start(struct master *m, const char *addr, int nthreads, int *port, char *err,
                          size_t errlen);
/* Stops accepting, gives in-flight calls grace_sec to finish, cancels the rest, waits for the
 * handlers still running (a cancelled call's handler runs to its end), joins. */
void mgrpc_stop(struct mgrpc *g, int grace_sec);

#endif
