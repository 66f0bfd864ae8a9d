"""Real SGLang 0.5.23 (installed from PyPI with ``--no-deps``) in a process
without torch, for the SGLang adapter tests.

What is SGLang's own code here: ``disaggregation/base/conn.py`` (``KVArgs``,
``KVPoll``, ``StateType``, the base classes), ``disaggregation/utils.py``
(``TransferBackend``, ``KVClassType``, ``DisaggregationMode``,
``get_kv_class``), ``plugins`` (``load_plugins``, ``HookRegistry``: entry-point
discovery through ``importlib.metadata``), ``arg_groups/choices.py``,
``environ.py``, ``distributed/communication_tags.py``. Nothing of SGLang is
copied; its files are loaded from the install.

Stubbed at the edges (tiny modules, only the names those files import):

- ``torch`` / ``torch.distributed``: a fake with ``ProcessGroup``, ``ReduceOp``
  and nothing else. It does NOT model tensors, devices, CUDA, streams,
  collectives or dtypes (pools and metadata buffers are numpy arrays here).
- ``sglang/__init__.py`` is not run (it imports torch, transformers, PIL ...):
  ``sglang`` is a bare package over the installed directory.
- ``sglang.srt.server_args`` (``ServerArgs`` placeholder; server args are a
  namespace of the fields the scheduler reads), ``sglang.srt.configs`` /
  ``.model_config`` (two functions ``utils.py`` imports, unused here),
  ``sglang.srt.distributed`` (a bare package; ``parallel_state`` offers only
  ``GroupCoordinator``), ``sglang.srt.utils`` (``is_npu`` -> False),
  ``sglang.srt.runtime_context``: ``get_parallel()`` returns the rank's
  parallel state the test sets (SGLang's ``ParallelContext`` fields the
  adapter reads: ``attn_tp_size/rank``, ``attn_cp_size/rank``,
  ``attn_dp_size/rank``, ``attn_dcp_size/rank``, ``dp_size``, ``pp_size``);
  it does not model SGLang's config bags or their publication.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from typing import Any, Optional

SGLANG_VERSION = "0.5.23"
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TARGET = os.environ.get("PDXFER_SGLANG_TARGET", os.path.join(REPO, ".cache", "sglang-" + SGLANG_VERSION))

_parallel: Optional[types.SimpleNamespace] = None


def ensure_installed() -> str:
    """Installs SGLang 0.5.23 (no dependencies) into ``TARGET`` if it is not there."""
    meta = os.path.join(TARGET, f"sglang-{SGLANG_VERSION}.dist-info")
    if not os.path.isdir(meta):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", TARGET,
                        f"sglang=={SGLANG_VERSION}"], check=True)
    return TARGET


def _module(name: str, path: Optional[str] = None, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name)
    if path is not None:
        m.__path__ = [path]
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m


def set_parallel(**fields: Any) -> None:
    """The parallel state ``sglang.srt.runtime_context.get_parallel()`` returns."""
    global _parallel
    _parallel = types.SimpleNamespace(**fields)


def _get_parallel() -> Any:
    if _parallel is None:
        raise ValueError("runtime context not published")
    return _parallel


def setup() -> types.ModuleType:
    """Makes SGLang importable (see the module docs); returns its ``disaggregation.utils``."""
    target = ensure_installed()
    if target not in sys.path:
        sys.path.insert(0, target)
    root = os.path.join(target, "sglang")
    if "sglang" not in sys.modules:
        _module("sglang", root)
        torch = _module("torch", __version__="0.0-fake")
        torch.distributed = _module("torch.distributed", ProcessGroup=object,
                                    ReduceOp=types.SimpleNamespace(MIN="min", MAX="max", SUM="sum"))
        _module("sglang.srt.server_args", ServerArgs=object)
        _module("sglang.srt.configs", os.path.join(root, "srt", "configs"))
        _module("sglang.srt.configs.model_config", get_dsa_mtp_topk_width=lambda *a, **k: 0,
                is_deepseek_dsa=lambda *a, **k: False)
        _module("sglang.srt.distributed", os.path.join(root, "srt", "distributed"))
        _module("sglang.srt.distributed.parallel_state", GroupCoordinator=object)
        _module("sglang.srt.utils", os.path.join(root, "srt", "utils"), is_npu=lambda: False)
        _module("sglang.srt.runtime_context", get_parallel=_get_parallel, get_disagg=None, get_spec=None)
    import sglang.srt.disaggregation.utils as utils

    return utils


def write_plugin_dist(site: str) -> None:
    """An installed distribution ``pdxfer`` whose ``entry_points.txt`` declares
    the ``sglang.srt.plugins`` entry point (what installing the pdxfer wheel leaves)."""
    d = os.path.join(site, "pdxfer-0.0.0.dist-info")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: pdxfer\nVersion: 0.0.0\n")
    with open(os.path.join(d, "entry_points.txt"), "w") as f:
        f.write("[sglang.srt.plugins]\npdxfer = pdxfer.sglang.plugin:register\n")


def load_plugins(site: str) -> types.ModuleType:
    """SGLang's own ``load_plugins()`` with ``site`` (holding the pdxfer
    distribution, see :func:`write_plugin_dist`) on ``sys.path``; returns
    ``disaggregation.utils``."""
    setup()
    if site not in sys.path:
        sys.path.append(site)
    from sglang.srt.plugins import load_plugins as sglang_load_plugins

    sglang_load_plugins()
    return sys.modules["sglang.srt.disaggregation.utils"]


def load_dcp_planner() -> types.ModuleType:
    """SGLang's ``disaggregation/common/utils.py`` (``build_dcp_token_transfer_plan``),
    executed from its file: its package's ``__init__`` imports the Mooncake
    connector (msgspec, zmq, ...), and its one SGLang import,
    ``observability.trace``, is given the two context classes it names for
    the time of the load only."""
    import importlib.util

    setup()
    names = ("sglang.srt.observability", "sglang.srt.observability.trace")
    saved = {n: sys.modules.get(n) for n in names}
    try:
        _module(names[0], path=os.path.join(TARGET, "sglang", "srt", "observability"))
        _module(names[1], TraceNullContext=type("TraceNullContext", (), {}),
                TraceReqContext=type("TraceReqContext", (), {}))
        path = os.path.join(TARGET, "sglang", "srt", "disaggregation", "common", "utils.py")
        spec = importlib.util.spec_from_file_location("sglang_disaggregation_common_utils", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
