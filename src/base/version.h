/* Version strings baked in at build time, with the documented fallbacks. */
#ifndef LMCACHE_BASE_VERSION_H
#define LMCACHE_BASE_VERSION_H

/* Package version; "" when unknown. */
const char *version_lmc(void);
/* Full git commit id; "" when unknown. */
const char *version_commit(void);
/* "<version>-<commit[:8]>", each missing part replaced by "NA". */
const char *version_combined(void);

#endif
