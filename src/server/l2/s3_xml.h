/* The S3 XML documents the S3 adapter reads: ListObjectsV2 results and error bodies, parsed with
 * expat. Nothing here trusts a length or a count read from the document. */
#ifndef LMCACHE_SERVER_L2_S3_XML_H
#define LMCACHE_SERVER_L2_S3_XML_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define S3_XML_KEY_MAX   1024   /* S3's own limit on object-key bytes */
#define S3_XML_TEXT_MAX  4096   /* longest text of one element we keep */
#define S3_XML_ITEMS_MAX 100000 /* most <Contents> accepted in one document */

struct s3_xml_item {
    char *key; /* malloc'd, NUL-terminated */
    uint64_t size;
};

/* One ListObjectsV2 page (<ListBucketResult>). */
struct s3_xml_list {
    struct s3_xml_item *items; /* malloc'd */
    size_t count;
    char *next_token; /* <NextContinuationToken>, malloc'd, NULL when absent */
    bool truncated;   /* <IsTruncated>true</IsTruncated> */
};

/* Parses a ListObjectsV2 result. Contents without a Key or with a malformed Size are skipped.
 * Returns 0, or -1 with a message in err (malformed XML, a DOCTYPE, the wrong root element, a
 * key or text over the limits). On success free *out with s3_xml_list_free(). */
int s3_xml_parse_list(const char *doc, size_t len, struct s3_xml_list *out, char *err,
                      size_t errlen);
void s3_xml_list_free(struct s3_xml_list *l);

/* Reads <Error><Code>..</Code><Message>..</Message></Error>. code/msg get "" when absent or when
 * the document is not an S3 error. Returns 0 when a <Code> was found, else -1. */
int s3_xml_parse_error(const char *doc, size_t len, char *code, size_t codelen, char *msg,
                       size_t msglen);

#endif
