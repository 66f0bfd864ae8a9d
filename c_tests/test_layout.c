/* The layout ABI from C: golden vectors, size queries, typed errors, bad inputs,
 * pinned struct sizes. Built with -Wall -Werror and run under valgrind. */
#include "pdxfer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

_Static_assert(sizeof(PdxDcpPlanArgs) == 88, "PdxDcpPlanArgs size is ABI");
_Static_assert(sizeof(PdxPairPlanArgs) == 144, "PdxPairPlanArgs size is ABI");
_Static_assert(sizeof(PdxRun) == 24, "PdxRun size is ABI");
_Static_assert(sizeof(PdxLayout) == 24, "PdxLayout size is ABI");
_Static_assert(sizeof(PdxTopology) == 96, "PdxTopology size is ABI");
_Static_assert(sizeof(PdxPeerCompat) == 24, "PdxPeerCompat size is ABI");
_Static_assert(sizeof(PdxRankMapping) == 48, "PdxRankMapping size is ABI");
_Static_assert(sizeof(PdxRankTargets) == 80, "PdxRankTargets size is ABI");

static PdxDcpPlanArgs plan_args(const int64_t *src, size_t ns, const int64_t *dst, size_t nd,
                                uint64_t p, uint64_t d, uint64_t r, int64_t n) {
    PdxDcpPlanArgs a;
    memset(&a, 0, sizeof a);
    a.struct_size = sizeof a;
    a.src_pages = src;
    a.num_src_pages = ns;
    a.dst_pages = dst;
    a.num_dst_pages = nd;
    a.page_size = p;
    a.dcp_size = d;
    a.dcp_rank = r;
    a.num_tokens = n;
    return a;
}

static void test_worked_example(void) {
    const int64_t src[] = {7, 3, 12, 5, 20};
    const int64_t dst[] = {40, 9};
    PdxDcpPlanArgs a = plan_args(src, 5, dst, 2, 64, 4, 1, 300);
    size_t n = 0;
    CHECK(pdxfer_dcp_token_plan(&a, NULL, NULL, 0, &n) == PDX_STATUS_OK);
    CHECK(n == 75);
    int64_t *s = malloc(n * sizeof *s), *d = malloc(n * sizeof *d);
    CHECK(pdxfer_dcp_token_plan(&a, s, d, 10, &n) == PDX_STATUS_BUFFER_TOO_SMALL);
    CHECK(n == 75);
    CHECK(pdxfer_dcp_token_plan(&a, s, d, n, &n) == PDX_STATUS_OK);
    CHECK(s[0] == 449 && d[0] == 2560);
    CHECK(s[16] == 193 && d[16] == 2576);
    CHECK(s[64] == 1281 && d[64] == 576);
    CHECK(s[74] == 1321 && d[74] == 586);

    /* unpacked rows coalesce into 75 runs; packed indices into 2 */
    size_t nr = 0;
    CHECK(pdxfer_coalesce_runs(s, d, n, NULL, 0, &nr) == PDX_STATUS_OK);
    CHECK(nr == 75);
    for (size_t i = 0; i < n; i++) s[i] = (int64_t)i;
    PdxRun runs[4];
    CHECK(pdxfer_coalesce_runs(s, d, n, runs, 4, &nr) == PDX_STATUS_OK);
    CHECK(nr == 2);
    CHECK(runs[0].src == 0 && runs[0].dst == 2560 && runs[0].len == 64);
    CHECK(runs[1].src == 64 && runs[1].dst == 576 && runs[1].len == 11);
    free(s);
    free(d);

    PdxPairPlanArgs pa;
    memset(&pa, 0, sizeof pa);
    pa.struct_size = sizeof pa;
    pa.src_layout = (PdxLayout){64, 1, 1};
    pa.src_pages = src;
    pa.num_src_pages = 5;
    pa.dst_layout = (PdxLayout){64, 4, 1};
    pa.dst_rank = 1;
    pa.dst_pages = dst;
    pa.num_dst_pages = 2;
    pa.num_tokens = 300;
    pa.flags = PDXFER_PLAN_PACKED;
    PdxRun pr[2];
    CHECK(pdxfer_pair_runs(&pa, pr, 2, &nr) == PDX_STATUS_OK);
    CHECK(nr == 2 && pr[0].len == 64 && pr[1].dst == 576);
    pa.flags = 0x80;
    CHECK(pdxfer_pair_runs(&pa, pr, 2, &nr) == PDX_STATUS_INVALID_ARGUMENT);
}

static void test_reference_vectors(void) {
    /* reference 6A: P=4, D=4, src [9,2], dst [7], n=5 */
    const int64_t src[] = {9, 2};
    const int64_t dst[] = {7};
    int64_t s[4], d[4];
    size_t n = 0;
    PdxDcpPlanArgs a = plan_args(src, 2, dst, 1, 4, 4, 0, 5);
    CHECK(pdxfer_dcp_token_plan(&a, s, d, 4, &n) == PDX_STATUS_OK);
    CHECK(n == 2 && s[0] == 36 && s[1] == 8 && d[0] == 28 && d[1] == 29);
    a.dcp_rank = 3;
    CHECK(pdxfer_dcp_token_plan(&a, s, d, 4, &n) == PDX_STATUS_OK);
    CHECK(n == 1 && s[0] == 39 && d[0] == 28);
}

static void test_plan_errors(void) {
    const int64_t one[] = {1};
    const int64_t four[] = {1, 2, 3, 4};
    const int64_t dst[] = {9};
    size_t n = 0;
    PdxDcpPlanArgs a = plan_args(one, 1, dst, 1, 64, 4, 1, -1);
    a.decode_prefix_len = 64;
    CHECK(pdxfer_dcp_token_plan(&a, NULL, NULL, 0, &n) == PDX_STATUS_PREFIX_MISALIGNED);
    CHECK(strstr(pdxfer_last_error(), "virtual DCP page size (256") != NULL);
    CHECK(strcmp(pdxfer_status_kind(PDX_STATUS_PREFIX_MISALIGNED), "prefix_misaligned") == 0);
    a = plan_args(one, 1, dst, 1, 64, 4, 1, 65);
    CHECK(pdxfer_dcp_token_plan(&a, NULL, NULL, 0, &n) == PDX_STATUS_TOKENS_EXCEED_SOURCE);
    a = plan_args(four, 4, dst, 1, 4, 2, 0, -1);
    CHECK(pdxfer_dcp_token_plan(&a, NULL, NULL, 0, &n) == PDX_STATUS_INSUFFICIENT_DESTINATION);
    CHECK(strstr(pdxfer_last_error(), "required=2, provided=1") != NULL);
}

static void test_bad_inputs(void) {
    const int64_t neg[] = {1, -1};
    const int64_t dst[] = {9};
    size_t n = 0;
    int64_t s[4], d[4];
    CHECK(pdxfer_dcp_token_plan(NULL, NULL, NULL, 0, &n) == PDX_STATUS_NULL_ARGUMENT);
    PdxDcpPlanArgs a = plan_args(neg, 2, dst, 1, 4, 2, 0, -1);
    CHECK(pdxfer_dcp_token_plan(&a, NULL, NULL, 0, &n) == PDX_STATUS_INVALID_ARGUMENT);
    CHECK(strstr(pdxfer_last_error(), "src_pages[1] = -1 is negative") != NULL);
    a = plan_args(NULL, 3, dst, 1, 4, 2, 0, -1);
    CHECK(pdxfer_dcp_token_plan(&a, NULL, NULL, 0, &n) == PDX_STATUS_NULL_ARGUMENT);
    a = plan_args(dst, 1, dst, 1, 4, 2, 0, -1);
    CHECK(pdxfer_dcp_token_plan(&a, NULL, NULL, 0, NULL) == PDX_STATUS_NULL_ARGUMENT);
    CHECK(pdxfer_dcp_token_plan(&a, s, NULL, 4, &n) == PDX_STATUS_NULL_ARGUMENT);
    a.struct_size = 16;
    CHECK(pdxfer_dcp_token_plan(&a, s, d, 4, &n) == PDX_STATUS_ABI_MISMATCH);
    a = plan_args(dst, 1, dst, 1, 0, 2, 0, -1);
    CHECK(pdxfer_dcp_token_plan(&a, s, d, 4, &n) == PDX_STATUS_INVALID_LAYOUT);
    a = plan_args(dst, 1, dst, 1, 4, 2, 2, -1);
    CHECK(pdxfer_dcp_token_plan(&a, s, d, 4, &n) == PDX_STATUS_INVALID_TOPOLOGY);
    a = plan_args(dst, 1, dst, 1, 4, 2, 0, -7);
    CHECK(pdxfer_dcp_token_plan(&a, s, d, 4, &n) == PDX_STATUS_INVALID_ARGUMENT);
    /* misaligned pointers are refused, not dereferenced */
    CHECK(pdxfer_coalesce_runs((const int64_t *)((const char *)dst + 1), dst, 1, NULL, 0, &n) ==
          PDX_STATUS_INVALID_ARGUMENT);
    uint64_t bytes = 0;
    const uint64_t lens[] = {100};
    CHECK(pdxfer_dcp_pack_buffer_bytes(lens, 1, 64, 10, 4, &bytes) == PDX_STATUS_GEOMETRY_MISMATCH);
    const uint64_t good[] = {64 * 16, 64 * 16};
    CHECK(pdxfer_dcp_pack_buffer_bytes(good, 2, 64, 10, 4, &bytes) == PDX_STATUS_OK && bytes == 384);
    CHECK(strcmp(pdxfer_status_kind(424242), "unknown_status") == 0);
}

static PdxTopology mla(uint32_t dcp, uint32_t rank, const uint32_t *ids, const uint64_t *rows, uint64_t n) {
    PdxTopology t;
    memset(&t, 0, sizeof t);
    t.struct_size = sizeof t;
    t.attn_tp_size = 1;
    t.attn_cp_size = 1;
    t.pp_size = 1;
    t.dcp_size = dcp;
    t.dcp_rank = rank;
    t.dcp_interleave = 1;
    t.page_size = 64;
    t.kv_dtype = 1;
    t.pool_kind = 0;
    t.num_entries = n;
    t.entry_layer_ids = ids;
    t.entry_row_bytes = rows;
    return t;
}

static void test_peer_and_mapping(void) {
    uint32_t ids[61];
    uint64_t rows[61];
    for (uint32_t i = 0; i < 61; i++) {
        ids[i] = i;
        rows[i] = 1152;
    }
    PdxTopology p = mla(1, 0, ids, rows, 61), d = mla(4, 2, ids, rows, 61);
    PdxPeerCompat c;
    memset(&c, 0, sizeof c);
    c.struct_size = sizeof c;
    CHECK(pdxfer_check_peer(&p, &d, &c) == PDX_STATUS_OK);
    CHECK(c.mode == 1 && c.num_decode_ranks_served == 4 && c.num_entry_pairs == 61);
    p = mla(4, 0, ids, rows, 61);
    d = mla(4, 1, ids, rows, 61);
    CHECK(pdxfer_check_peer(&p, &d, &c) == PDX_STATUS_DCP_RANK_MISMATCH);
    CHECK(strstr(pdxfer_last_error(), "PD peers must connect matching DCP ranks, got prefill=0, decode=1") != NULL);
    d = mla(4, 0, ids, rows, 61);
    d.kv_dtype = 4;
    CHECK(pdxfer_check_peer(&p, &d, &c) == PDX_STATUS_KV_DTYPE_MISMATCH);
    d.kv_dtype = 99;
    CHECK(pdxfer_check_peer(&p, &d, &c) == PDX_STATUS_INVALID_ARGUMENT);
    d = mla(4, 0, NULL, rows, 61);
    CHECK(pdxfer_check_peer(&p, &d, &c) == PDX_STATUS_NULL_ARGUMENT);
    CHECK(pdxfer_check_peer(&p, &p, NULL) == PDX_STATUS_NULL_ARGUMENT);

    /* an old caller's smaller output struct is written only up to its size */
    PdxRankMapping m;
    memset(&m, 0xAB, sizeof m);
    m.struct_size = sizeof m;
    PdxTopology dec = mla(16, 3, ids, rows, 61), pre = mla(1, 0, ids, rows, 61);
    dec.attn_tp_size = 16;
    dec.engine_rank = 3;
    pre.pp_size = 16;
    CHECK(pdxfer_rank_mapping(&dec, &pre, 0, &m) == PDX_STATUS_OK);
    CHECK(m.tp_rank_begin == 0 && m.tp_rank_end == 1);
    CHECK(m.pp_rank_begin == 0 && m.pp_rank_end == 16);
    CHECK(m.required_dst_info_num == 16 && m.required_prefill_response_num == 16);
    CHECK(pdxfer_rank_mapping(&dec, &pre, 0x10, &m) == PDX_STATUS_INVALID_ARGUMENT);
}

static void test_prefill_cp(void) {
    uint32_t ids[4] = {0, 1, 2, 3};
    uint64_t rows[4] = {1152, 1152, 1152, 1152};
    PdxPeerCompat c;
    memset(&c, 0, sizeof c);
    c.struct_size = sizeof c;
    /* prefill attention CP 2 over replicated KV pairs with a DCP 4 decode */
    PdxTopology p = mla(1, 0, ids, rows, 4), d = mla(4, 3, ids, rows, 4);
    p.attn_cp_size = 2;
    p.attn_cp_rank = 1;
    CHECK(pdxfer_check_peer(&p, &d, &c) == PDX_STATUS_OK);
    CHECK(c.mode == 1 && c.num_decode_ranks_served == 4);
    /* a split storage is refused, naming the SGLang flag */
    p.cp_storage = PDXFER_CP_STORAGE_LAYER_SPLIT;
    CHECK(pdxfer_check_peer(&p, &d, &c) == PDX_STATUS_PREFILL_CP_WITH_DECODE_DCP);
    CHECK(strstr(pdxfer_last_error(), "--enable-dsa-cache-layer-split") != NULL);
    p.cp_storage = 7;
    CHECK(pdxfer_check_peer(&p, &d, &c) == PDX_STATUS_INVALID_ARGUMENT);
    /* an 88-byte (older) struct reads as rank-0 mode over replicated KV */
    p.cp_storage = PDXFER_CP_STORAGE_LAYER_SPLIT;
    p.cp_mode = PDXFER_CP_MODE_ALL_CP;
    p.struct_size = 88;
    CHECK(pdxfer_check_peer(&p, &d, &c) == PDX_STATUS_OK);
    PdxRankMapping m;
    memset(&m, 0, sizeof m);
    m.struct_size = sizeof m;
    d.attn_tp_size = 4;
    d.engine_rank = 3;
    CHECK(pdxfer_rank_mapping(&d, &p, 0, &m) == PDX_STATUS_OK);
    CHECK(m.cp_rank_begin == 0 && m.cp_rank_end == 1 && m.required_prefill_response_num == 1);
    /* the published all-CP-ranks mode: the decode contacts and waits for both CP ranks */
    p.struct_size = sizeof p;
    p.cp_storage = PDXFER_CP_STORAGE_REPLICATED;
    CHECK(pdxfer_rank_mapping(&d, &p, 0, &m) == PDX_STATUS_OK);
    CHECK(m.cp_rank_begin == 0 && m.cp_rank_end == 2 && m.required_prefill_response_num == 2);
}

/* pdxfer_rank_targets: the prefill ranks as lists, gaps included; a size
 * query; a refused call writes nothing */
static void test_rank_targets(void) {
    uint32_t ids[4] = {0, 1, 2, 3};
    uint64_t rows[4] = {1152, 1152, 1152, 1152};
    /* decode DCP 2 rank 1 reads shares 1 and 3 of a DCP 4 prefill: no range */
    PdxTopology d = mla(2, 1, ids, rows, 4), p = mla(4, 0, ids, rows, 4);
    d.attn_tp_size = 2;
    d.attn_tp_rank = 1;
    d.engine_rank = 1;
    p.attn_tp_size = 4;
    PdxRankMapping m;
    memset(&m, 0, sizeof m);
    m.struct_size = sizeof m;
    CHECK(pdxfer_rank_mapping(&d, &p, 0, &m) == PDX_STATUS_INVALID_TOPOLOGY);

    PdxRankTargets t;
    memset(&t, 0, sizeof t);
    t.struct_size = sizeof t;
    CHECK(pdxfer_rank_targets(&d, &p, 0, &t) == PDX_STATUS_OK); /* size query */
    CHECK(t.num_tp_ranks == 2 && t.num_cp_ranks == 1 && t.num_pp_ranks == 1);
    CHECK(t.required_dst_info_num == 1 && t.required_prefill_response_num == 2);

    uint32_t tp[4], dummy[4], cp[4], pp[4];
    memset(tp, 0xAB, sizeof tp);
    memset(dummy, 0xAB, sizeof dummy);
    memset(cp, 0xAB, sizeof cp);
    memset(pp, 0xAB, sizeof pp);
    /* too small: refused, nothing written */
    PdxRankTargets small;
    memset(&small, 0, sizeof small);
    small.struct_size = sizeof small;
    small.tp_ranks = tp;
    small.cp_ranks = cp;
    small.pp_ranks = pp;
    small.capacity = 1;
    CHECK(pdxfer_rank_targets(&d, &p, 0, &small) == PDX_STATUS_BUFFER_TOO_SMALL);
    CHECK(strstr(pdxfer_last_error(), "2 entries are needed") != NULL);
    CHECK(small.num_tp_ranks == 0 && small.required_dst_info_num == 0 && tp[0] == 0xABABABABu);
    /* a rank array missing: refused, nothing written */
    small.capacity = 4;
    small.pp_ranks = NULL;
    CHECK(pdxfer_rank_targets(&d, &p, 0, &small) == PDX_STATUS_NULL_ARGUMENT);
    CHECK(small.num_tp_ranks == 0 && tp[0] == 0xABABABABu && cp[0] == 0xABABABABu);
    /* unknown flags: refused */
    small.pp_ranks = pp;
    CHECK(pdxfer_rank_targets(&d, &p, 0x10, &small) == PDX_STATUS_INVALID_ARGUMENT);
    CHECK(small.num_tp_ranks == 0 && tp[0] == 0xABABABABu);

    t.tp_ranks = tp;
    t.tp_dummy = dummy;
    t.cp_ranks = cp;
    t.pp_ranks = pp;
    t.capacity = 4;
    CHECK(pdxfer_rank_targets(&d, &p, 0, &t) == PDX_STATUS_OK);
    CHECK(t.num_tp_ranks == 2 && tp[0] == 1 && tp[1] == 3 && tp[2] == 0xABABABABu);
    CHECK(dummy[0] == 0 && dummy[1] == 0 && dummy[2] == 0xABABABABu);
    CHECK(t.num_cp_ranks == 1 && cp[0] == 0 && t.num_pp_ranks == 1 && pp[0] == 0);
    CHECK(t.tp_ranks == tp && t.capacity == 4); /* the caller's fields are kept */

    /* a decode TP 2 rank 1 over a TP 8 MLA prefill: ranks 4..7, the last three MLA replicas */
    PdxTopology d2 = mla(1, 0, ids, rows, 4), p2 = mla(1, 0, ids, rows, 4);
    d2.attn_tp_size = 2;
    d2.attn_tp_rank = 1;
    d2.engine_rank = 1;
    p2.attn_tp_size = 8;
    t.tp_dummy = NULL; /* optional */
    CHECK(pdxfer_rank_targets(&d2, &p2, 0, &t) == PDX_STATUS_OK);
    CHECK(t.num_tp_ranks == 4 && tp[0] == 4 && tp[1] == 5 && tp[2] == 6 && tp[3] == 7);
    t.tp_dummy = dummy;
    CHECK(pdxfer_rank_targets(&d2, &p2, 0, &t) == PDX_STATUS_OK);
    CHECK(dummy[0] == 0 && dummy[1] == 1 && dummy[2] == 1 && dummy[3] == 1);
    CHECK(pdxfer_rank_targets(&d2, &p2, 0, NULL) == PDX_STATUS_NULL_ARGUMENT);
}

int main(void) {
    CHECK(pdxfer_abi_version() >> 16 == PDXFER_ABI_VERSION_MAJOR);
    test_worked_example();
    test_reference_vectors();
    test_plan_errors();
    test_bad_inputs();
    test_peer_and_mapping();
    test_rank_targets();
    test_prefill_cp();
    return CHECK_SUMMARY();
}
