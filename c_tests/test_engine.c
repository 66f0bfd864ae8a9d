/* The engine ABI from C, with real processes: the parent forks the ranks
 * (before it starts any thread), then runs the bootstrap server in-process
 * and hands its URL to the children through pipes. Clusters (small enough for
 * valgrind; python/tests/test_engine.py runs 1->4 and 4->4): DCP 1->2 and
 * 2->2 (matched DCP ranks, as 4->4), chunked, with a decode prefix, and 1->2
 * with the decode KV pools in shared pool allocations (the prefill copies
 * rows straight into them: its one-copy metric counts every KV byte); every
 * decode rank checks every byte it owns and that nothing else was written.
 * Then, in-process: bad inputs through every export give typed statuses and
 * write nothing. Built with -Wall -Werror and run under valgrind. */
#define _DEFAULT_SOURCE
#include "check.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* check.h's CHECK, naming the process (the ranks are forked children) */
#undef CHECK
#define CHECK(cond)                                                              \
    do {                                                                         \
        checks++;                                                                \
        if (!(cond)) {                                                           \
            failures++;                                                          \
            fprintf(stderr, "[pid %d] %s:%d: CHECK failed: %s (last error: %s)\n", \
                    (int)getpid(), __FILE__, __LINE__, #cond, pdxfer_last_error()); \
        }                                                                        \
    } while (0)

_Static_assert(sizeof(PdxEngineConfig) == 192, "PdxEngineConfig size is ABI");
_Static_assert(sizeof(PdxSendOptions) == 48, "PdxSendOptions size is ABI");
_Static_assert(sizeof(PdxKvPool) == 32, "PdxKvPool size is ABI");
_Static_assert(sizeof(PdxKvPoolDesc) == 48, "PdxKvPoolDesc size is ABI");
_Static_assert(sizeof(PdxAuxBuffer) == 24, "PdxAuxBuffer size is ABI");
_Static_assert(sizeof(PdxTopology) == 96, "PdxTopology size is ABI");
_Static_assert(PDXFER_POLL_FAILED == 0 && PDXFER_POLL_BOOTSTRAPPING == 1 &&
                   PDXFER_POLL_WAITING_FOR_INPUT == 2 && PDXFER_POLL_TRANSFERRING == 3 &&
                   PDXFER_POLL_SUCCESS == 4,
               "KVPoll values are SGLang's");

enum { LAYERS = 2, PAGE = 4, ROW = 32, WORDS = ROW / 4, POOL_PAGES = 32, AUX_ROWS = 4, AUX_ITEM = 16 };

/* One rank's memory and its C descriptors. */
typedef struct {
    uint32_t *kv[LAYERS];
    uint32_t *aux;
    uint32_t ids[LAYERS];
    uint64_t rows[LAYERS];
    PdxKvPool pools[LAYERS];
    PdxAuxBuffer auxb;
    PdxTopology topo;
    int shared; /* kv[] are pdxfer_alloc_shared_pool allocations */
} Rank;

static void rank_init(Rank *r, uint32_t dcp, uint32_t dcp_rank, uint32_t tp_rank) {
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
    r->topo.engine_rank = tp_rank;
    r->topo.attn_tp_size = dcp;
    r->topo.attn_tp_rank = tp_rank;
    r->topo.attn_cp_size = 1;
    r->topo.pp_size = 1;
    r->topo.dcp_size = dcp;
    r->topo.dcp_rank = dcp_rank;
    r->topo.dcp_interleave = 1;
    r->topo.page_size = PAGE;
    r->topo.kv_dtype = 1;
    r->topo.pool_kind = 0;
    r->topo.num_entries = LAYERS;
    r->topo.entry_layer_ids = r->ids;
    r->topo.entry_row_bytes = r->rows;
}

/* Moves the rank's KV pools into shared pool allocations (zeroed, like calloc's). */
static void rank_share(Rank *r) {
    for (int l = 0; l < LAYERS; l++) {
        void *p = NULL;
        CHECK(pdxfer_alloc_shared_pool((size_t)POOL_PAGES * PAGE * ROW, &p) == PDX_STATUS_OK);
        free(r->kv[l]);
        r->kv[l] = p;
        r->pools[l].base = p;
    }
    r->shared = 1;
}

static void rank_free(Rank *r) {
    for (int l = 0; l < LAYERS; l++) {
        if (r->shared)
            CHECK(pdxfer_free_shared_pool(r->kv[l]) == PDX_STATUS_OK);
        else
            free(r->kv[l]);
    }
    free(r->aux);
}

static PdxEngineConfig config(const Rank *r, uint32_t role, const char *cluster, const char *url) {
    PdxEngineConfig c;
    memset(&c, 0, sizeof c);
    c.struct_size = sizeof c;
    c.role = role;
    c.cluster = cluster;
    c.bootstrap = url;
    c.topology = &r->topo;
    c.pools = r->pools;
    c.num_pools = LAYERS;
    c.aux = &r->auxb;
    c.num_aux = 1;
    c.staging_bytes = 1 << 16;
    c.room_timeout_ms = 60000;
    return c;
}

static uint32_t word(uint64_t room, int layer, uint64_t pos, int j) {
    return (uint32_t)((room << 26) | ((uint64_t)layer << 22) | (pos << 4) | (uint64_t)j);
}

/* The pool row of position t for a rank of DCP size d owning it, through pages from origin. */
static uint64_t row_of(uint64_t t, uint64_t d, const int64_t *pages, uint64_t origin) {
    uint64_t v = (uint64_t)PAGE * d;
    uint64_t li = (t - origin) / v * PAGE + (t % v) / d;
    return (uint64_t)pages[li / PAGE] * PAGE + li % PAGE;
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Creates an engine, retrying a few times while the bootstrap is slow to
 * answer (under valgrind every process of the cluster runs ~30x slower). */
static PdxStatus create(const PdxEngineConfig *c, PdxEngine **e) {
    PdxStatus st = PDX_STATUS_TIMEOUT;
    for (int i = 0; i < 5; i++) {
        st = pdxfer_engine_create(c, e);
        if (st != PDX_STATUS_TIMEOUT && st != PDX_STATUS_BOOTSTRAP) break;
    }
    return st;
}

typedef struct {
    const char *cluster;
    uint32_t p_dcp, d_dcp;
    uint64_t room, total, prefix;
    size_t chunk_pages;
    int layerwise; /* send each chunk layer by layer (pdxfer_engine_send_ex) behind ready flags */
    int shared;    /* decode KV pools in shared pool allocations: the prefill copies rows straight in */
} Job;

static size_t make_pages(int64_t *out, uint64_t n, uint64_t v, uint64_t room, uint64_t stride) {
    size_t k = (size_t)((n + v - 1) / v);
    for (size_t i = 0; i < k; i++) out[i] = (int64_t)((i * stride + room) % POOL_PAGES);
    return k;
}

/* Whether this process can open pidfds, which cma needs to map a peer's
 * shared memory (valgrind does not know the syscall: it falls back to
 * process_vm_writev, and the prefill takes the staged path). */
static int pidfds_work(void) {
    long fd = syscall(SYS_pidfd_open, getpid(), 0);
    if (fd < 0) return 0;
    close((int)fd);
    return 1;
}

/* A prefill rank: fills its pattern, sends in chunks, waits for success, then
 * for `done_fd` to close. Returns the number of failed checks. */
static int run_prefill(const Job *j, uint32_t rank, const char *url, int done_fd) {
    Rank r;
    rank_init(&r, j->p_dcp, rank, rank);
    uint64_t n = j->total - j->prefix, vp = (uint64_t)PAGE * j->p_dcp;
    int64_t pages[POOL_PAGES];
    size_t np = make_pages(pages, n, vp, j->room, 7);
    for (uint64_t t = j->prefix; t < j->total; t++) {
        if (t % j->p_dcp != rank) continue;
        uint64_t row = row_of(t, j->p_dcp, pages, j->prefix);
        for (int l = 0; l < LAYERS; l++)
            for (int w = 0; w < WORDS; w++) r.kv[l][row * WORDS + w] = word(j->room, l, t, w);
    }
    for (int w = 0; w < AUX_ITEM / 4; w++) r.aux[1 * (AUX_ITEM / 4) + w] = word(j->room, 15, 1, w);
    PdxEngineConfig c = config(&r, PDXFER_ROLE_PREFILL, j->cluster, url);
    PdxEngine *e = NULL;
    CHECK(create(&c, &e) == PDX_STATUS_OK);
    CHECK(pdxfer_engine_sender(e, j->room) == PDX_STATUS_OK);
    int32_t poll = -1;
    for (int i = 0; i < 6000; i++) {
        CHECK(pdxfer_engine_poll(e, j->room, &poll) == PDX_STATUS_OK);
        if (poll != PDXFER_POLL_BOOTSTRAPPING) break;
        sleep_ms(10);
    }
    CHECK(poll == PDXFER_POLL_WAITING_FOR_INPUT);
    uint64_t sent = 0;
    for (size_t i = 0; i < np; i += j->chunk_pages) {
        size_t k = np - i < j->chunk_pages ? np - i : j->chunk_pages;
        int last = i + k >= np;
        uint64_t tokens = last ? n - sent : k * vp;
        if (!j->layerwise) {
            CHECK(pdxfer_engine_send(e, j->room, pages + i, k, tokens, (uint32_t)last, 1) == PDX_STATUS_OK);
        } else {
            /* each layer behind its own flag (valid until the room ends), set
             * only after every layer of the chunk was queued */
            static uint64_t flags[POOL_PAGES][LAYERS];
            uint64_t *f = flags[i / j->chunk_pages];
            for (int l = 0; l < LAYERS; l++) {
                PdxSendOptions o;
                memset(&o, 0, sizeof o);
                o.struct_size = sizeof o;
                o.aux_index = 1;
                o.ready_flag = &f[l];
                o.first_layer = (uint32_t)l;
                o.num_layers = 1;
                CHECK(pdxfer_engine_send_ex(e, j->room, pages + i, k, tokens, (uint32_t)last, &o) == PDX_STATUS_OK);
                /* the same layer again is refused and queues nothing */
                CHECK(pdxfer_engine_send_ex(e, j->room, pages + i, k, tokens, (uint32_t)last, &o) ==
                      PDX_STATUS_LAYER_ORDER);
            }
            for (int l = 0; l < LAYERS; l++) __atomic_store_n(&f[l], 1, __ATOMIC_RELEASE);
        }
        sent += tokens;
    }
    CHECK(pdxfer_engine_wait(e, j->room, 60000, &poll) == PDX_STATUS_OK);
    CHECK(poll == PDXFER_POLL_SUCCESS);
    {
        /* every KV byte took the one-copy path with shared decode pools, none otherwise */
        static char m[1 << 16];
        size_t need = 0;
        CHECK(pdxfer_engine_metrics(e, m, sizeof m, &need) == PDX_STATUS_OK);
        char want[96];
        unsigned long long kv =
            j->shared && j->p_dcp == 1 && pidfds_work() ? (unsigned long long)n * LAYERS * ROW : 0;
        snprintf(want, sizeof want, "\npdxfer_engine_one_copy_bytes_total %llu\n", kv);
        if (j->p_dcp == 1 || !j->shared) CHECK(strstr(m, want) != NULL);
    }
    CHECK(pdxfer_engine_clear(e, j->room) == PDX_STATUS_OK);
    char b;
    while (read(done_fd, &b, 1) > 0) {
    }
    CHECK(pdxfer_engine_destroy(e) == PDX_STATUS_OK);
    rank_free(&r);
    return failures;
}

/* A decode rank: receiver (retried until the prefill is listed), metadata,
 * wait, then checks every owned row, the aux row and that no other row was written. */
static int run_decode(const Job *j, uint32_t rank, const char *url) {
    Rank r;
    rank_init(&r, j->d_dcp, rank, rank);
    if (j->shared) rank_share(&r);
    uint64_t n = j->total - j->prefix, vd = (uint64_t)PAGE * j->d_dcp;
    int64_t pages[POOL_PAGES];
    size_t np = make_pages(pages, n, vd, j->room, 3);
    PdxEngineConfig c = config(&r, PDXFER_ROLE_DECODE, j->cluster, url);
    PdxEngine *e = NULL;
    CHECK(create(&c, &e) == PDX_STATUS_OK);
    PdxStatus st = PDX_STATUS_NOT_READY;
    for (int i = 0; i < 3000 && st == PDX_STATUS_NOT_READY; i++) {
        st = pdxfer_engine_receiver(e, j->room, 0, 0);
        if (st == PDX_STATUS_NOT_READY) {
            CHECK(pdxfer_engine_clear(e, j->room) == PDX_STATUS_OK);
            sleep_ms(20);
        }
    }
    CHECK(st == PDX_STATUS_OK);
    CHECK(pdxfer_engine_send_metadata(e, j->room, pages, np, j->prefix, 2) == PDX_STATUS_OK);
    int32_t poll = -1;
    CHECK(pdxfer_engine_wait(e, j->room, 60000, &poll) == PDX_STATUS_OK);
    CHECK(poll == PDXFER_POLL_SUCCESS);
    if (poll != PDXFER_POLL_SUCCESS) {
        int32_t fs = 0;
        char text[512] = {0};
        size_t need = 0;
        pdxfer_engine_failure(e, j->room, &fs, text, sizeof text, &need);
        fprintf(stderr, "decode %u: room failed: %d %s\n", rank, fs, text);
    }
    uint64_t owned = 0, bad = 0, written = 0;
    for (uint64_t t = j->prefix; t < j->total; t++) {
        if (t % j->d_dcp != rank) continue;
        owned++;
        uint64_t row = row_of(t, j->d_dcp, pages, j->prefix);
        for (int l = 0; l < LAYERS; l++)
            for (int w = 0; w < WORDS; w++) bad += r.kv[l][row * WORDS + w] != word(j->room, l, t, w);
    }
    for (int l = 0; l < LAYERS; l++)
        for (uint64_t row = 0; row < (uint64_t)POOL_PAGES * PAGE; row++) {
            int nz = 0;
            for (int w = 0; w < WORDS; w++) nz |= r.kv[l][row * WORDS + w] != 0;
            written += (uint64_t)nz;
        }
    CHECK(bad == 0);
    CHECK(written == owned * LAYERS);
    for (int w = 0; w < AUX_ITEM / 4; w++) CHECK(r.aux[2 * (AUX_ITEM / 4) + w] == word(j->room, 15, 1, w));
    uint64_t bytes = 0;
    CHECK(pdxfer_engine_room_bytes(e, j->room, &bytes) == PDX_STATUS_OK);
    CHECK(bytes == owned * LAYERS * ROW);
    CHECK(pdxfer_engine_clear(e, j->room) == PDX_STATUS_OK);
    CHECK(pdxfer_engine_destroy(e) == PDX_STATUS_OK);
    rank_free(&r);
    if (failures == 0) printf("  decode rank %u/%u: %llu rows x %d layers verified\n", rank, j->d_dcp,
                              (unsigned long long)owned, LAYERS);
    return failures;
}

/* Forks p_dcp prefill and d_dcp decode processes, serves the bootstrap, waits for all. */
static void cluster(const Job *j) {
    int nproc = (int)(j->p_dcp + j->d_dcp);
    int url_pipe[8][2], done_pipe[2];
    pid_t pids[8];
    CHECK(pipe(done_pipe) == 0);
    for (int i = 0; i < nproc; i++) {
        CHECK(pipe(url_pipe[i]) == 0);
        fflush(NULL);
        pids[i] = fork();
        if (pids[i] == 0) {
            char url[256] = {0};
            for (int k = 0; k <= i; k++) close(url_pipe[k][1]); /* EOF of each pipe: only the parent writes */
            close(done_pipe[1]);
            ssize_t got = 0, k;
            while ((k = read(url_pipe[i][0], url + got, sizeof url - 1 - (size_t)got)) > 0) got += k;
            close(url_pipe[i][0]);
            int f = i < (int)j->p_dcp ? run_prefill(j, (uint32_t)i, url, done_pipe[0])
                                      : run_decode(j, (uint32_t)(i - (int)j->p_dcp), url);
            close(done_pipe[0]);
            exit(f == 0 ? 0 : 1);
        }
        close(url_pipe[i][0]);
    }
    close(done_pipe[0]);
    PdxBootstrapServerConfig sc;
    memset(&sc, 0, sizeof sc);
    sc.struct_size = sizeof sc;
    PdxBootstrapServer *srv = NULL;
    CHECK(pdxfer_bootstrap_server_start(&sc, &srv) == PDX_STATUS_OK);
    char url[256];
    size_t need = 0;
    CHECK(pdxfer_bootstrap_server_url(srv, url, sizeof url, &need) == PDX_STATUS_OK);
    for (int i = 0; i < nproc; i++) {
        CHECK(write(url_pipe[i][1], url, strlen(url)) == (ssize_t)strlen(url));
        close(url_pipe[i][1]);
    }
    for (int i = (int)j->p_dcp; i < nproc; i++) {
        int status = 0;
        CHECK(waitpid(pids[i], &status, 0) == pids[i]);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    close(done_pipe[1]);
    for (int i = 0; i < (int)j->p_dcp; i++) {
        int status = 0;
        CHECK(waitpid(pids[i], &status, 0) == pids[i]);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    CHECK(pdxfer_bootstrap_server_stop(srv) == PDX_STATUS_OK);
}

static int all_zero(const Rank *r) {
    for (int l = 0; l < LAYERS; l++)
        for (size_t i = 0; i < (size_t)POOL_PAGES * PAGE * WORDS; i++)
            if (r->kv[l][i]) return 0;
    for (size_t i = 0; i < AUX_ROWS * AUX_ITEM / 4; i++)
        if (r->aux[i]) return 0;
    return 1;
}

/* Bad inputs through every export, in one process; nothing is written. */
static void bad_inputs(void) {
    /* shared pools: refused calls allocate or free nothing */
    void *sp = (void *)0x1;
    CHECK(pdxfer_alloc_shared_pool(0, &sp) == PDX_STATUS_INVALID_ARGUMENT && sp == (void *)0x1);
    CHECK(pdxfer_alloc_shared_pool(4096, NULL) == PDX_STATUS_NULL_ARGUMENT);
    CHECK(pdxfer_alloc_shared_pool(3 * 4096, &sp) == PDX_STATUS_OK && ((uintptr_t)sp & 4095) == 0);
    CHECK(((unsigned char *)sp)[3 * 4096 - 1] == 0);
    ((unsigned char *)sp)[5] = 7; /* writable */
    CHECK(pdxfer_free_shared_pool((unsigned char *)sp + 8) == PDX_STATUS_INVALID_ARGUMENT);
    CHECK(((unsigned char *)sp)[5] == 7); /* still allocated */
    CHECK(pdxfer_free_shared_pool(NULL) == PDX_STATUS_NULL_ARGUMENT);
    CHECK(pdxfer_free_shared_pool(sp) == PDX_STATUS_OK);
    CHECK(pdxfer_free_shared_pool(sp) == PDX_STATUS_INVALID_ARGUMENT);
    PdxBootstrapServerConfig sc;
    memset(&sc, 0, sizeof sc);
    sc.struct_size = sizeof sc;
    PdxBootstrapServer *srv = NULL;
    CHECK(pdxfer_bootstrap_server_start(&sc, &srv) == PDX_STATUS_OK);
    char url[256];
    size_t need = 0;
    CHECK(pdxfer_bootstrap_server_url(srv, url, sizeof url, &need) == PDX_STATUS_OK);

    /* two prefill ranks with DCP 2; a decode rank with a matching and one with a crossed DCP rank */
    Rank p0, p1, d0, dx;
    rank_init(&p0, 2, 0, 0);
    rank_init(&p1, 2, 1, 1);
    rank_init(&d0, 2, 0, 0);
    rank_init(&dx, 2, 1, 0);
    PdxEngine *pe0 = NULL, *pe1 = NULL, *de0 = NULL, *dex = NULL;
    PdxEngineConfig c = config(&p0, PDXFER_ROLE_PREFILL, "c-bad", url);
    CHECK(pdxfer_engine_create(&c, &pe0) == PDX_STATUS_OK);
    c = config(&p1, PDXFER_ROLE_PREFILL, "c-bad", url);
    CHECK(pdxfer_engine_create(&c, &pe1) == PDX_STATUS_OK);
    /* dx has d0's rank key (tp rank 0): the one created last holds the
     * bootstrap entry, and a prefill dials only a decode instance whose
     * entry it can check, so the crossed rank (refused on its own side,
     * before any connection) is created first */
    c = config(&dx, PDXFER_ROLE_DECODE, "c-bad", url);
    CHECK(pdxfer_engine_create(&c, &dex) == PDX_STATUS_OK);
    c = config(&d0, PDXFER_ROLE_DECODE, "c-bad", url);
    CHECK(pdxfer_engine_create(&c, &de0) == PDX_STATUS_OK);

    /* config errors */
    PdxEngine *h = NULL;
    c = config(&p0, PDXFER_ROLE_PREFILL, "c-bad", url);
    c.struct_size = 16;
    CHECK(pdxfer_engine_create(&c, &h) == PDX_STATUS_ABI_MISMATCH);
    c = config(&p0, 0, "c-bad", url);
    CHECK(pdxfer_engine_create(&c, &h) == PDX_STATUS_INVALID_ARGUMENT);
    c = config(&p0, PDXFER_ROLE_PREFILL, "c-bad", url);
    c.num_pools = 1;
    CHECK(pdxfer_engine_create(&c, &h) == PDX_STATUS_GEOMETRY_MISMATCH);
    c = config(&p0, PDXFER_ROLE_PREFILL, "c-bad", url);
    c.transport = "carrier-pigeon";
    CHECK(pdxfer_engine_create(&c, &h) == PDX_STATUS_INVALID_ARGUMENT);
    CHECK(pdxfer_engine_create(NULL, &h) == PDX_STATUS_NULL_ARGUMENT);
    CHECK(h == NULL);
    /* ABI 1.7 pool descriptions: pages two apart inside the same memory
     * (16 pages span 31); a stride below the page, both arrays, or a
     * smaller struct_size are refused and create nothing */
    PdxKvPoolDesc descs[LAYERS];
    memset(descs, 0, sizeof descs);
    for (int l = 0; l < LAYERS; l++) {
        descs[l].struct_size = sizeof descs[l];
        descs[l].layer_id = (uint32_t)l;
        descs[l].base = d0.kv[l];
        descs[l].page_bytes = (uint64_t)PAGE * ROW;
        descs[l].page_stride = 2 * (uint64_t)PAGE * ROW;
        descs[l].num_pages = POOL_PAGES / 2;
    }
    c = config(&d0, PDXFER_ROLE_DECODE, "c-desc", url);
    c.pools = NULL;
    c.num_pools = 0;
    c.pool_descs = descs;
    c.num_pool_descs = LAYERS;
    c.transport = "tcp";
    CHECK(pdxfer_engine_create(&c, &h) == PDX_STATUS_OK && h != NULL);
    CHECK(pdxfer_engine_destroy(h) == PDX_STATUS_OK);
    h = NULL;
    descs[1].page_stride = (uint64_t)PAGE * ROW / 2;
    CHECK(pdxfer_engine_create(&c, &h) == PDX_STATUS_INVALID_LAYOUT && h == NULL);
    descs[1].page_stride = 2 * (uint64_t)PAGE * ROW;
    descs[0].struct_size = 40;
    CHECK(pdxfer_engine_create(&c, &h) == PDX_STATUS_ABI_MISMATCH && h == NULL);
    descs[0].struct_size = sizeof descs[0];
    c.pools = d0.pools;
    c.num_pools = LAYERS;
    CHECK(pdxfer_engine_create(&c, &h) == PDX_STATUS_INVALID_ARGUMENT && h == NULL);
    /* ABI 1.2 pool memory: unknown kinds refused; CUDA pools refused on a
     * decode over cma (process_vm_writev cannot reach device memory); a
     * decode over tcp and a prefill whose "CUDA" pools are host memory fail
     * typed: no driver here, or not device memory */
    c = config(&p0, PDXFER_ROLE_PREFILL, "c-bad", url);
    c.pool_memory = 7;
    CHECK(pdxfer_engine_create(&c, &h) == PDX_STATUS_INVALID_ARGUMENT);
    c = config(&d0, PDXFER_ROLE_DECODE, "c-bad", url);
    c.pool_memory = PDXFER_POOL_CUDA;
    c.transport = "cma";
    CHECK(pdxfer_engine_create(&c, &h) == PDX_STATUS_UNSUPPORTED);
    c = config(&d0, PDXFER_ROLE_DECODE, "c-bad", url);
    c.pool_memory = PDXFER_POOL_CUDA;
    c.transport = "tcp";
    PdxStatus dst = pdxfer_engine_create(&c, &h);
    CHECK(dst == PDX_STATUS_NO_CUDA_DRIVER || dst == PDX_STATUS_INVALID_ARGUMENT);
    CHECK(h == NULL);
    c = config(&p0, PDXFER_ROLE_PREFILL, "c-bad", url);
    c.pool_memory = PDXFER_POOL_CUDA;
    PdxStatus cst = pdxfer_engine_create(&c, &h);
    CHECK(cst == PDX_STATUS_NO_CUDA_DRIVER || cst == PDX_STATUS_INVALID_ARGUMENT);
    CHECK(h == NULL);

    /* unknown rooms and roles */
    int64_t pg[2] = {1, 2};
    CHECK(pdxfer_engine_send(pe0, 404, pg, 1, 4, 1, 0) == PDX_STATUS_UNKNOWN_ROOM);
    int32_t poll = -1, fst = 0;
    CHECK(pdxfer_engine_poll(pe0, 404, &poll) == PDX_STATUS_OK && poll == PDXFER_POLL_FAILED);
    CHECK(pdxfer_engine_failure(pe0, 404, &fst, NULL, 0, &need) == PDX_STATUS_OK);
    CHECK(fst == PDX_STATUS_UNKNOWN_ROOM && need > 1);
    char small[2];
    CHECK(pdxfer_engine_failure(pe0, 404, &fst, small, sizeof small, &need) == PDX_STATUS_BUFFER_TOO_SMALL);
    CHECK(pdxfer_engine_set_request_pages(pe0, 404, 4) == PDX_STATUS_UNKNOWN_ROOM);
    CHECK(pdxfer_engine_set_request_pages(de0, 404, 4) == PDX_STATUS_UNSUPPORTED);
    CHECK(pdxfer_engine_send_metadata(de0, 404, pg, 1, 0, 0) == PDX_STATUS_UNKNOWN_ROOM);
    CHECK(pdxfer_engine_clear(de0, 404) == PDX_STATUS_UNKNOWN_ROOM);
    CHECK(pdxfer_engine_abort(de0, 404, NULL) == PDX_STATUS_UNKNOWN_ROOM);
    CHECK(pdxfer_engine_sender(de0, 1) == PDX_STATUS_UNSUPPORTED);
    CHECK(pdxfer_engine_receiver(pe0, 1, 0, 0) == PDX_STATUS_UNSUPPORTED);
    CHECK(pdxfer_engine_poll(NULL, 1, &poll) == PDX_STATUS_NULL_ARGUMENT);
    CHECK(pdxfer_engine_poll(pe0, 1, NULL) == PDX_STATUS_NULL_ARGUMENT);
    CHECK(pdxfer_engine_wait(pe0, 1, 0, NULL) == PDX_STATUS_NULL_ARGUMENT);

    /* the crossed decode rank is refused at receiver(), typed; its room keeps the failure */
    CHECK(pdxfer_engine_receiver(dex, 7, 0, 0) == PDX_STATUS_DCP_RANK_MISMATCH);
    char text[1024];
    CHECK(pdxfer_engine_failure(dex, 7, &fst, text, sizeof text, &need) == PDX_STATUS_OK);
    CHECK(fst == PDX_STATUS_DCP_RANK_MISMATCH && strstr(text, "decode") != NULL);

    /* decode metadata errors: pages outside the pool, negative, NULL, misaligned prefix, aux row */
    CHECK(pdxfer_engine_receiver(de0, 7, 0, 0) == PDX_STATUS_OK);
    int64_t far[1] = {POOL_PAGES}, neg[1] = {-3};
    CHECK(pdxfer_engine_send_metadata(de0, 7, far, 1, 0, 0) == PDX_STATUS_OUT_OF_BOUNDS);
    CHECK(pdxfer_engine_send_metadata(de0, 7, neg, 1, 0, 0) == PDX_STATUS_INVALID_ARGUMENT);
    CHECK(pdxfer_engine_send_metadata(de0, 7, NULL, 1, 0, 0) == PDX_STATUS_NULL_ARGUMENT);
    CHECK(pdxfer_engine_send_metadata(de0, 7, pg, 1, PAGE, 0) == PDX_STATUS_PREFIX_MISALIGNED);
    CHECK(pdxfer_engine_send_metadata(de0, 7, pg, 1, 0, AUX_ROWS) == PDX_STATUS_OUT_OF_BOUNDS);
    CHECK(pdxfer_engine_poll(de0, 7, &poll) == PDX_STATUS_OK && poll == PDXFER_POLL_BOOTSTRAPPING);

    /* prefill send errors once the metadata is in */
    CHECK(pdxfer_engine_sender(pe0, 7) == PDX_STATUS_OK);
    CHECK(pdxfer_engine_send(pe0, 7, pg, 1, 4, 1, 0) == PDX_STATUS_INVALID_ARGUMENT); /* not WaitingForInput */
    CHECK(pdxfer_engine_send_metadata(de0, 7, pg, 2, 0, 0) == PDX_STATUS_OK);
    for (int i = 0; i < 1000; i++) {
        CHECK(pdxfer_engine_poll(pe0, 7, &poll) == PDX_STATUS_OK);
        if (poll != PDXFER_POLL_BOOTSTRAPPING) break;
        sleep_ms(5);
    }
    CHECK(poll == PDXFER_POLL_WAITING_FOR_INPUT);
    CHECK(pdxfer_engine_send(pe0, 7, far, 1, 4, 1, 0) == PDX_STATUS_OUT_OF_BOUNDS);
    CHECK(pdxfer_engine_send(pe0, 7, pg, 1, 2 * PAGE + 1, 1, 0) == PDX_STATUS_TOKENS_EXCEED_SOURCE);
    CHECK(pdxfer_engine_send(pe0, 7, pg, 2, 2, 0, 0) == PDX_STATUS_INVALID_ARGUMENT); /* partial, not last */
    CHECK(pdxfer_engine_send(pe0, 7, pg, 1, 4, 2, 0) == PDX_STATUS_INVALID_ARGUMENT);  /* last not 0/1 */
    CHECK(pdxfer_engine_send(pe0, 7, NULL, 1, 4, 1, 0) == PDX_STATUS_NULL_ARGUMENT);
    /* send_ex refusals queue nothing */
    PdxSendOptions so;
    memset(&so, 0, sizeof so);
    so.struct_size = 8;
    CHECK(pdxfer_engine_send_ex(pe0, 7, pg, 1, 4, 1, &so) == PDX_STATUS_ABI_MISMATCH);
    so.struct_size = sizeof so;
    so.first_layer = 1;
    so.num_layers = 1;
    CHECK(pdxfer_engine_send_ex(pe0, 7, pg, 1, 4, 1, &so) == PDX_STATUS_LAYER_ORDER); /* starts at 0 */
    so.first_layer = 0;
    so.num_layers = LAYERS + 1;
    CHECK(pdxfer_engine_send_ex(pe0, 7, pg, 1, 4, 1, &so) == PDX_STATUS_INVALID_ARGUMENT);
    so.num_layers = 0;
    so.first_layer = 1;
    CHECK(pdxfer_engine_send_ex(pe0, 7, pg, 1, 4, 1, &so) == PDX_STATUS_INVALID_ARGUMENT);
    so.first_layer = 0;
    so.cuda_event = 0x1234; /* host pools take a ready flag */
    CHECK(pdxfer_engine_send_ex(pe0, 7, pg, 1, 4, 1, &so) == PDX_STATUS_INVALID_ARGUMENT);
    so.cuda_event = 0;
    so.flags = 1;
    CHECK(pdxfer_engine_send_ex(pe0, 7, pg, 1, 4, 1, &so) == PDX_STATUS_INVALID_ARGUMENT);
    so.flags = 0;
    so.ready_flag = (const uint64_t *)((uintptr_t)pg + 1); /* misaligned */
    CHECK(pdxfer_engine_send_ex(pe0, 7, pg, 1, 4, 1, &so) == PDX_STATUS_INVALID_ARGUMENT);

    /* aborts: decode asks the prefill ranks and is fenced once they acknowledge */
    uint32_t fenced = 0;
    CHECK(pdxfer_engine_abort(de0, 7, &fenced) == PDX_STATUS_OK);
    for (int i = 0; i < 1000 && !fenced; i++) {
        CHECK(pdxfer_engine_is_fenced(de0, 7, &fenced) == PDX_STATUS_OK);
        sleep_ms(5);
    }
    CHECK(fenced == 1);
    CHECK(pdxfer_engine_failure(de0, 7, &fst, text, sizeof text, &need) == PDX_STATUS_OK);
    CHECK(fst == PDX_STATUS_ABORTED);
    CHECK(pdxfer_engine_wait(pe0, 7, 5000, &poll) == PDX_STATUS_OK && poll == PDXFER_POLL_FAILED);
    CHECK(all_zero(&d0) && all_zero(&dx));

    CHECK(pdxfer_engine_destroy(dex) == PDX_STATUS_OK);
    CHECK(pdxfer_engine_destroy(de0) == PDX_STATUS_OK);
    CHECK(pdxfer_engine_destroy(pe1) == PDX_STATUS_OK);
    CHECK(pdxfer_engine_destroy(pe0) == PDX_STATUS_OK);
    CHECK(pdxfer_engine_destroy(NULL) == PDX_STATUS_OK);
    CHECK(pdxfer_bootstrap_server_stop(srv) == PDX_STATUS_OK);
    rank_free(&p0);
    rank_free(&p1);
    rank_free(&d0);
    rank_free(&dx);
}

/* Runs a cluster in a forked sub-parent, so that this process starts no
 * thread before the next cluster forks (a child forked after threads ran
 * would inherit memory only those threads referenced: leaks to valgrind). */
static void cluster_in_child(const Job *j) {
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        cluster(j);
        exit(failures == 0 ? 0 : 1);
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

int main(void) {
    Job a = {"c-1to2", 1, 2, 3, 75, 16, 3, 0, 0};
    cluster_in_child(&a);
    Job b = {"c-2to2", 2, 2, 5, 61, 8, 2, 0, 0};
    cluster_in_child(&b);
    Job lw = {"c-1to2-layers", 1, 2, 11, 75, 16, 3, 1, 0};
    cluster_in_child(&lw);
    Job sh = {"c-1to2-shared", 1, 2, 15, 75, 16, 3, 0, 1};
    cluster_in_child(&sh);
    /* DCP 1->4 and 4->4 start nine processes: too slow under valgrind, so the
     * test command runs them in a second, uninstrumented pass. */
    if (getenv("PDXFER_C_TESTS_DCP4")) {
        Job c = {"c-1to4", 1, 4, 7, 120, 16, 3, 0, 0};
        cluster_in_child(&c);
        Job d = {"c-4to4", 4, 4, 9, 200, 32, 2, 0, 0};
        cluster_in_child(&d);
        Job dl = {"c-4to4-layers", 4, 4, 13, 200, 32, 2, 1, 0};
        cluster_in_child(&dl);
    }
    if (failures == 0) bad_inputs();
    return CHECK_SUMMARY();
}
