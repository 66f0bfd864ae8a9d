#!/usr/bin/env python3
"""pdxfer's SGLang adapter with KV pools as torch CUDA tensors: one prefill
rank and two decode DCP ranks (decode ``--dcp-size 2``), each its own process
on one GPU, replaying SGLang 0.5.23's scheduler call sequence
(``disaggregation/prefill.py``: sender, ``pop_decode_prefix_len``, ``init``,
chunked ``send``; ``decode.py``: ``try_ensure_parallel_info``, receiver
``init``, ``send_metadata``, ``poll``) through ``pdxfer.sglang``.

MLA pools (one entry per layer, 576 bf16 = 1,152 bytes a row) are filled on the
prefill with a known pattern (``pdxfer.synthetic.pattern``); the decode pools
start as a sentinel. After each room's ``Success`` every decode rank copies its
whole pools back to the host and compares them with the expected image: every
row of a token it owns under DCP (``position % 2 == dcp_rank``, at SGLang's
virtual-page slot) holds the prefill's row, every other row is still the
sentinel; the metadata rows are checked too. The classes subclass the real
``sglang`` base classes when ``sglang`` is importable, else pdxfer's stand-ins;
the output says which.

Run (needs numpy; torch with CUDA for device pools):

    PDXFER_LIB=target/libpdxfer.so PYTHONPATH=python python3 scripts/sglang-gpu-check.py

Options: ``--memory device|host`` (default ``$PDXFER_SGLANG_POOL_MEMORY`` or
``device``; ``host`` uses numpy pools and needs no torch: the CPU test of this
script), ``--layers``, ``--tokens`` (the first room's length; the others are
derived), ``--page``, ``--gpu``, ``--timeout`` (seconds for the whole check).
The decode ranks' parallel state (attention TP 2, DCP 2) is what SGLang's
scheduler would have: server args, and with the real SGLang also its runtime
context (``get_parallel().override_permanently``); the output says which.
Output: one JSON line on stdout (``verified``, ``bytes`` of KV checked,
``readback_bytes``, ``seconds`` from ``send_metadata`` to ``Success`` summed
over the rooms of the slower rank, ...; with the ranks' results and errors
when not verified); exit 0 only when every rank verified every room.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

DCP = 2
SENTINEL = np.uint64(0xEEEEEEEEEEEEEEEE)
# A subset of SGLang's MetadataBuffers (host memory, as SGLang keeps them): (name, width, dtype)
META = [("output_ids", 16, np.int32), ("cached_tokens", 16, np.int32), ("bootstrap_room", 8, np.uint64)]
META_ROWS = 8


def rooms_for(tokens: int, page: int) -> list:
    """The rooms of the check: a chunked one, one with a decode prefix-cache hit
    (a multiple of page x DCP, as SGLang requires under DCP), one sent at once."""
    v = page * DCP
    return [{"room": 101, "total": tokens, "prefix": 0, "chunk": max(page, (tokens // 3) // page * page)},
            {"room": 102, "total": tokens * 2 // 3 + 5, "prefix": 2 * v, "chunk": 0},
            {"room": 103, "total": tokens // 2 + 13, "prefix": 0, "chunk": max(page, tokens // 4 // page * page)}]


def page_plan(rooms: list, page: int, role: str) -> tuple:
    """Disjoint, scattered page ids of each room in a pool (prefill: pages of
    ``page`` tokens from position 0; decode: virtual DCP pages of page x DCP
    tokens after the prefix); returns (pool pages, {room: [page ids]})."""
    v = page if role == "prefill" else page * DCP
    need = [-(-(r["total"] - (0 if role == "prefill" else r["prefix"])) // v) for r in rooms]
    pool = sum(need) + 5
    stride = 7 if pool % 7 else 11
    order = [(i * stride + 3) % pool for i in range(pool)]
    plan, at = {}, 0
    for r, n in zip(rooms, need):
        plan[r["room"]] = order[at:at + n]
        at += n
    return pool, plan


def meta_row(room: int, name: str, width: int, dtype) -> np.ndarray:
    from pdxfer.synthetic import pattern

    k = [m[0] for m in META].index(name)
    raw = pattern(room, 0x800 + k, np.arange(1), (width * np.dtype(dtype).itemsize + 7) // 8)[0]
    row = np.frombuffer(raw.tobytes(), dtype=dtype)[:width].copy()
    if name == "bootstrap_room":
        row[:] = 0
        row[0] = room
    return row


class Pools:
    """One rank's KV pools: ``rows`` rows of ``words`` u64 per layer, as torch
    CUDA tensors (``device``) or numpy arrays (``host``)."""

    def __init__(self, memory: str, gpu: int, layers: int, rows: int, words: int):
        self.memory = memory
        init = np.full((rows, words), SENTINEL, dtype=np.uint64)
        if memory == "device":
            import torch

            torch.cuda.set_device(gpu)
            self.torch = torch
            self.dev = torch.device("cuda", gpu)
            self.bufs = [torch.from_numpy(init.view(np.int64)).to(self.dev) for _ in range(layers)]
            torch.cuda.synchronize(self.dev)  # the sentinel is in place before pdxfer sees the pools
        else:
            self.bufs = [init.copy() for _ in range(layers)]

    def ptr(self, i: int) -> int:
        b = self.bufs[i]
        return int(b.data_ptr()) if self.memory == "device" else int(b.ctypes.data)

    def nbytes(self, i: int) -> int:
        b = self.bufs[i]
        return int(b.numel() * b.element_size()) if self.memory == "device" else int(b.nbytes)

    def write_rows(self, i: int, rows: np.ndarray, values: np.ndarray) -> None:
        if self.memory == "device":
            t = self.torch
            idx = t.from_numpy(rows.astype(np.int64)).to(self.dev)
            self.bufs[i][idx] = t.from_numpy(np.ascontiguousarray(values).view(np.int64)).to(self.dev)
        else:
            self.bufs[i][rows] = values

    def sync(self) -> None:
        if self.memory == "device":
            self.torch.cuda.synchronize(self.dev)

    def read(self, i: int) -> np.ndarray:
        """The whole pool, copied to the host."""
        b = self.bufs[i]
        if self.memory == "device":
            return b.cpu().numpy().view(np.uint64)
        return b.copy()


def sglang_classes() -> tuple:
    """(where the base classes come from, KVArgs class, prefill mode, decode mode)."""
    from pdxfer.sglang import conn

    if conn.HAVE_SGLANG:
        from sglang.srt.disaggregation.base.conn import KVArgs

        try:
            from sglang.srt.disaggregation.utils import DisaggregationMode

            modes = (DisaggregationMode.PREFILL, DisaggregationMode.DECODE)
        except Exception:  # noqa: BLE001 - utils needs more of SGLang than base/conn
            modes = ("prefill", "decode")
        try:
            from importlib.metadata import version

            ver = version("sglang")
        except Exception:  # noqa: BLE001
            ver = "?"
        return f"sglang {ver}", KVArgs, modes[0], modes[1]

    class KVArgs:  # the fields SGLang's _init_kv_manager fills
        pass

    return "pdxfer stand-ins (sglang not importable)", KVArgs, "prefill", "decode"


def publish_parallel(decode: bool, engine_rank: int) -> str:
    """With the real SGLang: states this rank's parallel values in SGLang's
    runtime context, as its scheduler process has them published (the adapter
    reads ``get_parallel()``); returns where the adapter takes them from."""
    from pdxfer.sglang import conn

    if not conn.HAVE_SGLANG:
        return "server_args"
    try:
        from sglang.srt import runtime_context as rc

        par = rc.get_parallel()
    except Exception:  # noqa: BLE001 - no runtime context in this SGLang: server_args it is
        return "server_args"
    if not hasattr(par, "override_permanently"):
        return "server_args"
    n = DCP if decode else 1
    values = {"attn_tp_size": n, "attn_tp_rank": engine_rank % n, "attn_cp_size": 1, "attn_cp_rank": 0,
              "attn_dp_size": 1, "attn_dp_rank": 0, "attn_dcp_size": n, "attn_dcp_rank": engine_rank % n,
              "dp_size": 1, "pp_size": 1, "pp_rank": 0, "tp_size": n, "tp_rank": engine_rank % n}
    fields = getattr(rc, "_parallel_fields", None)
    if fields is not None:
        values = {k: v for k, v in values.items() if k in fields()}
    par.override_permanently(**values)
    return "sglang runtime context"


def wait(conn, states, limit: float) -> int:
    deadline = time.monotonic() + limit
    while True:
        st = conn.poll()
        if st in states or time.monotonic() > deadline:
            return st
        time.sleep(0.001)


def failure(conn) -> list:
    try:
        conn.failure_exception()
    except Exception as e:  # noqa: BLE001 - the scheduler catches Exception
        return [type(e).__name__, getattr(e, "kind", None), str(e)]
    return ["Failed", None, "no exception"]


def rank_main(s: dict) -> int:
    from pdxfer.sglang import KVManager, KVReceiver, KVSender
    from pdxfer.sglang.conn import KVPoll
    from pdxfer.synthetic import pattern

    role, p, layers, row = s["role"], s["page"], s["layers"], s["row"]
    words = row // 8
    rooms = s["rooms"]
    pool_pages, plan = page_plan(rooms, p, role)
    # decode pools hold pool_pages virtual pages of page x DCP tokens, page tokens on each rank
    pools = Pools(s["memory"], s["gpu"], layers, pool_pages * p, words)
    meta = [np.zeros((META_ROWS, w), dtype=d) for _, w, d in META]
    where, KVArgs, prefill_mode, decode_mode = sglang_classes()
    a = KVArgs()
    a.engine_rank = s["engine_rank"]
    a.pp_rank = 0
    a.system_dp_rank = 0
    a.kv_cache_dtype_str = "bfloat16"
    a.kv_layout = None
    a.prefill_start_layer = 0
    a.kv_data_ptrs = [pools.ptr(i) for i in range(layers)]
    a.kv_data_lens = [pools.nbytes(i) for i in range(layers)]
    a.kv_item_lens = [p * row] * layers
    a.num_draft_entries = 0
    a.kv_layer_ids = []
    a.page_size = p
    a.aux_data_ptrs = [b.ctypes.data for b in meta]
    a.aux_data_lens = [b.nbytes for b in meta]
    a.aux_item_lens = [b[0].nbytes for b in meta]
    a.state_types = []
    a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], []
    a.is_hybrid_mla_backend = False
    a.ib_device = None
    a.gpu_id = s["gpu"]
    decode = role == "decode"
    sa = type("ServerArgs", (), {"host": "127.0.0.1", "disaggregation_bootstrap_port": s["port"],
                                 "tp_size": DCP if decode else 1, "dcp_size": DCP if decode else 1,
                                 "dp_size": 1, "pp_size": 1, "page_size": p})()
    parallel_from = publish_parallel(decode, s["engine_rank"])
    mgr = KVManager(a, decode_mode if decode else prefill_mode, sa, True)
    addr = s["bootstrap_addr"]
    limit = s["timeout"]
    out = {"role": role, "engine_rank": s["engine_rank"], "sglang": where, "memory": s["memory"],
           "pool_device": mgr.pool_device, "parallel_from": parallel_from, "rooms": []}
    try:
        lay = mgr.layout
        if (lay.dcp_size, lay.dcp_rank) != ((DCP, s["engine_rank"] % DCP) if decode else (1, 0)):
            raise RuntimeError(f"the adapter sees DCP {lay.dcp_size} rank {lay.dcp_rank} ({parallel_from})")
        if not decode:
            for r in rooms:
                room, total = r["room"], r["total"]
                pages = plan[room]
                loc = np.array([pages[t // p] * p + t % p for t in range(total)], dtype=np.int64)
                for i in range(layers):
                    pools.write_rows(i, loc, pattern(room, i, np.arange(total), words))
                pools.sync()  # the rows are in the pools before the first send
                sender = KVSender(mgr=mgr, bootstrap_addr=addr, bootstrap_room=room,
                                  req_has_disagg_prefill_dp_rank=False)
                res = {"room": room}
                st = wait(sender, (KVPoll.WaitingForInput, KVPoll.Failed), limit)
                if st == KVPoll.WaitingForInput:
                    prefix = sender.pop_decode_prefix_len()
                    res["prefix_seen"] = prefix
                    idx = room % META_ROWS
                    sender.init(-(-(total - prefix) // p), idx)
                    start, chunk = prefix, r["chunk"]
                    while True:
                        end = min(start + chunk, total) if chunk else total
                        last = end >= total
                        if not last:
                            end -= end % p
                        if last:
                            for (name, w, d), buf in zip(META, meta):
                                buf[idx] = meta_row(room, name, w, d)
                        page_idx = loc[start:end][::p] // p
                        if sender.should_send_kv_chunk(len(page_idx), last):
                            sender.send(page_idx.astype(np.int32), None, num_kv_tokens=end - start)
                        start = end
                        if last:
                            break
                    st = wait(sender, (KVPoll.Success, KVPoll.Failed), limit)
                    res["metric_bytes"] = sender.get_transfer_metric().transfer_total_bytes
                res["poll"] = int(st)
                res["ok"] = st == KVPoll.Success and res.get("prefix_seen") == r["prefix"]
                if st == KVPoll.Failed:
                    res["error"] = failure(sender)
                sender.clear()
                out["rooms"].append(res)
            print(json.dumps(out), flush=True)
            sys.stdin.read()  # stays registered until the decode ranks are done
            return 0 if all(x["ok"] for x in out["rooms"]) else 1

        rank = s["engine_rank"] % DCP
        v = p * DCP
        expect = [np.full((pool_pages * p, words), SENTINEL, dtype=np.uint64) for _ in range(layers)]
        expect_meta = [b.copy() for b in meta]
        deadline = time.monotonic() + limit
        while not mgr.try_ensure_parallel_info(addr):
            if time.monotonic() > deadline:
                raise RuntimeError("the prefill never listed all its ranks")
            time.sleep(0.02)
        seconds = 0.0
        for r in rooms:
            room, total, prefix = r["room"], r["total"], r["prefix"]
            recv = KVReceiver(mgr=mgr, bootstrap_addr=addr, bootstrap_room=room)
            res = {"room": room}
            recv.init(0)
            st = wait(recv, (KVPoll.WaitingForInput, KVPoll.Failed), limit)
            if st == KVPoll.WaitingForInput:
                dst = plan[room]
                idx = (room + 1) % META_ROWS
                t0 = time.monotonic()
                recv.send_metadata(np.array(dst, dtype=np.int32), idx, None, decode_prefix_len=prefix)
                st = wait(recv, (KVPoll.Success, KVPoll.Failed), limit)
                seconds += time.monotonic() - t0
            res["poll"] = int(st)
            if st != KVPoll.Success:
                res["ok"] = False
                res["error"] = failure(recv) if st == KVPoll.Failed else ["Timeout", None, f"poll {int(st)}"]
                recv.clear()
                out["rooms"].append(res)
                break
            # the plan: position t (after the prefix) of this rank lands at its
            # virtual page's slot (t - prefix) % V // DCP
            pos = np.arange(prefix, total)
            rel = pos - prefix
            owned = pos % DCP == rank
            pg = np.array(dst, dtype=np.int64)[rel // v]
            rows = (pg * p + (rel % v) // DCP)[owned]
            for i in range(layers):
                expect[i][rows] = pattern(room, i, pos[owned], words)
            pools.sync()
            bad_rows = 0
            for i in range(layers):
                got = pools.read(i)  # the whole pool read back to the host
                bad = np.nonzero((got != expect[i]).any(axis=1))[0]
                if len(bad) and "first_bad" not in res:
                    res["first_bad"] = {"layer": i, "rows": bad[:8].tolist(),
                                        "owned_rows_bad": int(np.isin(bad, rows).sum())}
                bad_rows += len(bad)
            for (name, w, d), exp in zip(META, expect_meta):
                exp[idx] = meta_row(room, name, w, d)
            meta_ok = all((b == e).all() for b, e in zip(meta, expect_meta))
            res.update(rows_owned=int(owned.sum()), bad_rows=bad_rows, meta_ok=bool(meta_ok),
                       kv_bytes=int(owned.sum()) * row * layers,
                       readback_bytes=sum(pools.nbytes(i) for i in range(layers)))
            res["ok"] = bad_rows == 0 and meta_ok and int(owned.sum()) > 0
            recv.clear()
            out["rooms"].append(res)
        out["seconds"] = seconds
        print(json.dumps(out), flush=True)
        return 0 if len(out["rooms"]) == len(rooms) and all(x["ok"] for x in out["rooms"]) else 1
    finally:
        mgr.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--memory", choices=("device", "host"),
                    default=os.environ.get("PDXFER_SGLANG_POOL_MEMORY", "device").lower())
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=700)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--row", type=int, default=1152, help="bytes per KV row (576 bf16)")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--rank", help=argparse.SUPPRESS)  # internal: one rank's JSON spec
    args = ap.parse_args()
    if args.rank:
        return rank_main(json.loads(args.rank))

    t_start = time.monotonic()
    report = {"check": "sglang-adapter", "memory": args.memory, "prefill_ranks": 1, "decode_dcp_ranks": DCP,
              "layers": args.layers, "verified": False}
    if args.row % 8 or args.page < 1 or args.tokens < 4 * args.page * DCP:
        report["error"] = "--row must be a multiple of 8 and --tokens at least 4 x page x 2"
        print(json.dumps(report))
        return 2
    try:
        if args.memory == "device":
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("torch.cuda is not available")
            report["gpu"] = torch.cuda.get_device_name(args.gpu)
        from pdxfer.sglang import BootstrapServer
    except Exception as e:  # noqa: BLE001 - reported as the check's error
        report["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(report))
        return 1

    rooms = rooms_for(args.tokens, args.page)
    srv = BootstrapServer("127.0.0.1", 0)
    env = dict(os.environ, PDXFER_SGLANG_POOL_MEMORY=args.memory,
               PDXFER_SGLANG_CLUSTER=f"sglang-gpu-check-{os.getpid()}")
    base = {"bootstrap_addr": f"127.0.0.1:{srv.port}", "port": srv.port, "rooms": rooms, "page": args.page,
            "layers": args.layers, "row": args.row, "gpu": args.gpu, "memory": args.memory,
            "timeout": args.timeout}
    cmd = [sys.executable, os.path.abspath(__file__), "--rank"]
    procs, logs = [], []  # rank output goes to files: no pipe fills while the ranks run
    results, errors = [], []

    def start(spec, stdin=None):
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        logs.append((out, err))
        procs.append(subprocess.Popen(cmd + [json.dumps(spec)], env=env, stdin=stdin, stdout=out, stderr=err,
                                      text=True))
        return procs[-1]

    try:
        pre = start(dict(base, role="prefill", engine_rank=0), stdin=subprocess.PIPE)
        decs = [start(dict(base, role="decode", engine_rank=r)) for r in range(DCP)]
        deadline = t_start + args.timeout
        # the decode ranks end first; a rank that fails, or the deadline, ends the others
        while any(p.poll() is None for p in decs):
            if pre.poll() is not None or any(p.returncode not in (None, 0) for p in decs):
                break
            if time.monotonic() > deadline:
                errors.append(f"timed out after {args.timeout:g} s")
                break
            time.sleep(0.02)
        pre.stdin.close()  # the prefill stays registered until here
        try:
            pre.wait(timeout=10)
        except subprocess.TimeoutExpired:
            errors.append("the prefill rank did not exit")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        srv.close()
    for p, (out, err), name in zip(procs, logs, ["prefill"] + ["decode"] * DCP):
        out.seek(0)
        err.seek(0)
        lines = [json.loads(x) for x in out.read().splitlines() if x.startswith("{")]
        results += lines
        if p.returncode != 0:
            errors.append(f"{name} rank exit {p.returncode}: {err.read()[-2000:]}")
        elif not lines:
            errors.append(f"{name} rank printed no result")
        out.close()
        err.close()

    dec = [r for r in results if r["role"] == "decode"]
    pre_r = [r for r in results if r["role"] == "prefill"]
    verified = (not errors and len(dec) == DCP and len(pre_r) == 1
                and all(len(r["rooms"]) == len(rooms) and all(x["ok"] for x in r["rooms"]) for r in dec + pre_r))
    report.update(
        verified=verified,
        sglang=results[0]["sglang"] if results else None,
        parallel_from=results[0]["parallel_from"] if results else None,
        pool_device=sorted({r["pool_device"] for r in results}, key=str) if results else None,
        rooms=len(rooms),
        bytes=sum(x.get("kv_bytes", 0) for r in dec for x in r["rooms"]),
        readback_bytes=sum(x.get("readback_bytes", 0) for r in dec for x in r["rooms"]),
        seconds=round(max((r.get("seconds", 0.0) for r in dec), default=0.0), 4),
        wall_s=round(time.monotonic() - t_start, 2),
    )
    if report["seconds"]:
        report["gb_per_s"] = round(report["bytes"] / report["seconds"] / 1e9, 3)
    if not verified:
        report["errors"] = errors
        report["ranks"] = results
    print(json.dumps(report), flush=True)
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
