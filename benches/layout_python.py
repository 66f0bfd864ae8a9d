#!/usr/bin/env python3
"""Same-run comparison: SGLang's numpy DCP planner (restated from the reference,
section 4.2, with its run grouping) against pdxfer's Python API (numpy in and
out) and the library itself, for a 131,072-token request, page 64, DCP 16, all
16 decode ranks. Prints a table and, last, one JSON line.

    PDXFER_LIB=target/release/libpdxfer.so python3 benches/layout_python.py
"""

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import pdxfer  # noqa: E402

TOKENS, P, D = 131_072, 64, 16
SRC = (np.arange(TOKENS // P, dtype=np.int64) * 7919) % 100_003
DST = (np.arange(-(-TOKENS // (P * D)), dtype=np.int64) * 104_729) % 50_021


def sglang_plan(src, dst, p, d, r, off=0, prefix=0, n=None):
    """SGLang's per-rank plan (vectorised numpy, as SGLang computes it)."""
    n = len(src) * p if n is None else n
    chunk_start = prefix + off * p
    o = np.arange((r - chunk_start) % d, n, d, dtype=np.int64)
    src_rows = src[o // p] * p + o % p
    local = (off * p + o) // d
    dst_rows = dst[local // p] * p + local % p
    return src_rows, dst_rows


def sglang_group(src_rows, dst_rows):
    """SGLang's group_concurrent_contiguous: split where either side jumps, lists out."""
    if src_rows.size == 0:
        return [], []
    brk = np.where((np.diff(src_rows) != 1) | (np.diff(dst_rows) != 1))[0] + 1
    return ([g.tolist() for g in np.split(src_rows, brk)], [g.tolist() for g in np.split(dst_rows, brk)])


def best(fn, reps):
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return min(t) * 1e3, sorted(t)[len(t) // 2] * 1e3


def main():
    reps = int(os.environ.get("REPS", "20"))
    # correctness first: identical plans for every rank
    for r in range(D):
        a = sglang_plan(SRC, DST, P, D, r)
        b = pdxfer.dcp_token_plan(SRC, DST, page_size=P, dcp_size=D, dcp_rank=r, num_tokens=TOKENS)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]), f"rank {r} differs"

    def sg_plans():
        for r in range(D):
            sglang_plan(SRC, DST, P, D, r)

    def sg_plans_grouped():
        for r in range(D):
            sglang_group(*sglang_plan(SRC, DST, P, D, r))

    def px_plans():
        for r in range(D):
            pdxfer.dcp_token_plan(SRC, DST, page_size=P, dcp_size=D, dcp_rank=r, num_tokens=TOKENS)

    def px_plans_coalesced():
        for r in range(D):
            pdxfer.coalesce_runs(*pdxfer.dcp_token_plan(SRC, DST, page_size=P, dcp_size=D, dcp_rank=r,
                                                        num_tokens=TOKENS))

    def px_runs(packed):
        def go():
            for r in range(D):
                pdxfer.pair_runs(src_layout=(P, 1, 1), src_rank=0, src_pages=SRC, dst_layout=(P, D, 1),
                                 dst_rank=r, dst_pages=DST, num_tokens=TOKENS, packed=packed)
        return go

    rows = [
        ("sglang_numpy_plans", sg_plans, reps),
        ("sglang_numpy_plans_grouped", sg_plans_grouped, max(3, reps // 5)),
        ("pdxfer_py_plans", px_plans, reps),
        ("pdxfer_py_plans_coalesced", px_plans_coalesced, reps),
        ("pdxfer_py_runs_unpacked", px_runs(False), reps),
        ("pdxfer_py_runs_packed", px_runs(True), reps),
    ]
    out = {"tokens": TOKENS, "page_size": P, "dcp_size": D, "ranks": D}
    print(f"{'what (131072 tokens, P=64, DCP=16, all ranks)':<48} {'best ms':>9} {'median ms':>10}")
    for name, fn, n in rows:
        b, m = best(fn, n)
        out[name + "_ms"] = round(b, 4)
        print(f"{name:<48} {b:>9.3f} {m:>10.3f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
