/* POST /run_script when enabled: runs the uploaded Python script in a child
 * /usr/bin/python3 with restricted builtins and an import allow-list. */
#ifndef LMCACHE_ADMIN_RUN_SCRIPT_H
#define LMCACHE_ADMIN_RUN_SCRIPT_H

struct http_req;
struct http_resp;

#define RUN_SCRIPT_TIMEOUT_S 30
#define RUN_SCRIPT_PYTHON    "/usr/bin/python3"

void run_script_handle(struct http_req *req, struct http_resp *resp);

#endif
