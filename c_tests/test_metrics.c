/* Engine metrics and room telemetry from C, in one process: a bootstrap
 * server, a prefill rank serving /metrics on loopback and a decode rank over
 * tcp. The counts follow the rooms run, the histogram counts the rooms that
 * succeeded, an abort is counted by kind, the telemetry's times are ordered
 * and its bytes are the room's; the buffer convention and refused calls
 * write nothing. Built with -Wall -Werror and run under valgrind. */
#define _DEFAULT_SOURCE
#include "check.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

_Static_assert(sizeof(PdxEngineConfig) == 192, "PdxEngineConfig size is ABI");
_Static_assert(sizeof(PdxRoomTelemetry) == 96, "PdxRoomTelemetry size is ABI");
_Static_assert(PDXFER_TELEMETRY_UNSET == UINT64_MAX, "unset telemetry is all ones");

enum { LAYERS = 2, PAGE = 4, ROW = 32, POOL_PAGES = 32, AUX_ROWS = 4, AUX_ITEM = 16 };

typedef struct {
    unsigned char *kv[LAYERS];
    unsigned char *aux;
    uint32_t ids[LAYERS];
    uint64_t rows[LAYERS];
    PdxKvPool pools[LAYERS];
    PdxAuxBuffer auxb;
    PdxTopology topo;
} Rank;

static void rank_init(Rank *r) {
    memset(r, 0, sizeof *r);
    for (int l = 0; l < LAYERS; l++) {
        r->kv[l] = calloc((size_t)POOL_PAGES * PAGE, ROW);
        r->ids[l] = (uint32_t)l;
        r->rows[l] = ROW;
        r->pools[l].layer_id = (uint32_t)l;
        r->pools[l].base = r->kv[l];
        r->pools[l].page_bytes = (uint64_t)PAGE * ROW;
        r->pools[l].num_pages = POOL_PAGES;
    }
    r->aux = calloc(AUX_ROWS, AUX_ITEM);
    r->auxb.base = r->aux;
    r->auxb.item_bytes = AUX_ITEM;
    r->auxb.count = AUX_ROWS;
    r->topo.struct_size = sizeof r->topo;
    r->topo.attn_tp_size = 1;
    r->topo.attn_cp_size = 1;
    r->topo.pp_size = 1;
    r->topo.dcp_size = 1;
    r->topo.dcp_interleave = 1;
    r->topo.page_size = PAGE;
    r->topo.kv_dtype = 1;
    r->topo.num_entries = LAYERS;
    r->topo.entry_layer_ids = r->ids;
    r->topo.entry_row_bytes = r->rows;
}

static void rank_free(Rank *r) {
    for (int l = 0; l < LAYERS; l++) free(r->kv[l]);
    free(r->aux);
}

static PdxEngineConfig config(const Rank *r, uint32_t role, const char *url) {
    PdxEngineConfig c;
    memset(&c, 0, sizeof c);
    c.struct_size = sizeof c;
    c.role = role;
    c.cluster = "c-metrics";
    c.bootstrap = url;
    c.topology = &r->topo;
    c.pools = r->pools;
    c.num_pools = LAYERS;
    c.aux = &r->auxb;
    c.num_aux = 1;
    c.transport = "tcp";
    c.staging_bytes = 1 << 16;
    c.room_timeout_ms = 60000;
    return c;
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* The engine's metrics text (malloc'd; the caller frees it), through the size query. */
static char *metrics(const PdxEngine *e) {
    size_t need = 0;
    CHECK(pdxfer_engine_metrics(e, NULL, 0, &need) == PDX_STATUS_OK);
    CHECK(need > 1);
    size_t cap = need + 4096; /* headroom: the text may grow between the calls */
    char *buf = malloc(cap);
    CHECK(pdxfer_engine_metrics(e, buf, cap, &need) == PDX_STATUS_OK);
    CHECK(need <= cap && strlen(buf) + 1 == need);
    return buf;
}

/* 1 when the metrics text has the line `series value`. */
static int has(const char *text, const char *line) {
    size_t n = strlen(line);
    for (const char *p = strstr(text, line); p; p = strstr(p + 1, line))
        if ((p == text || p[-1] == '\n') && p[n] == '\n') return 1;
    return 0;
}

static int wait_poll(const PdxEngine *e, uint64_t room, int32_t want) {
    int32_t poll = -1;
    for (int i = 0; i < 6000; i++) {
        CHECK(pdxfer_engine_poll(e, room, &poll) == PDX_STATUS_OK);
        if (poll == want) return 1;
        sleep_ms(10);
    }
    return 0;
}

/* One request of `tokens` tokens; checks its telemetry on both sides before clearing it. */
static void request(PdxEngine *pe, PdxEngine *de, uint64_t room, uint64_t tokens) {
    int64_t src[8], dst[8];
    size_t np = (size_t)((tokens + PAGE - 1) / PAGE);
    for (size_t i = 0; i < np; i++) {
        src[i] = (int64_t)((i * 7 + room) % POOL_PAGES);
        dst[i] = (int64_t)((i * 3 + room) % POOL_PAGES);
    }
    PdxStatus st = PDX_STATUS_NOT_READY;
    for (int i = 0; i < 3000 && st == PDX_STATUS_NOT_READY; i++) {
        st = pdxfer_engine_receiver(de, room, 0, 0);
        if (st == PDX_STATUS_NOT_READY) {
            CHECK(pdxfer_engine_clear(de, room) == PDX_STATUS_OK);
            sleep_ms(20);
        }
    }
    CHECK(st == PDX_STATUS_OK);
    CHECK(pdxfer_engine_send_metadata(de, room, dst, np, 0, 2) == PDX_STATUS_OK);
    CHECK(pdxfer_engine_sender(pe, room) == PDX_STATUS_OK);
    CHECK(wait_poll(pe, room, PDXFER_POLL_WAITING_FOR_INPUT));
    CHECK(pdxfer_engine_send(pe, room, src, np, tokens, 1, 1) == PDX_STATUS_OK);
    int32_t poll = -1;
    CHECK(pdxfer_engine_wait(pe, room, 60000, &poll) == PDX_STATUS_OK && poll == PDXFER_POLL_SUCCESS);
    CHECK(pdxfer_engine_wait(de, room, 60000, &poll) == PDX_STATUS_OK && poll == PDXFER_POLL_SUCCESS);

    uint64_t kv = tokens * ROW * LAYERS, got = 0;
    CHECK(pdxfer_engine_room_bytes(de, room, &got) == PDX_STATUS_OK && got == kv);
    PdxRoomTelemetry t;
    memset(&t, 0, sizeof t);
    t.struct_size = sizeof t;
    CHECK(pdxfer_engine_room_telemetry(pe, room, &t) == PDX_STATUS_OK);
    CHECK(t.struct_size == sizeof t && t.room == room && t.attempt == 1 && t.state == PDXFER_POLL_SUCCESS);
    CHECK(t.queued_ns != PDXFER_TELEMETRY_UNSET && t.last_ack_ns != PDXFER_TELEMETRY_UNSET);
    CHECK(t.queued_ns <= t.planned_ns && t.planned_ns <= t.first_byte_ns && t.first_byte_ns <= t.last_ack_ns);
    CHECK(t.bytes == kv);
    CHECK(t.batches >= 2 && t.batches != PDXFER_TELEMETRY_UNSET); /* KV, then aux */
    CHECK(t.retries == 0);
    CHECK(t.created_unix_ns > 1700000000000000000ull);
    PdxRoomTelemetry d;
    memset(&d, 0, sizeof d);
    d.struct_size = sizeof d;
    CHECK(pdxfer_engine_room_telemetry(de, room, &d) == PDX_STATUS_OK);
    CHECK(d.state == PDXFER_POLL_SUCCESS && d.bytes == kv);
    CHECK(d.queued_ns <= d.last_ack_ns && d.last_ack_ns != PDXFER_TELEMETRY_UNSET);
    CHECK(d.planned_ns == PDXFER_TELEMETRY_UNSET && d.first_byte_ns == PDXFER_TELEMETRY_UNSET);
    CHECK(d.batches == PDXFER_TELEMETRY_UNSET && d.retries == PDXFER_TELEMETRY_UNSET);
    CHECK(pdxfer_engine_clear(de, room) == PDX_STATUS_OK);
    CHECK(pdxfer_engine_clear(pe, room) == PDX_STATUS_OK);
    /* cleared: unknown, and nothing written */
    PdxRoomTelemetry keep = t;
    CHECK(pdxfer_engine_room_telemetry(pe, room, &t) == PDX_STATUS_UNKNOWN_ROOM);
    CHECK(memcmp(&keep, &t, sizeof t) == 0);
}

/* GET path from the loopback responder at `addr` ("127.0.0.1:port"); malloc'd answer. */
static char *http_get(const char *addr, const char *path) {
    const char *colon = strrchr(addr, ':');
    CHECK(colon != NULL);
    if (!colon) return NULL;
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)atoi(colon + 1));
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(fd >= 0);
    CHECK(connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
    char req[128];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: x\r\n\r\n", path);
    CHECK(write(fd, req, (size_t)n) == n);
    size_t cap = 1 << 16, got = 0;
    char *out = calloc(cap, 1);
    ssize_t k;
    while (got + 1 < cap && (k = read(fd, out + got, cap - 1 - got)) > 0) got += (size_t)k;
    close(fd);
    return out;
}

int main(void) {
    PdxBootstrapServerConfig sc;
    memset(&sc, 0, sizeof sc);
    sc.struct_size = sizeof sc;
    PdxBootstrapServer *srv = NULL;
    CHECK(pdxfer_bootstrap_server_start(&sc, &srv) == PDX_STATUS_OK);
    char url[256];
    size_t need = 0;
    CHECK(pdxfer_bootstrap_server_url(srv, url, sizeof url, &need) == PDX_STATUS_OK);
    CHECK(pdxfer_abi_version() == ((PDXFER_ABI_VERSION_MAJOR << 16) | PDXFER_ABI_VERSION_MINOR));
    CHECK(PDXFER_ABI_VERSION_MINOR >= 3);

    Rank pr, dr;
    rank_init(&pr);
    rank_init(&dr);
    PdxEngineConfig c = config(&pr, PDXFER_ROLE_PREFILL, url);
    c.metrics_listen = "127.0.0.1:0";
    PdxEngine *pe = NULL, *de = NULL;
    CHECK(pdxfer_engine_create(&c, &pe) == PDX_STATUS_OK);
    c = config(&dr, PDXFER_ROLE_DECODE, url);
    CHECK(pdxfer_engine_create(&c, &de) == PDX_STATUS_OK);
    if (!pe || !de) return CHECK_SUMMARY();

    /* before any room */
    char *m = metrics(pe);
    CHECK(has(m, "pdxfer_engine_rooms_created_total 0"));
    CHECK(has(m, "pdxfer_engine_rooms{state=\"bootstrapping\"} 0"));
    CHECK(strstr(m, "pdxfer_engine_transfer_seconds_count") == NULL);
    free(m);

    /* the buffer convention: a short buffer is refused untouched, with the length written */
    CHECK(pdxfer_engine_metrics(pe, NULL, 0, &need) == PDX_STATUS_OK && need > 100);
    char *small = malloc(need - 1);
    memset(small, 'x', need - 1);
    size_t need2 = 0;
    CHECK(pdxfer_engine_metrics(pe, small, need - 1, &need2) == PDX_STATUS_BUFFER_TOO_SMALL);
    CHECK(need2 >= need);
    int untouched = 1;
    for (size_t i = 0; i < need - 1; i++) untouched &= small[i] == 'x';
    CHECK(untouched);
    free(small);
    CHECK(pdxfer_engine_metrics(NULL, NULL, 0, &need) == PDX_STATUS_NULL_ARGUMENT);
    CHECK(pdxfer_engine_metrics(pe, NULL, 0, NULL) == PDX_STATUS_NULL_ARGUMENT);

    /* three rooms: the counts follow them */
    uint64_t sizes[3] = {5, 17, 30};
    for (int i = 0; i < 3; i++) {
        request(pe, de, (uint64_t)(i + 1), sizes[i]);
        m = metrics(pe);
        char line[160];
        snprintf(line, sizeof line, "pdxfer_engine_rooms_created_total %d", i + 1);
        CHECK(has(m, line));
        snprintf(line, sizeof line, "pdxfer_engine_rooms_finished_total{state=\"success\"} %d", i + 1);
        CHECK(has(m, line));
        snprintf(line, sizeof line, "pdxfer_engine_transfer_seconds_count{transport=\"tcp\"} %d", i + 1);
        CHECK(has(m, line));
        snprintf(line, sizeof line, "pdxfer_engine_transfer_seconds_bucket{transport=\"tcp\",le=\"+Inf\"} %d", i + 1);
        CHECK(has(m, line));
        CHECK(has(m, "pdxfer_engine_rooms{state=\"success\"} 0"));
        free(m);
    }
    m = metrics(de);
    CHECK(has(m, "pdxfer_engine_rooms_finished_total{state=\"success\"} 3"));
    char line[160];
    snprintf(line, sizeof line,
             "pdxfer_engine_received_bytes_total{transport=\"tcp\",peer=\"dp0-tp0-cp0-pp0\"} %llu",
             (unsigned long long)((5 + 17 + 30) * ROW * LAYERS));
    CHECK(has(m, line));
    free(m);

    /* an abort, counted by kind on both ranks */
    CHECK(pdxfer_engine_receiver(de, 9, 0, 0) == PDX_STATUS_OK);
    int64_t pg[1] = {1};
    CHECK(pdxfer_engine_send_metadata(de, 9, pg, 1, 0, 0) == PDX_STATUS_OK);
    CHECK(pdxfer_engine_sender(pe, 9) == PDX_STATUS_OK);
    CHECK(wait_poll(pe, 9, PDXFER_POLL_WAITING_FOR_INPUT));
    CHECK(pdxfer_engine_abort(de, 9, NULL) == PDX_STATUS_OK);
    CHECK(wait_poll(pe, 9, PDXFER_POLL_FAILED));
    m = metrics(pe);
    CHECK(has(m, "pdxfer_engine_room_failures_total{kind=\"aborted\"} 1"));
    CHECK(has(m, "pdxfer_engine_rooms_finished_total{state=\"failed\"} 1"));
    CHECK(has(m, "pdxfer_engine_transfer_seconds_count{transport=\"tcp\"} 3"));
    free(m);
    m = metrics(de);
    CHECK(has(m, "pdxfer_engine_room_failures_total{kind=\"aborted\"} 1"));
    free(m);

    /* refused telemetry calls write nothing */
    PdxRoomTelemetry t, keep;
    memset(&t, 0x5a, sizeof t);
    t.struct_size = 8;
    keep = t;
    CHECK(pdxfer_engine_room_telemetry(pe, 9, &t) == PDX_STATUS_ABI_MISMATCH);
    CHECK(memcmp(&keep, &t, sizeof t) == 0);
    t.struct_size = sizeof t;
    keep = t;
    CHECK(pdxfer_engine_room_telemetry(pe, 404, &t) == PDX_STATUS_UNKNOWN_ROOM);
    CHECK(memcmp(&keep, &t, sizeof t) == 0);
    CHECK(pdxfer_engine_room_telemetry(pe, 9, NULL) == PDX_STATUS_NULL_ARGUMENT);
    CHECK(pdxfer_engine_room_telemetry(pe, 9, &t) == PDX_STATUS_OK && t.state == PDXFER_POLL_FAILED);
    CHECK(t.last_ack_ns == PDXFER_TELEMETRY_UNSET);

    /* /metrics over HTTP on the prefill; the decode serves none */
    char addr[64];
    CHECK(pdxfer_engine_metrics_address(de, addr, sizeof addr, &need) == PDX_STATUS_UNSUPPORTED);
    CHECK(pdxfer_engine_metrics_address(pe, NULL, 0, &need) == PDX_STATUS_OK && need > 10);
    CHECK(pdxfer_engine_metrics_address(pe, addr, sizeof addr, &need) == PDX_STATUS_OK);
    CHECK(strncmp(addr, "127.0.0.1:", 10) == 0);
    char *page = http_get(addr, "/metrics");
    if (page) {
        CHECK(strncmp(page, "HTTP/1.1 200 OK\r\n", 17) == 0);
        CHECK(strstr(page, "\npdxfer_engine_room_failures_total{kind=\"aborted\"} 1\n") != NULL);
        free(page);
    }
    page = http_get(addr, "/nothing");
    if (page) {
        CHECK(strncmp(page, "HTTP/1.1 404", 12) == 0);
        free(page);
    }

    CHECK(pdxfer_engine_clear(pe, 9) == PDX_STATUS_OK);
    CHECK(pdxfer_engine_destroy(de) == PDX_STATUS_OK);
    CHECK(pdxfer_engine_destroy(pe) == PDX_STATUS_OK);
    CHECK(pdxfer_bootstrap_server_stop(srv) == PDX_STATUS_OK);
    rank_free(&pr);
    rank_free(&dr);
    return CHECK_SUMMARY();
}
