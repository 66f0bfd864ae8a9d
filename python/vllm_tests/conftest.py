"""The vLLM connector tests run in the environment scripts/vllm-env.sh builds
(vLLM 0.33.0, torch 2.14.0) with pdxfer from this checkout on the path;
scripts/test.sh runs them with that environment's python."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # python/: the pdxfer package
sys.path.insert(0, HERE)
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
