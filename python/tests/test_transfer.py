"""The data plane from Python: register, connect, submit, wait/poll, the
receiver's completion records, typed errors, a `pdxfer target` peer process,
and pinned struct sizes."""

import ctypes
import json
import os
import subprocess
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest

import pdxfer
from pdxfer import transfer as T


def test_struct_sizes_pinned():
    assert ctypes.sizeof(T._AgentOptions) == 24
    assert ctypes.sizeof(T._Completion) == 64
    assert ctypes.sizeof(T._Region) == 40
    assert ctypes.sizeof(T._PeerOptions) == 32
    assert ctypes.sizeof(T._WriteOp) == 40
    assert ctypes.sizeof(T._BatchOptions) == 40


def test_transport_constants_match_the_header():
    """TRANSPORTS carries the header's PDXFER_TRANSPORT_* numbers, one per name."""
    header = Path(__file__).resolve().parents[2] / "include" / "pdxfer.h"
    defined = {}
    for line in header.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "#define" and parts[1].startswith("PDXFER_TRANSPORT_"):
            defined[parts[1][len("PDXFER_TRANSPORT_"):].lower()] = int(parts[2])
    assert defined == T.TRANSPORTS
    assert T.TRANSPORTS["nccl"] == 5


SECRET = "0123456789abcdef-python-cluster"


def test_agents_authenticate_with_the_cluster_secret():
    rx = pdxfer.Agent(listen="127.0.0.1:0", secret=SECRET)
    dst = np.zeros(4096, dtype=np.uint8)
    d = rx.register(dst)
    src = np.full(4096, 7, dtype=np.uint8)
    good = pdxfer.Agent(secret=SECRET)
    s = good.register(src)
    with good.connect(rx.listen_addr, transport="tcp") as peer:
        peer.wait(peer.submit([(s.id, 0, d.id, 0, 4096)]))
    assert (dst == 7).all()
    dst[:] = 0
    # Another secret, or none, is refused by name and writes nothing.
    for other in [pdxfer.Agent(secret="0123456789abcdef-another-one"), pdxfer.Agent()]:
        other.register(src)
        with pytest.raises(pdxfer.PdxError) as e:
            other.connect(rx.listen_addr, transport="tcp")
        assert e.value.kind == "auth_failed", e.value
        other.close()
    assert not dst.any()
    first = rx.next_completion(timeout=1)
    assert first is not None and first.bytes == 4096  # the good batch's record
    assert rx.next_completion(timeout=0.2) is None, "a refused peer delivered a completion"
    good.close()
    rx.close()
    # A listener reachable from other hosts needs the secret.
    with pytest.raises(pdxfer.PdxError) as e:
        pdxfer.Agent(listen="0.0.0.0:0")
    assert e.value.kind == "auth_required" and "0.0.0.0" in e.value.detail
    pdxfer.Agent(listen="0.0.0.0:0", secret=SECRET).close()


@pytest.fixture
def pair():
    rx = pdxfer.Agent(listen="127.0.0.1:0")
    tx = pdxfer.Agent()
    dst = np.zeros(1 << 20, dtype=np.uint8)
    src = (np.arange(1 << 20, dtype=np.uint64) * 7 + 3).astype(np.uint8)
    d = rx.register(dst)
    s = tx.register(src)
    yield rx, tx, dst, src, d, s
    tx.close()
    rx.close()


@pytest.mark.parametrize("transport,streams", [("tcp", 1), ("tcp", 3), ("cma", 1), ("auto", 1)])
def test_roundtrip_and_receiver_completion(pair, transport, streams):
    rx, tx, dst, src, d, s = pair
    with tx.connect(rx.listen_addr, transport=transport, streams=streams) as peer:
        assert peer.transport == ("cma" if transport == "auto" else transport)
        assert peer.remote_regions() == [d]
        ops = [pdxfer.WriteOp(s.id, 0, d.id, 100, 4096), (s.id, 5000, d.id, 300_000, 600_000)]
        b = peer.submit(ops, room=42, epoch=3, checksum=True)
        c = peer.wait(b)
        assert (c.bytes, c.room, c.epoch) == (4096 + 600_000, 42, 3)
        assert c.checksum is not None
        got = rx.next_completion(timeout=5)
        assert got is not None and got.batch_id == c.batch_id and got.bytes == c.bytes
        assert got.checksum == c.checksum and got.peer_pid == os.getpid()
        assert np.array_equal(dst[100:4196], src[:4096])
        assert np.array_equal(dst[300_000:900_000], src[5000:605_000])
        assert not dst[4196:300_000].any()


def test_out_of_bounds_refused_nothing_written(pair):
    rx, tx, dst, src, d, s = pair
    with tx.connect(rx.listen_addr, transport="tcp") as peer:
        with pytest.raises(pdxfer.MemoryError_) as e:
            peer.submit([(s.id, 0, d.id, (1 << 20) - 10, 11)])
        assert e.value.kind == "out_of_bounds" and e.value.code == -301
        with pytest.raises(pdxfer.MemoryError_) as e:
            peer.submit([(s.id, 0, d.id + 5, 0, 1)])
        assert e.value.kind == "region_not_found"
        assert rx.next_completion(timeout=0.05) is None
        assert not dst.any()


def test_poll_local_and_errors(pair):
    rx, tx, dst, src, d, s = pair
    peer = tx.connect_local(rx)
    assert peer.transport == "local"
    b = peer.submit([(s.id, 10, d.id, 20, 30)])
    deadline = time.time() + 5
    c = None
    while c is None and time.time() < deadline:
        c = peer.poll(b)
    assert c is not None and c.bytes == 30
    assert np.array_equal(dst[20:50], src[10:40])
    with pytest.raises(pdxfer.ArgumentError):
        peer.poll(b)  # reported once, then forgotten
    peer.close()
    with pytest.raises(pdxfer.ArgumentError):
        tx.connect(rx.listen_addr, transport="carrier-pigeon")
    with pytest.raises(pdxfer.TransportError) as e:
        tx.connect("127.0.0.1:1", transport="tcp", timeout=2)
    assert e.value.kind == "peer_unreachable"
    with pytest.raises(pdxfer.MemoryError_) as e:
        tx.register((s.addr, 16))
    assert e.value.kind == "region_overlap"
    assert [r.id for r in tx.regions()] == [s.id]
    rx.unregister(d)
    with pytest.raises(pdxfer.MemoryError_):
        rx.unregister(d)


def _pdxfer_bin():
    """The CLI next to the library (cargo target folder), else the one the
    installed wheel put into the environment's scripts folder."""
    for p in (Path(pdxfer.library_path()).with_name("pdxfer"), Path(sysconfig.get_path("scripts")) / "pdxfer"):
        if p.is_file():
            return p
    return None


@pytest.mark.skipif(_pdxfer_bin() is None, reason="pdxfer binary neither next to libpdxfer.so nor installed")
def test_target_process_over_cma_and_tcp():
    size = 1 << 16
    proc = subprocess.Popen([str(_pdxfer_bin()), "target", "--size", str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        region = ready["regions"][0]["id"]
        tx = pdxfer.Agent()
        src = np.full(size, 0x5A, dtype=np.uint8)
        s = tx.register(src)
        for i, transport in enumerate(["cma", "tcp"]):
            with tx.connect(ready["addr"], transport=transport) as peer:
                peer.wait(peer.submit([(s.id, 0, region, i * 1000, 1000)], checksum=True))
                rec = json.loads(proc.stdout.readline())
                assert rec["completion"]["bytes"] == 1000 and rec["peer_pid"] == os.getpid()
        # one-sided read back over cma; tcp cannot read
        back = np.zeros(size, dtype=np.uint8)
        bk = tx.register(back)
        with tx.connect(ready["addr"], transport="cma") as peer:
            peer.wait(peer.submit_reads([(bk.id, 0, region, 0, 4000)], checksum=True))
        assert (back[:2000] == 0x5A).all() and not back[2000:].any()
        with tx.connect(ready["addr"], transport="tcp") as peer:
            with pytest.raises(pdxfer.ArgumentError) as e:
                peer.submit_reads([(bk.id, 0, region, 0, 1)])
            assert e.value.kind == "unsupported"
        dump = Path(f"/tmp/pdxfer-pytest-dump-{os.getpid()}")
        proc.stdin.write(f"dump {dump}\n")
        proc.stdin.flush()
        assert "dumped" in json.loads(proc.stdout.readline())
        mem = np.fromfile(dump, dtype=np.uint8)
        dump.unlink()
        assert (mem[:2000] == 0x5A).all() and not mem[2000:].any()
        tx.close()
    finally:
        proc.kill()
        proc.wait()


def test_shared_allocation_written_with_memcpy_over_cma():
    with pdxfer.Agent(listen="127.0.0.1:0") as rx, pdxfer.Agent() as tx:
        d, view = rx.alloc_shared(1 << 16)
        assert d.len == 1 << 16 and not view.any()
        src = np.arange(1 << 16, dtype=np.uint64).astype(np.uint8)
        s = tx.register(src)
        with tx.connect(rx.listen_addr, transport="cma") as peer:
            peer.wait(peer.submit([(s.id, 0, d.id, 0, 1 << 16)], checksum=True))
        assert np.array_equal(view, src)
        with pytest.raises(pdxfer.ArgumentError):
            rx.alloc_shared(0)
        rx.unregister(d)
