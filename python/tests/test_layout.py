"""The layout API from Python: golden vectors, numpy/list parity, typed errors,
bad inputs and pinned struct sizes."""

import ctypes
import random

import numpy as np
import pytest

import pdxfer
from pdxfer import layout as L


def sglang_reference(src, dst, p, d, r, off=0, prefix=0, n=None):
    """SGLang's build_dcp_token_transfer_plan, restated from reference 4.2 in numpy."""
    n = len(src) * p if n is None else n
    if prefix % (p * d):
        raise ValueError("prefix_misaligned")
    if n > len(src) * p:
        raise ValueError("tokens_exceed_source")
    chunk_start = prefix + off * p
    o = np.arange((r - chunk_start) % d, n, d, dtype=np.int64)
    src_rows = np.asarray(src, dtype=np.int64)[o // p] * p + o % p
    local = (off * p + o) // d
    if len(local) and local[-1] // p >= len(dst):
        raise ValueError("insufficient_destination")
    dst_rows = np.asarray(dst, dtype=np.int64)[local // p] * p + local % p
    return src_rows, dst_rows


def test_reference_6a_vectors():
    assert pdxfer.dcp_token_plan([10, 11], [30], page_size=4, dcp_size=2, dcp_rank=0) == (
        [40, 42, 44, 46], [120, 121, 122, 123])
    assert pdxfer.dcp_token_plan([10, 11], [30], page_size=4, dcp_size=2, dcp_rank=1) == (
        [41, 43, 45, 47], [120, 121, 122, 123])
    assert pdxfer.dcp_token_plan([11], [30], page_size=4, dcp_size=2, dcp_rank=0, src_page_offset=1) == (
        [44, 46], [122, 123])
    s, d = pdxfer.dcp_token_plan([10, 11, 12, 13], [30, 47], page_size=4, dcp_size=2, dcp_rank=1)
    assert s == list(range(41, 56, 2)) and d == [120, 121, 122, 123, 188, 189, 190, 191]
    assert pdxfer.dcp_token_plan([7], [20], page_size=4, dcp_size=2, dcp_rank=1, decode_prefix_len=8) == (
        [29, 31], [80, 81])
    want = {0: ([36, 8], [28, 29]), 1: ([37], [28]), 2: ([38], [28]), 3: ([39], [28])}
    for r, w in want.items():
        assert pdxfer.dcp_token_plan([9, 2], [7], page_size=4, dcp_size=4, dcp_rank=r, num_tokens=5) == w


def test_reference_6b_vectors():
    union = []
    for r, s in enumerate([[10, 22], [11, 23], [4, 8], [5, 9]]):
        got = pdxfer.dcp_token_plan([5, 2, 11, 4], [7], page_size=2, dcp_size=4, dcp_rank=r, num_tokens=8)
        assert got == (s, [14, 15])
        union += got[0]
    assert sorted(union) == [4, 5, 8, 9, 10, 11, 22, 23]
    for r, s in enumerate([[18, 6], [19, 7]]):
        assert pdxfer.dcp_token_plan([9, 3], [4, 6], page_size=2, dcp_size=2, dcp_rank=r, src_page_offset=2,
                                     decode_prefix_len=4, num_tokens=4) == (s, [12, 13])


def test_worked_example_and_packing():
    s, d = pdxfer.dcp_token_plan([7, 3, 12, 5, 20], [40, 9], page_size=64, dcp_size=4, dcp_rank=1,
                                 num_tokens=300)
    assert len(s) == 75 and (s[0], d[0], s[74], d[74]) == (449, 2560, 1321, 586)
    assert len(pdxfer.coalesce_runs(s, d)) == 75
    assert pdxfer.coalesce_runs(list(range(75)), d) == [(0, 2560, 64), (64, 576, 11)]
    runs = pdxfer.pair_runs(src_layout=(64, 1, 1), src_rank=0, src_pages=[7, 3, 12, 5, 20],
                            dst_layout=(64, 4, 1), dst_rank=1, dst_pages=[40, 9], num_tokens=300, packed=True)
    assert runs == [(0, 2560, 64), (64, 576, 11)]


def test_numpy_in_numpy_out_matches_lists_and_reference():
    rng = random.Random(7)
    for _ in range(200):
        p, d = rng.choice([1, 4, 8, 64]), rng.choice([1, 2, 4, 16])
        ns = rng.randint(1, 2 * d)
        src = [rng.randrange(1000) for _ in range(ns)]
        n = rng.randint(0, ns * p)
        off = rng.randint(0, 2)
        prefix = rng.randint(0, 2) * p * d
        dst = [rng.randrange(1000) for _ in range((off * p + n) // (p * d) + 1)]
        for r in range(d):
            want = sglang_reference(src, dst, p, d, r, off, prefix, n)
            got_np = pdxfer.dcp_token_plan(np.array(src), np.array(dst), page_size=p, dcp_size=d, dcp_rank=r,
                                           src_page_offset=off, decode_prefix_len=prefix, num_tokens=n)
            assert isinstance(got_np[0], np.ndarray) and got_np[0].dtype == np.int64
            np.testing.assert_array_equal(got_np[0], want[0])
            np.testing.assert_array_equal(got_np[1], want[1])
            got_l = pdxfer.dcp_token_plan(src, dst, page_size=p, dcp_size=d, dcp_rank=r, src_page_offset=off,
                                          decode_prefix_len=prefix, num_tokens=n)
            assert got_l == (want[0].tolist(), want[1].tolist())
            runs = pdxfer.coalesce_runs(got_np[0], got_np[1])
            assert isinstance(runs, np.ndarray) and runs.shape[1] == 3
            assert int(runs[:, 2].sum()) == len(want[0])


@pytest.mark.parametrize("kw,kind,text", [
    (dict(decode_prefix_len=64), "prefix_misaligned", "(256 = page_size 64 x dcp_size 4), got 64"),
    (dict(num_tokens=65), "tokens_exceed_source", "tokens=65, capacity=64"),
])
def test_plan_errors_are_typed(kw, kind, text):
    with pytest.raises(pdxfer.PlanError) as e:
        pdxfer.dcp_token_plan([1], [2], page_size=64, dcp_size=4, dcp_rank=1, **kw)
    assert e.value.kind == kind and text in e.value.detail
    assert e.value.code == {"prefix_misaligned": -200, "tokens_exceed_source": -201}[kind]
    assert isinstance(e.value, pdxfer.LayoutError) and isinstance(e.value, ValueError)


def test_insufficient_destination():
    with pytest.raises(pdxfer.PlanError) as e:
        pdxfer.dcp_token_plan([1, 2, 3, 4], [9], page_size=4, dcp_size=2, dcp_rank=0)
    assert e.value.kind == "insufficient_destination" and e.value.code == -202
    assert "required=2, provided=1" in e.value.detail


def test_bad_inputs_give_clear_errors():
    with pytest.raises(pdxfer.ArgumentError, match="src_pages\\[1\\] = -3 is negative"):
        pdxfer.dcp_token_plan([1, -3], [2], page_size=4, dcp_size=2, dcp_rank=0)
    with pytest.raises(pdxfer.ArgumentError, match="integers"):
        pdxfer.dcp_token_plan(["a"], [2], page_size=4, dcp_size=2, dcp_rank=0)
    with pytest.raises(pdxfer.ArgumentError, match="one-dimensional"):
        pdxfer.dcp_token_plan(np.zeros((2, 2)), [2], page_size=4, dcp_size=2, dcp_rank=0)
    with pytest.raises(pdxfer.LayoutError) as e:
        pdxfer.dcp_token_plan([1], [2], page_size=0, dcp_size=2, dcp_rank=0)
    assert e.value.kind == "invalid_layout"
    with pytest.raises(pdxfer.LayoutError) as e:
        pdxfer.dcp_token_plan([1], [2], page_size=4, dcp_size=2, dcp_rank=2)
    assert e.value.kind == "invalid_topology"
    with pytest.raises(pdxfer.ArgumentError, match="differ in length"):
        pdxfer.coalesce_runs([1, 2], [1])
    with pytest.raises(pdxfer.ArgumentError):
        pdxfer.dcp_token_plan([1], [2], page_size=4, dcp_size=2, dcp_rank=0, num_tokens=-5)
    # the raw ABI refuses a NULL args pointer and a too-small struct_size
    n = ctypes.c_size_t()
    assert pdxfer.lib.pdxfer_dcp_token_plan(None, None, None, 0, ctypes.byref(n)) == -100
    args = L.DcpPlanArgs(8)
    assert pdxfer.lib.pdxfer_dcp_token_plan(ctypes.byref(args), None, None, 0, ctypes.byref(n)) == -103
    assert "struct_size=8" in pdxfer.lib.pdxfer_last_error().decode()


def test_general_planner_m_to_n():
    # prefill DCP 2 -> decode DCP 4: rank pairs (a, b) share tokens only when a == b mod 2
    total = 0
    for a in range(2):
        for b in range(4):
            if a != b % 2:
                s, d = pdxfer.pair_token_plan(src_layout=(4, 2, 1), src_rank=a, src_pages=[0, 1, 2, 3],
                                              dst_layout=(4, 4, 1), dst_rank=b, dst_pages=[5, 6], num_tokens=32)
                assert s == [] and d == []
                continue
            s, d = pdxfer.pair_token_plan(src_layout=(4, 2, 1), src_rank=a, src_pages=[0, 1, 2, 3],
                                          dst_layout=(4, 4, 1), dst_rank=b, dst_pages=[5, 6], num_tokens=32)
            # decode rank b holds positions b, b+4, ...: prefill rank a holds them at local (t // 2)
            assert s == [t // 2 for t in range(b, 32, 4)]
            assert d == [20 + k for k in range(8)]
            total += len(s)
    assert total == 32


def test_check_peer_and_rank_mapping():
    c = pdxfer.check_peer(pdxfer.Topology.mla(), pdxfer.Topology.mla(dcp_size=4, dcp_rank=2))
    assert (c.mode, c.num_decode_ranks_served, c.num_entry_pairs) == ("token_relayout", 4, 61)
    c = pdxfer.check_peer(pdxfer.Topology.mla(dcp_size=4, dcp_rank=2), pdxfer.Topology.mla(dcp_size=4, dcp_rank=2))
    assert c.mode == "pages"
    with pytest.raises(pdxfer.CompatError) as e:
        pdxfer.check_peer(pdxfer.Topology.mla(dcp_size=4, dcp_rank=0), pdxfer.Topology.mla(dcp_size=4, dcp_rank=1))
    assert e.value.kind == "dcp_rank_mismatch" and e.value.code == -203
    assert "got prefill=0, decode=1" in e.value.detail
    for kw, kind in [(dict(kv_dtype="fp8_e4m3"), "kv_dtype_mismatch"),
                     (dict(pool=L.POOL_MHA), "dcp_requires_mla")]:
        with pytest.raises(pdxfer.CompatError) as e:
            pdxfer.check_peer(pdxfer.Topology.mla(), pdxfer.Topology.mla(dcp_size=4, **kw))
        assert e.value.kind == kind
    with pytest.raises(pdxfer.CompatError) as e:
        pdxfer.check_peer(pdxfer.Topology.mla(attn_cp_size=2, cp_storage="layer_split"),
                          pdxfer.Topology.mla(dcp_size=4))
    assert e.value.kind == "prefill_cp_with_decode_dcp"
    with pytest.raises(pdxfer.CompatError) as e:
        pdxfer.check_peer(pdxfer.Topology.mla(), pdxfer.Topology.mla(row_bytes=576, dcp_size=4))
    assert e.value.kind == "geometry_mismatch"
    m = pdxfer.rank_mapping(pdxfer.Topology.mla(attn_tp_size=2, engine_rank=1),
                            pdxfer.Topology.mla(attn_tp_size=8))
    assert m.target_tp_ranks == [4, 5, 6, 7] and m.dummy_tp == [False, True, True, True]
    m = pdxfer.rank_mapping(pdxfer.Topology.mla(attn_tp_size=16, engine_rank=3, dcp_size=16, dcp_rank=3),
                            pdxfer.Topology.mla(pp_size=16))
    assert m.target_pp_ranks == list(range(16)) and m.required_prefill_response_num == 16
    assert m.required_dst_info_num == 16
    with pytest.raises(pdxfer.CompatError) as e:
        pdxfer.rank_mapping(pdxfer.Topology.mla(pp_size=2), pdxfer.Topology.mla(pp_size=4))
    assert e.value.kind == "pp_mismatch"
    # a DCP-sharded prefill: each decode rank reads the shares overlapping its positions
    for r in range(4):
        m = pdxfer.rank_mapping(pdxfer.Topology.mla(attn_tp_size=4, engine_rank=r, dcp_size=4, dcp_rank=r),
                                pdxfer.Topology.mla(attn_tp_size=2, dcp_size=2))
        assert (m.target_tp_ranks, m.dummy_tp, m.required_dst_info_num) == ([r % 2], [False], 2), (r, m)
    m = pdxfer.rank_mapping(pdxfer.Topology.mla(attn_tp_size=2, engine_rank=1, dcp_size=2, dcp_rank=1),
                            pdxfer.Topology.mla(attn_tp_size=2, dcp_size=2, dcp_interleave=64))
    assert (m.target_tp_ranks, m.dummy_tp, m.required_prefill_response_num) == ([0, 1], [False, False], 2)
    # shares 1 and 3 of a DCP 4 prefill for a DCP 2 decode rank: no range in
    # PdxRankMapping (refused there), a list from pdxfer_rank_targets
    dec = pdxfer.Topology.mla(attn_tp_size=2, engine_rank=1, dcp_size=2, dcp_rank=1)
    pre = pdxfer.Topology.mla(attn_tp_size=4, dcp_size=4)
    m = pdxfer.rank_mapping(dec, pre)
    assert (m.target_tp_ranks, m.dummy_tp, m.required_prefill_response_num) == ([1, 3], [False, False], 2), m
    d, keep_d = dec._c()
    p, keep_p = pre._c()
    r = L.CRankMapping(ctypes.sizeof(L.CRankMapping))
    assert L.lib.pdxfer_rank_mapping(ctypes.byref(d), ctypes.byref(p), 0, ctypes.byref(r)) == -210
    for d_dcp, p_dcp in ((1, 4), (2, 8), (4, 8)):  # every decode rank: the shares r, r + N, ...
        for rank in range(d_dcp):
            m = pdxfer.rank_mapping(pdxfer.Topology.mla(attn_tp_size=d_dcp, engine_rank=rank, dcp_size=d_dcp,
                                                        dcp_rank=rank),
                                    pdxfer.Topology.mla(attn_tp_size=p_dcp, dcp_size=p_dcp))
            assert m.target_tp_ranks == list(range(rank, p_dcp, d_dcp)), (d_dcp, p_dcp, rank, m)


def test_rank_targets_size_query_and_refusals_write_nothing():
    d, keep_d = pdxfer.Topology.mla(attn_tp_size=2, engine_rank=1, dcp_size=2, dcp_rank=1)._c()
    p, keep_p = pdxfer.Topology.mla(attn_tp_size=4, dcp_size=4)._c()
    call = L.lib.pdxfer_rank_targets
    t = L.CRankTargets(ctypes.sizeof(L.CRankTargets))
    assert call(ctypes.byref(d), ctypes.byref(p), 0, ctypes.byref(t)) == 0  # NULL arrays, capacity 0
    assert (t.num_tp_ranks, t.num_cp_ranks, t.num_pp_ranks) == (2, 1, 1)
    tp, cp, pp = ((ctypes.c_uint32 * 4)(*[7] * 4) for _ in range(3))
    small = L.CRankTargets(ctypes.sizeof(L.CRankTargets))
    small.tp_ranks, small.cp_ranks, small.pp_ranks, small.capacity = tp, cp, pp, 1
    assert call(ctypes.byref(d), ctypes.byref(p), 0, ctypes.byref(small)) == -104  # buffer_too_small
    assert b"2 entries are needed" in L.lib.pdxfer_last_error()
    assert (small.num_tp_ranks, list(tp)) == (0, [7] * 4), "a refused call writes nothing"
    small.capacity = 4
    small.cp_ranks = None
    assert call(ctypes.byref(d), ctypes.byref(p), 0, ctypes.byref(small)) == -100  # null_argument
    assert (small.num_tp_ranks, list(tp)) == (0, [7] * 4)
    small.cp_ranks = cp
    assert call(ctypes.byref(d), ctypes.byref(p), 0, ctypes.byref(small)) == 0
    assert (small.num_tp_ranks, list(tp), list(cp)[:1]) == (2, [1, 3, 7, 7], [0])


def test_prefill_cp_with_decode_dcp():
    dec = pdxfer.Topology.mla(attn_tp_size=4, engine_rank=2, dcp_size=4, dcp_rank=2)
    pre = pdxfer.Topology.mla(attn_cp_size=2, attn_cp_rank=1)
    c = pdxfer.check_peer(pre, dec)
    assert (c.mode, c.num_decode_ranks_served) == ("token_relayout", 4)
    assert pdxfer.rank_mapping(dec, pre).required_prefill_response_num == 1, "rank-0 mode: one response"
    pre.cp_mode = "all-cp"
    m = pdxfer.rank_mapping(dec, pre)
    assert (m.target_cp_ranks, m.required_prefill_response_num) == ([0, 1], 2)
    pre.cp_storage = "kv_sharded"
    with pytest.raises(pdxfer.CompatError) as e:
        pdxfer.check_peer(pre, dec)
    assert e.value.kind == "prefill_cp_with_decode_dcp"
    assert "without --enable-kv-cache-sharding" in str(e.value)
    pre.cp_mode = "every"
    with pytest.raises(pdxfer.ArgumentError):
        pdxfer.check_peer(pre, dec)


def test_pack_buffer_bytes():
    assert pdxfer.dcp_pack_buffer_bytes([64 * 16, 64 * 16], 64, 10, 4) == 384
    with pytest.raises(pdxfer.CompatError, match="page-aligned"):
        pdxfer.dcp_pack_buffer_bytes([100], 64, 10, 4)


def test_struct_sizes_pinned():
    assert ctypes.sizeof(L.DcpPlanArgs) == 88
    assert ctypes.sizeof(L.PairPlanArgs) == 144
    assert ctypes.sizeof(L.Run) == 24
    assert ctypes.sizeof(L.Layout) == 24
    assert ctypes.sizeof(L.CTopology) == 96
    assert ctypes.sizeof(L.CPeerCompat) == 24
    assert ctypes.sizeof(L.CRankMapping) == 48
    assert ctypes.sizeof(L.CRankTargets) == 80


def test_status_text_and_abi():
    assert pdxfer.abi_version()[0] == pdxfer.ABI_VERSION_MAJOR
    assert pdxfer.lib.pdxfer_status_kind(-203) == b"dcp_rank_mismatch"
    assert pdxfer.lib.pdxfer_status_kind(12345) == b"unknown_status"
    assert pdxfer.error_class(-201) is pdxfer.PlanError
    assert pdxfer.error_class(-700) is pdxfer.RdmaError
