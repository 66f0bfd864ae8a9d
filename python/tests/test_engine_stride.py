"""KV pools with a page stride from Python: a layer-compact prefill to a
block-outermost decode (every layer in one allocation, a padding page in each
block row, as vLLM's BLNHC) and the reverse, byte-exact, with every byte
outside the pages sent left as it was; strides the engine cannot use are
typed errors."""

import time

import numpy as np
import pytest

import pdxfer

PAGE, LAYERS, ROW, BLOCKS = 4, 3, 64, 12
PAGE_BYTES = PAGE * ROW


def compact():
    """One array per layer, pages end to end, random bytes."""
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, BLOCKS * PAGE_BYTES, dtype=np.uint8) for _ in range(LAYERS)]


def block_outermost():
    """[blocks, LAYERS + 1 pages] of one allocation, 0xA5 everywhere."""
    return np.full((BLOCKS, LAYERS + 1, PAGE_BYTES), 0xA5, dtype=np.uint8)


def pools_of(block):
    stride = (LAYERS + 1) * PAGE_BYTES
    return [(int(block.ctypes.data) + l * PAGE_BYTES, BLOCKS, stride) for l in range(LAYERS)]


def transfer(name, src_pools, dst_pools, keep, src_pages, dst_pages, transport):
    srv = pdxfer.bootstrap.BootstrapServer()
    t = pdxfer.Topology.mla(LAYERS, ROW, page_size=PAGE)
    pre = dec = None
    try:
        pre = pdxfer.Engine("prefill", name, srv.url, t, src_pools, transport=transport)
        dec = pdxfer.Engine("decode", name, srv.url, t, dst_pools, transport=transport)
        room = 5
        rx = dec.receiver(room)
        rx.send_metadata(dst_pages)
        tx = pre.sender(room)
        deadline = time.time() + 20
        while tx.poll() == pdxfer.KVPoll.Bootstrapping and time.time() < deadline:
            time.sleep(0.005)
        tx.send(src_pages, num_tokens=len(src_pages) * PAGE)
        assert tx.wait(20) == pdxfer.KVPoll.Success, tx.failure_exception()
        deadline = time.time() + 20
        while dec.poll(room) != pdxfer.KVPoll.Success and time.time() < deadline:
            time.sleep(0.005)
        assert dec.poll(room) == pdxfer.KVPoll.Success
    finally:
        for e in (pre, dec):
            if e is not None:
                e.close()
        srv.stop()
    del keep


@pytest.mark.parametrize("transport", ["cma", "tcp"])
def test_compact_prefill_to_block_outermost_decode_and_back(transport):
    src, dst = [3, 7, 0, 9], [5, 1, 11, 2]
    # layer-compact -> block-outermost
    p = compact()
    block = block_outermost()
    before = block.copy()
    transfer(f"py-stride-bo-{transport}", p, pools_of(block), block, src, dst, transport)
    want = before.copy()
    for l in range(LAYERS):
        for s, d in zip(src, dst):
            want[d, l] = p[l][s * PAGE_BYTES:(s + 1) * PAGE_BYTES]
    np.testing.assert_array_equal(block, want)
    assert (block[:, LAYERS] == 0xA5).all(), "the padding page of every block row is untouched"
    # block-outermost -> layer-compact
    rng = np.random.default_rng(11)
    sblock = rng.integers(0, 256, (BLOCKS, LAYERS + 1, PAGE_BYTES), dtype=np.uint8)
    d = [np.zeros(BLOCKS * PAGE_BYTES, dtype=np.uint8) for _ in range(LAYERS)]
    transfer(f"py-stride-ob-{transport}", pools_of(sblock), d, sblock, dst, src, transport)
    for l in range(LAYERS):
        got = d[l].reshape(BLOCKS, PAGE_BYTES)
        for s, dd in zip(dst, src):
            np.testing.assert_array_equal(got[dd], sblock[s, l])
        untouched = [b for b in range(BLOCKS) if b not in src]
        assert not got[untouched].any()


def test_strides_the_engine_cannot_use_are_typed():
    t = pdxfer.Topology.mla(LAYERS, ROW, page_size=PAGE)
    block = block_outermost()
    base = int(block.ctypes.data)
    for stride, kind in [(PAGE_BYTES // 2, "invalid_layout"), (PAGE_BYTES * 2 + 8, "invalid_layout")]:
        with pytest.raises(pdxfer.PdxError) as e:
            pdxfer.Engine("decode", "py-stride-bad", "http://127.0.0.1:1", t,
                          [(base + l * PAGE_BYTES, BLOCKS, stride) for l in range(LAYERS)], transport="tcp")
        assert e.value.kind == kind, e.value
    # a buffer too small for its strided pages
    small = np.zeros(BLOCKS * PAGE_BYTES, dtype=np.uint8)
    with pytest.raises(pdxfer.PdxError, match="apart, exceed its buffer"):
        pdxfer.Engine("decode", "py-stride-bad", "http://127.0.0.1:1", t,
                      [(small, BLOCKS, 2 * PAGE_BYTES) for _ in range(LAYERS)], transport="tcp")
