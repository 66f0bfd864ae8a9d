"""Prefill attention CP to decode DCP (and to a decode without DCP) through
SGLang 0.5.23's real classes, one process per rank (sglang_rank.py): the CP
ranks' polls are MIN-reduced as SGLang's scheduler reduces them, in SGLang's
rank-0 mode and with ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER``; every KV,
metadata and state row is checked on the decode, and the whole pools against
their expected image. Each CP rank holds the room's rows only where it is the
sender, so a row read from another CP rank fails the check.
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import sglang_env  # noqa: E402
from test_sglang import PAGE, ROW, SUCCESS, FAILED, parallel, run, spec  # noqa: E402
from pdxfer import sglang as S  # noqa: E402

ALL_CP = {"SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1"}


@pytest.fixture(scope="module", autouse=True)
def sglang_installed():
    sglang_env.ensure_installed()


@pytest.fixture
def server():
    srv = S.BootstrapServer("127.0.0.1", 0)
    yield srv
    srv.close()


def cp_run(server, tmp_path, rooms, c, d, *, env=None, page=PAGE, state=False):
    """C prefill CP ranks (one attention CP group) and D decode DCP ranks."""
    a = f"127.0.0.1:{server.port}"
    group = tmp_path / "cp"
    group.mkdir()
    prefills = [spec("prefill", a, rooms, port=server.port, page=page, state=state, env=env,
                     cp={"dir": str(group)}, par=parallel(cp=c) | {"attn_cp_rank": k}) for k in range(c)]
    decodes = [spec("decode", a, rooms, page=page, state=state, engine_rank=r,
                    par=parallel(tp=d, rank=r, dcp=d)) for r in range(d)]
    return run(prefills, decodes, timeout=120)


def owned(total, prefix, d, r):
    return sum(1 for t in range(prefix, total) if t % d == r)


def check(ps, ds, rooms, d, *, layers=3):
    for r, dres in enumerate(ds):
        assert [x["poll"] for x in dres] == [SUCCESS] * len(rooms), (r, dres)
        for x, room in zip(dres, rooms):
            assert x["bytes_checked"] == owned(room["total"], room["prefix"], d, r) * ROW * layers, (r, x)
    for k, pres in enumerate(ps):
        assert [x["poll"] for x in pres] == [SUCCESS] * len(rooms), (k, pres)


def test_prefill_cp2_to_a_decode_without_dcp_leaves_bootstrap(server, tmp_path):
    """Under the CP-reduced poll CP rank 1 (a dummy) must reach WaitingForInput and Success too."""
    rooms = [{"room": 101, "total": 45, "prefix": 0, "chunk": 16},
             {"room": 102, "total": 61, "prefix": 16, "chunk": 24}]
    ps, ds = cp_run(server, tmp_path, rooms, 2, 1)
    check(ps, ds, rooms, 1)
    p0, p1 = ps
    assert [x["prefix_seen"] for x in p0] == [0, 16]
    assert [x["prefix_seen"] for x in p1] == [0, 0], "a dummy CP rank's pop_decode_prefix_len is 0"
    assert not any(x["dummy_cp_rank"] or x["all_cp_ranks"] for x in p0)
    assert all(x["dummy_cp_rank"] and not x["all_cp_ranks"] for x in p1)
    assert all(x["polled_at_construction"] == 2 for x in p1), "a dummy sender is WaitingForInput at once"


def test_rank0_mode_prefill_cp2_to_decode_dcp4(server, tmp_path):
    rooms = [{"room": 111, "total": 173, "prefix": 0, "chunk": 64},
             {"room": 112, "total": 150, "prefix": PAGE * 4 * 2, "chunk": 40},
             {"room": 113, "total": 1, "prefix": 0, "chunk": 0}]
    ps, ds = cp_run(server, tmp_path, rooms, 2, 4, state=True)
    check(ps, ds, rooms, 4)


def test_all_cp_ranks_c2_to_dcp4_chunked_prefixed_state(server, tmp_path):
    rooms = [{"room": 121, "total": 205, "prefix": 0, "chunk": 64},  # chunked, odd length
             {"room": 122, "total": 150, "prefix": PAGE * 4 * 2, "chunk": 40},  # decode prefix hit
             {"room": 123, "total": 1, "prefix": 0, "chunk": 0},  # one token: CP rank 1's share is empty
             {"room": 124, "total": 64, "prefix": 64, "chunk": 0}]  # all cached: only aux and state
    ps, ds = cp_run(server, tmp_path, rooms, 2, 4, env=ALL_CP, state=True)
    check(ps, ds, rooms, 4)
    assert all(x["all_cp_ranks"] and not x["dummy_cp_rank"] for p in ps for x in p)


@pytest.mark.parametrize("c,d", [(4, 2), (3, 4), (2, 2)])
def test_all_cp_ranks_c_against_d(server, tmp_path, c, d):
    rooms = [{"room": 131, "total": 203, "prefix": 0, "chunk": 80},
             {"room": 132, "total": 20, "prefix": 0, "chunk": 0}]  # 3 pages: fewer than 4 CP ranks
    ps, ds = cp_run(server, tmp_path, rooms, c, d, env=ALL_CP)
    check(ps, ds, rooms, d)


@pytest.mark.parametrize("page", [1, 64])
def test_all_cp_ranks_page_sizes(server, tmp_path, page):
    rooms = [{"room": 141, "total": 37 if page == 1 else 300, "prefix": 0, "chunk": 0},
             {"room": 142, "total": 29 if page == 1 else 700, "prefix": 2 * page * 2,
              "chunk": 8 if page == 1 else 256}]
    ps, ds = cp_run(server, tmp_path, rooms, 2, 2, env=ALL_CP, page=page)
    check(ps, ds, rooms, 2)


@pytest.mark.parametrize("env", [ALL_CP, None], ids=["all-cp", "rank0"])
def test_an_abort_on_either_side_with_cp_senders(server, tmp_path, env):
    """Every CP sender fails promptly, the decode's pages are fenced, the next room is served."""
    rooms = [{"room": 151, "total": 160, "prefix": 0, "chunk": 16, "abort": "decode"},
             {"room": 152, "total": 160, "prefix": 0, "chunk": 16, "abort": "prefill"},
             {"room": 153, "total": 40, "prefix": 0, "chunk": 16}]
    ps, ds = cp_run(server, tmp_path, rooms, 2, 2, env=env)
    for dres in ds:
        assert [x["poll"] for x in dres] == [FAILED, FAILED, SUCCESS], dres
        assert dres[0]["fenced"]
    for pres in ps:
        assert [x["poll"] for x in pres] == [FAILED, FAILED, SUCCESS], pres


def dict_ns(d):
    import types

    return types.SimpleNamespace(**d)


@pytest.mark.parametrize("extra,all_cp,dummy", [
    ({}, [False, False], [False, True]),  # SGLang's default: CP rank 1 is a dummy
    ({"enable_dsa_cache_layer_split": True}, [True, True], [False, False]),
    ({"enable_kv_cache_sharding": True, "kv_shard_size": 2}, [True, True], [False, False]),
    ({"enable_cp_tp_group_sharing": True}, [False, False], [False, False]),
])
def test_cp_rank_attributes_are_sglangs(server, monkeypatch, extra, all_cp, dummy):
    """``CommonKVManager.__init__``'s rules (common/conn.py:373-389, 431-440), from get_parallel()."""
    from test_sglang import _Args, _sa

    monkeypatch.setenv("PDXFER_SGLANG_POOL_MEMORY", "host")
    monkeypatch.setenv("PDXFER_SGLANG_CLUSTER", "cp-attrs-" + "-".join(sorted(extra)))
    keep = []
    mgrs = [S.KVManager(_Args(0, keep), "prefill", _sa(server.port), True,
                        parallel=dict_ns(parallel(cp=2) | {"attn_cp_rank": c} | extra)) for c in range(2)]
    try:
        assert [m.enable_all_cp_ranks_for_transfer for m in mgrs] == all_cp
        assert [m.is_dummy_cp_rank for m in mgrs] == dummy
        assert [(m.attn_cp_size, m.attn_cp_rank) for m in mgrs] == [(2, 0), (2, 1)], "from get_parallel()"
        if extra.get("enable_cp_tp_group_sharing"):
            # CP rank r transfers as TP rank r of a CP-1 prefill
            assert [(m.topology.attn_tp_size, m.topology.attn_tp_rank, m.topology.attn_cp_size)
                    for m in mgrs] == [(2, 0, 1), (2, 1, 1)]
    finally:
        for m in mgrs:
            m.close()
