"""PdxferConnector under vLLM 0.33's own classes on the CPU: a prefill and a
decode instance as two processes (instance.py), the test as the PD proxy
(prefill request first, its kv_transfer_params forwarded verbatim to the
decode request). Every byte of every loaded request is checked on the decode,
and both schedulers end with no request, no held block and no open room."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import socket
import time
from typing import Any, Dict, List, Optional

import pytest

import instance

BLOCK = 16
BLOCKS = 64
TIMEOUT = 8.0  # the instances' transfer_timeout (s)


def _ephemeral_low() -> int:
    """The first port the kernel hands out for a bind to port 0 or a connect."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PORTS = random.Random(os.getpid())


def _port() -> int:
    """A free port for an instance to listen on seconds from now. Drawn below
    the ephemeral range: a port the kernel handed out for a bind to port 0 is
    free again once closed, and the next bind to 0 (a pdxfer agent's data-plane
    listener, say) may take it before the instance listens on it."""
    low = _ephemeral_low()
    for _ in range(200):
        p = _PORTS.randrange(10000, max(10001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                continue
        return p
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Inst:
    """One vLLM instance: ``opts["tp"]`` rank processes, rank 0 with the scheduler."""

    def __init__(self, role: str, opts: Dict[str, Any]):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        leads, self.ranks = [], []
        for rank in range(1, opts.get("tp", 1)):
            a, b = ctx.Pipe()
            leads.append(a)
            self.ranks.append(ctx.Process(target=instance.follower, args=(role, opts, rank, b), daemon=True))
        self.proc = ctx.Process(target=instance.main, args=(role, opts, child, leads), daemon=True)
        self.proc.start()
        for r in self.ranks:
            r.start()
        self.opts = opts
        self.events: List[tuple] = []

    def wait(self, pred, timeout: float = 120.0):
        end = time.monotonic() + timeout
        while True:
            for i, ev in enumerate(self.events):
                if pred(ev):
                    return self.events.pop(i)
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no matching event within {timeout} s; have {self.events}")
            if self.conn.poll(min(left, 0.5)):
                ev = self.conn.recv()
                if ev[0] == "error":
                    raise AssertionError("instance failed:\n" + ev[1])
                self.events.append(ev)
            elif not self.proc.is_alive():
                raise AssertionError(f"instance exited with {self.proc.exitcode}")

    def send(self, *cmd) -> None:
        self.conn.send(cmd)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.send("stop")
                self.wait(lambda e: e[0] == "stopped", 30)
            finally:
                for p in [self.proc] + self.ranks:
                    p.join(10)
                    if p.is_alive():
                        p.kill()


def _opts(engine_id: str, boot_port: int, **kw) -> Dict[str, Any]:
    o = {"block_size": BLOCK, "num_blocks": BLOCKS, "engine_id": engine_id, "dist_port": _port(),
         "extra": {"bootstrap_port": boot_port, "transport": "tcp", "transfer_timeout": TIMEOUT}}
    o.update(kw)
    return o


@pytest.fixture(scope="module")
def pd():
    """A prefill, a decode, and a decode whose model dtype differs (fp16),
    all started at once (each import of vLLM takes seconds)."""
    boot = _port()
    p = Inst("kv_producer", _opts("prefill-0", boot))
    d = Inst("kv_consumer", _opts("decode-0", boot))
    d16 = Inst("kv_consumer", _opts("decode-fp16", boot, dtype="float16"))
    try:
        for i in (p, d, d16):
            i.wait(lambda e: e[0] == "ready", 300)
        yield p, d, d16
    finally:
        for i in (d16, d, p):
            i.stop()


def _prompt(n: int, seed: int, prefix: Optional[List[int]] = None) -> List[int]:
    head = list(prefix or [])
    return head + [(seed * 131 + i * 17) % 1000 + 2 for i in range(n - len(head))]


def _pd_request(p: Inst, d: Inst, rid: str, prompt: List[int], decode_tokens: int = 3) -> Dict[str, Any]:
    """The proxy: prefill first, its kv_transfer_params to the decode verbatim."""
    p.send("add", {"id": rid, "prompt": prompt, "max_tokens": 1,
                   "params": {"do_remote_decode": True, "do_remote_prefill": False}})
    ev = p.wait(lambda e: e[0] == "finished" and e[1] == rid)
    params = ev[3]
    assert params and params["do_remote_prefill"] is True, ev
    assert params["remote_num_tokens"] == len(prompt)
    d.send("add", {"id": "d-" + rid, "prompt": prompt, "max_tokens": decode_tokens, "params": params})
    loaded = d.wait(lambda e: e[0] == "loaded" and e[1] == "d-" + rid)[2]
    loaded["prefill_hit"] = p.wait(lambda e: e[0] == "scheduled" and e[1] == rid)[2]
    d.wait(lambda e: e[0] == "finished" and e[1] == "d-" + rid)
    decoded = time.monotonic()
    p.wait(lambda e: e[0] == "finished_sending" and rid in e[1])
    # every prefill rank's finished_sending (vLLM aggregates them) after the decode's end
    loaded["freed_after_s"] = time.monotonic() - decoded
    return loaded


def _no_leaks(*insts: Inst) -> None:
    for inst in insts:
        deadline = time.monotonic() + 20
        while True:
            inst.send("check")
            lk = inst.wait(lambda e: e[0] == "leaks")[1]
            clean = (lk["requests"] == 0 and lk["waiting"] == 0 and lk["running"] == 0
                     and lk["ref_nonzero"] == 0 and lk["req_to_blocks"] == 0
                     and lk["free_blocks"] == lk["num_blocks"] - 1 and not lk["pending_push"]
                     and lk["worker_rooms"] == 0)
            if clean:
                break
            assert time.monotonic() < deadline, f"leaked: {lk}"
            time.sleep(0.2)


def test_sequential_proxy_flow_every_byte(pd):
    p, d, _ = pd
    for i, n in enumerate((5, 16, 100)):
        got = _pd_request(p, d, f"seq-{i}", _prompt(n, i))
        assert got["bad_rows"] == 0, got
        assert got["tokens"] == n and got["bytes"] == n * 2 * instance.ROW * 2
        assert got["decode_prefix_len"] == 0 and got["prefill_hit"] == 0
    _no_leaks(p, d)


def test_chunked_prefill_chunks_not_page_aligned(pd):
    # max_num_batched_tokens=40: chunks of 40 tokens over 16-token blocks
    p, d, _ = pd
    got = _pd_request(p, d, "chunked", _prompt(150, 7))
    assert got["bad_rows"] == 0 and got["tokens"] == 150
    _no_leaks(p, d)


def test_layer_saves_before_the_decode_registers_are_queued_then_sent(pd):
    """Sequential flow: the prefill's four steps (40-token chunks of 150) all
    run before the decode exists; each step's layers are queued as saved (with
    their events on device pools) and sent layer by layer once the decode's
    metadata arrives: one chunk per step, every layer of each, every byte."""
    p, d, _ = pd
    got = _pd_request(p, d, "queued", _prompt(150, 17))
    assert got["bad_rows"] == 0 and got["tokens"] == 150, got
    p.send("sends")
    sends = p.wait(lambda e: e[0] == "sends")[1]
    steps = -(-150 // 40)
    assert sends["chunks"].get("queued") == steps, sends
    assert sends["layers"].get("queued") == 2 * steps, sends  # 2 layers
    _no_leaks(p, d)


def test_decode_and_prefill_prefix_hits(pd):
    p, d, _ = pd
    base = _prompt(64, 11)
    first = _pd_request(p, d, "prefix-a", base + _prompt(9, 12))
    assert first["bad_rows"] == 0
    # the second prompt shares 64 tokens (4 blocks) with the first: cached on both sides
    got = _pd_request(p, d, "prefix-b", base + _prompt(30, 13))
    assert got["bad_rows"] == 0 and got["tokens"] == 94
    assert got["decode_prefix_len"] == 64, got  # only 30 tokens moved
    assert got["prefill_hit"] == 64, got
    _no_leaks(p, d)


def test_decode_timeout_fails_the_request_with_a_typed_reason(pd, caplog):
    p, d, _ = pd
    # kv_transfer_params of a prefill request that never ran: no sender for the room
    params = {"do_remote_prefill": True, "do_remote_decode": False, "pdxfer_room_key": "never-sent",
              "remote_bootstrap_addr": f"http://127.0.0.1:{p_boot(p)}", "remote_num_tokens": 20}
    t0 = time.monotonic()
    d.send("add", {"id": "d-lost", "prompt": _prompt(20, 3), "max_tokens": 2, "params": params})
    ev = d.wait(lambda e: e[0] == "failed_recving" and "d-lost" in e[1], 3 * TIMEOUT + 30)
    assert ev[2], "the failed request's blocks are reported as load errors"
    assert time.monotonic() - t0 < 3 * TIMEOUT + 30
    fin = d.wait(lambda e: e[0] == "finished" and e[1] == "d-lost")
    assert "ERROR" in fin[2].upper() or "ABORT" in fin[2].upper(), fin
    assert any("KV load" in r or "transfer_timeout" in r for r in d_log(d)), "a typed reason was logged"
    _no_leaks(p, d)


def p_boot(p: Inst) -> int:
    return p.opts["extra"]["bootstrap_port"]


def d_log(d: Inst) -> List[str]:
    d.send("logs")
    return d.wait(lambda e: e[0] == "logs")[1]


def test_abort_on_the_decode_while_waiting_reports_once(pd):
    p, d, _ = pd
    params = {"do_remote_prefill": True, "do_remote_decode": False, "pdxfer_room_key": "abort-me",
              "remote_bootstrap_addr": f"http://127.0.0.1:{p_boot(p)}", "remote_num_tokens": 40}
    d.send("add", {"id": "d-abort", "prompt": _prompt(40, 5), "max_tokens": 2, "params": params})
    time.sleep(1.0)
    d.send("abort", "d-abort")
    _no_leaks(p, d)
    # and the pair still works afterwards
    got = _pd_request(p, d, "after-abort", _prompt(33, 21))
    assert got["bad_rows"] == 0
    _no_leaks(p, d)


def test_dtype_mismatch_is_a_typed_failure_naming_the_flag(pd):
    p, d, d16 = pd
    prompt = _prompt(24, 9)
    p.send("add", {"id": "mismatch", "prompt": prompt, "max_tokens": 1,
                   "params": {"do_remote_decode": True, "do_remote_prefill": False}})
    params = p.wait(lambda e: e[0] == "finished" and e[1] == "mismatch")[3]
    d16.send("add", {"id": "d-mismatch", "prompt": prompt, "max_tokens": 2, "params": params})
    ev = d16.wait(lambda e: e[0] == "failed_recving" and "d-mismatch" in e[1], 60)
    assert ev[2], "load-error blocks reported"
    d16.wait(lambda e: e[0] == "finished" and e[1] == "d-mismatch")
    logs = d_log(d16)
    assert any("kv_dtype_mismatch" in m and "--kv-cache-dtype" in m for m in logs), logs
    # the prefill's room was never taken: it is released within its deadline (2 x transfer_timeout)
    p.wait(lambda e: e[0] == "finished_sending" and "mismatch" in e[1], 2 * TIMEOUT + 30)
    _no_leaks(p, d16)


def test_plugin_registers_the_connector_by_name():
    """The vllm.general_plugins entry point's function: "PdxferConnector" then
    needs no module path (vLLM's factory resolves it); it is HMA-capable, so
    vLLM's default hybrid KV cache manager may stay on."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    from pdxfer.vllm import PdxferConnector, plugin

    plugin.register()
    plugin.register()  # vLLM may load plugins twice
    kt = KVTransferConfig(kv_connector="PdxferConnector", kv_role="kv_consumer")
    assert KVConnectorFactory.get_connector_class(kt) is PdxferConnector
    assert supports_hma(PdxferConnector)


def test_router_flow_decode_first_chunks_sent_as_computed(pd):
    """A router gives both sides one transfer_id and sends the decode first:
    its metadata waits in the prefill engine, and the prefill sends page-aligned
    chunks while its chunked prefill (40-token chunks) runs, each layer by layer
    from save_kv_layer."""
    p, d, _ = pd
    prompt = _prompt(150, 31)
    tid = "router-7f3a"
    d.send("add", {"id": "d-router", "prompt": prompt, "max_tokens": 2,
                   "params": {"do_remote_prefill": True, "transfer_id": tid, "remote_num_tokens": len(prompt),
                              "remote_bootstrap_addr": f"http://127.0.0.1:{p_boot(p)}"}})
    time.sleep(0.5)
    p.send("add", {"id": "p-router", "prompt": prompt, "max_tokens": 1,
                   "params": {"do_remote_decode": True, "transfer_id": tid}})
    got = d.wait(lambda e: e[0] == "loaded" and e[1] == "d-router")[2]
    assert got["bad_rows"] == 0 and got["tokens"] == 150, got
    d.wait(lambda e: e[0] == "finished" and e[1] == "d-router")
    p.wait(lambda e: e[0] == "finished" and e[1] == "p-router")
    p.wait(lambda e: e[0] == "finished_sending" and "p-router" in e[1])
    p.send("sends")
    sends = p.wait(lambda e: e[0] == "sends")[1]
    chunks = sends["chunks"].get("p-router", 0)
    assert chunks > 1, f"sent in more than one chunk as it was computed: {sends}"
    # each chunk layer by layer from save_kv_layer (2 layers)
    assert sends["layers"].get("p-router", 0) == 2 * chunks, sends
    _no_leaks(p, d)


def test_abort_on_the_prefill_frees_its_blocks_once_fenced(pd):
    p, d, _ = pd
    p.send("add", {"id": "p-abort", "prompt": _prompt(400, 8), "max_tokens": 1,
                   "params": {"do_remote_decode": True, "do_remote_prefill": False}})
    p.wait(lambda e: e[0] == "scheduled" and e[1] == "p-abort")
    p.send("abort", "p-abort")
    p.wait(lambda e: e[0] == "finished_sending" and "p-abort" in e[1], 30)
    _no_leaks(p, d)


def test_a_killed_prefill_fails_the_decode_request_before_its_timeout(pd):
    """A second prefill instance takes a decode's metadata (router flow) and is
    killed (SIGKILL) before it sends: the decode request fails through
    failed_recving with its blocks as load errors, from the broken link and
    not its transfer timeout, and the decode ends clean."""
    _, d, _ = pd
    boot = _port()
    victim = Inst("kv_producer", _opts("prefill-victim", boot))
    try:
        victim.wait(lambda e: e[0] == "ready", 300)
        params = {"do_remote_prefill": True, "transfer_id": "victim-1", "remote_num_tokens": 48,
                  "remote_bootstrap_addr": f"http://127.0.0.1:{boot}"}
        # the request's deadline starts when the decode worker opens its load,
        # after this: it cannot pass before t_add + TIMEOUT
        t_add = time.monotonic()
        d.send("add", {"id": "d-victim", "prompt": _prompt(48, 61), "max_tokens": 2, "params": params})
        time.sleep(2.0)  # the decode's receiver connected and sent its metadata
    finally:
        victim.proc.kill()
        victim.proc.join(10)
    ev = d.wait(lambda e: e[0] == "failed_recving" and "d-victim" in e[1], 2 * TIMEOUT + 30)
    failed_after = time.monotonic() - t_add
    assert ev[2], "load-error blocks reported"
    reasons = [m for m in d_log(d) if "d-victim" in m and "failed" in m]
    assert reasons and all("no KV within" not in m for m in reasons), reasons  # not the timeout's reason
    assert failed_after < TIMEOUT, f"the broken link failed the load after {failed_after:.1f} s, " \
                                   f"before its {TIMEOUT:.0f} s timeout could ({reasons})"
    d.wait(lambda e: e[0] == "finished" and e[1] == "d-victim")
    assert any("(" in m for m in reasons), "the typed reason was logged"
    _no_leaks(d)
