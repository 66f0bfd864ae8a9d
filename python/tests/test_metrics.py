"""Engine metrics and room telemetry from Python (ABI 1.3): a prefill rank
serving /metrics on loopback and two decode DCP ranks in one process; the
counts follow the rooms run, the histogram counts the rooms that succeeded,
failures are counted by kind, telemetry times are ordered and its bytes are
the room's; the buffer-too-small convention of the C call underneath."""

import ctypes
import time
import urllib.error
import urllib.request

import pytest

import pdxfer
from pdxfer import engine as E
from pdxfer._lib import lib
from pdxfer.synthetic import SyntheticPools, scattered_pages

PAGE, LAYERS, ROW, DCP = 8, 2, 64, 2


def sample(text, series):
    """The value of the sample ``series`` (name and labels exactly as printed), or None."""
    for line in text.splitlines():
        if not line.startswith("#") and line.rsplit(" ", 1)[0] == series:
            return float(line.rsplit(" ", 1)[1])
    return None


def total(text, name):
    """The sum of every sample of metric ``name``."""
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
               if not l.startswith("#") and (l.startswith(name + "{") or l.startswith(name + " ")))


def test_struct_sizes_are_pinned():
    assert ctypes.sizeof(E.CEngineConfig) == 192
    assert ctypes.sizeof(E.CRoomTelemetry) == 96
    assert lib.pdxfer_abi_version() & 0xFFFF >= 3


@pytest.fixture
def cluster():
    srv = pdxfer.bootstrap.BootstrapServer()
    pp = SyntheticPools(LAYERS, ROW, PAGE, 32)
    t = pdxfer.Topology.mla(LAYERS, ROW, page_size=PAGE)
    pre = pdxfer.Engine("prefill", "py-metrics", srv.url, t, pp.kv, aux=[(pp.aux, 32)], transport="cma",
                        staging_bytes=1 << 20, metrics_listen="127.0.0.1:0")
    decs = []
    for r in range(DCP):
        dp = SyntheticPools(LAYERS, ROW, PAGE, 32)
        td = pdxfer.Topology.mla(LAYERS, ROW, page_size=PAGE, engine_rank=r, attn_tp_size=DCP, attn_tp_rank=r,
                                 dcp_size=DCP, dcp_rank=r)
        decs.append((pdxfer.Engine("decode", "py-metrics", srv.url, td, dp.kv, aux=[(dp.aux, 32)],
                                   transport="cma"), dp))
    yield pre, pp, decs
    for e, _ in decs:
        e.close()
    pre.close()
    srv.stop()


def wait_for(cond, what, timeout=20):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def run_room(pre, pp, decs, room, tokens):
    src = scattered_pages((tokens + PAGE - 1) // PAGE, 32, room)
    dst = scattered_pages((tokens + PAGE * DCP - 1) // (PAGE * DCP), 32, room, stride=3)
    pp.fill(room, 1, 0, src, 0, tokens)
    pp.fill_aux(room, 1)
    rx = [d.receiver(room) for d, _ in decs]
    for r in rx:
        r.send_metadata(dst, aux_index=2)
    tx = pre.sender(room)
    wait_for(lambda: tx.poll() == pdxfer.KVPoll.WaitingForInput, "metadata never arrived")
    assert sample(pre.metrics(), 'pdxfer_engine_rooms{state="waiting_for_input"}') == 1
    tx.send(src, num_tokens=tokens, aux_index=1)
    assert tx.wait(20) == pdxfer.KVPoll.Success, tx.failure_exception()
    verified = 0
    for i, r in enumerate(rx):
        assert r.wait(20) == pdxfer.KVPoll.Success
        verified += decs[i][1].verify(room, DCP, i, dst, 0, tokens, aux_idx=2, src_aux_idx=1)
        d = r.telemetry()
        assert d.state == pdxfer.KVPoll.Success and d.bytes == r.bytes_received() > 0
        assert d.queued <= d.last_ack
        assert (d.planned, d.first_byte, d.batches, d.retries) == (None, None, None, None)
    t = tx.telemetry()
    assert (t.room, t.attempt, t.state) == (room, 1, pdxfer.KVPoll.Success)
    assert 0 <= t.queued <= t.planned <= t.first_byte <= t.last_ack, t
    assert t.bytes == tokens * ROW * LAYERS == sum(r.bytes_received() for r in rx)
    assert t.batches >= 2 and t.retries == 0
    assert abs(t.created_unix_ns / 1e9 - time.time()) < 60
    for r in rx:
        r.clear()
    tx.clear()
    with pytest.raises(pdxfer.EngineError) as e:
        tx.telemetry()
    assert e.value.kind == "unknown_room"
    return verified


def test_metrics_follow_the_rooms(cluster):
    pre, pp, decs = cluster
    m = pre.metrics()
    assert sample(m, "pdxfer_engine_rooms_created_total") == 0
    assert sample(m, 'pdxfer_engine_info{role="prefill",cluster="py-metrics"}') == 1
    assert total(m, "pdxfer_engine_transfer_seconds_count") == 0
    verified = 0
    for i, (room, tokens) in enumerate([(1, 40), (2, 77), (3, 9)]):
        verified += run_room(pre, pp, decs, room, tokens)
        m = pre.metrics()
        assert sample(m, "pdxfer_engine_rooms_created_total") == i + 1
        assert sample(m, 'pdxfer_engine_rooms_finished_total{state="success"}') == i + 1
        assert sample(m, 'pdxfer_engine_transfer_seconds_count{transport="cma"}') == i + 1
        assert sample(m, 'pdxfer_engine_transfer_seconds_bucket{transport="cma",le="+Inf"}') == i + 1
        assert total(m, "pdxfer_engine_rooms") == 0
    assert total(m, "pdxfer_engine_sent_bytes_total") == verified
    assert sample(m, 'pdxfer_engine_sent_bytes_total{transport="cma",peer="dp0-tp1-cp0-pp0"}') > 0
    assert sample(m, "pdxfer_engine_staging_in_flight_bytes") == 0
    assert sample(m, 'pdxfer_engine_registered_bytes{kind="kv"}') == LAYERS * 32 * PAGE * ROW
    for d, _ in decs:
        dm = d.metrics()
        assert sample(dm, 'pdxfer_engine_rooms_finished_total{state="success"}') == 3
        assert sample(dm, 'pdxfer_engine_transfer_seconds_count{transport="cma"}') == 3
        assert d.metrics_address is None
    # the same text over HTTP
    addr = pre.metrics_address
    assert addr.startswith("127.0.0.1:")
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        body = r.read().decode()
    assert sample(body, 'pdxfer_engine_rooms_finished_total{state="success"}') == 3
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://{addr}/other", timeout=10)
    assert e.value.code == 404


def test_an_abort_is_counted_by_kind(cluster):
    pre, pp, decs = cluster
    rx = [d.receiver(5) for d, _ in decs]
    for r in rx:
        r.send_metadata([1])
    tx = pre.sender(5)
    wait_for(lambda: tx.poll() == pdxfer.KVPoll.WaitingForInput, "metadata never arrived")
    rx[0].abort()
    wait_for(lambda: tx.poll() == pdxfer.KVPoll.Failed, "the prefill never heard the abort")
    m = pre.metrics()
    assert sample(m, 'pdxfer_engine_room_failures_total{kind="aborted"}') == 1
    assert sample(m, 'pdxfer_engine_rooms_finished_total{state="failed"}') == 1
    assert total(m, "pdxfer_engine_transfer_seconds_count") == 0
    assert sample(decs[0][0].metrics(), 'pdxfer_engine_room_failures_total{kind="aborted"}') == 1
    t = tx.telemetry()
    assert t.state == pdxfer.KVPoll.Failed and t.last_ack is None and t.first_byte is None


def test_a_short_buffer_is_refused_with_the_length_and_left_untouched(cluster):
    pre, _, _ = cluster
    h = pre._hd.raw
    need = ctypes.c_size_t(0)
    assert lib.pdxfer_engine_metrics(h, None, 0, ctypes.byref(need)) == 0
    n = need.value
    assert n > 100
    buf = ctypes.create_string_buffer(b"x" * (n - 2), n - 1)
    got = ctypes.c_size_t(0)
    assert lib.pdxfer_engine_metrics(h, buf, n - 1, ctypes.byref(got)) == -104
    assert got.value >= n
    assert buf.raw == b"x" * (n - 2) + b"\0"
    assert lib.pdxfer_engine_metrics(h, buf, n - 1, None) == -100
