"""The engine from Python: KVPoll values, pinned struct sizes, prefill and
decode ranks as real processes (DCP 1->4 and 4->4, chunked, with a decode
prefix, byte-exact), and bad inputs through every call giving typed errors
and writing nothing."""

import ctypes
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import pdxfer
from pdxfer import engine as E
from pdxfer.synthetic import SyntheticPools

HERE = os.path.dirname(os.path.abspath(__file__))
PAGE, LAYERS, ROW = 8, 2, 64


def test_kvpoll_values_are_sglangs():
    assert [int(p) for p in pdxfer.KVPoll] == [0, 1, 2, 3, 4]
    assert pdxfer.KVPoll.Failed == 0 and pdxfer.KVPoll.Success == 4
    assert pdxfer.KVPoll.WaitingForInput.name == "WaitingForInput"


def test_engine_flags_match_the_header():
    """The engine's flag constants are the header's PDXFER_ENGINE_* numbers."""
    from pathlib import Path

    header = Path(__file__).resolve().parents[2] / "include" / "pdxfer.h"
    defined = {}
    for line in header.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "#define" and parts[1].startswith("PDXFER_ENGINE_"):
            defined[parts[1][len("PDXFER_ENGINE_"):]] = int(parts[2])
    assert defined == {"NO_STAGING": E.NO_STAGING, "NO_ONE_COPY": E.NO_ONE_COPY, "NO_PREFAULT": E.NO_PREFAULT}


def test_struct_sizes_are_pinned():
    assert ctypes.sizeof(E.CEngineConfig) == 192
    assert ctypes.sizeof(E.CKvPoolDesc) == 48
    assert ctypes.sizeof(E.CKvPool) == 32
    assert ctypes.sizeof(E.CAuxBuffer) == 24


def test_device_pools_are_typed_errors_here():
    """KV pools in CUDA memory: a decode over cma is refused whatever the
    machine (process_vm_writev cannot reach device memory); a decode over tcp
    and a prefill whose "device" pools are host memory fail typed (no driver
    here, or not device memory)."""
    topo = pdxfer.Topology(page_size=PAGE, entries=[(i, ROW) for i in range(LAYERS)])
    bufs = [np.zeros(4 * PAGE * ROW, dtype=np.uint8) for _ in range(LAYERS)]
    addrs = [(int(b.ctypes.data), 4) for b in bufs]
    with pytest.raises(pdxfer.PdxError) as e:
        E.Engine("decode", "py-dev", "http://127.0.0.1:1", topo, addrs, pool_device=0, transport="cma")
    assert e.value.kind == "unsupported" and "process_vm_writev" in str(e.value)
    with pytest.raises(pdxfer.PdxError) as e:
        E.Engine("decode", "py-dev", "http://127.0.0.1:1", topo, addrs, pool_device=0, transport="tcp")
    assert e.value.kind in ("no_cuda_driver", "invalid_argument"), e.value
    with pytest.raises(pdxfer.PdxError) as e:
        E.Engine("prefill", "py-dev", "http://127.0.0.1:1", topo, addrs, pool_device=0)
    assert e.value.kind in ("no_cuda_driver", "invalid_argument"), e.value
    with pytest.raises(pdxfer.PdxError) as e:
        E.Engine("prefill", "py-dev", "http://127.0.0.1:1", topo, [bufs[0], bufs[1]], pool_device=0)
    assert e.value.kind == "invalid_argument" and "device address" in str(e.value)


def run_cluster(name, p_dcp, d_dcp, rooms, transport="auto", staging=1 << 20, prefill_lines=None, **spec):
    """Starts the prefill ranks, then the decode ranks, as processes; returns
    the decode ranks' per-room results (the prefill ranks' lines go to
    ``prefill_lines`` when given; ``spec`` adds engine_proc.py keys)."""
    with pdxfer.bootstrap.BootstrapServer() as srv:
        base = {"url": srv.url, "cluster": name, "page": PAGE, "layers": LAYERS, "row": ROW,
                "p_dcp": p_dcp, "d_dcp": d_dcp, "rooms": rooms, "transport": transport, "staging": staging,
                **spec}
        env = dict(os.environ)
        procs = []
        try:
            pre = [subprocess.Popen([sys.executable, os.path.join(HERE, "engine_proc.py"),
                                     json.dumps(dict(base, role="prefill", rank=r))],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=env) for r in range(p_dcp)]
            procs += pre
            # decode ranks start once the prefill instance is listed (as a router would wait)
            with pdxfer.bootstrap.BootstrapClient(srv.url) as c:
                deadline = time.monotonic() + 30
                while True:
                    try:
                        if c.summary(name, "prefill")["ready"]:
                            break
                    except pdxfer.BootstrapError:
                        pass
                    dead = [q.poll() for q in pre if q.poll() is not None]
                    assert not dead and time.monotonic() < deadline, (
                        f"prefill ranks not registered: {[q.communicate()[1] for q in pre if q.poll() is not None]}")
                    time.sleep(0.02)
            dec = [subprocess.Popen([sys.executable, os.path.join(HERE, "engine_proc.py"),
                                     json.dumps(dict(base, role="decode", rank=r))],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                   for r in range(d_dcp)]
            procs += dec
            results = []
            for r, d in enumerate(dec):
                out, err = d.communicate(timeout=90)
                if d.returncode != 0:
                    for q in pre:
                        q.kill()
                    perr = [q.communicate()[1] for q in pre]
                    raise AssertionError(f"decode {r} failed:\n{err}\nprefill stderr:\n{perr}")
                results.append([json.loads(l) for l in out.splitlines() if l.startswith("{")])
            for r, p in enumerate(pre):
                out, err = p.communicate(input="", timeout=60)
                assert p.returncode == 0, f"prefill {r} failed:\n{err}"
                for line in (json.loads(l) for l in out.splitlines() if l.startswith("{")):
                    assert line["poll"] == int(pdxfer.KVPoll.Success), (
                        f"prefill {r}: {json.dumps(line)}\nprefill stderr:\n{err}")
                    if prefill_lines is not None:
                        prefill_lines.append(line)
            return results
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


def expected_bytes(total, prefix, d_dcp, rank):
    owned = sum(1 for t in range(prefix, total) if t % d_dcp == rank)
    return owned * LAYERS * ROW + 32


def test_dcp_1_to_4_processes_chunked_with_prefix():
    rooms = [{"room": 11, "total": 203, "prefix": 32, "chunk_pages": 5},
             {"room": 12, "total": 96, "prefix": 0, "chunk_pages": 100}]
    res = run_cluster("py-1to4", 1, 4, rooms)
    for rank, per_room in enumerate(res):
        assert len(per_room) == 2
        for spec, got in zip(rooms, per_room):
            assert got["poll"] == int(pdxfer.KVPoll.Success), got
            assert got["bytes"] == expected_bytes(spec["total"], spec["prefix"], 4, rank)
            assert got["received"] == got["bytes"] - 32


def test_dcp_4_to_4_processes_chunked_with_prefix():
    rooms = [{"room": 21, "total": 300, "prefix": 64, "chunk_pages": 2}]
    res = run_cluster("py-4to4", 4, 4, rooms, transport="tcp", staging=0)
    for rank, per_room in enumerate(res):
        got = per_room[0]
        assert got["poll"] == int(pdxfer.KVPoll.Success), got
        assert got["bytes"] == expected_bytes(300, 64, 4, rank)


# ----- bad inputs, in one process -----


@pytest.fixture(scope="module")
def pair():
    """A prefill (DCP 1) and two decode ranks (DCP 2) over a bootstrap server."""
    srv = pdxfer.bootstrap.BootstrapServer()
    pp = SyntheticPools(LAYERS, ROW, PAGE, 16)
    t = pdxfer.Topology.mla(LAYERS, ROW, page_size=PAGE)
    pre = pdxfer.Engine("prefill", "py-bad", srv.url, t, pp.kv, aux=[(pp.aux, 32)], transport="cma")
    decs = []
    for r in range(2):
        dp = SyntheticPools(LAYERS, ROW, PAGE, 16)
        td = pdxfer.Topology.mla(LAYERS, ROW, page_size=PAGE, engine_rank=r, attn_tp_size=2, attn_tp_rank=r,
                                 dcp_size=2, dcp_rank=r)
        decs.append((pdxfer.Engine("decode", "py-bad", srv.url, td, dp.kv, aux=[(dp.aux, 32)]), dp))
    yield srv, pre, pp, decs
    for e, _ in decs:
        e.close()
    pre.close()
    srv.stop()


def test_bad_inputs_are_typed_and_write_nothing(pair):
    srv, pre, pp, decs = pair
    (d0, dp0), (d1, dp1) = decs
    with pytest.raises(pdxfer.EngineError) as e:
        pre.send(4040, [1], 8)
    assert e.value.kind == "unknown_room"
    assert pre.poll(4040) == pdxfer.KVPoll.Failed
    assert pre.failure(4040).kind == "unknown_room"
    rcv = d0.receiver(50)
    with pytest.raises(pdxfer.MemoryError_) as e:
        rcv.send_metadata([16])
    assert e.value.kind == "out_of_bounds"
    with pytest.raises(pdxfer.PlanError) as e:
        rcv.send_metadata([1], decode_prefix_len=8)
    assert e.value.kind == "prefix_misaligned" and "16" in e.value.detail
    with pytest.raises(pdxfer.ArgumentError):
        rcv.send_metadata([-2])
    with pytest.raises(pdxfer.MemoryError_):
        rcv.send_metadata([1], aux_index=99)
    with pytest.raises(pdxfer.EngineError) as e:
        d0.send_metadata(51, [1])
    assert e.value.kind == "unknown_room"
    with pytest.raises(pdxfer.PdxError) as e:
        d0.sender(52)
    assert e.value.kind == "unsupported"
    with pytest.raises(pdxfer.PdxError) as e:
        pre.receiver(52)
    assert e.value.kind == "unsupported"
    # prefill pages out of its pool, and a send before the metadata arrived
    snd = pre.sender(60)
    with pytest.raises(pdxfer.ArgumentError):
        snd.send([1], 8)
    rcv.abort()
    assert rcv.poll() == pdxfer.KVPoll.Failed
    assert rcv.failure_exception().kind == "aborted"
    d0.clear(50)
    r60 = [d.receiver(60) for d, _ in decs]
    for r in r60:
        r.send_metadata([2, 3])
    deadline = time.monotonic() + 10
    while snd.poll() == pdxfer.KVPoll.Bootstrapping and time.monotonic() < deadline:
        time.sleep(0.005)
    assert snd.poll() == pdxfer.KVPoll.WaitingForInput
    with pytest.raises(pdxfer.MemoryError_) as e:
        snd.send([3, 16], 16)
    assert e.value.kind == "out_of_bounds"
    with pytest.raises(pdxfer.PlanError) as e:
        snd.send([3], 9)
    assert e.value.kind == "tokens_exceed_source"
    snd.abort()
    for r in r60:
        r.abort()
    # a failure on the prefill's transfer worker (too few decode pages for the
    # chunk) is kept on the room, typed, on both sides; nothing is written
    r61 = [d.receiver(61) for d, _ in decs]
    for r in r61:
        r.send_metadata([4])  # one virtual page: 16 positions
    snd61 = pre.sender(61)
    while snd61.poll() == pdxfer.KVPoll.Bootstrapping and time.monotonic() < deadline + 10:
        time.sleep(0.005)
    snd61.send([5, 6, 7], 24)
    assert snd61.wait(10) == pdxfer.KVPoll.Failed
    err = snd61.failure_exception()
    assert isinstance(err, pdxfer.PlanError) and err.kind == "insufficient_destination", err
    assert "required=2" in err.detail, err.detail
    for r in r61:
        assert r.wait(10) == pdxfer.KVPoll.Failed
        assert r.failure_exception().kind == "insufficient_destination"
        r.clear()
    snd61.clear()
    assert dp0.is_zero() and dp1.is_zero(), "a refused call wrote into a decode pool"
    with pytest.raises(pdxfer.ArgumentError):
        pdxfer.Engine("router", "x", srv.url, pdxfer.Topology.mla(1, 64, page_size=8), [np.zeros(64, np.uint64)])
    with pytest.raises(pdxfer.LayoutError):
        pdxfer.Engine("prefill", "x", srv.url, pdxfer.Topology.mla(2, 64, page_size=8), [np.zeros(64, np.uint64)])
    with pytest.raises(pdxfer.ArgumentError):
        pdxfer.Engine("prefill", "x", srv.url, pdxfer.Topology.mla(1, 64, page_size=8),
                      [np.zeros(64, np.uint64)[::2]])


def test_decode_rank_pairing_with_the_wrong_prefill_rank_is_refused():
    """4->4 needs matching DCP ranks: a decode dcp_rank 1 on TP rank 0 would
    pair with prefill dcp_rank 0; receiver() refuses it, typed, writing nothing."""
    with pdxfer.bootstrap.BootstrapServer() as srv:
        engines = []
        try:
            for r in range(2):
                pp = SyntheticPools(LAYERS, ROW, PAGE, 8)
                t = pdxfer.Topology.mla(LAYERS, ROW, page_size=PAGE, engine_rank=r, attn_tp_size=2,
                                        attn_tp_rank=r, dcp_size=2, dcp_rank=r)
                engines.append(pdxfer.Engine("prefill", "py-pair", srv.url, t, pp.kv, aux=[(pp.aux, 32)]))
            dp = SyntheticPools(LAYERS, ROW, PAGE, 8)
            bad = pdxfer.Topology.mla(LAYERS, ROW, page_size=PAGE, engine_rank=0, attn_tp_size=2, attn_tp_rank=0,
                                      dcp_size=2, dcp_rank=1)
            d = pdxfer.Engine("decode", "py-pair", srv.url, bad, dp.kv, aux=[(dp.aux, 32)])
            engines.append(d)
            with pytest.raises(pdxfer.CompatError) as e:
                d.receiver(1)
            assert e.value.kind == "dcp_rank_mismatch"
            assert d.poll(1) == pdxfer.KVPoll.Failed
            assert d.failure(1).kind == "dcp_rank_mismatch"
            assert dp.is_zero()
        finally:
            for e in engines:
                e.close()


def test_the_token_is_the_cluster_secret_peers_prove():
    """A decode with another token is refused by name at receiver(), writing
    nothing; without a token a non-loopback listener is refused."""
    secret = "py-cluster-secret-0123456789abcdef"
    with pdxfer.bootstrap.BootstrapServer() as srv:
        pp = SyntheticPools(LAYERS, ROW, PAGE, 8)
        t = pdxfer.Topology.mla(LAYERS, ROW, page_size=PAGE)
        pre = pdxfer.Engine("prefill", "py-auth", srv.url, t, pp.kv, aux=[(pp.aux, 32)], token=secret)
        dp = SyntheticPools(LAYERS, ROW, PAGE, 8)
        d = pdxfer.Engine("decode", "py-auth", srv.url, t, dp.kv, aux=[(dp.aux, 32)], token=secret[::-1])
        try:
            with pytest.raises(pdxfer.PdxError) as e:
                d.receiver(1)
            assert e.value.kind == "auth_failed", e.value
            assert "prefill" in e.value.detail and "authentication" in e.value.detail, e.value
            assert dp.is_zero()
        finally:
            d.close()
            pre.close()
        with pytest.raises(pdxfer.PdxError) as e:
            pdxfer.Engine("decode", "py-auth", srv.url, t, dp.kv, aux=[(dp.aux, 32)], host="0.0.0.0")
        assert e.value.kind == "auth_required" and "0.0.0.0" in e.value.detail


def test_pool_as_address_needs_num_pages():
    buf = np.zeros(PAGE * 8, dtype=np.uint64)
    with pytest.raises(pdxfer.ArgumentError):
        E.buffer_address(buf[::2])
    addr, n = E.buffer_address(buf)
    assert addr == buf.ctypes.data and n == buf.nbytes
    assert E.buffer_address(bytearray(16))[1] == 16
    with pytest.raises(pdxfer.ArgumentError):
        E.buffer_address(b"read-only")


def test_state_rows_follow_the_kv():
    """State buffers (ABI 1.1): one row per buffer and request, whole, to every decode rank."""
    srv = pdxfer.bootstrap.BootstrapServer()
    try:
        pp = SyntheticPools(LAYERS, ROW, PAGE, 16)
        t = pdxfer.Topology.mla(LAYERS, ROW, page_size=PAGE)
        p_state = (np.arange(4 * 40, dtype=np.uint64) * 37 % 251 + 1).astype(np.uint8)
        pre = pdxfer.Engine("prefill", "py-state", srv.url, t, pp.kv, state=[(p_state, 40)], transport="cma")
        decs = []
        for r in range(2):
            dp = SyntheticPools(LAYERS, ROW, PAGE, 16)
            td = pdxfer.Topology.mla(LAYERS, ROW, page_size=PAGE, engine_rank=r, attn_tp_size=2, attn_tp_rank=r,
                                     dcp_size=2, dcp_rank=r)
            st = np.zeros(4 * 40, dtype=np.uint8)
            decs.append((pdxfer.Engine("decode", "py-state", srv.url, td, dp.kv, state=[(st, 40)]), st))
        room = 77
        for e, _ in decs:
            rx = e.receiver(room)
            with pytest.raises(pdxfer.MemoryError_):
                rx.set_state_indices([4])
            rx.set_state_indices([2])
            rx.send_metadata([1, 3])
        tx = pre.sender(room)
        tx.set_state_indices([0])
        deadline = time.time() + 20
        while tx.poll() == pdxfer.KVPoll.Bootstrapping and time.time() < deadline:
            time.sleep(0.005)
        tx.send([0, 1, 2, 3], num_tokens=30)
        assert tx.wait(20) == pdxfer.KVPoll.Success, tx.failure_exception()
        for e, st in decs:
            deadline = time.time() + 20
            while e.poll(room) != pdxfer.KVPoll.Success and time.time() < deadline:
                time.sleep(0.005)
            assert e.poll(room) == pdxfer.KVPoll.Success
            np.testing.assert_array_equal(st[2 * 40:3 * 40], p_state[0:40])
            assert not st[:2 * 40].any() and not st[3 * 40:].any()
        for e, _ in decs:
            e.close()
        pre.close()
    finally:
        srv.stop()
