"""One SGLang prefill or decode rank as its own process, replaying the call
sequence of SGLang 0.5.23's scheduler (``disaggregation/prefill.py`` and
``decode.py``) against the pdxfer backend, for test_sglang.py.

Usage: ``python sglang_rank.py '<json spec>'``. With ``spec["cp"]`` the prefill
ranks of one attention CP group reduce their polls (MIN) through files, as
SGLang's ``poll_and_all_reduce_attn_cp_tp_group`` does, and each CP rank holds
the room's rows only where it is the sender. The classes come from SGLang's
own ``get_kv_class`` after SGLang's ``load_plugins()`` found pdxfer's entry
point (``spec["plugin_site"]``), or straight from ``pdxfer.sglang`` when that
is null. KVArgs is SGLang's class, filled as ``_init_kv_manager`` fills it
(``kv_layer_ids=[]``); pools and SGLang's metadata buffers are numpy arrays in
host memory. Prints one JSON line per room; the decode checks every KV,
metadata and state row it owns, and that nothing outside the rooms' rows
changed (the whole pools are compared with the expected image).
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import sglang_env  # noqa: E402

sglang_env.setup()  # before pdxfer: its adapter then subclasses SGLang's base classes
from pdxfer.synthetic import pattern  # noqa: E402

SENTINEL = np.uint64(0xEEEEEEEEEEEEEEEE)
POISON = 999  # room offset of the rows a CP rank holds where it is not the sender
POOL_PAGES = 64
META_ROWS = 6
STATE_SLOTS = 8
HIDDEN = 32
# SGLang's ten metadata buffers (MetadataBuffers.get_buf_infos without the
# sampling-mask, DSA and checksum extras): (name, width, numpy dtype)
META = [("output_ids", 16, np.int32), ("cached_tokens", 16, np.int32),
        ("output_token_logprobs_val", 16, np.float32), ("output_token_logprobs_idx", 16, np.int32),
        ("output_top_logprobs_val", 128, np.float32), ("output_top_logprobs_idx", 128, np.int32),
        ("output_topk_p", 16, np.float32), ("output_topk_index", 16, np.int64),
        ("output_hidden_states", HIDDEN, np.uint16), ("bootstrap_room", 8, np.uint64)]
STATE = [("conv", 96), ("temporal", 160)]  # a Mamba component: two tensors, bytes per slot


def entry_keys(s, local: bool):
    """Pattern key and row bytes of each KV entry (the prefill's local ones, or all)."""
    layers = range(s["start_layer"], s["start_layer"] + s["local_layers"]) if local else range(s["layers"])
    groups = 1 if s["mla"] else 2
    keys = [(g * 1000 + l, s["row"]) for g in range(groups) for l in layers]
    keys += [(5000 + j, s["draft_row"]) for j in range(s["draft"])]
    return keys


def room_pages(room, n, stride):
    return [(room * 5 + i * stride) % POOL_PAGES for i in range(n)]


def meta_row(room, name, width, dtype):
    raw = pattern(room, 0x800 + META.index(next(m for m in META if m[0] == name)), np.arange(1), 8)[0]
    row = np.frombuffer(np.resize(raw, (width * np.dtype(dtype).itemsize + 7) // 8).tobytes(),
                        dtype=dtype)[:width].copy()
    if name == "bootstrap_room":
        row[:] = 0
        row[0] = room
    return row


def state_slot(room, side):
    return (room + (0 if side == "prefill" else 3)) % STATE_SLOTS


class Rank:
    def __init__(self, s):
        self.s = s
        self.role = s["role"]
        if s.get("plugin_site"):
            self.u = sglang_env.load_plugins(s["plugin_site"])
            self.backend = self.u.TransferBackend("pdxfer")
            self.cls = lambda kind: self.u.get_kv_class(self.backend, getattr(self.u.KVClassType, kind))
        else:
            self.u = sglang_env.setup()
            from pdxfer import sglang as S

            names = {"MANAGER": S.KVManager, "SENDER": S.KVSender, "RECEIVER": S.KVReceiver}
            from sglang.srt.disaggregation.base.conn import KVArgs

            self.cls = lambda kind: KVArgs if kind == "KVARGS" else names[kind]
        sglang_env.set_parallel(**s["parallel"])
        # attention CP: the prefill ranks of one CP group reduce their polls (MIN) as
        # SGLang's poll_and_all_reduce_attn_cp_tp_group does, through files in cp["dir"]
        self.cp = s.get("cp") if self.role == "prefill" else None
        from sglang.srt.disaggregation.base.conn import StateType

        p, local = s["page"], self.role == "prefill"
        self.keys = entry_keys(s, local)
        dcp = s["parallel"]["attn_dcp_size"]
        scale = lambda k: dcp if k >= 5000 and not local else 1  # noqa: E731 - unsharded draft pool: page V
        self.kv = [np.full((POOL_PAGES * p * scale(k), r // 8), SENTINEL, dtype=np.uint64) for k, r in self.keys]
        self.meta = [np.zeros((META_ROWS, w), dtype=d) for _, w, d in META]
        self.state = [np.full((STATE_SLOTS, b // 8), SENTINEL, dtype=np.uint64) for _, b in STATE] \
            if s["state"] else []
        a = self.cls("KVARGS")()
        a.engine_rank = s["engine_rank"]
        a.pp_rank = s["parallel"]["pp_rank"]
        a.system_dp_rank = s["system_dp_rank"]
        a.kv_cache_dtype_str = "bfloat16"
        a.kv_layout = None
        a.prefill_start_layer = s["start_layer"] if local else 0
        a.kv_data_ptrs = [b.ctypes.data for b in self.kv]
        a.kv_data_lens = [b.nbytes for b in self.kv]
        # the draft pool is not DCP-sharded on the decode (SGLang's Mooncake path)
        a.kv_item_lens = [p * r * scale(k) for k, r in self.keys]
        a.num_draft_entries = s["draft"]
        a.kv_layer_ids = []
        a.page_size = p
        a.aux_data_ptrs = [b.ctypes.data for b in self.meta]
        a.aux_data_lens = [b.nbytes for b in self.meta]
        a.aux_item_lens = [b[0].nbytes for b in self.meta]
        a.state_types = [StateType.MAMBA] if self.state else []
        a.state_data_ptrs = [[b.ctypes.data for b in self.state]] if self.state else []
        a.state_data_lens = [[b.nbytes for b in self.state]] if self.state else []
        a.state_item_lens = [[b[0].nbytes for b in self.state]] if self.state else []
        a.is_hybrid_mla_backend = False
        a.ib_device = None
        a.gpu_id = 0
        self.kv_args = a
        sa = type("ServerArgs", (), dict(s["server_args"]))()
        mode = self.u.DisaggregationMode.PREFILL if local else self.u.DisaggregationMode.DECODE
        self.mgr = self.cls("MANAGER")(a, mode, sa, s["mla"])
        from sglang.srt.disaggregation.base.conn import BaseKVManager

        assert isinstance(self.mgr, BaseKVManager), "the manager is one of SGLang's"

    # ----- prefill: PrefillBootstrapQueue + send_kv_chunk + inflight queue -----

    def prefill(self):
        s, p, K = self.s, self.s["page"], self.u.KVPoll
        out = []
        for r in s["rooms"]:
            room, total = r["room"], r["total"]
            pages = room_pages(room, -(-total // p), 7)
            loc = np.array([pages[t // p] * p + t % p for t in range(total)], dtype=np.int64)
            # a CP rank holds the room's rows only where it is the sender (the others
            # hold another room's), so a row sent from the wrong CP rank shows on the decode
            mine = self.cp_owned(r["prefix"], total)
            for (key, rb), buf in zip(self.keys, self.kv):
                buf[loc] = pattern(room, key, np.arange(total), rb // 8)
                buf[loc[~mine]] = pattern(room + POISON, key, np.arange(total)[~mine], rb // 8)
            own_rows = room if self.sends_rows() else room + POISON
            if self.state:
                for i, buf in enumerate(self.state):
                    buf[state_slot(room, "prefill")] = pattern(own_rows, 0x900 + i, np.arange(1), buf.shape[1])[0]
            addr = s["bootstrap_addr"]
            sender = self.cls("SENDER")(mgr=self.mgr, bootstrap_addr=addr, bootstrap_room=room,
                                        req_has_disagg_prefill_dp_rank=False)
            res = {"room": room, "dummy_cp_rank": self.mgr.is_dummy_cp_rank,
                   "all_cp_ranks": self.mgr.enable_all_cp_ranks_for_transfer,
                   "polled_at_construction": int(sender.poll())}
            st = self.wait(sender, (K.WaitingForInput, K.Failed), pp=True)
            if st == K.WaitingForInput:
                prefix = sender.pop_decode_prefix_len()
                res["prefix_seen"] = prefix
                num_pages = -(-(total - prefix) // p)
                idx = room % META_ROWS
                sender.init(num_pages, idx)
                start, chunk = prefix, r["chunk"]
                while True:
                    end = min(start + chunk, total) if chunk else total
                    last = end >= total
                    if not last:
                        end -= end % p
                    if last:
                        for (name, w, d), buf in zip(META, self.meta):
                            buf[idx] = meta_row(own_rows, name, w, d)
                    kv_idx = loc[start:end]
                    page_idx = kv_idx[::p] // p
                    state_idx = [[np.array([state_slot(room, "prefill")], dtype=np.int64)]] \
                        if last and self.state else None
                    if sender.should_send_kv_chunk(len(page_idx), last):
                        sender.send(page_idx.astype(np.int32), state_idx, num_kv_tokens=end - start)
                    start = end
                    if r.get("abort") == "prefill":
                        time.sleep(0.05)
                        sender.abort()  # the request was aborted mid-transfer
                        break
                    if last:
                        break
                    if r.get("abort") == "decode":
                        self.wait(sender, (K.Failed,), limit=10)
                st = self.wait(sender, (K.Success, K.Failed))
                m = sender.get_transfer_metric()
                res["metric_bytes"] = m.transfer_total_bytes
            res["poll"] = int(st)
            if st == K.Failed:
                try:
                    sender.failure_exception()
                except Exception as e:  # noqa: BLE001 - the scheduler catches Exception
                    res["error"] = [type(e).__name__, getattr(e, "kind", None), str(e)]
            sender.clear()
            out.append(res)
            print(json.dumps(res), flush=True)
        return out

    # ----- decode: DecodePreallocQueue + DecodeTransferQueue -----

    def decode(self):
        s, p, K = self.s, self.s["page"], self.u.KVPoll
        dcp = s["parallel"]["attn_dcp_size"]
        rank = s["parallel"]["attn_dcp_rank"]
        v = p * dcp
        addr = s["bootstrap_addr"]
        expect_kv = [b.copy() for b in self.kv]
        expect_state = [b.copy() for b in self.state]
        expect_meta = [b.copy() for b in self.meta]
        deadline = time.monotonic() + 30
        while not self.mgr.try_ensure_parallel_info(addr):
            assert time.monotonic() < deadline, "prefill never listed all ranks"
            time.sleep(0.02)
        info = self.mgr.prefill_info_table[addr]
        for r in s["rooms"]:
            room, total, prefix = r["room"], r["total"], r["prefix"]
            recv = self.cls("RECEIVER")(mgr=self.mgr, bootstrap_addr=addr, bootstrap_room=room)
            res = {"room": room}
            assert recv.poll() == K.Bootstrapping
            dp = 0 if info.dp_size == 1 else room % info.dp_size  # follow_bootstrap_room
            recv.init(dp)
            st = self.wait(recv, (K.WaitingForInput, K.Failed))
            res["handshake"] = int(st)
            if st == K.WaitingForInput:
                dst = room_pages(room, -(-(total - prefix) // v), 3)
                idx = (room + 1) % META_ROWS
                state_idx = [[np.array([state_slot(room, "decode")], dtype=np.int64)]] if self.state else None
                recv.send_metadata(np.array(dst, dtype=np.int32), idx, state_idx, decode_prefix_len=prefix)
                if r.get("abort") == "decode":
                    self.wait_landed(dst, p)  # mid-transfer: the first chunk's rows are here
                    recv.abort()
                    recv.ensure_abort_notified(force_arm=True)
                    d0 = time.monotonic() + 20
                    while not self.mgr.is_abort_release_safe(room, len(recv.bootstrap_infos)):
                        assert time.monotonic() < d0, "abort never fenced"
                        time.sleep(0.01)
                    res["fenced"] = True
                st = self.wait(recv, (K.Success, K.Failed))
                pos = np.arange(prefix, total)
                rel = pos - prefix
                owned = pos % dcp == rank
                pg = np.array(dst, dtype=np.int64)[rel // v]
                rows = pg * p + (rel % v) // dcp
                drows = pg * v + rel % v  # draft pools are not sharded (page = V)
                written = []
                for (key, rb), buf, exp in zip(self.keys, self.kv, expect_kv):
                    draft = key >= 5000
                    rr = drows if draft else rows[owned]
                    pp = pos if draft else pos[owned]
                    want = pattern(room, key, pp, rb // 8)
                    if st == K.Success:
                        exp[rr] = want
                    else:  # partially written: only the room's rows may differ
                        exp[rr] = buf[rr]
                    written.append(len(rr) * rb)
                if st == K.Success:
                    for (name, w, d), exp in zip(META, expect_meta):
                        exp[idx] = meta_row(room, name, w, d)
                    assert self.meta[-1][idx, 0] == room, "metadata gate: bootstrap_room row"
                    for i, exp in enumerate(expect_state):
                        exp[state_slot(room, "decode")] = pattern(room, 0x900 + i, np.arange(1), exp.shape[1])[0]
                else:
                    for exp, buf in zip(expect_meta, self.meta):
                        exp[idx] = buf[idx]
                    for exp, buf in zip(expect_state, self.state):
                        exp[state_slot(room, "decode")] = buf[state_slot(room, "decode")]
                for i, (buf, exp) in enumerate(zip(self.kv, expect_kv)):
                    bad = np.nonzero((buf != exp).any(axis=1))[0]
                    assert not len(bad), f"room {room} entry {i}: rows {bad[:8].tolist()} differ ({len(bad)})"
                for i, (buf, exp) in enumerate(zip(self.meta, expect_meta)):
                    assert (buf == exp).all(), f"room {room}: metadata buffer {META[i][0]} differs"
                for i, (buf, exp) in enumerate(zip(self.state, expect_state)):
                    assert (buf == exp).all(), f"room {room}: state tensor {i} differs"
                res["bytes_checked"] = sum(written) if st == K.Success else 0
                res["checksum_comparable"] = self.mgr.should_verify_kv_checksum(addr)
            res["poll"] = int(st)
            if st == K.Failed:
                try:
                    recv.failure_exception()
                except Exception as e:  # noqa: BLE001
                    res["error"] = [type(e).__name__, getattr(e, "kind", None), str(e),
                                    getattr(e, "failure_reason", None) is not None]
            recv.clear()
            print(json.dumps(res), flush=True)

    def wait(self, conn, states, limit=30.0, pp=False):
        deadline = time.monotonic() + limit
        while True:
            st = conn.poll_pp_consensus() if pp and self.s["parallel"]["pp_size"] > 1 else conn.poll()
            if self.cp is not None:
                st = self.cp_reduce(conn.bootstrap_room, int(st))
            if st in states or time.monotonic() > deadline:
                return st
            time.sleep(0.002)

    def cp_reduce(self, room, st):
        """The MIN of the CP group's latest polls of ``room`` (a rank not heard from: Bootstrapping)."""
        d, c, n = self.cp["dir"], self.s["parallel"]["attn_cp_rank"], self.s["parallel"]["attn_cp_size"]
        tmp = os.path.join(d, f".{room}-{c}")
        with open(tmp, "w") as f:
            f.write(str(st))
        os.replace(tmp, os.path.join(d, f"{room}-{c}"))
        vals = []
        for k in range(n):
            try:
                with open(os.path.join(d, f"{room}-{k}")) as f:
                    vals.append(int(f.read()))
            except (FileNotFoundError, ValueError):
                vals.append(int(self.u.KVPoll.Bootstrapping))
        return min(vals)

    def cp_owned(self, prefix, total):
        """Which positions of the room this CP rank is the sender of (all without CP)."""
        pos = np.arange(total)
        if self.cp is None:
            return np.ones(total, dtype=bool)
        c, n = self.s["parallel"]["attn_cp_rank"], self.s["parallel"]["attn_cp_size"]
        if not self.mgr.enable_all_cp_ranks_for_transfer:
            return (pos >= prefix) if c == 0 else np.zeros(total, dtype=bool)
        p = self.s["page"]
        pages = -(-(total - prefix) // p)
        base, rem = divmod(pages, n)
        lo = c * base + min(c, rem)
        hi = lo + base + (1 if c < rem else 0)
        return (pos >= prefix + lo * p) & (pos < prefix + hi * p)

    def sends_rows(self):
        """The aux and state rows come from CP rank 0."""
        return self.cp is None or self.s["parallel"]["attn_cp_rank"] == 0

    def wait_landed(self, dst, p, limit=20.0):
        rows = (np.asarray(dst, dtype=np.int64)[:, None] * p + np.arange(p)[None, :]).reshape(-1)
        deadline = time.monotonic() + limit
        while (self.kv[0][rows] == SENTINEL).all():
            assert time.monotonic() < deadline, "no KV row landed"
            time.sleep(0.0005)


def main() -> int:
    s = json.loads(sys.argv[1])
    os.environ.update(s.get("env") or {})
    rank = Rank(s)
    try:
        if rank.role == "prefill":
            rank.prefill()
            sys.stdin.read()  # stay registered until the decode ranks are done
        else:
            rank.decode()
    finally:
        rank.mgr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
