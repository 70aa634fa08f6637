/* The systemd notification protocol (sd_notify) without libsystemd. */
#ifndef LMCACHE_BASE_SDNOTIFY_H
#define LMCACHE_BASE_SDNOTIFY_H

/* Sends state (e.g. "READY=1") to $NOTIFY_SOCKET. Returns 1 if sent, 0 when
 * NOTIFY_SOCKET is unset, -1 on error. */
int sd_notify_send(const char *state);

#endif
