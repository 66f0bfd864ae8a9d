/* Log records reach the host through pdxfer_set_log_callback: a miswired DCP
 * pair (a decode rank whose DCP rank differs from the prefill rank it maps
 * to) is refused at receiver() and the refusal arrives as a warning naming
 * the status kind and the peer instance; levels filter; NULL turns it off;
 * replacing the callback while other threads log is safe, and once the call
 * returns the previous callback is never called again. Run under valgrind. */
#define _DEFAULT_SOURCE
#include "check.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { LAYERS = 1, PAGE = 4, ROW = 32, POOL_PAGES = 8, THREADS = 2, PER_THREAD = 20 };

typedef struct {
    pthread_mutex_t mu;
    int calls;
    int refusals; /* warnings naming dcp_rank_mismatch and a peer instance */
    int bad_records;
    int reentry_status;
    int closed; /* set once the callback was replaced: any later call is a bug */
    char target[256];
    char message[2048];
} Seen;

static void on_log(void *user, uint32_t level, const char *target, const char *message) {
    Seen *s = user;
    pthread_mutex_lock(&s->mu);
    s->calls++;
    if (s->closed || level < PDXFER_LOG_ERROR || level > PDXFER_LOG_WARN || !target || !message)
        s->bad_records++;
    if (target && message && strstr(message, "dcp_rank_mismatch") && strstr(message, "peer instance")) {
        s->refusals++;
        snprintf(s->target, sizeof s->target, "%s", target);
        snprintf(s->message, sizeof s->message, "%s", message);
    }
    pthread_mutex_unlock(&s->mu);
    /* replacing the callback from inside it is refused (it would wait for itself) */
    int st = pdxfer_set_log_callback(PDXFER_LOG_OFF, NULL, NULL);
    pthread_mutex_lock(&s->mu);
    s->reentry_status = st;
    pthread_mutex_unlock(&s->mu);
}

typedef struct {
    uint32_t *kv;
    uint32_t id;
    uint64_t row;
    PdxKvPool pool;
    PdxTopology topo;
} Rank;

static void rank_init(Rank *r, uint32_t dcp_rank, uint32_t tp_rank) {
    memset(r, 0, sizeof *r);
    r->kv = calloc((size_t)POOL_PAGES * PAGE, ROW);
    r->row = ROW;
    r->pool.base = r->kv;
    r->pool.page_bytes = (uint64_t)PAGE * ROW;
    r->pool.num_pages = POOL_PAGES;
    r->topo.struct_size = sizeof r->topo;
    r->topo.engine_rank = tp_rank;
    r->topo.attn_tp_size = 2;
    r->topo.attn_tp_rank = tp_rank;
    r->topo.attn_cp_size = 1;
    r->topo.pp_size = 1;
    r->topo.dcp_size = 2;
    r->topo.dcp_rank = dcp_rank;
    r->topo.dcp_interleave = 1;
    r->topo.page_size = PAGE;
    r->topo.kv_dtype = 1;
    r->topo.num_entries = LAYERS;
    r->topo.entry_layer_ids = &r->id;
    r->topo.entry_row_bytes = &r->row;
}

static PdxEngine *engine(const Rank *r, uint32_t role, const char *url) {
    PdxEngineConfig c;
    memset(&c, 0, sizeof c);
    c.struct_size = sizeof c;
    c.role = role;
    c.cluster = "c-log";
    c.bootstrap = url;
    c.topology = &r->topo;
    c.pools = &r->pool;
    c.num_pools = LAYERS;
    c.staging_bytes = 1 << 16;
    c.room_timeout_ms = 60000;
    PdxEngine *e = NULL;
    CHECK(pdxfer_engine_create(&c, &e) == PDX_STATUS_OK);
    return e;
}

typedef struct {
    PdxEngine *decode;
    uint64_t first_room;
    int refused;
} Worker;

static void *refuse_rooms(void *arg) {
    Worker *w = arg;
    for (int i = 0; i < PER_THREAD; i++)
        if (pdxfer_engine_receiver(w->decode, w->first_room + (uint64_t)i, 0, 0) == PDX_STATUS_DCP_RANK_MISMATCH)
            w->refused++;
    return NULL;
}

static Seen *seen_new(void) {
    Seen *s = calloc(1, sizeof *s);
    pthread_mutex_init(&s->mu, NULL);
    s->reentry_status = 1;
    return s;
}

static void seen_free(Seen *s) {
    pthread_mutex_destroy(&s->mu);
    free(s);
}

int main(void) {
    Seen *a = seen_new();
    CHECK(pdxfer_set_log_callback(6, on_log, a) == PDX_STATUS_INVALID_ARGUMENT);
    CHECK(pdxfer_set_log_callback(PDXFER_LOG_WARN, on_log, a) == PDX_STATUS_OK);

    PdxBootstrapServerConfig sc;
    memset(&sc, 0, sizeof sc);
    sc.struct_size = sizeof sc;
    PdxBootstrapServer *srv = NULL;
    CHECK(pdxfer_bootstrap_server_start(&sc, &srv) == PDX_STATUS_OK);
    char url[256];
    size_t need = 0;
    CHECK(pdxfer_bootstrap_server_url(srv, url, sizeof url, &need) == PDX_STATUS_OK);

    /* prefill DCP 2 on TP ranks 0 and 1; the decode rank on TP rank 0 claims DCP rank 1 */
    Rank p0, p1, dx;
    rank_init(&p0, 0, 0);
    rank_init(&p1, 1, 1);
    rank_init(&dx, 1, 0);
    PdxEngine *pe0 = engine(&p0, PDXFER_ROLE_PREFILL, url);
    PdxEngine *pe1 = engine(&p1, PDXFER_ROLE_PREFILL, url);
    PdxEngine *dex = engine(&dx, PDXFER_ROLE_DECODE, url);

    CHECK(pdxfer_engine_receiver(dex, 1, 0, 0) == PDX_STATUS_DCP_RANK_MISMATCH);
    pthread_mutex_lock(&a->mu);
    CHECK(a->refusals == 1 && a->bad_records == 0);
    CHECK(strncmp(a->target, "pdxfer::bootstrap", 17) == 0);
    CHECK(strstr(a->message, "refused") != NULL && strstr(a->message, "dcp_rank=1/2") != NULL);
    CHECK(a->reentry_status == PDX_STATUS_INVALID_ARGUMENT);
    pthread_mutex_unlock(&a->mu);
    printf("callback got: [%s] %s\n", a->target, a->message);

    /* ERROR level: the warning is filtered out */
    CHECK(pdxfer_set_log_callback(PDXFER_LOG_ERROR, on_log, a) == PDX_STATUS_OK);
    CHECK(pdxfer_engine_receiver(dex, 2, 0, 0) == PDX_STATUS_DCP_RANK_MISMATCH);
    CHECK(a->refusals == 1);

    /* replacing the callback while two threads log: every record goes to one of
     * them, and once replaced a callback is never called again */
    Seen *b = seen_new();
    CHECK(pdxfer_set_log_callback(PDXFER_LOG_WARN, on_log, a) == PDX_STATUS_OK);
    Worker w[THREADS];
    pthread_t th[THREADS];
    for (int t = 0; t < THREADS; t++) {
        w[t] = (Worker){dex, 100 + (uint64_t)t * 1000, 0};
        CHECK(pthread_create(&th[t], NULL, refuse_rooms, &w[t]) == 0);
    }
    Seen *cur = a;
    for (int i = 0; i < 40; i++) {
        Seen *next = cur == a ? b : a;
        pthread_mutex_lock(&next->mu);
        next->closed = 0;
        pthread_mutex_unlock(&next->mu);
        CHECK(pdxfer_set_log_callback(PDXFER_LOG_WARN, on_log, next) == PDX_STATUS_OK);
        /* the call returned: `cur` is running nowhere and must not be called again */
        pthread_mutex_lock(&cur->mu);
        cur->closed = 1;
        pthread_mutex_unlock(&cur->mu);
        cur = next;
    }
    for (int t = 0; t < THREADS; t++) CHECK(pthread_join(th[t], NULL) == 0);
    CHECK(pdxfer_set_log_callback(PDXFER_LOG_WARN, NULL, cur) == PDX_STATUS_OK);
    pthread_mutex_lock(&cur->mu);
    cur->closed = 1;
    pthread_mutex_unlock(&cur->mu);
    int refused = 0;
    for (int t = 0; t < THREADS; t++) refused += w[t].refused;
    CHECK(refused == THREADS * PER_THREAD);
    /* the callback was set the whole time, so every refusal was delivered to one of them */
    CHECK(a->refusals + b->refusals == 1 + refused);
    CHECK(a->bad_records == 0 && b->bad_records == 0);

    /* NULL turned forwarding off */
    int before = a->calls + b->calls;
    CHECK(pdxfer_engine_receiver(dex, 3, 0, 0) == PDX_STATUS_DCP_RANK_MISMATCH);
    CHECK(a->calls + b->calls == before);

    CHECK(pdxfer_engine_destroy(dex) == PDX_STATUS_OK);
    CHECK(pdxfer_engine_destroy(pe1) == PDX_STATUS_OK);
    CHECK(pdxfer_engine_destroy(pe0) == PDX_STATUS_OK);
    CHECK(pdxfer_bootstrap_server_stop(srv) == PDX_STATUS_OK);
    free(p0.kv);
    free(p1.kv);
    free(dx.kv);
    seen_free(a);
    seen_free(b);
    return CHECK_SUMMARY();
}
