/* The data-plane ABI from C: agents, memory registration, peers over tcp,
 * cma and local, batches (submit, wait, poll), the receiver's completion
 * records, typed errors, pinned struct sizes. Built with -Wall -Werror and
 * run under valgrind. */
#define _DEFAULT_SOURCE /* usleep */
#include "pdxfer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"

_Static_assert(sizeof(PdxAgentOptions) == 24, "PdxAgentOptions size is ABI");
_Static_assert(sizeof(PdxCompletion) == 64, "PdxCompletion size is ABI");
_Static_assert(sizeof(PdxRegion) == 40, "PdxRegion size is ABI");
_Static_assert(sizeof(PdxPeerOptions) == 32, "PdxPeerOptions size is ABI");
_Static_assert(sizeof(PdxWriteOp) == 40, "PdxWriteOp size is ABI");
_Static_assert(sizeof(PdxBatchOptions) == 40, "PdxBatchOptions size is ABI");
_Static_assert(PDXFER_TRANSPORT_AUTO == 0 && PDXFER_TRANSPORT_LOCAL == 1 && PDXFER_TRANSPORT_CMA == 2 &&
                   PDXFER_TRANSPORT_TCP == 3 && PDXFER_TRANSPORT_RDMA == 4 && PDXFER_TRANSPORT_NCCL == 5,
               "PDXFER_TRANSPORT_* values are ABI");

#define N (256 * 1024)

static void roundtrip(uint32_t transport, uint32_t streams) {
    PdxAgentOptions ao = {sizeof ao, "127.0.0.1:0", NULL};
    PdxAgent *rx = NULL, *tx = NULL;
    CHECK(pdxfer_agent_create(&ao, &rx) == PDX_STATUS_OK);
    CHECK(pdxfer_agent_create(NULL, &tx) == PDX_STATUS_OK);
    unsigned char *dst = calloc(N, 1), *src = malloc(N);
    for (size_t i = 0; i < N; i++) src[i] = (unsigned char)(i * 13 + 1);
    PdxRegion rd = {.struct_size = sizeof rd}, sd = {.struct_size = sizeof sd};
    CHECK(pdxfer_register_memory(rx, dst, N, &rd) == PDX_STATUS_OK);
    CHECK(pdxfer_register_memory(tx, src, N, &sd) == PDX_STATUS_OK);
    CHECK(rd.len == N && rd.kind == PDXFER_REGION_HOST && rd.addr == (uint64_t)(uintptr_t)dst);

    PdxPeer *peer = NULL;
    if (transport == PDXFER_TRANSPORT_LOCAL) {
        CHECK(pdxfer_peer_open_local(tx, rx, &peer) == PDX_STATUS_OK);
    } else {
        char addr[64];
        size_t n = 0;
        CHECK(pdxfer_agent_listen_addr(rx, NULL, 0, &n) == PDX_STATUS_OK);
        CHECK(n > 8 && n <= sizeof addr);
        CHECK(pdxfer_agent_listen_addr(rx, addr, sizeof addr, &n) == PDX_STATUS_OK);
        PdxPeerOptions po = {sizeof po, transport, streams, 1, 0, 5000};
        CHECK(pdxfer_peer_open(tx, addr, &po, &peer) == PDX_STATUS_OK);
    }
    if (!peer) return;
    uint32_t kind = 99;
    CHECK(pdxfer_peer_transport(peer, &kind) == PDX_STATUS_OK && kind == transport);
    PdxRegion remote[4];
    size_t nr = 0;
    for (int i = 0; i < 4; i++) remote[i].struct_size = sizeof remote[i];
    CHECK(pdxfer_peer_regions(peer, remote, 4, &nr) == PDX_STATUS_OK);
    CHECK(nr == 1 && remote[0].id == rd.id && remote[0].len == N);

    PdxWriteOp ops[3] = {
        {sd.id, 0, rd.id, 64, 4096},
        {sd.id, 10000, rd.id, 100000, 150000},
        {sd.id, 7, rd.id, 0, 1},
    };
    PdxBatchOptions bo = {sizeof bo, 5000, 9, 4, PDXFER_BATCH_CHECKSUM, 0};
    uint64_t b = 0;
    CHECK(pdxfer_submit(peer, ops, 3, &bo, &b) == PDX_STATUS_OK);
    PdxCompletion c = {.struct_size = sizeof c};
    CHECK(pdxfer_wait(peer, b, 5000, &c) == PDX_STATUS_OK);
    CHECK(c.batch_id == b && c.bytes == 4096 + 150000 + 1 && c.room == 9 && c.epoch == 4 && c.has_checksum == 1);
    PdxCompletion rc = {.struct_size = sizeof rc};
    CHECK(pdxfer_agent_next_completion(rx, 5000, &rc) == PDX_STATUS_OK);
    CHECK(rc.batch_id == c.batch_id && rc.bytes == c.bytes && rc.checksum == c.checksum);
    CHECK(rc.peer_pid == (uint32_t)getpid());
    CHECK(memcmp(dst + 64, src, 4096) == 0);
    CHECK(memcmp(dst + 100000, src + 10000, 150000) == 0);
    CHECK(dst[0] == src[7]);

    /* poll until done; a finished batch is reported once */
    CHECK(pdxfer_submit(peer, ops, 1, NULL, &b) == PDX_STATUS_OK);
    PdxStatus st = PDX_STATUS_IN_PROGRESS;
    /* bounded by time, yielding between polls: under valgrind threads run one
     * at a time, and a tight loop would starve the thread doing the transfer */
    for (int i = 0; i < 50000 && st == PDX_STATUS_IN_PROGRESS; i++) {
        st = pdxfer_poll(peer, b, &c);
        if (st == PDX_STATUS_IN_PROGRESS) usleep(200);
    }
    CHECK(st == PDX_STATUS_OK && c.bytes == 4096);
    CHECK(pdxfer_poll(peer, b, &c) == PDX_STATUS_INVALID_ARGUMENT);
    CHECK(pdxfer_agent_next_completion(rx, 5000, &rc) == PDX_STATUS_OK);

    /* one-sided reads where the transport can (local, cma); tcp says unsupported */
    unsigned char *back = calloc(4096, 1);
    PdxRegion bd = {.struct_size = sizeof bd};
    CHECK(pdxfer_register_memory(tx, back, 4096, &bd) == PDX_STATUS_OK);
    PdxWriteOp rop = {bd.id, 0, rd.id, 64, 4096};
    st = pdxfer_submit_reads(peer, &rop, 1, &bo, &b);
    if (transport == PDXFER_TRANSPORT_TCP) {
        CHECK(st == PDX_STATUS_UNSUPPORTED);
    } else {
        CHECK(st == PDX_STATUS_OK);
        CHECK(pdxfer_wait(peer, b, 5000, &c) == PDX_STATUS_OK && c.bytes == 4096);
        CHECK(memcmp(back, src, 4096) == 0);
    }
    CHECK(pdxfer_unregister_memory(tx, bd.id, 1000) == PDX_STATUS_OK);
    free(back);

    /* out of bounds and unknown regions: refused, nothing sent */
    unsigned char before = dst[N - 1];
    PdxWriteOp bad = {sd.id, 0, rd.id, N - 4, 5};
    CHECK(pdxfer_submit(peer, &bad, 1, &bo, &b) == PDX_STATUS_OUT_OF_BOUNDS);
    bad.remote_region = rd.id + 100;
    bad.remote_offset = 0;
    CHECK(pdxfer_submit(peer, &bad, 1, &bo, &b) == PDX_STATUS_REGION_NOT_FOUND);
    CHECK(strstr(pdxfer_last_error(), "region") != NULL);
    CHECK(pdxfer_agent_next_completion(rx, 20, &rc) == PDX_STATUS_TIMEOUT);
    CHECK(dst[N - 1] == before);

    pdxfer_peer_close(peer);
    CHECK(pdxfer_unregister_memory(rx, rd.id, 1000) == PDX_STATUS_OK);
    CHECK(pdxfer_unregister_memory(tx, sd.id, 1000) == PDX_STATUS_OK);
    pdxfer_agent_destroy(tx);
    pdxfer_agent_destroy(rx);
    free(dst);
    free(src);
}

static void shared_allocation(void) {
    PdxAgentOptions ao = {sizeof ao, "127.0.0.1:0", NULL};
    PdxAgent *rx = NULL, *tx = NULL;
    CHECK(pdxfer_agent_create(&ao, &rx) == PDX_STATUS_OK);
    CHECK(pdxfer_agent_create(NULL, &tx) == PDX_STATUS_OK);
    PdxRegion rd = {.struct_size = sizeof rd}, sd = {.struct_size = sizeof sd};
    CHECK(pdxfer_alloc_shared_memory(rx, 65536, &rd) == PDX_STATUS_OK);
    CHECK(pdxfer_alloc_shared_memory(rx, 0, &rd) == PDX_STATUS_INVALID_ARGUMENT);
    CHECK(pdxfer_alloc_shared_memory(rx, 16, NULL) == PDX_STATUS_NULL_ARGUMENT);
    unsigned char *dst = (unsigned char *)(uintptr_t)rd.addr;
    unsigned char src[4096];
    for (int i = 0; i < 4096; i++) src[i] = (unsigned char)(i ^ 0x5a);
    CHECK(pdxfer_register_memory(tx, src, sizeof src, &sd) == PDX_STATUS_OK);
    char addr[64];
    size_t n = 0;
    CHECK(pdxfer_agent_listen_addr(rx, addr, sizeof addr, &n) == PDX_STATUS_OK);
    PdxPeerOptions po = {sizeof po, PDXFER_TRANSPORT_CMA, 1, 1, 0, 5000};
    PdxPeer *peer = NULL;
    CHECK(pdxfer_peer_open(tx, addr, &po, &peer) == PDX_STATUS_OK);
    PdxWriteOp op = {sd.id, 0, rd.id, 1000, 4096};
    uint64_t b = 0;
    CHECK(pdxfer_submit(peer, &op, 1, NULL, &b) == PDX_STATUS_OK);
    CHECK(pdxfer_wait(peer, b, 5000, NULL) == PDX_STATUS_OK);
    CHECK(memcmp(dst + 1000, src, 4096) == 0 && dst[999] == 0);
    pdxfer_peer_close(peer);
    CHECK(pdxfer_unregister_memory(rx, rd.id, 1000) == PDX_STATUS_OK);
    pdxfer_agent_destroy(tx);
    pdxfer_agent_destroy(rx);
}

static void bad_inputs(void) {
    PdxAgent *a = NULL;
    CHECK(pdxfer_agent_create(NULL, NULL) == PDX_STATUS_NULL_ARGUMENT);
    CHECK(pdxfer_agent_create(NULL, &a) == PDX_STATUS_OK);
    char buf[8];
    size_t n;
    CHECK(pdxfer_agent_listen_addr(a, buf, sizeof buf, &n) == PDX_STATUS_INVALID_ARGUMENT);
    CHECK(pdxfer_register_memory(a, NULL, 16, NULL) == PDX_STATUS_NULL_ARGUMENT);
    CHECK(pdxfer_register_memory(NULL, buf, 8, NULL) == PDX_STATUS_NULL_ARGUMENT);
    CHECK(pdxfer_register_memory(a, buf, 0, NULL) == PDX_STATUS_INVALID_ARGUMENT);
    CHECK(pdxfer_unregister_memory(a, 77, 0) == PDX_STATUS_REGION_NOT_FOUND);
    PdxStatus dev = pdxfer_register_device_memory(a, 0x1000, 16, 0, NULL);
    CHECK(dev == PDX_STATUS_NO_CUDA_DRIVER || dev == PDX_STATUS_UNSUPPORTED || dev == PDX_STATUS_CUDA ||
          dev == PDX_STATUS_INVALID_ARGUMENT);
    PdxPeer *p = NULL;
    PdxPeerOptions po = {sizeof po, PDXFER_TRANSPORT_TCP, 1, 1, 0, 2000};
    CHECK(pdxfer_peer_open(a, "127.0.0.1:1", &po, &p) == PDX_STATUS_PEER_UNREACHABLE);
    po.transport = 42;
    CHECK(pdxfer_peer_open(a, "127.0.0.1:1", &po, &p) == PDX_STATUS_INVALID_ARGUMENT);
    po.transport = PDXFER_TRANSPORT_RDMA;
    /* no NIC here: typed before dialing; with NICs the dial itself fails */
    PdxStatus rst = pdxfer_peer_open(a, "127.0.0.1:1", &po, &p);
    CHECK(rst == PDX_STATUS_NO_RDMA_DEVICE || rst == PDX_STATUS_PEER_UNREACHABLE ||
          rst == PDX_STATUS_TRANSPORT_UNAVAILABLE);
    po.struct_size = 8;
    CHECK(pdxfer_peer_open(a, "127.0.0.1:1", &po, &p) == PDX_STATUS_ABI_MISMATCH);
    CHECK(p == NULL);
    CHECK(pdxfer_wait(NULL, 1, 0, NULL) == PDX_STATUS_NULL_ARGUMENT);
    pdxfer_peer_close(NULL);
    pdxfer_agent_destroy(a);
    pdxfer_agent_destroy(NULL);
}

/* The cluster secret: agents that share it move bytes; another secret is
 * refused by name (auth_failed) and writes nothing; a listener other hosts
 * can reach needs a secret (auth_required). */
static void secrets(void) {
    const char *secret = "c-test-cluster-secret-0123456789";
    PdxAgentOptions ao = {sizeof ao, "127.0.0.1:0", secret};
    PdxAgentOptions good = {sizeof good, NULL, secret};
    PdxAgentOptions bad = {sizeof bad, NULL, "another-cluster-secret-0123456789"};
    PdxAgent *rx = NULL, *tx = NULL, *other = NULL;
    CHECK(pdxfer_agent_create(&ao, &rx) == PDX_STATUS_OK);
    CHECK(pdxfer_agent_create(&good, &tx) == PDX_STATUS_OK);
    CHECK(pdxfer_agent_create(&bad, &other) == PDX_STATUS_OK);
    char addr[64];
    size_t n = 0;
    CHECK(pdxfer_agent_listen_addr(rx, addr, sizeof addr, &n) == PDX_STATUS_OK);
    PdxPeerOptions po = {sizeof po, PDXFER_TRANSPORT_TCP, 1, 1, 0, 5000};
    PdxPeer *peer = NULL;
    CHECK(pdxfer_peer_open(tx, addr, &po, &peer) == PDX_STATUS_OK);
    if (peer) pdxfer_peer_close(peer);
    peer = NULL;
    CHECK(pdxfer_peer_open(other, addr, &po, &peer) == PDX_STATUS_AUTH_FAILED);
    CHECK(peer == NULL);
    CHECK(strstr(pdxfer_last_error(), "authentication") != NULL);
    PdxAgentOptions any = {sizeof any, "0.0.0.0:0", NULL};
    PdxAgent *open = NULL;
    CHECK(pdxfer_agent_create(&any, &open) == PDX_STATUS_AUTH_REQUIRED);
    CHECK(open == NULL);
    CHECK(strstr(pdxfer_last_error(), "0.0.0.0") != NULL);
    pdxfer_agent_destroy(other);
    pdxfer_agent_destroy(tx);
    pdxfer_agent_destroy(rx);
}

int main(void) {
    secrets();
    roundtrip(PDXFER_TRANSPORT_TCP, 1);
    roundtrip(PDXFER_TRANSPORT_TCP, 2);
    roundtrip(PDXFER_TRANSPORT_CMA, 1);
    roundtrip(PDXFER_TRANSPORT_LOCAL, 1);
    shared_allocation();
    bad_inputs();
    return CHECK_SUMMARY();
}
