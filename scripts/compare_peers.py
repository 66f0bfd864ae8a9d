#!/usr/bin/env python3
"""The same PD request's bytes through Mooncake TE and NIXL, next to pdxfer.

Run by scripts/compare-peers.sh (which makes the venv); by hand:

    python3 scripts/compare_peers.py [--pdxfer target/release/pdxfer] [--requests 6]

The request: TOKENS x LAYERS x ROW bytes (8,192 x 61 x 1152 = 575.7 MB) for
DCP decode ranks. The peers get it with the rows pre-packed: the sender's
buffer and the receiver's buffer are laid out [rank][layer][rows], one write
per (rank, layer) of TOKENS / DCP rows (244 writes of 2.36 MB), all in one
batch, into one receiving process (pdxfer's decode ranks are DCP processes,
its prefill gathers the rows itself). Each figure is one request, first and
median of the warm ones; the receiver's CRC32 of its buffer is checked
against the sender's after the last request. A peer that cannot be imported
or run is reported with the reason, and the others go on.
"""

import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
import zlib


def buffer(n):
    """n bytes of anonymous memory and their address."""
    m = mmap.mmap(-1, n)
    return m, ctypes.addressof(ctypes.c_char.from_buffer(m))


def fill(m):
    """A pattern that differs per 4 KiB page, written page by page."""
    page = bytes(range(256)) * 16
    for off in range(0, len(m), 4096):
        k = (off // 4096) & 0xFF
        chunk = page[k:] + page[:k]
        m[off : off + 4096] = chunk[: min(4096, len(m) - off)]


def geometry(a):
    rows = a.tokens // a.dcp
    piece = rows * a.row
    pieces = [(r * a.layers + l) * piece for r in range(a.dcp) for l in range(a.layers)]
    return piece, pieces, piece * len(pieces)


def median_warm(ms):
    return statistics.median(ms[1:]) if len(ms) > 1 else ms[0]


# ---------------------------------------------------------------- child side


def serve_mooncake(a):
    from mooncake.engine import TransferEngine

    _, total = geometry(a)[1:]
    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"mooncake initialize returned {rc}")
    m, addr = buffer(total)
    if te.register_memory(addr, total) != 0:
        raise RuntimeError("mooncake register_memory failed")
    print(json.dumps({"session": f"127.0.0.1:{te.get_rpc_port()}", "addr": addr}), flush=True)
    for line in sys.stdin:
        if line.strip() == "crc":
            print(json.dumps({"crc": zlib.crc32(m)}), flush=True)


def serve_nixl(a):
    import nixl_cu12 as nixl

    _, total = geometry(a)[1:]
    agent = nixl.nixl_agent("pdx-target", nixl.nixl_agent_config(backends=["UCX"]))
    m, addr = buffer(total)
    agent.register_memory([(addr, total, 0, "")], "DRAM")
    print(json.dumps({"meta": agent.get_agent_metadata().hex(), "addr": addr}), flush=True)
    for line in sys.stdin:
        line = line.strip()
        if line.startswith("meta "):
            agent.add_remote_agent(bytes.fromhex(line[5:]))
            print(json.dumps({"ok": True}), flush=True)
        elif line.startswith("wait "):
            tag = line[5:].encode()
            while not agent.check_remote_xfer_done("pdx-initiator", tag):
                pass
            print(json.dumps({"done": True}), flush=True)
        elif line == "crc":
            print(json.dumps({"crc": zlib.crc32(m)}), flush=True)


# ---------------------------------------------------------------- driver side


class Child:
    def __init__(self, a, role, env=None):
        cmd = [sys.executable, __file__, "--serve", role] + child_args(a)
        self.p = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )

    def read(self):
        while True:  # the peers' libraries log on stdout too: take the JSON lines only
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"receiver exited (rc {self.p.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, s):
        self.p.stdin.write(s + "\n")
        self.p.stdin.flush()
        return self.read()

    def close(self):
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def child_args(a):
    return ["--tokens", str(a.tokens), "--layers", str(a.layers), "--row", str(a.row), "--dcp", str(a.dcp)]


def run_mooncake(a):
    from mooncake.engine import TransferEngine

    piece, pieces, total = geometry(a)
    child = Child(a, "mooncake")
    try:
        hello = child.read()
        te = TransferEngine()
        if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("mooncake initialize failed")
        m, addr = buffer(total)
        fill(m)
        if te.register_memory(addr, total) != 0:
            raise RuntimeError("mooncake register_memory failed")
        srcs = [addr + o for o in pieces]
        dsts = [hello["addr"] + o for o in pieces]
        lens = [piece] * len(pieces)
        ms = []
        for _ in range(a.requests):
            t0 = time.perf_counter()
            rc = te.batch_transfer_sync_write(hello["session"], srcs, dsts, lens)
            ms.append((time.perf_counter() - t0) * 1e3)
            if rc != 0:
                raise RuntimeError(f"mooncake batch_transfer_sync_write returned {rc}")
        crc = child.ask("crc")["crc"]
        if crc != zlib.crc32(m):
            raise RuntimeError("mooncake: the receiver's bytes differ from the sender's")
        return ms
    finally:
        child.close()


def run_nixl(a, tls):
    import nixl_cu12 as nixl

    # UCX's tcp stays on loopback; without tcp in UCX_TLS the NIXL 1.5.1 receiver
    # crashes (SIGSEGV) before it is ready, so the shm row lists tcp last: UCX
    # takes shared memory for the puts between two processes of one host
    env = {"UCX_TLS": tls, "UCX_NET_DEVICES": "lo"}
    os.environ.update(env)
    piece, pieces, total = geometry(a)
    child = Child(a, "nixl", env)
    try:
        hello = child.read()
        agent = nixl.nixl_agent("pdx-initiator", nixl.nixl_agent_config(backends=["UCX"]))
        m, addr = buffer(total)
        fill(m)
        agent.register_memory([(addr, total, 0, "")], "DRAM")
        remote = agent.add_remote_agent(bytes.fromhex(hello["meta"]))
        child.ask("meta " + agent.get_agent_metadata().hex())
        local = agent.get_xfer_descs([(addr + o, piece, 0) for o in pieces], "DRAM")
        dst = agent.get_xfer_descs([(hello["addr"] + o, piece, 0) for o in pieces], "DRAM")
        ms = []
        for i in range(a.requests):
            tag = f"req{i}"
            child.p.stdin.write(f"wait {tag}\n")
            child.p.stdin.flush()
            t0 = time.perf_counter()
            h = agent.initialize_xfer("WRITE", local, dst, remote, tag.encode())
            state = agent.transfer(h)
            while state == "PROC":
                state = agent.check_xfer_state(h)
            if state != "DONE":
                raise RuntimeError(f"nixl transfer state {state}")
            child.read()  # the receiver saw the notification
            ms.append((time.perf_counter() - t0) * 1e3)
            agent.release_xfer_handle(h)
        crc = child.ask("crc")["crc"]
        if crc != zlib.crc32(m):
            raise RuntimeError("nixl: the receiver's bytes differ from the sender's")
        return ms
    finally:
        child.close()


def run_pdxfer(a, notes):
    modes = "cma-heap,cma-shared,tcp"
    out = subprocess.run(
        [a.pdxfer, "bench-request", "--json", "--modes", modes, "--requests", str(a.requests),
         "--tokens", str(a.tokens), "--layers", str(a.layers), "--row-bytes", str(a.row),
         "--dcp-size", str(a.dcp), "--iperf3-secs", "0"],
        capture_output=True, text=True, check=False,
    )
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    if not lines:
        raise RuntimeError(f"pdxfer bench-request gave no JSON (rc {out.returncode}): {out.stderr[-500:]}")
    v = json.loads(lines[-1])
    notes.extend(f"pdxfer {e['mode']}: not measured: {e['error']}" for e in v.get("errors", []))
    return {r["mode"]: r["transfer_ms"] for r in v["results"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--pdxfer", default="target/release/pdxfer")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--row", type=int, default=1152)
    ap.add_argument("--dcp", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.serve == "mooncake":
        return serve_mooncake(a)
    if a.serve == "nixl":
        return serve_nixl(a)
    if a.run:
        fn = {"mooncake": lambda: run_mooncake(a), "nixl-tcp": lambda: run_nixl(a, "tcp"),
              "nixl-shm": lambda: run_nixl(a, os.environ.get("PDXFER_NIXL_SHM_TLS", "shm,cma,self,tcp"))}[a.run]
        print(json.dumps({"ms": fn()}), flush=True)
        # NIXL 1.5.1 crashes (SIGSEGV) in its teardown at interpreter exit, after the
        # figures are out: leave without running it
        os._exit(0)

    total = geometry(a)[2]
    rows, notes = {}, []
    # which pdxfer row each peer is compared with: the same kind of path
    ref_of = {"Mooncake TE tcp (pre-packed)": "pdxfer tcp-heap",
              "NIXL UCX tcp (UCX_TLS=tcp, UCX_NET_DEVICES=lo)": "pdxfer tcp-heap",
              "NIXL UCX shm (UCX_TLS=shm,cma,self,tcp, UCX_NET_DEVICES=lo)": "pdxfer cma-heap"}

    def attempt(name, run):
        # each peer in its own process: one that cannot import, fails or crashes is reported
        p = subprocess.run([sys.executable, __file__, "--run", run] + child_args(a)
                           + ["--requests", str(a.requests)],
                           capture_output=True, text=True, check=False)
        lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
        if p.returncode == 0 and lines:
            rows[name] = json.loads(lines[-1])["ms"]
        else:
            err = [l for l in (p.stderr + p.stdout).strip().splitlines() if l.strip()]
            notes.append(f"{name}: not measured (rc {p.returncode}): {err[-1] if err else 'no output'}")
        print(f"  {'done: ' + name if name in rows else notes[-1]}", file=sys.stderr, flush=True)

    print(f"compare-peers: {total / 1e6:.1f} MB per request, {a.requests} requests each", file=sys.stderr)
    try:
        rows.update({f"pdxfer {k}": v for k, v in run_pdxfer(a, notes).items()})
    except Exception as e:
        notes.append(f"pdxfer: not measured: {e}")
    attempt("Mooncake TE tcp (pre-packed)", "mooncake")
    attempt("NIXL UCX tcp (UCX_TLS=tcp, UCX_NET_DEVICES=lo)", "nixl-tcp")
    attempt("NIXL UCX shm (UCX_TLS=shm,cma,self,tcp, UCX_NET_DEVICES=lo)", "nixl-shm")

    result = []
    for name, ms in rows.items():
        warm = median_warm(ms)
        if ref_of.get(name) == "pdxfer cma-heap" and "pdxfer cma-shared" in rows:
            ref_of[name] = "pdxfer cma-shared"  # shared memory against shared memory
        ref = rows.get(ref_of.get(name, name))
        result.append({
            "what": name, "first_ms": ms[0], "warm_ms": warm, "gb_per_s": total / warm / 1e6,
            "compared_with": ref_of.get(name, name),
            "time_over_pdxfer": (warm / median_warm(ref)) if ref else None,
        })
    if a.json:
        print(json.dumps({"request_bytes": total, "requests": a.requests, "rows": result, "notes": notes}))
        return 0
    print("| what | first ms | warm ms | GB/s (warm) | warm time / pdxfer's | against |")
    print("|---|---:|---:|---:|---:|---|")
    for r in result:
        ratio = f"{r['time_over_pdxfer']:.2f}x" if r["time_over_pdxfer"] else "n/a"
        print(f"| {r['what']} | {r['first_ms']:.1f} | {r['warm_ms']:.1f} | {r['gb_per_s']:.2f} | {ratio} "
              f"| {r['compared_with']} |")
    for n in notes:
        print(n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
