#!/usr/bin/env python3
"""Bootstrap round-trip latency through the Python binding over loopback HTTP:
register (61-layer MLA topology, 64 region descriptors), lookup and summary
against an embedded server in this process, with the token set. Prints a
table and, last, one JSON line.

    PDXFER_LIB=target/release/libpdxfer.so python3 benches/bootstrap_python.py
"""

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))
import pdxfer  # noqa: E402
from pdxfer.bootstrap import BootstrapClient, BootstrapServer, make_registration  # noqa: E402

N = int(os.environ.get("N", "500"))


def timed(f, n):
    out = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        out.append((time.perf_counter() - t) * 1e6)
    out.sort()
    return {"median_us": round(statistics.median(out), 1), "p99_us": round(out[int(0.99 * (n - 1))], 1)}


def main():
    regions = [{"id": i, "addr": 1 << 32 | i << 24, "len": 1 << 24, "kind": "kv", "keys": {"rkey": str(i)}} for i in range(64)]
    topo = pdxfer.Topology.mla(layers=61, attn_tp_size=8, attn_tp_rank=3, engine_rank=3)
    reg = make_registration("bench", "prefill", topo, endpoints={"tcp": "127.0.0.1:7000"}, regions=regions)
    with BootstrapServer(token="t") as srv, BootstrapClient(srv.url, token="t") as c:
        regs = []

        def register():
            regs.append(c.register(reg, ttl_ms=60_000))

        res = {
            "register": timed(register, N),
            "lookup": timed(lambda: c.lookup("bench", "prefill", "dp0-tp3-cp0-pp0"), N),
            "summary": timed(lambda: c.summary("bench", "prefill"), N),
        }
        for r in regs:
            r.close()
    print(f"{'op':<10}{'median us':>12}{'p99 us':>10}   (N={N}, loopback, lib {pdxfer.library_path().parent.name})")
    for k, v in res.items():
        print(f"{k:<10}{v['median_us']:>12}{v['p99_us']:>10}")
    print(json.dumps({"n": N, **res}))


if __name__ == "__main__":
    main()
