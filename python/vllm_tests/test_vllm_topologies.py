"""PdxferConnector across topologies, each a prefill and a decode instance
with one process per rank (vLLM's parallel state on gloo): heterogeneous TP
(MLA replicated: P TP2 -> D TP1, P TP1 -> D TP2), decode DCP 1 -> 2 at
interleave 1 and at the block size (vLLM's NIXL forces the latter), prefill
DCP 2 -> decode DCP 1, 2 and 4 (M > N, M = N, M < N) at both interleaves. Every decode rank checks every byte it owns; a
request shorter than one DCP round completes on every rank; prefix hits are
whole DCP rounds; every prefill rank, one that sends nothing too (P TP2 -> D
TP1's rank 1), reports finished_sending soon after the decode finished, far
below the transfer timeout; both schedulers end with nothing held."""

from __future__ import annotations

import pytest

from test_vllm_connector import TIMEOUT, Inst, _no_leaks, _opts, _pd_request, _port, _prompt

TOPOLOGIES = {
    "p_tp2_to_d_tp1": ({"tp": 2}, {"tp": 1}),
    "p_tp1_to_d_tp2": ({"tp": 1}, {"tp": 2}),
    "d_dcp2_interleave1": ({"tp": 1}, {"tp": 2, "dcp": 2, "interleave": 1}),
    "d_dcp2_interleave_block": ({"tp": 1}, {"tp": 2, "dcp": 2, "interleave": 16}),
    # prefill DCP M -> decode DCP N: each decode rank reads the prefill shares overlapping its positions
    "p_dcp2_to_d_dcp1_interleave1": ({"tp": 2, "dcp": 2, "interleave": 1}, {"tp": 1}),
    "p_dcp2_to_d_dcp2_interleave_block": ({"tp": 2, "dcp": 2, "interleave": 16},
                                          {"tp": 2, "dcp": 2, "interleave": 16}),
    "p_dcp2_to_d_dcp4_interleave1": ({"tp": 2, "dcp": 2, "interleave": 1}, {"tp": 4, "dcp": 4, "interleave": 1}),
    "p_dcp2_block_to_d_dcp4_interleave1": ({"tp": 2, "dcp": 2, "interleave": 16},
                                           {"tp": 4, "dcp": 4, "interleave": 1}),
}


@pytest.fixture(scope="module", params=sorted(TOPOLOGIES))
def pd(request):
    pre, dec = TOPOLOGIES[request.param]
    boot = _port()
    p = Inst("kv_producer", _opts("prefill-" + request.param, boot, **pre))
    d = Inst("kv_consumer", _opts("decode-" + request.param, boot, **dec))
    try:
        for i in (p, d):
            i.wait(lambda e: e[0] == "ready", 300)
        yield p, d, dec
    finally:
        d.stop()
        p.stop()


def test_every_rank_gets_every_byte_it_owns(pd):
    p, d, dec = pd
    replicas = dec.get("tp", 1) // dec.get("dcp", 1)
    round_ = 16 * dec.get("dcp", 1)
    for i, n in enumerate((5, 33, 100)):  # 5: shorter than one DCP round
        got = _pd_request(p, d, f"topo-{i}", _prompt(n, 40 + i))
        assert got["bad_rows"] == 0, got
        assert got["tokens"] == n * replicas, got  # each position on its owner, on every TP replica
        # a prefill rank no decode rank reads from frees its blocks now, not at its deadline
        assert got["freed_after_s"] < TIMEOUT / 2, got
    base = _prompt(2 * round_, 50)
    _pd_request(p, d, "topo-pa", base + _prompt(7, 51))
    got = _pd_request(p, d, "topo-pb", base + _prompt(20, 52))
    assert got["bad_rows"] == 0 and got["decode_prefix_len"] == 2 * round_, got
    _no_leaks(p, d)
