"""Careless callers: closing a handle while other threads use it gives those
threads a typed error (never a crash) and the close waits for their calls;
a call refused for a too-small output struct changes nothing.

The races run in child processes, so a crash shows up as a failed test with
the child's exit status instead of taking pytest down."""

import ctypes
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import pdxfer
from pdxfer import transfer as T
from pdxfer._lib import lib

HERE = os.path.dirname(os.path.abspath(__file__))
ABI_MISMATCH = -103


def run_child(body: str) -> str:
    """Runs ``body`` in a fresh interpreter; returns its stdout, failing on any non-zero exit."""
    code = "import faulthandler; faulthandler.enable()\n" + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=os.path.join(HERE, ".."))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, f"child exited {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr[-4000:]}"
    return p.stdout


RACE_PRELUDE = """
import threading, time
import numpy as np
import pdxfer
from pdxfer._lib import PdxError

def hammer(call, stop, errors, counts):
    # Calls `call` until it raises (a typed PdxError is the only acceptable failure).
    while not stop.is_set():
        try:
            call()
            counts[0] += 1
        except PdxError as e:
            errors.append(e)
            return
        except BaseException as e:  # anything else is a bug
            errors.append(e)
            return

def race(make, calls, close, rounds):
    typed = 0
    for _ in range(rounds):
        obj = make()
        stop = threading.Event()
        errors, threads = [], []
        for c in calls:
            counts = [0]
            t = threading.Thread(target=hammer, args=(lambda c=c: c(obj), stop, errors, counts))
            t.start()
            threads.append(t)
        time.sleep(0.002)
        close(obj)
        stop.set()
        for t in threads:
            t.join(30)
            assert not t.is_alive(), "a call hung after close"
        for e in errors:
            assert isinstance(e, PdxError), repr(e)
            typed += 1
    return typed
"""


def test_peer_close_racing_calls_from_other_threads_is_a_typed_error():
    out = run_child(RACE_PRELUDE + """
rx = pdxfer.Agent("127.0.0.1:0")
tx = pdxfer.Agent()
dst = np.zeros(1 << 16, np.uint8)
src = np.arange(1 << 16, dtype=np.uint32).astype(np.uint8)
rd, sd = rx.register(dst), tx.register(src)

def submit_wait(p):
    b = p.submit([(sd.id, 0, rd.id, 0, 4096)], timeout=5.0)
    p.wait(b, timeout=5.0)

calls = [submit_wait, lambda p: p.transport, lambda p: p.remote_regions(), lambda p: p.poll(1)]
typed = race(lambda: tx.connect(rx.listen_addr, transport="tcp"), calls, lambda p: p.close(), 60)
typed += race(lambda: tx.connect_local(rx), calls, lambda p: p.close(), 60)
print("typed", typed)
""")
    assert int(out.split()[-1]) > 0, out


def test_agent_close_racing_calls_is_a_typed_error():
    out = run_child(RACE_PRELUDE + """
buf = np.zeros(4096, np.uint8)

def reg_unreg(a):
    r = a.register(buf)
    a.unregister(r, timeout=1.0)

calls = [reg_unreg, lambda a: a.regions(), lambda a: a.listen_addr, lambda a: a.next_completion(0.001)]
typed = race(lambda: pdxfer.Agent("127.0.0.1:0"), calls, lambda a: a.close(), 150)
print("typed", typed)
""")
    assert int(out.split()[-1]) > 0, out


def test_bootstrap_handles_close_racing_calls_is_a_typed_error():
    out = run_child(RACE_PRELUDE + """
srv = pdxfer.bootstrap.BootstrapServer()
t = pdxfer.Topology.mla(2, 64, page_size=8)
reg = pdxfer.bootstrap.make_registration("hd", "prefill", t, {"tcp": "127.0.0.1:1"})
typed = race(lambda: pdxfer.bootstrap.BootstrapClient(srv.url),
             [lambda c: c.summary("hd", "prefill"), lambda c: c.summary("hd", "decode")],
             lambda c: c.close(), 300)
client = pdxfer.bootstrap.BootstrapClient(srv.url)
typed += race(lambda: client.register(reg, ttl_ms=5000), [lambda r: r.info, lambda r: r.hello],
              lambda r: r.deregister(), 100)
typed += race(lambda: pdxfer.bootstrap.BootstrapServer(), [lambda s: s.url], lambda s: s.stop(), 20)
print("typed", typed)
""")
    assert int(out.split()[-1]) > 0, out


def test_engine_close_racing_calls_is_a_typed_error():
    out = run_child(RACE_PRELUDE + """
from pdxfer.synthetic import SyntheticPools
srv = pdxfer.bootstrap.BootstrapServer()
t = pdxfer.Topology.mla(2, 64, page_size=8)
pp = SyntheticPools(2, 64, 8, 16)

def make():
    return pdxfer.Engine("prefill", "py-close", srv.url, t, pp.kv, aux=[(pp.aux, 32)], transport="tcp")

calls = [lambda e: e.poll(7), lambda e: e.wait(7, 0.001), lambda e: e.failure(7), lambda e: e.room_bytes(7),
         lambda e: e.is_fenced(7)]
typed = race(make, calls, lambda e: e.close(), 12)
print("typed", typed)
""")
    assert int(out.split()[-1]) > 0, out


def test_close_waits_for_a_call_in_flight_and_later_calls_raise():
    a = pdxfer.Agent("127.0.0.1:0")
    started, finished = threading.Event(), threading.Event()
    result = []

    def waiter():
        started.set()
        try:
            result.append(a.next_completion(0.5))
        except pdxfer.PdxError as e:  # pragma: no cover - reported below
            result.append(e)
        finished.set()

    th = threading.Thread(target=waiter)
    th.start()
    started.wait()
    time.sleep(0.05)
    a.close()
    # close returned only after the blocked call had returned normally.
    assert finished.is_set()
    assert result == [None]
    th.join()
    with pytest.raises(pdxfer.ArgumentError, match="agent is closed"):
        a.regions()
    a.close()  # idempotent


def test_close_from_inside_its_own_call_is_refused_not_a_deadlock():
    a = pdxfer.Agent()
    with a._hd.use():
        with pytest.raises(pdxfer.ArgumentError, match="inside one of its own calls"):
            a.close()
    a.close()


def test_register_with_a_too_small_out_struct_registers_nothing():
    a = pdxfer.Agent()
    buf = np.zeros(4096, np.uint8)
    addr = buf.ctypes.data
    small = T._Region(struct_size=8)
    assert lib.pdxfer_register_memory(a._hd.raw, ctypes.c_void_p(addr), 4096, ctypes.byref(small)) == ABI_MISMATCH
    assert a.regions() == []
    assert lib.pdxfer_alloc_shared_memory(a._hd.raw, 4096, ctypes.byref(small)) == ABI_MISMATCH
    assert a.regions() == []
    # The same range registers cleanly afterwards (nothing overlaps it).
    r = a.register(buf)
    assert [x.id for x in a.regions()] == [r.id]
    a.close()


def test_wait_and_poll_with_a_too_small_out_struct_keep_the_result():
    rx, tx = pdxfer.Agent(), pdxfer.Agent()
    dst, src = np.zeros(4096, np.uint8), np.full(4096, 7, np.uint8)
    rd, sd = rx.register(dst), tx.register(src)
    p = tx.connect_local(rx)
    small = T._Completion(struct_size=8)
    for call in ("wait", "poll"):
        b = p.submit([(sd.id, 0, rd.id, 0, 4096)], timeout=5.0)
        raw = p._hd.raw
        if call == "wait":
            st = lib.pdxfer_wait(raw, b, 5000, ctypes.byref(small))
        else:
            time.sleep(0.05)
            st = lib.pdxfer_poll(raw, b, ctypes.byref(small))
        assert st == ABI_MISMATCH, call
        c = p.wait(b, timeout=5.0)
        assert c.batch_id == b and c.bytes == 4096, call
    assert (dst == 7).all()
    # The receiver's completion records are not consumed by a refused call either.
    assert lib.pdxfer_agent_next_completion(rx._hd.raw, 1000, ctypes.byref(small)) == ABI_MISMATCH
    got = [rx.next_completion(1.0), rx.next_completion(1.0)]
    assert all(g is not None and g.bytes == 4096 for g in got)
    p.close()
    tx.close()
    rx.close()
