/* sd_notify: one datagram to the AF_UNIX socket named by $NOTIFY_SOCKET ('@' = abstract). */
#include "base/sdnotify.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

int sd_notify_send(const char *state) {
    const char *path = getenv("NOTIFY_SOCKET");
    if (!path || !*path) return 0;
    size_t len = strlen(path);
    struct sockaddr_un sa;
    if (len >= sizeof(sa.sun_path) || (path[0] != '/' && path[0] != '@')) return -1;
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    memcpy(sa.sun_path, path, len);
    if (path[0] == '@') sa.sun_path[0] = 0;
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    ssize_t n = sendto(fd, state, strlen(state), MSG_NOSIGNAL, (struct sockaddr *)&sa,
                       (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len));
    close(fd);
    return n < 0 ? -1 : 1;
}
