"""The library's log records reach Python's logging module (loggers
``pdxfer.<target>``): the refusal of a miswired DCP pair arrives as a warning
naming the status kind and the peer instance."""

import logging

import numpy as np
import pytest

import pdxfer
from pdxfer.synthetic import SyntheticPools

PAGE, LAYERS, ROW = 8, 1, 64


def test_logger_names_follow_the_rust_module_path():
    assert pdxfer.log.logger_name("pdxfer::bootstrap::peer") == "pdxfer.bootstrap.peer"
    assert pdxfer.log.logger_name("pdxfer") == "pdxfer"
    assert pdxfer.log.logger_name("ureq::pool") == "pdxfer.ureq.pool"


def test_refused_pair_is_logged_to_the_pdxfer_logger(caplog):
    caplog.set_level(logging.WARNING, logger="pdxfer")
    with pdxfer.bootstrap.BootstrapServer() as srv:
        engines = []
        try:
            for r in range(2):
                pp = SyntheticPools(LAYERS, ROW, PAGE, 8)
                t = pdxfer.Topology.mla(LAYERS, ROW, page_size=PAGE, engine_rank=r, attn_tp_size=2,
                                        attn_tp_rank=r, dcp_size=2, dcp_rank=r)
                engines.append(pdxfer.Engine("prefill", "py-log", srv.url, t, pp.kv))
            dp = SyntheticPools(LAYERS, ROW, PAGE, 8)
            bad = pdxfer.Topology.mla(LAYERS, ROW, page_size=PAGE, engine_rank=0, attn_tp_size=2, attn_tp_rank=0,
                                      dcp_size=2, dcp_rank=1)
            d = pdxfer.Engine("decode", "py-log", srv.url, bad, dp.kv)
            engines.append(d)
            with pytest.raises(pdxfer.CompatError):
                d.receiver(1)
            refusals = [r for r in caplog.records if "dcp_rank_mismatch" in r.getMessage()
                        and r.name == "pdxfer.bootstrap.peer"]
            assert len(refusals) == 1, [r.getMessage() for r in caplog.records]
            rec = refusals[0]
            assert rec.levelno == logging.WARNING
            assert "refused" in rec.getMessage() and "peer instance" in rec.getMessage()
            # and the room's failure, naming the room and the status kind
            failed = [r for r in caplog.records if r.name.startswith("pdxfer.engine")
                      and "room 1 failed" in r.getMessage()]
            assert len(failed) == 1, [r.getMessage() for r in caplog.records]
            assert "dcp_rank_mismatch (-203)" in failed[0].getMessage()
            assert failed[0].levelno == logging.WARNING

            # stopped: nothing more arrives; restarted: it does again
            pdxfer.log.stop()
            caplog.clear()
            with pytest.raises(pdxfer.CompatError):
                d.receiver(2)
            assert not [r for r in caplog.records if r.name.startswith("pdxfer.")]
            pdxfer.log.forward_to_logging(logging.INFO)
            with pytest.raises(pdxfer.CompatError):
                d.receiver(3)
            assert [r for r in caplog.records if "dcp_rank_mismatch" in r.getMessage()]
        finally:
            pdxfer.log.forward_to_logging(logging.INFO)
            for e in engines:
                e.close()
    assert np.all(dp.kv[0] == 0)
