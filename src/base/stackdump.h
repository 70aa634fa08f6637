/* Stack traces of every thread of the process, for GET /threads. */
#ifndef LMCACHE_BASE_STACKDUMP_H
#define LMCACHE_BASE_STACKDUMP_H

#include <sys/types.h>

struct strbuf;

/* Installs the signal handler used to sample other threads' stacks. Call once at
 * start-up, before threads that should be sampled are created. 0 on success. */
int stackdump_init(void);

/* Appends a text report: a total count line, then for each thread (optionally
 * only those whose name contains name_filter, case-insensitively, or whose id is
 * tid_filter when > 0) its name, id and current stack. Threads that block the
 * sampling signal are listed with a note instead of a stack. Returns the number
 * of threads reported. */
int stackdump_report(struct strbuf *out, const char *name_filter, pid_t tid_filter);

#endif
