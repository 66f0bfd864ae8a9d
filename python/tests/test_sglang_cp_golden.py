"""Prefill attention CP -> decode DCP plans against SGLang 0.5.23's own
planner functions (loaded from the installed package, no torch):
``_get_cp_rank_page_bounds`` / ``filter_kv_indices_for_cp_rank``
(``disaggregation/utils.py``) for each CP rank's share and
``build_dcp_token_transfer_plan`` (``disaggregation/common/utils.py``) for
its rows, with the chunk's ``num_kv_tokens`` recomputed for the share (the
correction pdxfer makes: SGLang's unmodified call walks past the narrowed
pages, which is checked too). The plan pdxfer computes is ``pdxfer plan
--src-cp-size C --cp-mode ...``'s, row for row.
"""

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import sglang_env  # noqa: E402

REPO = os.path.abspath(os.path.join(HERE, "..", ".."))


def pdxfer_cli():
    lib = os.environ.get("PDXFER_LIB")
    for d in ([os.path.dirname(lib)] if lib else []) + [os.path.join(REPO, "target", "debug")]:
        exe = os.path.join(d, "pdxfer")
        if os.access(exe, os.X_OK):
            return exe
    raise AssertionError("the pdxfer binary is not built: cargo build --bin pdxfer (next to PDXFER_LIB)")


@pytest.fixture(scope="module")
def sg():
    u = sglang_env.setup()
    return types.SimpleNamespace(bounds=u._get_cp_rank_page_bounds, filter=u.filter_kv_indices_for_cp_rank,
                                 plan=sglang_env.load_dcp_planner().build_dcp_token_transfer_plan)


# (P, C, D, L, prefix, prefill chunk ends, mode): reference/prefill-cp-to-dcp.md section 7
CASES = [
    (64, 2, 4, 1000, 0, [1000], "all-cp"),  # C < D
    (64, 4, 2, 1000, 0, [1000], "all-cp"),  # C > D
    (64, 4, 4, 777, 0, [777], "all-cp"),  # C = D, odd length
    (64, 2, 4, 1000, 0, [1000], "rank0"),  # SGLang's default
    (64, 2, 4, 2055, 0, [512, 1100, 1600, 2055], "all-cp"),  # chunked prefill
    (64, 4, 2, 1500, 256, [1500], "all-cp"),  # decode prefix hit
    (1, 2, 4, 37, 0, [37], "all-cp"),  # page size 1
    (64, 8, 2, 300, 0, [300], "all-cp"),  # 5 pages < 8 CP ranks
    (64, 3, 4, 1283, 0, [640, 1283], "all-cp"),  # C does not divide D
    (64, 2, 2, 1, 0, [1], "all-cp"),  # one token
    (64, 3, 4, 2055, 256, [768, 1408, 2055], "rank0"),  # rank-0 mode, chunked, prefix
    (16, 3, 4, 700, 64, [320, 576, 700], "all-cp"),  # chunk edges inside CP shares
]


def sglang_rows(sg, P, C, D, L, prefix, ends, mode, src, dst):
    """(cp rank, chunk, decode rank, src row, dst row) as SGLang's functions place them."""
    total_pages = len(src)
    out = set()
    overrun = 0
    for c in range(C) if mode == "all-cp" else [0]:
        mgr = types.SimpleNamespace(attn_cp_rank=c, attn_cp_size=C if mode == "all-cp" else 1)
        a = prefix
        for i, b in enumerate(ends):
            off = (a - prefix) // P
            np_ = -(-(b - a) // P)
            kv, sl = sg.filter(mgr, np.asarray(src[off:off + np_], dtype=np.int32), slice(off, off + np_),
                               total_pages=total_pages)
            lo, hi = sg.bounds(total_pages, c, C) if mode == "all-cp" else (0, total_pages)
            assert (sl.start, sl.stop) == ((max(lo, off), min(hi, off + np_)) if max(lo, off) < min(hi, off + np_)
                                           else (off, off)), "SGLang's filter is its page bounds"
            n = max(0, min(b, prefix + sl.stop * P) - (prefix + sl.start * P)) if len(kv) else 0
            for d in range(D):
                p = sg.plan(kv, np.asarray(dst, dtype=np.int32), physical_page_size=P, dcp_size=D, dcp_rank=d,
                            src_page_offset=sl.start, decode_prefix_len=prefix, num_kv_tokens=n)
                for s_, d_ in zip(p.target_src_token_indices.tolist(), p.target_dst_token_indices.tolist()):
                    out.add((c, i, d, s_, d_))
                if len(kv) and n < b - a:
                    # SGLang's own call keeps the chunk's count and indexes past the narrowed pages
                    with pytest.raises(IndexError):
                        sg.plan(kv, np.asarray(dst, dtype=np.int32), physical_page_size=P, dcp_size=D,
                                dcp_rank=d, src_page_offset=sl.start, decode_prefix_len=prefix,
                                num_kv_tokens=b - a)
                    overrun += 1
            a = b
    return out, overrun


def pdxfer_rows(P, C, D, L, prefix, ends, mode, src, dst):
    cmd = [pdxfer_cli(), "plan", "--json", "--tokens", str(L - prefix), "--prefix", str(prefix), "--page-size",
           str(P), "--dcp-size", str(D), "--src-cp-size", str(C), "--cp-mode", mode,
           "--chunk-ends", ",".join(map(str, ends)), "--src-pages", ",".join(map(str, src)),
           "--dst-pages", ",".join(map(str, dst)), "--layers", "1", "--show-rows", str(L)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    v = json.loads(r.stdout)
    out = set()
    for pair in v["pairs"]:
        rows = pair.get("rows", [])  # absent for a pair with no token
        assert len(rows) == pair["tokens"]
        for _, s_, d_ in rows:
            out.add((pair.get("cp_rank", 0), pair["chunk"], pair["decode_rank"], s_, d_))
    return out, v["total_tokens"]


@pytest.mark.parametrize("P,C,D,L,prefix,ends,mode", CASES)
def test_cp_plan_matches_sglangs_planner(sg, P, C, D, L, prefix, ends, mode):
    # the scheduler sends each non-final chunk up to its last whole page (prefill.py:1540-1546)
    ends = [e - e % P for e in ends[:-1]] + [L]
    n_pages = -(-(L - prefix) // P)
    src = [(i * 7 + 3) % (4 * n_pages + 1) for i in range(n_pages)]  # distinct, scattered
    dst = [(i * 5 + 2) % (4 * n_pages + 1) for i in range(-(-(L - prefix) // (P * D)))]
    want, overrun = sglang_rows(sg, P, C, D, L, prefix, ends, mode, src, dst)
    got, total = pdxfer_rows(P, C, D, L, prefix, ends, mode, src, dst)
    assert total == L - prefix == len(want), "every token once"
    assert got == want
    if (P, C, D, L) == (64, 2, 4, 1000) and mode == "all-cp":
        assert overrun == 2 * D, "each CP rank's half of the one chunk: SGLang's own call overruns"
    # the owner rule: token t goes from S[(t-prefix) div P] to decode rank t mod D at V[k div P]*P + k mod P
    rule = set()
    for t in range(prefix, L):
        k = t // D - prefix // D
        rule.add((t % D, src[(t - prefix) // P] * P + (t - prefix) % P, dst[k // P] * P + k % P))
    assert {(d, s_, d_) for _, _, d, s_, d_ in got} == rule


def test_a_misaligned_decode_prefix_is_refused_as_sglang_does(sg):
    with pytest.raises(ValueError, match="align to the virtual"):
        sg.plan(np.asarray([1], dtype=np.int32), np.asarray([2], dtype=np.int32), physical_page_size=64,
                dcp_size=4, dcp_rank=0, decode_prefix_len=64, num_kv_tokens=10)
    r = subprocess.run([pdxfer_cli(), "plan", "--tokens", "300", "--prefix", "64", "--src-cp-size", "2",
                        "--cp-mode", "all-cp"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "prefix_misaligned" in r.stderr, r.stderr
