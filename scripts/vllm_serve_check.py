"""A real `vllm serve` PD run on this machine's CPU (scripts/vllm-serve-check.sh
runs this with the environment of scripts/vllm-serve-env.sh).

Steps (each printed; a JSON summary closes the run; any failed check exits 1):

1. One plain `vllm serve` of the tiny MLA model (python/vllm_tests/model,
   dummy weights, seed 0, no tokenizer: token-id prompts): the reference
   greedy tokens.
2. Per transport (tcp, cma): a prefill `vllm serve` (kv_producer) and a decode
   `vllm serve` (kv_consumer) with pdxfer's connector, and the PD proxy
   (`python -m pdxfer.vllm.proxy`) in front; the same requests through the
   proxy. Checked: the greedy tokens equal the plain server's; the decode's
   prompt-token metrics count every prompt token as taken from the external
   KV transfer and none as computed locally,
   its connector logged the KV bytes landed (= tokens x layers x 576 x 2) per
   request, the prefill's connector freed every request's blocks after
   sending; after the requests both servers hold no KV blocks
   (kv_cache_usage 0, nothing running or waiting); then both shut down on
   SIGTERM to their main process, in time, with exit status 0, no process
   left behind and no error logged (while serving; pdxfer's while stopping).

Environment: PDXFER_LIB (the library), PDXFER_SERVE_CHECK_PORT (first port,
default 18100; it uses 8 from there and +10 for pdxfer's bootstrap),
PDXFER_SERVE_CHECK_TRANSPORTS (default "tcp cma"), PDXFER_SERVE_CHECK_TIMEOUT
(seconds for a server to start, default 600), PDXFER_SERVE_CHECK_DIR (logs,
default target/vllm-serve-check).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "python", "vllm_tests", "model")
NUM_LAYERS = 2
ROW_BYTES = 576 * 2  # MLA row (kv_lora_rank 512 + rope 64), bf16
BLOCK = 32  # vLLM's CPU MLA backends take multiples of 32
MAX_TOKENS = 8
PORT = int(os.environ.get("PDXFER_SERVE_CHECK_PORT", "18100"))
TRANSPORTS = os.environ.get("PDXFER_SERVE_CHECK_TRANSPORTS", "tcp cma").split()
START_TIMEOUT = float(os.environ.get("PDXFER_SERVE_CHECK_TIMEOUT", "600"))
LOG_DIR = os.environ.get("PDXFER_SERVE_CHECK_DIR", os.path.join(ROOT, "target", "vllm-serve-check"))
# prompts of 1.25, 2.4 and 4.1 blocks: partial last blocks, several chunks
PROMPTS = [[(7 * i + 3 * n) % 1000 + 2 for i in range(n)] for n in (40, 77, 131)]

SUMMARY: Dict[str, Any] = {"steps": [], "failures": []}
T0 = time.monotonic()


def step(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f} s] {msg}", flush=True)
    SUMMARY["steps"].append(msg)


def check(ok: bool, what: str) -> bool:
    print(f"           {'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        SUMMARY["failures"].append(what)
    return ok


class Server:
    """One `vllm serve` (or the proxy) in its own process group, logging to a file."""

    def __init__(self, name: str, argv: List[str], port: int, env: Dict[str, str]):
        self.name, self.port = name, port
        self.log_path = os.path.join(LOG_DIR, f"{name}.log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self.started = time.monotonic()
        self.ready_s: Optional[float] = None
        self.pre_stop = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        deadline = self.started + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode} while starting; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        self.ready_s = time.monotonic() - self.started
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise SystemExit(f"{self.name} not healthy within {START_TIMEOUT:.0f} s; see {self.log_path}")

    def text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def stop(self, timeout: float = 90.0) -> Dict[str, Any]:
        """SIGTERM to the server's main process, as a service manager sends it
        (the server stops its own children); the exit status, the seconds it
        took, and whether anything of its process group had to be killed (a
        failure). ``pre_stop``: the log up to the signal."""
        self.pre_stop = self.text()
        t = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
            killed = False
        except subprocess.TimeoutExpired:
            rc, killed = None, True
        left = _group_alive(self.proc.pid, 15.0)  # children left behind
        if left:
            os.killpg(self.proc.pid, signal.SIGKILL)
        if rc is None:
            rc = self.proc.wait()
        self.log.close()
        return {"rc": rc, "stop_s": round(time.monotonic() - t, 1), "killed": killed or left}


def _group_alive(pgid: int, wait_s: float) -> bool:
    """Whether the process group still has a member after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.25)


def post(url: str, body: Dict[str, Any], timeout: float = 900.0) -> Dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def metrics(url: str) -> Dict[str, float]:
    """The /metrics samples that matter here, by name and label."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: Dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'^(vllm:[a-z_]+)(?:\{([^}]*)\})? ([0-9.e+-]+)$', line)
        if not m:
            continue
        name, labels, v = m.groups()
        src = re.search(r'source="([a-z_]+)"', labels or "")
        key = f"{name}[{src.group(1)}]" if src else name
        out[key] = out.get(key, 0.0) + float(v)
    return out


def complete(url: str, prompt: List[int]) -> Dict[str, Any]:
    r = post(url + "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "return_token_ids": True, "ignore_eos": True})  # no logprobs: they need a tokenizer
    return {"token_ids": r["choices"][0]["token_ids"]}


def serve_argv(py: str, port: int, kv_config: Optional[Dict[str, Any]]) -> List[str]:
    argv = [py, "-m", "vllm.entrypoints.cli.main", "serve", MODEL, "--port", str(port), "--host", "127.0.0.1",
            "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16", "--seed", "0",
            "--max-model-len", "512", "--block-size", str(BLOCK), "--enforce-eager"]
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config)]
    return argv


def own_cpus(env: Dict[str, str]) -> Tuple[Dict[str, str], Dict[str, str]]:
    """The prefill's and the decode's environments, each instance on its own
    half of this machine's CPUs. vLLM's CPU worker binds its OpenMP threads,
    its main thread among them, to every CPU it sees (VLLM_CPU_OMP_THREADS_BIND
    =auto); two instances on one host then pin both main threads to the same
    CPU, and each spins there between steps, so one instance's step waits for
    the other's spin (a first request took 25 s to 300 s on 2 CPUs). As vLLM's
    CPU docs say for several instances on one host: give each its own CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or "VLLM_CPU_OMP_THREADS_BIND" in env:
        return env, env
    half = len(cpus) // 2
    return ({**env, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus[:half]))},
            {**env, "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus[half:]))})


def errors_in(s: Server) -> List[str]:
    """Lines logged at ERROR and tracebacks (not inside a WARNING record: vLLM
    logs its chat-template warm-up failure without a tokenizer as a WARNING
    with its traceback) while serving; after the SIGTERM, those of pdxfer."""
    out = []
    pre = len(s.pre_stop)
    log = s.text()
    for i, part in enumerate((log[:pre], log[pre:])):
        for line in part.splitlines():
            bad = re.search(r"\bERROR\b", line) or ("Traceback (most recent call last)" in line
                                                    and "WARNING" not in line)
            # after the SIGTERM: pdxfer's own records, not a vLLM traceback
            # whose file paths happen to run through ~/.cache/pdxfer
            own = re.sub(r'"/[^"]*"', '""', line)
            if bad and (i == 0 or "pdxfer" in own or "connector" in own):
                out.append(line[:300])
    return out


def main() -> int:
    py = sys.executable
    os.makedirs(LOG_DIR, exist_ok=True)
    env = dict(os.environ)
    env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
                "PYTHONPATH": os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")})
    if not env.get("PDXFER_LIB"):
        env["PDXFER_LIB"] = os.path.join(ROOT, "target", "debug", "libpdxfer.so")
    SUMMARY.update({"model": os.path.relpath(MODEL, ROOT), "prompt_tokens": [len(p) for p in PROMPTS],
                    "max_tokens": MAX_TOKENS, "transports": {}})

    step("plain vllm serve (the reference)")
    plain = Server("plain", serve_argv(py, PORT, None), PORT, env)
    plain.wait_ready()
    step(f"plain server ready in {plain.ready_s:.0f} s; {len(PROMPTS)} greedy requests")
    try:
        ref = [complete(plain.url, p) for p in PROMPTS]
    finally:
        st = plain.stop()
    check(st["rc"] == 0 and not st["killed"], f"plain server stopped on SIGTERM in {st['stop_s']} s (rc {st['rc']})")
    SUMMARY["plain"] = {"ready_s": round(plain.ready_s, 1), **st, "token_ids": [r["token_ids"] for r in ref]}

    for i, transport in enumerate(TRANSPORTS):
        base = PORT + 1 + 3 * i
        extra = {"bootstrap_port": PORT + 10 + i, "transport": transport, "transfer_timeout": 600}
        kv = {"kv_connector": "PdxferConnector", "kv_connector_module_path": "pdxfer.vllm",
              "kv_connector_extra_config": extra}
        step(f"{transport}: prefill (kv_producer) :{base} and decode (kv_consumer) :{base + 1}, proxy :{base + 2}")
        p_env, d_env = own_cpus(env)
        p = Server(f"prefill-{transport}", serve_argv(py, base, {**kv, "kv_role": "kv_producer"}), base, p_env)
        d = Server(f"decode-{transport}", serve_argv(py, base + 1, {**kv, "kv_role": "kv_consumer"}), base + 1, d_env)
        proxy = Server(f"proxy-{transport}", [py, "-m", "pdxfer.vllm.proxy", "--prefill", p.url, "--decode", d.url,
                                              "--port", str(base + 2)], base + 2, env)
        res: Dict[str, Any] = {}
        try:
            p.wait_ready()
            d.wait_ready()
            proxy.wait_ready()
            step(f"{transport}: servers ready (prefill {p.ready_s:.0f} s, decode {d.ready_s:.0f} s); "
                 f"{len(PROMPTS)} requests through the proxy")
            t = time.monotonic()
            got = [complete(proxy.url, q) for q in PROMPTS]
            res["requests_s"] = round(time.monotonic() - t, 1)
            for q, r, g in zip(PROMPTS, ref, got):
                check(g["token_ids"] == r["token_ids"],
                      f"{transport}: {len(q)}-token prompt: PD tokens {g['token_ids']} == plain {r['token_ids']}")
            step(f"{transport}: the servers' metrics and the connector's logs")
            dm, pm = metrics(d.url), metrics(p.url)
            n_ext = dm.get("vllm:prompt_tokens_by_source_total[external_kv_transfer]", 0)
            n_local = dm.get("vllm:prompt_tokens_by_source_total[local_compute]", 0)
            want_ext = sum(len(q) for q in PROMPTS)
            check(n_ext == want_ext, f"{transport}: decode took {n_ext:.0f} prompt tokens from the KV transfer "
                                     f"(every prompt token: {want_ext})")
            check(n_local == 0, f"{transport}: decode prefilled {n_local:.0f} prompt tokens locally (none)")
            for name, m in (("prefill", pm), ("decode", dm)):
                check(m.get("vllm:kv_cache_usage_perc") == 0.0
                      and m.get("vllm:num_requests_running") == 0 and m.get("vllm:num_requests_waiting") == 0,
                      f"{transport}: {name} holds no KV blocks and no requests "
                      f"(kv_cache_usage {m.get('vllm:kv_cache_usage_perc')})")
            landed = [int(b) for b in re.findall(r"pdxfer: request \S+: (\d+) KV bytes of", d.text())]
            want = [len(q) * NUM_LAYERS * ROW_BYTES for q in PROMPTS]
            check(sorted(landed) == sorted(want), f"{transport}: decode connector landed {landed} B (want {want})")
            sent = re.findall(r"pdxfer: request \S+: sent after", p.text())
            check(len(sent) == len(PROMPTS), f"{transport}: prefill connector sent and freed {len(sent)} requests")
            res.update({"landed_bytes": landed, "external_tokens": n_ext, "local_tokens": n_local})
        finally:
            step(f"{transport}: SIGTERM to the proxy, the decode and the prefill")
            for s in (proxy, d, p):
                res[f"{s.name.split('-')[0]}_stop"] = st = s.stop()
                check(not st["killed"] and st["rc"] == 0,
                      f"{transport}: {s.name} stopped in {st['stop_s']} s (rc {st['rc']})")
            for s in (p, d):
                errs = errors_in(s)
                check(not errs, f"{transport}: {s.name} logged no error" + (f": {errs[:3]}" if errs else ""))
            res.update({"prefill_ready_s": p.ready_s and round(p.ready_s, 1),
                        "decode_ready_s": d.ready_s and round(d.ready_s, 1)})
            SUMMARY["transports"][transport] = res

    SUMMARY["wall_s"] = round(time.monotonic() - T0, 1)
    SUMMARY["ok"] = not SUMMARY["failures"]
    SUMMARY["logs"] = os.path.relpath(LOG_DIR, ROOT)
    print(json.dumps(SUMMARY, indent=1))
    return 0 if SUMMARY["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
