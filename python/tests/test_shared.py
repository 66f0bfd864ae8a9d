"""Shared KV pools: the allocation helper (zeroed, page-aligned, writable
numpy and buffer-protocol views, freed once), and decode ranks (real
processes) whose KV pools are shared pool allocations: the prefill copies
every KV row straight into them (its one-copy metric counts every byte),
byte-exact; with ``one_copy=False`` it takes the staged path."""

import gc

import numpy as np
import pytest

import pdxfer
from test_engine import LAYERS, ROW, expected_bytes, run_cluster


def test_alloc_shared_pool_views_and_free():
    pool = pdxfer.alloc_shared_pool(3 * 4096 + 8)
    assert pool.addr % 4096 == 0 and pool.nbytes == 3 * 4096 + 8
    a = pool.array()
    assert a.dtype == np.uint8 and a.size == pool.nbytes and not a.any()
    w = pool.array(np.uint64, (pool.nbytes // 8,))
    w[1] = 0x0102030405060708
    assert a[8] == 8 and memoryview(pool.buffer)[15] == 1, "views share the memory"
    assert a.ctypes.data == pool.addr and a.flags["WRITEABLE"]
    pool.free()
    pool.free()  # a second free does nothing
    with pytest.raises(pdxfer.ArgumentError):
        pool.buffer
    for bad in (0, -1, True, 1.5):
        with pytest.raises(pdxfer.ArgumentError):
            pdxfer.alloc_shared_pool(bad)
    with pdxfer.alloc_shared_pool(4096) as p:
        assert "0x" in repr(p)
    assert "freed" in repr(p)


def test_a_view_keeps_the_allocation_alive():
    view = pdxfer.alloc_shared_pool(1 << 16).array(np.uint32)
    gc.collect()
    view[:] = 7  # the pool object is gone; its memory is not
    assert int(view.sum()) == 7 * view.size


def test_decode_pools_in_shared_memory_take_the_one_copy_path():
    rooms = [{"room": 31, "total": 203, "prefix": 32, "chunk_pages": 5},
             {"room": 32, "total": 96, "prefix": 0, "chunk_pages": 100}]
    kv = sum(r["total"] - r["prefix"] for r in rooms) * LAYERS * ROW
    for one_copy in (True, False):
        lines = []
        res = run_cluster(f"py-shared-{one_copy}", 1, 2, rooms, transport="cma", prefill_lines=lines,
                          shared=True, one_copy=one_copy)
        for rank, per_room in enumerate(res):
            for spec, got in zip(rooms, per_room):
                assert got["poll"] == int(pdxfer.KVPoll.Success), got
                assert got["bytes"] == expected_bytes(spec["total"], spec["prefix"], 2, rank)
        assert lines[-1]["one_copy_bytes"] == (kv if one_copy else 0), lines
