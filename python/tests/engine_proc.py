"""One prefill or decode rank as its own process, for test_engine.py.

Usage: python engine_proc.py '<json spec>'. The spec names the bootstrap URL,
the cluster, the role, the DCP sizes of both sides, this rank and the rooms
(``room``, ``total``, ``prefix``, ``chunk_pages``); ``shared``: the decode's KV
pools are shared pool allocations; ``one_copy``: the prefill's option. Prints
one JSON line per room (``{"room", "poll", "bytes"}``, decode: bytes verified;
prefill: ``one_copy_bytes`` so far) and, for prefill,
waits for stdin to close before exiting, so its decode ranks finish first.
"""

import json
import os
import sys
import time

if os.environ.get("PDXFER_EXPECT_INSTALLED") != "1":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import pdxfer  # noqa: E402
from pdxfer.synthetic import SyntheticPools, scattered_pages  # noqa: E402

POOL_PAGES = 64  # coprime with the page stride 7


def main() -> int:
    s = json.loads(sys.argv[1])
    role, rank = s["role"], s["rank"]
    p, layers, row = s["page"], s["layers"], s["row"]
    pd, dd = s["p_dcp"], s["d_dcp"]
    dcp = pd if role == "prefill" else dd
    pools = SyntheticPools(layers, row, p, POOL_PAGES)
    shared = []
    if role == "decode" and s.get("shared"):
        # the KV pools in shared pool allocations: the prefill copies rows straight in
        for l, buf in enumerate(pools.kv):
            shared.append(pdxfer.alloc_shared_pool(buf.nbytes))
            pools.kv[l] = shared[-1].array(buf.dtype, buf.shape)
    topo = pdxfer.Topology.mla(layers, row, page_size=p, engine_rank=rank, attn_tp_size=dcp,
                               attn_tp_rank=rank, dcp_size=dcp, dcp_rank=rank)
    eng = pdxfer.Engine(role, s["cluster"], s["url"], topo, pools.kv, aux=[(pools.aux, pools.aux_item)],
                        transport=s.get("transport", "auto"), staging_bytes=s.get("staging", 0),
                        no_staging=s.get("staging", 1) == 0, one_copy=s.get("one_copy", True),
                        room_timeout=30)
    vp, vd = p * pd, p * dd
    for r in s["rooms"]:
        room, total, prefix, chunk = r["room"], r["total"], r["prefix"], r["chunk_pages"]
        n = total - prefix
        if role == "prefill":
            pages = scattered_pages(-(-n // vp), POOL_PAGES, room)
            pools.fill(room, pd, rank, pages, prefix, total)
            pools.fill_aux(room, 3)
            snd = eng.sender(room)
            deadline = time.monotonic() + 20
            while snd.poll() == pdxfer.KVPoll.Bootstrapping:
                if time.monotonic() > deadline:
                    raise SystemExit(f"room {room}: no decode metadata in 20 s")
                time.sleep(0.005)
            sent = 0
            for i in range(0, len(pages), chunk):
                last = i + chunk >= len(pages)
                tokens = n - sent if last else chunk * vp
                snd.send(pages[i:i + chunk], tokens, last=last, aux_index=3)
                sent += tokens
            st = snd.wait(30)
            out = {"room": room, "poll": int(st), "bytes": 0, "one_copy_bytes": one_copy_bytes(eng)}
            if st != pdxfer.KVPoll.Success:
                out["error"] = str(snd.failure_exception())
            snd.clear()
        else:
            deadline = time.monotonic() + 20
            while True:
                try:
                    rcv = eng.receiver(room, 0, timeout=30)
                    break
                except pdxfer.BootstrapError as e:
                    if e.kind != "not_ready" or time.monotonic() > deadline:
                        raise
                    eng.clear(room)
                    time.sleep(0.02)
            dst = scattered_pages(-(-n // vd), POOL_PAGES, room, stride=3)
            rcv.send_metadata(dst, prefix, aux_index=5)
            st = rcv.wait(30)
            out = {"room": room, "poll": int(st), "bytes": 0}
            if st == pdxfer.KVPoll.Success:
                out["bytes"] = pools.verify(room, dd, rank, dst, prefix, total, aux_idx=5, src_aux_idx=3)
                out["received"] = rcv.bytes_received()
            else:
                out["error"] = str(rcv.failure_exception())
            rcv.clear()
        print(json.dumps(out), flush=True)
    if role == "prefill":
        sys.stdin.read()
    eng.close()
    for sp in shared:
        sp.free()
    return 0


def one_copy_bytes(eng) -> int:
    """The engine's pdxfer_engine_one_copy_bytes_total."""
    for line in eng.metrics().splitlines():
        if line.startswith("pdxfer_engine_one_copy_bytes_total "):
            return int(float(line.split()[1]))
    raise AssertionError("no pdxfer_engine_one_copy_bytes_total in the metrics")


if __name__ == "__main__":
    sys.exit(main())
