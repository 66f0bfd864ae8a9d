#!/usr/bin/env python3
"""The speed targets of the data plane and the engine, measured in one run,
printed as a markdown table of figure / target / met (see scripts/bench-targets.sh).

    python3 scripts/bench_targets.py [--pdxfer target/release/pdxfer] [--json]
    python3 scripts/bench_targets.py --self-test     # checks the fit

Figures (every ratio within one run):
- per-batch fixed cost on cma: the intercept of a least-squares line through
  the median batch latency of 64-byte writes at batch sizes 1, 4, 16, 64
  (depth 1: one batch in flight), next to the median latency of one batch
  of one 64-byte write;
- 4 KiB writes batched (256 per batch, 4 batches in flight), operations per
  second over cma (shared target regions) and tcp (one stream);
- `pdxfer bench-request`: one 575.7 MB PD request against memcpy of its bytes
  (cma, heap and shared decode pools), against iperf3 (tcp), and its first
  request after connecting against the warm ones.
With `--room-grant` in `pdxfer bench --help`, the bench rows run twice: without
and with it.
"""

import argparse
import json
import subprocess
import sys


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
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if not lines:
        tail = p.stderr.strip().splitlines()
        raise RuntimeError(f"rc {p.returncode}: {tail[-1] if tail else 'no output'}")
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pdxfer", default="target/release/pdxfer")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    B = a.pdxfer
    help_text = subprocess.run([B, "bench", "--help"], capture_output=True, text=True).stdout
    variants = [("", [])] + ([(" (--room-grant)", ["--room-grant"])] if "--room-grant" in help_text else [])
    rows, notes = [], []

    def row(figure, value, unit, target, met, command):
        rows.append({"figure": figure, "value": value, "unit": unit, "target": target,
                     "met": met, "command": command})

    def show(cmd):
        return "`" + " ".join(["B" if c == B else c for c in cmd]) + " --json`"

    for label, extra in variants:
        # per-batch fixed cost: one tiny op, and the intercept over batch sizes
        cmd = [B, "bench", "--transport", "cma", "--block-sizes", "64", "--batch-sizes", "1,4,16,64",
               "--depth", "1", "--max-ms", "1500"] + extra
        try:
            pts = pdxfer_json(cmd)["points"]
            xs = [p["batch_size"] for p in pts]
            ys = [p["p50_us"] for p in pts]
            a0, b0 = fit_line(xs, ys)
            one = next(p["p50_us"] for p in pts if p["batch_size"] == 1)
            row(f"cma batch of one 64 B write, p50{label}", one, "us", "<= 15 us", one <= 15, show(cmd))
            row(f"cma per-batch fixed cost (intercept; slope {b0:.2f} us/op){label}", a0, "us",
                "<= 15 us", a0 <= 15, "same run: p50 at batch " + ", ".join(f"{x}: {y:.1f}" for x, y in zip(xs, ys)))
        except Exception as e:
            notes.append(f"per-batch fixed cost{label}: not measured: {e}")
        for transport, target, extra_t in (("cma", 3e6, []), ("tcp", 1e6, ["--threads", "1"])):
            cmd = [B, "bench", "--transport", transport, "--block-sizes", "4K", "--batch-sizes", "256",
                   "--depth", "4", "--max-ms", "2000"] + extra_t + extra
            try:
                ops = pdxfer_json(cmd)["ops_per_s"]
                row(f"{transport} 4 KiB writes, batch 256{label}", ops / 1e6, "Mops/s",
                    f">= {target / 1e6:g} Mops/s", ops >= target, show(cmd))
            except Exception as e:
                notes.append(f"{transport} 4 KiB writes{label}: not measured: {e}")

    cmd = [B, "bench-request", "--modes", "cma-heap,cma-shared,tcp", "--requests", str(a.requests)]
    p = subprocess.run(cmd + ["--json"], capture_output=True, text=True, check=False)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if lines:
        v = json.loads(lines[-1])
        for r in v["results"]:
            m = r["mode"]
            row(f"PD request {m}, warm ({r['warm_median_ms']:.1f} ms) vs memcpy ({r['memcpy_ms']:.1f} ms)",
                r["ratio_vs_memcpy"], "x memcpy", ">= 0.8x" if m == "cma-shared" else "(>= 0.8x is for cma-shared)",
                (r["ratio_vs_memcpy"] >= 0.8) if m == "cma-shared" else None, show(cmd))
            if r.get("ratio_vs_iperf3") is not None:
                row(f"PD request {m} vs iperf3 loopback ({r['iperf3_gb_per_s']:.2f} GB/s)",
                    r["ratio_vs_iperf3"], "x iperf3", ">= 0.9x", r["ratio_vs_iperf3"] >= 0.9, "same run")
            row(f"PD request {m}, first ({r['first_ms']:.1f} ms) over warm", r["first_over_warm"], "x",
                "<= 1.2x", r["first_over_warm"] <= 1.2, "same run")
            if m == "cma-shared":
                share = r.get("one_copy_bytes_per_request", 0) / r["request_bytes"]
                row(f"PD request {m}, KV bytes copied straight into the decode's rows", share * 100, "%",
                    "(one copy)", None, "same run")
            c = r.get("control_messages_per_request")
            row(f"PD request {m}, control messages per request", c, "", "(counted)", None, "same run")
        for e in v.get("errors", []):
            notes.append(f"PD request {e['mode']}: not measured: {e['error']}")
    else:
        notes.append(f"pdxfer bench-request gave no JSON (rc {p.returncode}): {p.stderr.strip()[-300:]}")

    if a.json:
        print(json.dumps({"rows": rows, "notes": notes}))
        return 0
    print("| figure | value | target | met | command |")
    print("|---|---:|---|---|---|")
    for r in rows:
        v = r["value"]
        val = "n/a" if v is None else f"{v:.2f} {r['unit']}".strip()
        met = {True: "yes", False: "no", None: "-"}[r["met"]]
        print(f"| {r['figure']} | {val} | {r['target']} | {met} | {r['command']} |")
    for n in notes:
        print(n)
    print("(B = " + B + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
