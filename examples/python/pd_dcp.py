"""A prefill and decode DCP ranks as separate processes, from Python.

    PDXFER_LIB=target/debug/libpdxfer.so python3 examples/python/pd_dcp.py [--dcp 4] [--prefill-dcp 1]
        [--tokens 1000] [--prefix 128] [--chunk-pages 8]

This process runs pdxfer's bootstrap server and starts one process per rank
(the same script with ``--role``): ``--prefill-dcp`` prefill ranks (1, or equal
to ``--dcp``: prefill DCP rank r pairs with decode rank r) and ``--dcp`` decode
ranks. The prefill fills numpy pools with a pattern per (layer, position) and
sends the request in chunks; every decode rank checks every byte it owns.
"""

import argparse
import json
import os
import subprocess
import sys
import time

try:
    import pdxfer  # the installed package (pip install .)
except ImportError:  # a source checkout: python/pdxfer
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
    import pdxfer  # noqa: E402
from pdxfer.synthetic import SyntheticPools, scattered_pages  # noqa: E402

LAYERS, ROW, PAGE, POOL_PAGES, ROOM = 4, 576, 16, 256, 42


def rank_main(a) -> int:
    dcp = a.prefill_dcp if a.role == "prefill" else a.dcp
    pools = SyntheticPools(LAYERS, ROW, PAGE, POOL_PAGES)
    topo = pdxfer.Topology.mla(LAYERS, ROW, page_size=PAGE, kv_dtype="fp8_e4m3", engine_rank=a.rank,
                               attn_tp_size=dcp, attn_tp_rank=a.rank, dcp_size=dcp, dcp_rank=a.rank)
    n = a.tokens - a.prefix
    with pdxfer.Engine(a.role, "py-example", a.url, topo, pools.kv, aux=[(pools.aux, pools.aux_item)]) as eng:
        if a.role == "prefill":
            v = PAGE * dcp
            pages = scattered_pages(-(-n // v), POOL_PAGES, ROOM)
            pools.fill(ROOM, dcp, a.rank, pages, a.prefix, a.tokens)
            pools.fill_aux(ROOM, 0)
            snd = eng.sender(ROOM)
            deadline = time.monotonic() + 30
            while snd.poll() == pdxfer.KVPoll.Bootstrapping:
                if time.monotonic() > deadline:
                    raise SystemExit("no decode metadata within 30 s")
                time.sleep(0.005)
            t0 = time.perf_counter()
            sent = 0
            for i in range(0, len(pages), a.chunk_pages):
                last = i + a.chunk_pages >= len(pages)
                tokens = n - sent if last else a.chunk_pages * v
                snd.send(pages[i:i + a.chunk_pages], tokens, last=last, aux_index=0)
                sent += tokens
            if snd.wait(30) != pdxfer.KVPoll.Success:
                raise snd.failure_exception()
            print(f"prefill rank {a.rank}/{dcp}: sent in {(time.perf_counter() - t0) * 1e3:.1f} ms", flush=True)
            sys.stdin.read()  # until the decode ranks are done
        else:
            deadline = time.monotonic() + 30
            while True:
                try:
                    rcv = eng.receiver(ROOM, 0)
                    break
                except pdxfer.BootstrapError as e:  # the prefill is not listed yet
                    eng.clear(ROOM)
                    if e.kind != "not_ready" or time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
            dst = scattered_pages(-(-n // (PAGE * dcp)), POOL_PAGES, ROOM, stride=3)
            rcv.send_metadata(dst, a.prefix, aux_index=1)
            if rcv.wait(30) != pdxfer.KVPoll.Success:
                raise rcv.failure_exception()
            b = pools.verify(ROOM, dcp, a.rank, dst, a.prefix, a.tokens, aux_idx=1, src_aux_idx=0)
            print(f"decode rank {a.rank}/{dcp}: {b} bytes verified", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dcp", type=int, default=4, help="decode DCP size")
    ap.add_argument("--prefill-dcp", type=int, default=1, help="prefill DCP size: 1 or --dcp")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--prefix", type=int, default=128, help="decode prefix, a multiple of 16 * dcp")
    ap.add_argument("--chunk-pages", type=int, default=8)
    ap.add_argument("--role", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role:
        return rank_main(a)
    with pdxfer.bootstrap.BootstrapServer() as srv:
        print(f"bootstrap server at {srv.url}: {a.prefill_dcp} prefill -> {a.dcp} decode DCP ranks", flush=True)
        base = [sys.executable, os.path.abspath(__file__), "--url", srv.url, "--dcp", str(a.dcp),
                "--prefill-dcp", str(a.prefill_dcp), "--tokens", str(a.tokens), "--prefix", str(a.prefix),
                "--chunk-pages", str(a.chunk_pages)]
        pre = [subprocess.Popen(base + ["--role", "prefill", "--rank", str(r)], stdin=subprocess.PIPE, text=True)
               for r in range(a.prefill_dcp)]
        dec = [subprocess.Popen(base + ["--role", "decode", "--rank", str(r)]) for r in range(a.dcp)]
        rc = max(d.wait(120) for d in dec)
        for p in pre:
            p.communicate("", timeout=60)
            rc = max(rc, p.returncode)
    print("OK: every byte landed where its DCP rank owns it" if rc == 0 else "FAILED", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
