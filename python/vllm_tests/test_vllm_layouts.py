"""Block-outermost KV caches under vLLM 0.33's own classes on the CPU: a
layer-compact prefill (vLLM's MLA default) to a decode whose caches are
vLLM's own ``BLNHC`` views (``create_kv_cache_views``: one allocation, each
block row every layer's page then a padding page), and a ``BLNHC`` prefill to
a layer-compact decode. Every byte of every loaded request is checked, the
padding pages are untouched, and both schedulers end with nothing held.

vLLM 0.33 on the CPU takes the layout from ``VLLM_KV_CACHE_LAYOUT`` (the CPU
MLA backend declares no layouts, so any is a candidate) and plans
block-outermost tensors for it (``kv_cache_planning``); these instances build
their views from the same ``KVCacheTensor`` placement with the same vLLM
function, as the model runner's ``allocate_kv_cache`` does."""

from __future__ import annotations

import pytest

import instance
from test_vllm_connector import Inst, _no_leaks, _opts, _pd_request, _port, _prompt


@pytest.fixture(scope="module")
def layouts():
    """Two PD pairs, each on its own bootstrap port: compact -> BLNHC, BLNHC -> compact."""
    b1, b2 = _port(), _port()
    p = Inst("kv_producer", _opts("prefill-compact", b1))
    d_bo = Inst("kv_consumer", _opts("decode-blnhc", b1, kv_layout="BLNHC"))
    p_bo = Inst("kv_producer", _opts("prefill-blnhc", b2, kv_layout="BLNHC"))
    d = Inst("kv_consumer", _opts("decode-compact", b2))
    insts = (p, d_bo, p_bo, d)
    try:
        for i in insts:
            i.wait(lambda e: e[0] == "ready", 600)
        yield (p, d_bo), (p_bo, d)
    finally:
        for i in reversed(insts):
            i.stop()


@pytest.mark.parametrize("pair", [0, 1], ids=["compact-to-blnhc", "blnhc-to-compact"])
def test_block_outermost_caches_every_byte_and_the_padding_untouched(layouts, pair):
    p, d = layouts[pair]
    for i, n in enumerate((5, 16, 100)):
        got = _pd_request(p, d, f"bo-{pair}-{i}", _prompt(n, 40 + i))
        assert got["bad_rows"] == 0, got
        assert got["tokens"] == n and got["bytes"] == n * 2 * instance.ROW * 2
        if pair == 0:
            assert got["pad_bytes_changed"] == 0, got
    # a chunked prefill: chunks of 40 tokens over 16-token blocks
    got = _pd_request(p, d, f"bo-{pair}-chunked", _prompt(150, 47))
    assert got["bad_rows"] == 0 and got["tokens"] == 150, got
    _no_leaks(p, d)
