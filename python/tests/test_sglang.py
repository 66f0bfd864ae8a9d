"""pdxfer as SGLang 0.5.23's transfer backend: SGLang's scheduler call sequence
replayed with one process per rank (sglang_rank.py), against SGLang's own
KVArgs, KVPoll, base classes, get_kv_class and plugin loader (sglang_env.py
says what of SGLang is real and what is stubbed). Every KV, metadata and state
row is checked on the decode, and the whole pools against their expected image.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import sglang_env  # noqa: E402
import pdxfer  # noqa: E402
from pdxfer import sglang as S  # noqa: E402

PAGE, ROW = 8, 64
SUCCESS, FAILED, WAITING = 4, 0, 2


@pytest.fixture(scope="module", autouse=True)
def sglang_installed():
    sglang_env.ensure_installed()


@pytest.fixture
def plugin_site(tmp_path):
    """A site directory where ``pdxfer`` is installed as a distribution with its entry point."""
    site = str(tmp_path / "site")
    sglang_env.write_plugin_dist(site)
    return site


def parallel(tp=1, rank=0, dcp=1, pp=1, pp_rank=0, cp=1, dp=1, attn_dp=1):
    return {"attn_tp_size": tp, "attn_tp_rank": rank, "attn_cp_size": cp, "attn_cp_rank": 0,
            "attn_dp_size": attn_dp, "attn_dp_rank": 0, "attn_dcp_size": dcp, "attn_dcp_rank": rank % dcp,
            "dp_size": dp, "pp_size": pp, "pp_rank": pp_rank}


def spec(role, addr, rooms, *, mla=True, layers=3, par=None, engine_rank=0, start_layer=0, local_layers=None,
         state=False, draft=0, dp_rank=0, site=None, port=0, page=PAGE, cp=None, env=None):
    return {"role": role, "bootstrap_addr": addr, "rooms": rooms, "mla": mla, "page": page, "row": ROW,
            "cp": cp, "env": env,
            "layers": layers, "start_layer": start_layer,
            "local_layers": layers if local_layers is None else local_layers, "draft": draft, "draft_row": 32,
            "state": state, "parallel": par or parallel(), "engine_rank": engine_rank, "system_dp_rank": dp_rank,
            "plugin_site": site,
            "server_args": {"host": "127.0.0.1", "disaggregation_bootstrap_port": port}}


def run(prefills, decodes, timeout=90):
    """Runs the rank processes; returns (prefill results, decode results), one list per process."""
    env = dict(os.environ, PDXFER_SGLANG_POOL_MEMORY="host", PDXFER_SGLANG_CLUSTER="t" + str(os.getpid()))
    cmd = [sys.executable, os.path.join(HERE, "sglang_rank.py")]
    ps = [subprocess.Popen(cmd + [json.dumps(s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env) for s in prefills]
    ds = [subprocess.Popen(cmd + [json.dumps(s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=env) for s in decodes]
    try:
        dres = []
        for d in ds:
            out, err = d.communicate(timeout=timeout)
            if d.returncode != 0:
                # the cause is often on the prefill side: show its stderr too
                perr = []
                for p in ps:
                    p.kill()
                    perr.append(p.communicate()[1][-3000:])
                raise AssertionError(f"decode rank failed:\n{err[-4000:]}\nprefill stderr:\n" + "\n".join(perr))
            dres.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
        pres = []
        for p in ps:
            out, err = p.communicate("", timeout=timeout)
            assert p.returncode == 0, f"prefill rank failed:\n{err[-4000:]}"
            pres.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
        return pres, dres
    finally:
        for x in ps + ds:
            if x.poll() is None:
                x.kill()


@pytest.fixture
def server():
    srv = S.BootstrapServer("127.0.0.1", 0)
    yield srv
    srv.close()


def addr_of(srv):
    return f"127.0.0.1:{srv.port}"


@pytest.mark.parametrize("path", ["plugin", "classes"])
def test_mha_one_to_one_chunked_with_decode_prefix_hit(server, plugin_site, path):
    """``plugin``: the classes come from SGLang's get_kv_class; ``classes``: from pdxfer.sglang."""
    a = addr_of(server)
    site = plugin_site if path == "plugin" else None
    rooms = [{"room": 11, "total": 45, "prefix": 0, "chunk": 16},
             {"room": 12, "total": 61, "prefix": 16, "chunk": 24},  # decode prefix-cache hit
             {"room": 13, "total": 8, "prefix": 0, "chunk": 0}]
    (p,), (d,) = run([spec("prefill", a, rooms, mla=False, port=server.port, site=site)],
                     [spec("decode", a, rooms, mla=False, site=site)])
    assert [r["poll"] for r in d] == [SUCCESS] * 3, d
    assert [r["poll"] for r in p] == [SUCCESS] * 3, p
    assert [r["prefix_seen"] for r in p] == [0, 16, 0], "pop_decode_prefix_len is the decode's prefix"
    assert d[1]["bytes_checked"] == (61 - 16) * ROW * 6
    assert all(r["checksum_comparable"] for r in d)


@pytest.mark.parametrize("dcp", [2, 4])
def test_mla_one_to_dcp_ranks_through_the_plugin(server, plugin_site, dcp):
    a = addr_of(server)
    rooms = [{"room": 21, "total": 173, "prefix": 0, "chunk": 64},
             {"room": 22, "total": 150, "prefix": PAGE * dcp * 2, "chunk": 40}]
    (p,), ds = run([spec("prefill", a, rooms, port=server.port, site=plugin_site)],
                   [spec("decode", a, rooms, par=parallel(tp=dcp, rank=r, dcp=dcp), engine_rank=r,
                         site=plugin_site) for r in range(dcp)])
    for r, d in enumerate(ds):
        assert [x["poll"] for x in d] == [SUCCESS, SUCCESS], (r, d)
        owned = sum(1 for t in range(173) if t % dcp == r)
        assert d[0]["bytes_checked"] == owned * ROW * 3
        assert not d[0]["checksum_comparable"], "a DCP rank holds a slice of the prefill's digest"
    assert [x["poll"] for x in p] == [SUCCESS, SUCCESS]
    assert p[1]["prefix_seen"] == PAGE * dcp * 2


def test_speculative_draft_entry_is_replicated_to_every_dcp_rank(server, plugin_site):
    a = addr_of(server)
    rooms = [{"room": 81, "total": 100, "prefix": 0, "chunk": 32},
             {"room": 82, "total": 70, "prefix": 2 * PAGE * 2, "chunk": 0}]
    (p,), ds = run([spec("prefill", a, rooms, draft=1, port=server.port, site=plugin_site)],
                   [spec("decode", a, rooms, draft=1, par=parallel(tp=2, rank=r, dcp=2), engine_rank=r,
                         site=plugin_site) for r in range(2)])
    for r, d in enumerate(ds):
        assert [x["poll"] for x in d] == [SUCCESS, SUCCESS], (r, d)
        owned = sum(1 for t in range(100) if t % 2 == r)
        assert d[0]["bytes_checked"] == owned * ROW * 3 + 100 * 32, "target sharded, draft whole"
    assert [x["poll"] for x in p] == [SUCCESS, SUCCESS], p


def test_abort_mid_transfer_on_either_side(server, plugin_site):
    a = addr_of(server)
    rooms = [{"room": 31, "total": 160, "prefix": 0, "chunk": 16, "abort": "decode"},
             {"room": 32, "total": 160, "prefix": 0, "chunk": 16, "abort": "prefill"},
             {"room": 33, "total": 40, "prefix": 0, "chunk": 16}]
    (p,), (d,) = run([spec("prefill", a, rooms, site=plugin_site, port=server.port)],
                     [spec("decode", a, rooms, site=plugin_site)])
    assert [x["poll"] for x in d] == [FAILED, FAILED, SUCCESS], d
    assert d[0]["fenced"]
    assert d[0]["error"][0] == "KVTransferError" and d[0]["error"][3], "SGLang reads failure_reason"
    assert [x["poll"] for x in p] == [FAILED, FAILED, SUCCESS], p
    assert p[1]["error"][0] == "KVTransferError"


def test_dp_prefill_follows_the_bootstrap_room(server, plugin_site):
    a = addr_of(server)
    rooms = [{"room": 40 + i, "total": 30 + 7 * i, "prefix": 0, "chunk": 16} for i in range(4)]
    prefills = [spec("prefill", a, [r for r in rooms if r["room"] % 2 == g], site=plugin_site,
                     port=server.port, dp_rank=g, par=parallel(dp=2)) for g in range(2)]
    (p0, p1), (d,) = run(prefills, [spec("decode", a, rooms, site=plugin_site)])
    assert [x["poll"] for x in d] == [SUCCESS] * 4, d
    assert [x["room"] for x in p0] == [40, 42] and all(x["poll"] == SUCCESS for x in p0 + p1)


def test_pp2_prefill_to_one_decode(server, plugin_site):
    a = addr_of(server)
    rooms = [{"room": 51, "total": 77, "prefix": 0, "chunk": 32}, {"room": 52, "total": 40, "prefix": 8, "chunk": 0}]
    prefills = [spec("prefill", a, rooms, site=plugin_site, layers=4, local_layers=2, start_layer=2 * k,
                     port=server.port, par=parallel(pp=2, pp_rank=k)) for k in range(2)]
    (p0, p1), (d,) = run(prefills, [spec("decode", a, rooms, site=plugin_site, layers=4)])
    assert [x["poll"] for x in d] == [SUCCESS, SUCCESS], d
    assert d[0]["bytes_checked"] == 77 * ROW * 4
    assert [x["prefix_seen"] for x in p0 + p1] == [0, 8, 0, 8]
    assert not d[0]["checksum_comparable"], "each PP stage digests its own layers"


def test_hybrid_model_state_pools_move_with_the_room(server, plugin_site):
    a = addr_of(server)
    rooms = [{"room": 61, "total": 50, "prefix": 0, "chunk": 16}, {"room": 62, "total": 20, "prefix": 8, "chunk": 0}]
    (p,), (d,) = run([spec("prefill", a, rooms, site=plugin_site, mla=False, state=True, port=server.port)],
                     [spec("decode", a, rooms, site=plugin_site, mla=False, state=True)])
    assert [x["poll"] for x in d] == [SUCCESS, SUCCESS], d


def test_state_rows_reach_every_decode_dcp_rank(server, plugin_site):
    """Mamba state is not DCP-sharded: every DCP rank gets the request's rows."""
    a = addr_of(server)
    rooms = [{"room": 63, "total": 70, "prefix": 0, "chunk": 32}]
    (p,), ds = run([spec("prefill", a, rooms, site=plugin_site, state=True, port=server.port)],
                   [spec("decode", a, rooms, site=plugin_site, state=True, par=parallel(tp=2, rank=r, dcp=2),
                         engine_rank=r)
                    for r in range(2)])
    assert [[x["poll"] for x in d] for d in ds] == [[SUCCESS], [SUCCESS]], ds


class _Args:
    """KVArgs as SGLang fills them for a 3-layer MLA pool (host numpy memory here)."""

    def __init__(self, rank, pools):
        import numpy as np

        self.bufs = [np.zeros((16 * PAGE, ROW // 8), dtype=np.uint64) for _ in range(3)]
        self.meta = np.zeros((4, 8), dtype=np.uint64)
        self.engine_rank, self.pp_rank, self.system_dp_rank = rank, 0, 0
        self.kv_cache_dtype_str = "bfloat16"
        self.prefill_start_layer, self.kv_layer_ids, self.num_draft_entries = 0, [], 0
        self.kv_data_ptrs = [b.ctypes.data for b in self.bufs]
        self.kv_data_lens = [b.nbytes for b in self.bufs]
        self.kv_item_lens = [PAGE * ROW] * 3
        self.page_size = PAGE
        self.aux_data_ptrs, self.aux_data_lens, self.aux_item_lens = [self.meta.ctypes.data], [self.meta.nbytes], [64]
        self.state_types = []
        self.gpu_id = 0
        pools.append(self)


def _sa(port):
    return type("ServerArgs", (), {"host": "127.0.0.1", "disaggregation_bootstrap_port": port})()


def test_seed_refusals_name_the_sglang_arguments(server, monkeypatch):
    monkeypatch.setenv("PDXFER_SGLANG_POOL_MEMORY", "host")
    monkeypatch.setenv("PDXFER_SGLANG_CLUSTER", "seed-cp")
    a, keep = addr_of(server), []
    # prefill attention CP 2 with DSA cache-layer split (each CP rank holds some layers), decode
    # with DCP 2: refused before any room, naming the flag (replicated CP KV is served)
    split = {"enable_dsa_cache_layer_split": True}
    pre = [S.KVManager(_Args(0, keep), "prefill", _sa(server.port), True,
                       parallel=dict_ns(parallel(cp=2) | {"attn_cp_rank": c} | split)) for c in range(2)]
    assert all(m.enable_all_cp_ranks_for_transfer and not m.is_dummy_cp_rank for m in pre), \
        "a layer-split prefill sends from every CP rank, as SGLang's"
    dec = S.KVManager(_Args(0, keep), "decode", _sa(0), True, parallel=dict_ns(parallel(tp=2, dcp=2)))
    try:
        with pytest.raises(S.SGLangCompatError) as e:
            dec.try_ensure_parallel_info(a)
        assert e.value.kind == "prefill_cp_with_decode_dcp"
        assert isinstance(e.value, RuntimeError), "SGLang raises RuntimeError here"
        assert "without --enable-dsa-cache-layer-split" in str(e.value) and "--dcp-size 1" in str(e.value)
    finally:
        for m in pre + [dec]:
            m.close()

    # a miswired DCP pair: decode TP rank 0 claims DCP rank 1 and meets prefill DCP rank 0
    monkeypatch.setenv("PDXFER_SGLANG_CLUSTER", "seed-dcp")
    pre = [S.KVManager(_Args(r, keep), "prefill", _sa(server.port), True,
                       parallel=dict_ns(parallel(tp=2, rank=r, dcp=2))) for r in range(2)]
    bad = parallel(tp=2, rank=0, dcp=2)
    bad["attn_dcp_rank"] = 1
    dec = S.KVManager(_Args(0, keep), "decode", _sa(0), True, parallel=dict_ns(bad))
    try:
        assert dec.try_ensure_parallel_info(a)
        rcv = S.KVReceiver(dec, a, 71)
        assert rcv.poll() == S.KVPoll.Bootstrapping
        rcv.init(0)
        assert rcv.poll() == S.KVPoll.Failed, "the room fails; init does not raise into the scheduler"
        with pytest.raises(S.KVTransferError) as e:
            rcv.failure_exception()
        assert e.value.kind == "dcp_rank_mismatch"
        assert "--dcp-size" in e.value.failure_reason and "KVArgs.dcp_rank" in e.value.failure_reason
        assert isinstance(e.value.cause, S.SGLangCompatError)
        rcv.clear()
    finally:
        for m in pre + [dec]:
            m.close()


def dict_ns(d):
    import types

    return types.SimpleNamespace(**d)


def test_kvargs_and_parallel_state_as_sglang_fills_them(monkeypatch):
    monkeypatch.setenv("PDXFER_SGLANG_POOL_MEMORY", "device")
    from pdxfer.sglang import config as C

    a = _Args(3, [])
    a.kv_item_lens = [PAGE * ROW] * 4 + [PAGE * 32] * 2  # MHA K0 K1 V0 V1 + a draft K/V pair
    a.kv_data_ptrs, a.kv_data_lens = [1] * 6, [PAGE * ROW * 4] * 6
    a.num_draft_entries = 2
    a.prefill_start_layer = 5
    ids = C.entry_layer_ids(a, is_mla=False)
    assert ids == [5, 6, 5 + C.LAYER_BAND, 6 + C.LAYER_BAND, C.DRAFT_LAYER_BASE, C.DRAFT_LAYER_BASE + C.LAYER_BAND]
    sa = type("SA", (), {"tp_size": 8, "dp_size": 2, "enable_dp_attention": True, "dcp_size": 2, "pp_size": 1})()
    lay = C.parallel_layout(a, sa, parallel=None)
    assert (lay.attn_tp_size, lay.attn_tp_rank, lay.attn_dp_size, lay.dcp_size, lay.dcp_rank) == (4, 3, 2, 2, 1)
    # SGLang's parallel state wins over server_args, KVArgs fields over both
    lay = C.parallel_layout(a, sa, parallel=dict_ns(parallel(tp=4, rank=3, dcp=4)))
    assert (lay.dcp_size, lay.dcp_rank) == (4, 3)
    a.dcp_rank = 0
    assert C.parallel_layout(a, sa, parallel=dict_ns(parallel(tp=4, rank=3, dcp=4))).dcp_rank == 0
    assert C.pool_device(a) == 0, "SGLang's pools live on gpu_id"
    monkeypatch.setenv("PDXFER_SGLANG_POOL_MEMORY", "host")
    assert C.pool_device(a) is None
    a.state_types = ["swa"]
    a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [[1]], [[64]], [[8]]
    with pytest.raises(pdxfer.ArgumentError) as e:
        C.state_buffers(a)
    assert e.value.kind == "unsupported" and "swa" in str(e.value)
    assert C.state_rows([[[7]]], [2]) == [7, 7] and C.state_rows([[3, 4]], [2]) == [3, 4]
    with pytest.raises(pdxfer.ArgumentError):
        C.state_rows(None, [2])


def test_the_plugin_makes_sglangs_get_kv_class_return_pdxfer(plugin_site):
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{os.path.join(HERE, "..")!r}, {HERE!r}]
        import sglang_env
        u = sglang_env.load_plugins({plugin_site!r})
        from pdxfer.sglang import conn
        from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
        from sglang.srt.disaggregation.base.conn import BaseKVManager, BaseKVSender, BaseKVReceiver, \
            BaseKVBootstrapServer, KVArgs
        b = u.TransferBackend("pdxfer")
        assert b is u.TransferBackend.PDXFER and "pdxfer" in DISAGG_TRANSFER_BACKEND_CHOICES
        K = u.KVClassType
        got = {{k: u.get_kv_class(b, k) for k in K}}
        assert got[K.KVARGS] is KVArgs
        assert got[K.MANAGER] is conn.KVManager and issubclass(conn.KVManager, BaseKVManager)
        assert got[K.SENDER] is conn.KVSender and issubclass(conn.KVSender, BaseKVSender)
        assert got[K.RECEIVER] is conn.KVReceiver and issubclass(conn.KVReceiver, BaseKVReceiver)
        assert got[K.BOOTSTRAP_SERVER] is conn.BootstrapServer
        assert issubclass(conn.BootstrapServer, BaseKVBootstrapServer)
        assert conn.HAVE_SGLANG
        import sglang.srt.disaggregation.utils as again
        assert again.get_kv_class(again.TransferBackend.FAKE, K.KVARGS) is KVArgs, "other backends unchanged"
        srv = got[K.BOOTSTRAP_SERVER](host="127.0.0.1", port=0)
        assert srv.port > 0
        srv.close()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_a_decode_room_fails_after_sglangs_waiting_timeout(server, monkeypatch):
    import time

    monkeypatch.setenv("PDXFER_SGLANG_POOL_MEMORY", "host")
    monkeypatch.setenv("PDXFER_SGLANG_CLUSTER", "waiting")
    a, keep = addr_of(server), []
    pre = S.KVManager(_Args(0, keep), "prefill", _sa(server.port), True, parallel=dict_ns(parallel()))
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "1")
    dec = S.KVManager(_Args(0, keep), "decode", _sa(0), True, parallel=dict_ns(parallel()))
    assert (pre.room_timeout, dec.room_timeout) == (600, 1)
    try:
        assert dec.try_ensure_parallel_info(a)
        rcv = S.KVReceiver(dec, a, 91)
        rcv.init(0)
        assert rcv.poll() == S.KVPoll.WaitingForInput
        rcv.send_metadata([1, 2], 0, None, decode_prefix_len=0)
        t0 = time.monotonic()
        while rcv.poll() != S.KVPoll.Failed:  # the prefill never opens the room
            assert time.monotonic() - t0 < 10, rcv.poll()
            time.sleep(0.02)
        assert time.monotonic() - t0 > 0.5
        with pytest.raises(S.KVTransferError) as e:
            rcv.failure_exception()
        assert e.value.kind == "timeout", e.value
        assert not any(b.any() for b in keep[1].bufs), "nothing written"
        rcv.clear()
    finally:
        dec.close()
        pre.close()


def test_a_failed_prefill_room_is_forgotten_by_failure_exception(server, monkeypatch):
    monkeypatch.setenv("PDXFER_SGLANG_POOL_MEMORY", "host")
    monkeypatch.setenv("PDXFER_SGLANG_CLUSTER", "reuse")
    pre = S.KVManager(_Args(0, []), "prefill", _sa(server.port), True, parallel=dict_ns(parallel()))
    try:
        snd = S.KVSender(pre, addr_of(server), 95)
        assert snd.poll() == S.KVPoll.Bootstrapping
        snd.abort()  # the scheduler aborts the request; it never calls clear() on this path
        assert snd.poll() == S.KVPoll.Failed
        with pytest.raises(S.KVTransferError) as e:
            snd.failure_exception()
        assert not e.value.is_from_another_rank and "aborted" in e.value.failure_reason
        again = S.KVSender(pre, addr_of(server), 95)
        assert again.poll() == S.KVPoll.Bootstrapping, "the room id is free again"
        again.abort()
        again.clear()
    finally:
        pre.close()


def test_the_prefill_registers_once_the_bootstrap_server_is_up(monkeypatch):
    """SGLang starts the bootstrap server and the schedulers at once."""
    import socket
    import threading
    import time

    monkeypatch.setenv("PDXFER_SGLANG_POOL_MEMORY", "host")
    monkeypatch.setenv("PDXFER_SGLANG_CLUSTER", "late")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    started = []
    t = threading.Timer(0.5, lambda: started.append(S.BootstrapServer("127.0.0.1", port)))
    t.start()
    t0 = time.monotonic()
    mgr = S.KVManager(_Args(0, []), "prefill", _sa(port), True, parallel=dict_ns(parallel()))
    try:
        assert time.monotonic() - t0 >= 0.4 and started, "it waited for the server"
        snd = S.KVSender(mgr, f"127.0.0.1:{port}", 97)
        assert snd.poll() == S.KVPoll.Bootstrapping
        snd.abort()
        snd.clear()
    finally:
        t.join()
        mgr.close()
        for srv in started:
            srv.close()
