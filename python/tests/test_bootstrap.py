"""The bootstrap through the Python binding: server, client, registration
with keep-alive, lookups, readiness, tokens and the handshake re-check."""

import json
import time

import pytest

import pdxfer
from pdxfer.bootstrap import (
    BootstrapClient,
    BootstrapServer,
    make_registration,
    verify_peer,
)

TOKEN = "py-token"


@pytest.fixture
def server():
    with BootstrapServer(token=TOKEN) as s:
        yield s


def test_register_lookup_summary_and_deregister(server):
    assert server.url.startswith("http://127.0.0.1:")
    with BootstrapClient(server.url, token=TOKEN) as c:
        regs = []
        for tp in range(2):
            t = pdxfer.Topology.mla(layers=4, attn_tp_size=2, attn_tp_rank=tp, engine_rank=tp)
            r = c.register(
                make_registration("py", "prefill", t, endpoints={"tcp": f"127.0.0.1:{7000 + tp}"},
                                  regions=[{"id": 1, "addr": 4096, "len": 1 << 20, "kind": "kv", "keys": {}}]),
                ttl_ms=300,
            )
            regs.append(r)
        # Kept alive across several TTLs.
        time.sleep(1.0)
        s = c.summary("py", "prefill")
        assert s["ready"] and s["registered_ranks"] == 2 and s["expected_ranks"] == 2
        got = c.lookup("py", "prefill", "dp0-tp1-cp0-pp0")
        info = regs[1].info
        assert got == info
        assert got["endpoints"]["tcp"] == "127.0.0.1:7001"
        assert got["regions"][0]["len"] == 1 << 20
        assert len(info["instance_id"]) == 32 and info["epoch"] > 0
        assert regs[0].info["instance_id"] != info["instance_id"]

        regs[1].deregister()
        with pytest.raises(pdxfer.BootstrapError) as e:
            c.lookup("py", "prefill", "dp0-tp1-cp0-pp0")
        assert e.value.kind == "not_registered" and e.value.code == -503
        assert not c.summary("py", "prefill")["ready"]
        regs[0].close()


def test_token_is_required_for_writes_and_endpoint_reads(server):
    with BootstrapClient(server.url) as anon:
        with pytest.raises(pdxfer.BootstrapError) as e:
            anon.register(make_registration("py", "decode", pdxfer.Topology.mla(layers=2)))
        assert e.value.kind == "unauthorized"
        with pytest.raises(pdxfer.BootstrapError) as e:
            anon.lookup("py", "decode", "dp0-tp0-cp0-pp0")
        assert e.value.kind == "unauthorized"
        assert anon.summary("py", "decode")["registered_ranks"] == 0


def test_verify_peer_names_stale_entries_and_the_seed_miswire(server):
    with BootstrapClient(server.url, token=TOKEN) as c:
        p = c.register(make_registration("v", "prefill", pdxfer.Topology.mla(layers=2)))
        d = c.register(make_registration("v", "decode", pdxfer.Topology.mla(layers=2, dcp_size=2)))
        adv = c.lookup("v", "prefill", "dp0-tp0-cp0-pp0")
        ok = verify_peer(adv, p.hello, d.info)
        assert ok["mode"] == "token_relayout"
        # The prefill rank restarts at the same address with DCP 2, rank 1.
        p.close()
        p2 = c.register(make_registration("v", "prefill", pdxfer.Topology.mla(layers=2, dcp_size=2, dcp_rank=1)))
        with pytest.raises(pdxfer.BootstrapError) as e:
            verify_peer(adv, p2.hello, d.info)
        assert e.value.kind == "stale_metadata" and e.value.code == -501
        for ident in (adv["instance_id"], p2.info["instance_id"], d.info["instance_id"]):
            assert ident in e.value.detail
        fresh = c.lookup("v", "prefill", "dp0-tp0-cp0-pp0")
        with pytest.raises(pdxfer.CompatError) as e:
            verify_peer(fresh, p2.hello, d.info)
        assert e.value.kind == "dcp_rank_mismatch"
        assert "got prefill=1, decode=0" in e.value.detail
        assert p2.info["instance_id"] in e.value.detail
        p2.deregister()
        d.deregister()


def test_bad_arguments_raise_typed_errors(server):
    with pytest.raises(pdxfer.ArgumentError):
        BootstrapClient("ftp://nowhere")
    with BootstrapClient(server.url, token=TOKEN) as c:
        with pytest.raises(pdxfer.ArgumentError) as e:
            c.lookup("py", "router", "dp0-tp0-cp0-pp0")
        assert "role" in e.value.detail
        bad = make_registration("py", "decode", pdxfer.Topology.mla(layers=2, dcp_size=2, dcp_rank=2))
        with pytest.raises(pdxfer.LayoutError) as e:
            c.register(bad)
        assert e.value.kind == "invalid_topology"
    with pytest.raises(pdxfer.BootstrapError) as e:
        BootstrapServer(listen=server.url[len("http://"):])
    assert e.value.kind == "bootstrap"


def test_large_entries_round_trip_past_the_first_buffer(server):
    regions = [{"id": i, "addr": (i + 1) << 20, "len": 4096, "kind": "kv", "keys": {"rkey": "x" * 16}}
               for i in range(400)]
    with BootstrapClient(server.url, token=TOKEN) as c:
        r = c.register(make_registration("big", "decode", pdxfer.Topology.mla(layers=61), regions=regions))
        got = c.lookup("big", "decode", "dp0-tp0-cp0-pp0")
        assert len(got["regions"]) == 400 and got["regions"][399]["addr"] == 400 << 20
        assert len(json.dumps(got)) > 16384
        r.deregister()
