"""scripts/sglang-gpu-check.py (the SGLang adapter step of scripts/gpu-check.sh)
run here with host-memory pools, so its plan, its rank processes and its
read-back verification are exercised on every test run; on a GPU host the
same code runs with torch CUDA tensors as pools."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
SCRIPT = os.path.join(REPO, "scripts", "sglang-gpu-check.py")
sys.path.insert(0, HERE)

import sglang_env  # noqa: E402


def run_check(*args, extra_path=None):
    env = dict(os.environ, PDXFER_SGLANG_POOL_MEMORY="host")
    path = [extra_path] if extra_path else []
    if os.environ.get("PDXFER_EXPECT_INSTALLED") != "1":  # the source checkout's package
        path.append(os.path.join(REPO, "python"))
    env["PYTHONPATH"] = os.pathsep.join(path + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    p = subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON line (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    return p.returncode, json.loads(lines[-1])


def test_one_prefill_to_two_dcp_ranks_verified_with_host_pools():
    rc, r = run_check("--memory", "host", "--layers", "3", "--tokens", "300", "--page", "16")
    assert rc == 0 and r["verified"] is True, r
    assert r["memory"] == "host" and r["pool_device"] == [None]
    assert r["decode_dcp_ranks"] == 2 and r["rooms"] == 3
    assert r["sglang"], "the output says whose base classes were used"
    # rooms of 300 tokens, 205 with a 64-token decode prefix and 163: every token
    # after the prefix reaches exactly one of the two ranks, 1,152 bytes a layer
    assert r["bytes"] == (300 + (205 - 64) + 163) * 1152 * 3
    assert r["readback_bytes"] > r["bytes"], "whole pools are read back, not only the owned rows"
    assert r["seconds"] > 0


def test_an_impossible_plan_is_refused_with_a_non_zero_exit():
    rc, r = run_check("--memory", "host", "--tokens", "20")
    assert rc != 0 and r["verified"] is False and "tokens" in r["error"]


def test_the_same_check_on_sglangs_own_base_classes(tmp_path):
    """Every rank process imports SGLang 0.5.23 first (sglang_env, through a
    ``sitecustomize`` on its path), so the adapter subclasses SGLang's classes
    and the ranks fill SGLang's own KVArgs."""
    sglang_env.ensure_installed()
    (tmp_path / "sitecustomize.py").write_text(
        f"import sys\nsys.path.insert(0, {HERE!r})\nimport sglang_env\nsglang_env.setup()\n")
    rc, r = run_check("--memory", "host", "--layers", "2", "--tokens", "200", extra_path=str(tmp_path))
    assert rc == 0 and r["verified"] is True, r
    assert r["sglang"].startswith("sglang "), r["sglang"]
    assert r["bytes"] == (200 + (138 - 64) + 113) * 1152 * 2
