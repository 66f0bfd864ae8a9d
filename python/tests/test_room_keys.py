"""Rooms named by request ids: ``room_for_key`` is the documented SHA-256
mapping (the same on every side), ``Engine.bind_room_key`` binds a key until
its room is cleared, and host pools may be given as objects with
``data_ptr()`` (a CPU tensor without the buffer protocol)."""

import hashlib

import numpy as np
import pytest

import pdxfer
from pdxfer.synthetic import SyntheticPools

PAGE, LAYERS, ROW = 8, 2, 64


def _want(key: bytes) -> int:
    d = hashlib.sha256(b"pdxfer.room_key.v1\0" + key).digest()
    return int.from_bytes(d[:8], "big") & ((1 << 63) - 1)


def test_room_for_key_is_the_documented_hash():
    for k in ("cmpl-1", "cmpl-2", "chatcmpl-9f1c-0", "x" * 4096):
        assert pdxfer.room_for_key(k) == _want(k.encode())
        assert pdxfer.room_for_key(k.encode()) == _want(k.encode())
    with pytest.raises(pdxfer.PdxError) as e:
        pdxfer.room_for_key("")
    assert e.value.kind == "invalid_argument"
    with pytest.raises(pdxfer.PdxError):
        pdxfer.room_for_key("x" * 4097)
    with pytest.raises(pdxfer.PdxError):
        pdxfer.room_for_key(7)


class _HostTensor:
    """A CPU tensor as torch shows it: data_ptr(), nbytes, is_contiguous(), device."""

    class _Dev:
        type = "cpu"

    def __init__(self, arr):
        self.arr = arr
        self.nbytes = arr.nbytes
        self.device = self._Dev()

    def data_ptr(self):
        return self.arr.ctypes.data

    def is_contiguous(self):
        return True


def test_bind_room_key_on_an_engine_and_data_ptr_pools():
    with pdxfer.bootstrap.BootstrapServer() as srv:
        dp = SyntheticPools(LAYERS, ROW, PAGE, 8)
        t = pdxfer.Topology.mla(LAYERS, ROW, page_size=PAGE)
        with pdxfer.Engine("decode", "py-keys", srv.url, t, [_HostTensor(a) for a in dp.kv]) as d:
            r = d.bind_room_key("req-a")
            assert r == pdxfer.room_for_key("req-a")
            assert d.bind_room_key(b"req-a") == r, "binding the same key again gives its room"
            assert d.bind_room_key("req-b") == pdxfer.room_for_key("req-b")
            with pytest.raises(pdxfer.PdxError) as e:
                d.clear(r)  # never opened: unknown, and its key is released all the same
            assert e.value.kind == "unknown_room"
            assert d.bind_room_key("req-a") == r


def test_a_device_tensor_is_not_a_host_pool():
    class Dev(_HostTensor):
        class _Dev:
            type = "cuda"

            def __str__(self):
                return "cuda:0"

    with pytest.raises(pdxfer.PdxError) as e:
        pdxfer.engine.buffer_address(Dev(np.zeros(8, np.uint8)))
    assert "pool_device" in str(e.value)
