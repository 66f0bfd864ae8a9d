#!/usr/bin/env python3
"""The speed targets of the data plane and the engine, measured in one run,
printed as a markdown table of figure / value / target / PASS or FAIL (see
scripts/bench-targets.sh).

    python3 scripts/bench_targets.py [--pdxfer target/release/pdxfer] [--rounds N] [--json]
    python3 scripts/bench_targets.py --self-test     # checks the fit and the checks

With `--rounds N` every figure is measured N times (`--pause` seconds apart)
and its median is checked against the target; each row also lists every
round's value and in how many rounds it met the target (on a shared VM one
round is not a figure: the same binary met 5 to 11 of 14 targets a round).

Figures (every ratio within one run; targets for an idle 2-core machine):
- 4 KiB writes, 256 per batch, over cma (shared target regions): without a
  room grant >= 3 Mops/s (4 batches in flight) with a per-batch p50 <= 100 us
  (one batch in flight); with `--room-grant` >= 5 Mops/s;
- per-batch fixed cost on cma (informational): the intercept of a
  least-squares line through the median latency of 64-byte writes at batch
  sizes 1, 4, 16, 64 (one batch in flight);
- 4 KiB writes over tcp (one stream) >= 1 Mops/s;
- `pdxfer bench-request` (one 575.7 MB PD request, 1 prefill -> 4 decode
  ranks): with shared decode pools >= 0.95x one memcpy of its bytes (median of
  6 warm requests) and every warm request >= 0.9x; over tcp >= 1.0x an iperf3
  loopback stream; in every mode the first request within 1.2x of a warm one;
  heap pools over cma against memcpy (informational);
- `pdxfer bench --layerwise`: transfer exposed after the last layer's compute
  <= 1 layer at 8K and 32K tokens, over cma and tcp;
- the floor of this machine, same run (informational; `--floor`, built from
  benches/cma_floor.c by scripts/bench-targets.sh): 4 KiB x 256 with no
  engine at all, memcpy into a shared memfd mapping and process_vm_writev
  into another process, one thread, in Mops/s at their per-batch p50; the
  cma figures above as a ratio of the memcpy floor.
Exit status 0 when every target passed, 1 otherwise.
"""

import argparse
import json
import re
import subprocess
import sys
import time


def fit_line(xs, ys):
    """Least-squares line y = a + b x; returns (a, b). Needs two distinct xs."""
    n = len(xs)
    if n != len(ys) or n < 2:
        raise ValueError("need at least two points, as many ys as xs")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("the xs are all equal")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def self_test():
    a, b = fit_line([1, 4, 16, 64], [12.0, 13.5, 19.5, 43.5])
    assert abs(a - 11.5) < 1e-9 and abs(b - 0.5) < 1e-9, (a, b)
    a, b = fit_line([0, 2], [1.0, 1.0])
    assert a == 1.0 and b == 0.0
    for bad in (([1], [1.0]), ([2, 2], [1.0, 3.0]), ([1, 2], [1.0])):
        try:
            fit_line(*bad)
        except ValueError:
            continue
        raise AssertionError(f"fit_line{bad} did not refuse")
    print("bench_targets self-test: ok")


def pdxfer_json(cmd):
    """Runs a pdxfer command with --json; its last JSON line, or raises with its stderr."""
    p = subprocess.run(cmd + ["--json"], capture_output=True, text=True, check=False)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{") or l.startswith("[")]
    if not lines:
        tail = p.stderr.strip().splitlines()
        raise RuntimeError(f"rc {p.returncode}: {tail[-1] if tail else 'no output'}")
    return json.loads(lines[-1])


def every_run_ratio(memcpy_ms, transfer_ms):
    """The lowest per-request ratio against memcpy over the warm requests
    (all but the first); None without a warm one."""
    warm = [t for t in transfer_ms[1:] if t > 0]
    if not warm or memcpy_ms <= 0:
        return None
    return memcpy_ms / max(warm)


def meets(value, cmp):
    """Whether `value` meets `cmp` (`(">=", x)` or `("<=", x)`); None when
    nothing is checked or the value is missing."""
    if cmp is None or value is None:
        return None
    op, x = cmp
    return value >= x if op == ">=" else value <= x


def figure_key(figure):
    """A figure's name without the run's own numbers in parentheses (a row
    of another round of the same figure has the same key)."""
    return " ".join(re.sub(r"\((?:[^()]*\d[^()]*)\)", "", figure).split())


def median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def combine(rounds):
    """The rows of several rounds as one table: each figure's median value,
    checked against its target, with every round's value and how many met it
    in the command column; a note of any round is kept. One round is returned
    as it is."""
    if len(rounds) == 1:
        return rounds[0]
    by_key, order, notes = {}, [], []
    for i, (rows, n) in enumerate(rounds):
        notes += [f"round {i + 1}: {x}" for x in n]
        for r in rows:
            k = figure_key(r["figure"])
            if k not in by_key:
                by_key[k] = []
                order.append(k)
            by_key[k].append(r)
    out = []
    for k in order:
        rs = by_key[k]
        vals = [r["value"] for r in rs if r["value"] is not None]
        first = rs[0]
        value = median(vals) if vals else None
        met = [r["met"] for r in rs if r["met"] is not None]
        spread = ", ".join(f"{v:.2f}" for v in vals)
        counted = f"; met in {sum(met)} of {len(met)} rounds" if met else ""
        if len(rs) < len(rounds):
            counted += f"; measured in {len(rs)} of {len(rounds)} rounds"
        out.append({**first, "figure": k, "value": value, "met": meets(value, first["cmp"]),
                    "rounds": vals,
                    "command": f"median of {spread}{counted}; {first['command']}"})
    return out, notes


def check_self():
    assert every_run_ratio(90.0, [200.0, 100.0, 95.0]) == 0.9
    assert every_run_ratio(90.0, [200.0]) is None
    assert every_run_ratio(0.0, [1.0, 2.0]) is None
    assert meets(3.1, (">=", 3.0)) and not meets(2.9, (">=", 3.0)) and meets(None, (">=", 1)) is None
    assert meets(99.0, ("<=", 100.0)) and meets(1.0, None) is None
    assert figure_key("PD request x, first (221.9 ms) over warm") == "PD request x, first over warm"
    assert figure_key("floor: memcpy, one thread (p50 43.0 us)") == "floor: memcpy, one thread"
    assert figure_key("cma per-batch fixed cost, no grant (intercept; slope 0.03 us/op)") == \
        "cma per-batch fixed cost, no grant"
    assert figure_key("cma 4 KiB x 256, with a room grant") == "cma 4 KiB x 256, with a room grant"
    r = lambda f, v, c: {"figure": f, "value": v, "unit": "u", "target": "t", "cmp": c,
                         "met": meets(v, c), "command": "c"}
    rows, notes = combine([([r("a (1 ms)", 2.0, (">=", 3.0)), r("b", 1.0, None)], []),
                           ([r("a (2 ms)", 4.0, (">=", 3.0))], ["x"]),
                           ([r("a (3 ms)", 3.5, (">=", 3.0))], [])])
    assert [x["figure"] for x in rows] == ["a", "b"], rows
    assert rows[0]["value"] == 3.5 and rows[0]["met"] is True and rows[0]["rounds"] == [2.0, 4.0, 3.5]
    assert "met in 2 of 3 rounds" in rows[0]["command"], rows[0]["command"]
    assert "measured in 1 of 3 rounds" in rows[1]["command"] and rows[1]["met"] is None
    assert notes == ["round 2: x"]
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([1.0, 2.0]) == 1.5


def measure(a):
    """One round of every figure: (rows, notes)."""
    B = a.pdxfer
    help_text = subprocess.run([B, "bench", "--help"], capture_output=True, text=True).stdout
    has_grant = "--room-grant" in help_text
    rows, notes = [], []

    def row(figure, value, unit, target, cmp, command):
        rows.append({"figure": figure, "value": value, "unit": unit, "target": target,
                     "cmp": cmp, "met": meets(value, cmp), "command": command})

    def show(cmd):
        return "`" + " ".join(["B" if c == B else c for c in cmd]) + " --json`"

    # 4 KiB x 256 over cma: throughput with 4 in flight, latency with one
    for label, extra, target in (("without a grant", [], 3e6), ("with a room grant", ["--room-grant"], 5e6)):
        if extra and not has_grant:
            notes.append("cma 4 KiB writes with a room grant: not measured: no --room-grant in pdxfer bench")
            continue
        cmd = [B, "bench", "--transport", "cma", "--block-sizes", "4K", "--batch-sizes", "256",
               "--depth", "4", "--max-ms", "2000"] + extra
        try:
            ops = pdxfer_json(cmd)["ops_per_s"]
            row(f"cma 4 KiB x 256, {label}", ops / 1e6, "Mops/s", f">= {target / 1e6:g} Mops/s",
                (">=", target / 1e6), show(cmd))
        except Exception as e:
            notes.append(f"cma 4 KiB writes {label}: not measured: {e}")
        if not extra:
            cmd = [B, "bench", "--transport", "cma", "--block-sizes", "4K", "--batch-sizes", "256",
                   "--depth", "1", "--max-ms", "2000"]
            try:
                p50 = pdxfer_json(cmd)["p50_us"]
                row(f"cma 4 KiB x 256, {label}: per-batch p50 (one in flight)", p50, "us", "<= 100 us",
                    ("<=", 100.0), show(cmd))
            except Exception as e:
                notes.append(f"cma per-batch p50 {label}: not measured: {e}")

    cmd = [B, "bench", "--transport", "cma", "--block-sizes", "64", "--batch-sizes", "1,4,16,64",
           "--depth", "1", "--max-ms", "1500"]
    try:
        pts = pdxfer_json(cmd)["points"]
        xs = [p["batch_size"] for p in pts]
        ys = [p["p50_us"] for p in pts]
        a0, b0 = fit_line(xs, ys)
        row(f"cma per-batch fixed cost, no grant (intercept; slope {b0:.2f} us/op)", a0, "us",
            "(informational)", None, show(cmd) + "; p50 at batch " + ", ".join(f"{x}: {y:.1f}" for x, y in zip(xs, ys)))
    except Exception as e:
        notes.append(f"per-batch fixed cost: not measured: {e}")

    cmd = [B, "bench", "--transport", "tcp", "--block-sizes", "4K", "--batch-sizes", "256",
           "--depth", "4", "--max-ms", "2000", "--threads", "1"]
    try:
        ops = pdxfer_json(cmd)["ops_per_s"]
        row("tcp 4 KiB x 256, one stream", ops / 1e6, "Mops/s", ">= 1 Mops/s", (">=", 1.0), show(cmd))
    except Exception as e:
        notes.append(f"tcp 4 KiB writes: not measured: {e}")

    cmd = [B, "bench-request", "--modes", "cma-heap,cma-shared,tcp", "--requests", str(a.requests)]
    try:
        v = pdxfer_json(cmd)
        for r in v["results"]:
            m = r["mode"]
            ratio = r["ratio_vs_memcpy"]
            if m == "cma-shared":
                row(f"PD request {m}, warm median ({r['warm_median_ms']:.1f} ms) vs memcpy ({r['memcpy_ms']:.1f} ms)",
                    ratio, "x memcpy", ">= 0.95x", (">=", 0.95), show(cmd))
                low = every_run_ratio(r["memcpy_ms"], r.get("transfer_ms", []))
                row(f"PD request {m}, slowest warm request vs memcpy", low, "x memcpy", ">= 0.9x",
                    (">=", 0.9), "same run")
                share = r.get("one_copy_bytes_per_request", 0) / r["request_bytes"]
                row(f"PD request {m}, KV bytes copied straight into the decode's rows", share * 100, "%",
                    "(one copy)", None, "same run")
            else:
                row(f"PD request {m}, warm median ({r['warm_median_ms']:.1f} ms) vs memcpy ({r['memcpy_ms']:.1f} ms)",
                    ratio, "x memcpy", "(informational)", None, show(cmd))
            if m.startswith("tcp"):
                x = r.get("ratio_vs_iperf3")
                if x is None:
                    notes.append(f"PD request tcp vs iperf3: not measured: {r.get('iperf3_note') or 'no iperf3'}")
                else:
                    row(f"PD request {m} vs iperf3 loopback ({r['iperf3_gb_per_s']:.2f} GB/s)", x, "x iperf3",
                        ">= 1.0x", (">=", 1.0), "same run")
            row(f"PD request {m}, first ({r['first_ms']:.1f} ms) over warm", r["first_over_warm"], "x",
                "<= 1.2x", ("<=", 1.2), "same run")
            c = r.get("control_messages_per_request")
            row(f"PD request {m}, control messages per request", c, "", "(counted)", None, "same run")
        for e in v.get("errors", []):
            notes.append(f"PD request {e['mode']}: not measured: {e['error']}")
    except Exception as e:
        notes.append(f"pdxfer bench-request: not measured: {e}")

    for transport in ("cma", "tcp"):
        cmd = [B, "bench", "--layerwise", "--transport", transport, "--tokens", "8192,32768"]
        try:
            for p in pdxfer_json(cmd):
                x = p["exposed_in_layers"]
                row(f"layer-wise over {transport}, {p['tokens']} tokens: transfer exposed after the last layer",
                    x, "layers", "<= 1 layer", ("<=", 1.0), show(cmd))
        except Exception as e:
            notes.append(f"layer-wise over {transport}: not measured: {e}")

    if a.floor:
        cmd = [a.floor, "4096", "256", "1500"]
        try:
            p = subprocess.run(cmd + ["--json"], capture_output=True, text=True, check=True)
            modes = {(m["mode"], m["threads"]): m for m in json.loads(p.stdout.splitlines()[-1])["modes"]}
            for mode, what in (("memcpy-shared", "memcpy into a shared memfd mapping"),
                               ("vm-writev", "process_vm_writev into another process")):
                m = modes[(mode, 1)]
                row(f"floor: 4 KiB x 256, {what}, one thread (p50 {m['p50_us']:.1f} us)", m["p50_mops"],
                    "Mops/s at the p50", "(the machine)", None, "`" + " ".join(cmd) + "`")
            floor = modes[("memcpy-shared", 1)]["p50_mops"]
            for r in list(rows):
                if r["figure"].startswith("cma 4 KiB x 256") and r["unit"] == "Mops/s" and floor > 0:
                    row(r["figure"] + " vs the memcpy floor", r["value"] / floor, "x floor",
                        "(informational)", None, "same run")
        except Exception as e:
            notes.append(f"the floor ({a.floor}): not measured: {e}")

    return rows, notes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pdxfer", default="target/release/pdxfer")
    ap.add_argument("--requests", type=int, default=7, help="requests per bench-request mode (the first is the cold one)")
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--floor", default="", help="the built benches/cma_floor.c (rows of the machine's floor)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure everything this many times and check each figure's median "
                         "(every round's value and how many met the target are printed)")
    ap.add_argument("--pause", type=float, default=30.0,
                    help="seconds between rounds, so a round's rank processes are gone (default 30)")
    a = ap.parse_args()
    if a.self_test:
        check_self()
        return self_test()
    rounds = []
    for i in range(max(1, a.rounds)):
        if i:
            time.sleep(a.pause)
        rounds.append(measure(a))
        if a.rounds > 1:
            print(f"round {i + 1} of {a.rounds}: done", file=sys.stderr, flush=True)
    rows, notes = combine(rounds)
    B = a.pdxfer
    checked = [r for r in rows if r["met"] is not None]
    passed = sum(1 for r in checked if r["met"])
    ok = passed == len(checked) and not notes
    if a.json:
        print(json.dumps({"rows": rows, "notes": notes, "passed": passed, "checked": len(checked)}))
        return 0 if ok else 1
    print("| figure | value | target | result | command |")
    print("|---|---:|---|---|---|")
    for r in rows:
        v = r["value"]
        val = "n/a" if v is None else f"{v:.2f} {r['unit']}".strip()
        met = {True: "PASS", False: "FAIL", None: "-"}[r["met"]]
        print(f"| {r['figure']} | {val} | {r['target']} | {met} | {r['command']} |")
    for n in notes:
        print("NOT MEASURED: " + n)
    print(f"{passed} of {len(checked)} targets PASS" + ("" if not notes else f"; {len(notes)} not measured"))
    print("(B = " + B + ")")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
