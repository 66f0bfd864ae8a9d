/* Careless callers: a call refused for a bad output argument (a struct_size
 * too small, a misaligned out-pointer) changes nothing: no region stays
 * registered, no batch result or completion record is consumed, no batch is
 * sent. Built with -Wall -Werror and run under valgrind. */
#define _DEFAULT_SOURCE /* usleep */
#include "pdxfer.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"

static size_t region_count(PdxAgent *a) {
    size_t n = 99;
    CHECK(pdxfer_agent_regions(a, NULL, 0, &n) == PDX_STATUS_OK);
    return n;
}

static void refused_registrations_register_nothing(void) {
    PdxAgent *a = NULL;
    CHECK(pdxfer_agent_create(NULL, &a) == PDX_STATUS_OK);
    unsigned char *buf = calloc(4096, 1);
    PdxRegion small = {.struct_size = 8};
    CHECK(pdxfer_register_memory(a, buf, 4096, &small) == PDX_STATUS_ABI_MISMATCH);
    CHECK(region_count(a) == 0);
    CHECK(pdxfer_alloc_shared_memory(a, 4096, &small) == PDX_STATUS_ABI_MISMATCH);
    CHECK(region_count(a) == 0);
    PdxStatus dev = pdxfer_register_device_memory(a, 0x1000, 16, 0, &small);
    CHECK(dev == PDX_STATUS_ABI_MISMATCH);
    CHECK(region_count(a) == 0);
    /* The same range registers afterwards: nothing overlaps it. */
    PdxRegion r = {.struct_size = sizeof r};
    CHECK(pdxfer_register_memory(a, buf, 4096, &r) == PDX_STATUS_OK);
    CHECK(region_count(a) == 1);
    CHECK(pdxfer_unregister_memory(a, r.id, 1000) == PDX_STATUS_OK);
    pdxfer_agent_destroy(a);
    free(buf);
}

static void refused_waits_keep_the_result(void) {
    PdxAgent *rx = NULL, *tx = NULL;
    CHECK(pdxfer_agent_create(NULL, &rx) == PDX_STATUS_OK);
    CHECK(pdxfer_agent_create(NULL, &tx) == PDX_STATUS_OK);
    unsigned char *dst = calloc(8192, 1), *src = malloc(8192);
    memset(src, 0x5a, 8192);
    PdxRegion rd = {.struct_size = sizeof rd}, sd = {.struct_size = sizeof sd};
    CHECK(pdxfer_register_memory(rx, dst, 8192, &rd) == PDX_STATUS_OK);
    CHECK(pdxfer_register_memory(tx, src, 8192, &sd) == PDX_STATUS_OK);
    PdxPeer *peer = NULL;
    CHECK(pdxfer_peer_open_local(tx, rx, &peer) == PDX_STATUS_OK);
    if (!peer) return;
    PdxCompletion small = {.struct_size = 8};
    PdxCompletion c = {.struct_size = sizeof c};
    PdxWriteOp op = {sd.id, 0, rd.id, 0, 4096};

    /* pdxfer_wait */
    uint64_t b = 0;
    CHECK(pdxfer_submit(peer, &op, 1, NULL, &b) == PDX_STATUS_OK);
    CHECK(pdxfer_wait(peer, b, 5000, &small) == PDX_STATUS_ABI_MISMATCH);
    CHECK(pdxfer_wait(peer, b, 5000, &c) == PDX_STATUS_OK);
    CHECK(c.batch_id == b && c.bytes == 4096);

    /* pdxfer_poll */
    CHECK(pdxfer_submit(peer, &op, 1, NULL, &b) == PDX_STATUS_OK);
    usleep(50 * 1000);
    CHECK(pdxfer_poll(peer, b, &small) == PDX_STATUS_ABI_MISMATCH);
    c.bytes = 0;
    CHECK(pdxfer_wait(peer, b, 5000, &c) == PDX_STATUS_OK);
    CHECK(c.batch_id == b && c.bytes == 4096);

    /* pdxfer_agent_next_completion: both records are still there. */
    CHECK(pdxfer_agent_next_completion(rx, 1000, &small) == PDX_STATUS_ABI_MISMATCH);
    CHECK(pdxfer_agent_next_completion(rx, 1000, NULL) == PDX_STATUS_NULL_ARGUMENT);
    PdxCompletion rc = {.struct_size = sizeof rc};
    CHECK(pdxfer_agent_next_completion(rx, 1000, &rc) == PDX_STATUS_OK && rc.bytes == 4096);
    CHECK(pdxfer_agent_next_completion(rx, 1000, &rc) == PDX_STATUS_OK && rc.bytes == 4096);
    CHECK(pdxfer_agent_next_completion(rx, 100, &rc) == PDX_STATUS_TIMEOUT);

    /* pdxfer_submit with a misaligned out_batch sends nothing. */
    memset(dst, 0, 8192);
    uint64_t slots[2] = {0, 0};
    uint64_t *odd = (uint64_t *)(void *)((char *)slots + 1);
    PdxWriteOp op2 = {sd.id, 0, rd.id, 4096, 4096};
    CHECK(pdxfer_submit(peer, &op2, 1, NULL, odd) == PDX_STATUS_INVALID_ARGUMENT);
    CHECK(pdxfer_agent_next_completion(rx, 200, &rc) == PDX_STATUS_TIMEOUT);
    int untouched = 1;
    for (int i = 0; i < 8192; i++) untouched &= dst[i] == 0;
    CHECK(untouched);

    pdxfer_peer_close(peer);
    pdxfer_agent_destroy(tx);
    pdxfer_agent_destroy(rx);
    free(dst);
    free(src);
}

int main(void) {
    refused_registrations_register_nothing();
    refused_waits_keep_the_result();
    return CHECK_SUMMARY();
}
