"""Layer-wise sends and sends behind ready flags from Python (ABI 1.3):
rooms byte-exact on two decode ranks (DCP 2), the rows written after the
sends were queued, typed ``layer_order`` errors, and the event handles the
``event=`` argument accepts."""

import ctypes
import time

import pytest

import pdxfer
from pdxfer import engine as E
from pdxfer.synthetic import SyntheticPools, scattered_pages

PAGE, LAYERS, ROW = 8, 4, 64


def test_send_options_size_is_pinned():
    assert ctypes.sizeof(E.CSendOptions) == 48
    assert pdxfer.abi_version() >= (1, 4)


def test_event_handles():
    class TorchEvent:
        cuda_event = 0x7F00

    class CupyEvent:
        ptr = 0x7F10

    assert E._event_handle(None) == 0
    assert E._event_handle(0x1234) == 0x1234
    assert E._event_handle(TorchEvent()) == 0x7F00
    assert E._event_handle(CupyEvent()) == 0x7F10
    with pytest.raises(TypeError):
        E._event_handle("event")
    with pytest.raises(TypeError):
        E._event_handle(True)


def test_event_with_no_cuda_handle_is_refused():
    # torch.cuda.Event creates its CUevent at the first record(): before that .cuda_event is 0
    class UnrecordedTorchEvent:
        cuda_event = 0

    class NullCupyEvent:
        ptr = 0

    for ev in (UnrecordedTorchEvent(), NullCupyEvent(), 0):
        with pytest.raises(pdxfer.ArgumentError) as err:
            E._event_handle(ev)
        assert "record the event before the send" in str(err.value), err.value
        assert err.value.kind == "invalid_argument"
    with pytest.raises(pdxfer.ArgumentError):
        E._event_handle(-5)


def test_layerwise_room_behind_ready_flags_is_byte_exact():
    srv = pdxfer.bootstrap.BootstrapServer()
    try:
        pp = SyntheticPools(LAYERS, ROW, PAGE, 32)
        t = pdxfer.Topology.mla(LAYERS, ROW, page_size=PAGE)
        pre = pdxfer.Engine("prefill", "py-lw", srv.url, t, pp.kv, aux=[(pp.aux, 32)], transport="tcp")
        decs = []
        for r in range(2):
            dp = SyntheticPools(LAYERS, ROW, PAGE, 32)
            td = pdxfer.Topology.mla(LAYERS, ROW, page_size=PAGE, engine_rank=r, attn_tp_size=2, attn_tp_rank=r,
                                     dcp_size=2, dcp_rank=r)
            decs.append((pdxfer.Engine("decode", "py-lw", srv.url, td, dp.kv, aux=[(dp.aux, 32)]), dp))
        room, total, prefix = 31, 150, 16
        n = total - prefix
        src = scattered_pages(-(-n // PAGE), 32, room)
        dst = scattered_pages(-(-n // (2 * PAGE)), 32, room, stride=3)
        for e, _ in decs:
            e.receiver(room).send_metadata(dst, prefix, aux_index=5)
        tx = pre.sender(room)
        deadline = time.time() + 20
        while tx.poll() == pdxfer.KVPoll.Bootstrapping and time.time() < deadline:
            time.sleep(0.005)
        chunks = [(src[:6], 6 * PAGE, False), (src[6:], n - 6 * PAGE, True)]
        flags = []
        for pages, tokens, last in chunks:
            for first, count in [(0, 1), (1, 3)]:
                f = ctypes.c_uint64(0)
                flags.append(f)
                tx.send_layers(pages, first, count, tokens, last=last, aux_index=3, ready_flag=f)
            with pytest.raises(pdxfer.PdxError) as err:
                tx.send_layers(pages, 1, 3, tokens, last=last, aux_index=3)
            assert err.value.kind == "layer_order", err.value
        # a never-recorded event is refused before the library sees it, and queues nothing
        # (the room below still completes with exactly its two chunks)
        class UnrecordedEvent:
            cuda_event = 0

        with pytest.raises(pdxfer.ArgumentError, match="record the event before the send"):
            tx.send(src[:6], 6 * PAGE, last=False, aux_index=3, event=UnrecordedEvent())
        assert room not in pre._room_keep or all(not isinstance(e, UnrecordedEvent) for e, _ in pre._room_keep[room])
        time.sleep(0.2)
        assert decs[0][0].poll(room) == pdxfer.KVPoll.WaitingForInput
        # the rows are written only now, after every send was queued
        pp.fill(room, 1, 0, src, prefix, total)
        pp.fill_aux(room, 3)
        for f in flags:
            f.value = 1
        assert tx.wait(20) == pdxfer.KVPoll.Success, tx.failure_exception()
        for r, (e, dp) in enumerate(decs):
            assert e.wait(room, 20) == pdxfer.KVPoll.Success, e.failure(room)
            want = sum(1 for p in range(prefix, total) if p % 2 == r) * LAYERS * ROW + 32
            assert dp.verify(room, 2, r, dst, prefix, total, aux_idx=5, src_aux_idx=3) == want
        tx.clear()
        assert room not in pre._room_keep
        for e, _ in decs:
            e.close()
        pre.close()
    finally:
        srv.stop()
