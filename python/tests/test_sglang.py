"""pdxfer.sglang: a prefill and two decode DCP ranks through SGLang's connector
method names (KVManager / KVSender / KVReceiver / BootstrapServer), numpy
arrays as pools, chunked with a decode prefix; every byte checked."""

import time
from types import SimpleNamespace

import pytest

import pdxfer
from pdxfer import sglang as S
from pdxfer.synthetic import SyntheticPools

PAGE, LAYERS, ROW = 8, 3, 64


def kv_args(pools, rank, dcp):
    """SGLang's KVArgs for synthetic pools."""
    return SimpleNamespace(
        engine_rank=rank,
        kv_data_ptrs=[b.ctypes.data for b in pools.kv],
        kv_data_lens=[b.nbytes for b in pools.kv],
        kv_item_lens=[PAGE * ROW] * LAYERS,
        aux_data_ptrs=[pools.aux.ctypes.data],
        aux_data_lens=[pools.aux.nbytes],
        aux_item_lens=[pools.aux_item],
        page_size=PAGE,
        dcp_size=dcp,
        dcp_rank=rank,
    )


def wait_for(conn, states, limit=20.0):
    deadline = time.monotonic() + limit
    while conn.poll() not in states:
        assert time.monotonic() < deadline, f"stuck in {conn.poll()!r}"
        time.sleep(0.005)
    return conn.poll()


def test_prefill_to_two_decode_dcp_ranks_through_the_sglang_interface():
    srv = S.BootstrapServer("127.0.0.1", 0)
    addr = srv.url.split("://")[1]
    p_pools = SyntheticPools(LAYERS, ROW, PAGE, 32)
    d_pools = [SyntheticPools(LAYERS, ROW, PAGE, 16) for _ in range(2)]
    p_args = SimpleNamespace(pdxfer_cluster="sgl", pdxfer_bootstrap_url=srv.url, tp_size=1)
    mgr_p = S.KVManager(kv_args(p_pools, 0, 1), "prefill", p_args, is_mla_backend=True)
    mgr_p.register_to_bootstrap()
    d_args = SimpleNamespace(pdxfer_cluster="sgl", tp_size=2)
    mgr_d = [S.KVManager(kv_args(d_pools[r], r, 2), SimpleNamespace(value="decode"), d_args, True)
             for r in range(2)]
    try:
        room, total, prefix = 77, 173, 32
        n = total - prefix
        src = [(i * 7 + 3) % 32 for i in range(-(-n // PAGE))]
        dst = [(i * 3 + 1) % 16 for i in range(-(-n // (2 * PAGE)))]
        p_pools.fill(room, 1, 0, src, prefix, total)
        p_pools.fill_aux(room, 2)

        receivers = [S.KVReceiver(m, addr, room) for m in mgr_d]
        assert receivers[0].poll() == S.KVPoll.Bootstrapping
        sender = S.KVSender(mgr_p, addr, room, dest_tp_ranks=[0, 1], pp_rank=0)
        sender.init(len(src), aux_index=2)
        for r in receivers:
            r.init(prefill_dp_rank=0)
            r.send_metadata(dst, aux_index=1, decode_prefix_len=prefix)
        assert wait_for(sender, {S.KVPoll.WaitingForInput}) == S.KVPoll.WaitingForInput
        sender.send(src[:10])
        sender.send(src[10:], num_kv_tokens=n - 10 * PAGE)
        assert wait_for(sender, {S.KVPoll.Success, S.KVPoll.Failed}) == S.KVPoll.Success
        for rank, r in enumerate(receivers):
            assert wait_for(r, {S.KVPoll.Success, S.KVPoll.Failed}) == S.KVPoll.Success
            got = d_pools[rank].verify(room, 2, rank, dst, prefix, total, aux_idx=1, src_aux_idx=2)
            owned = sum(1 for t in range(prefix, total) if t % 2 == rank)
            assert got == owned * LAYERS * ROW + p_pools.aux_item
            r.clear()
        sender.clear()

        # a failed room raises its typed error through failure_exception()
        bad = S.KVReceiver(mgr_d[0], addr, 78)
        bad.init(0)
        with pytest.raises(pdxfer.PlanError) as e:
            bad.send_metadata(dst, aux_index=0, decode_prefix_len=8)
        assert e.value.kind == "prefix_misaligned"
        bad.abort()
        assert bad.poll() == S.KVPoll.Failed
        with pytest.raises(pdxfer.EngineError) as e:
            bad.failure_exception()
        assert e.value.kind == "aborted"
        bad.clear()
    finally:
        for m in mgr_d:
            m.close()
        mgr_p.close()
        srv.close()
