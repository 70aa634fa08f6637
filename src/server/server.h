/* `lmcache server`: process life cycle of the cache daemon. */
#ifndef LMCACHE_SERVER_SERVER_H
#define LMCACHE_SERVER_SERVER_H

int server_main(int argc, char **argv);

#endif
