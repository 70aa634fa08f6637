/* libFuzzer driver for the S3 XML decoders (ListObjectsV2 pages and error bodies): any input is
 * either parsed within the documented limits or rejected, never a crash or a leak. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "server/l2/s3_xml.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    struct s3_xml_list l;
    char err[256];
    if (s3_xml_parse_list((const char *)data, size, &l, err, sizeof(err)) == 0) {
        if (l.count > S3_XML_ITEMS_MAX) __builtin_trap();
        for (size_t i = 0; i < l.count; i++)
            if (!l.items[i].key || strlen(l.items[i].key) > S3_XML_KEY_MAX) __builtin_trap();
        s3_xml_list_free(&l);
    }
    char code[64], msg[256];
    s3_xml_parse_error((const char *)data, size, code, sizeof(code), msg, sizeof(msg));
    return 0;
}
