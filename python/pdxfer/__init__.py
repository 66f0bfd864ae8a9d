"""pdxfer: KV-cache transfer for prefill/decode disaggregated LLM serving.

A ctypes binding of ``libpdxfer.so`` (``PDXFER_LIB`` if set, else the one
installed inside this package, else a source checkout's cargo target
directory; see :func:`library_path`). The library's log records go to :mod:`logging`
(loggers ``pdxfer.*``, see :mod:`pdxfer.log`). Errors are :class:`PdxError` subclasses with ``.code`` (the
stable status number shared with C) and ``.kind`` (its snake_case name).
"""

from ._lib import (
    ABI_VERSION_MAJOR,
    ArgumentError,
    BootstrapError,
    CompatError,
    CudaError,
    EngineError,
    LayoutError,
    MemoryError_,
    NcclError,
    PdxError,
    PlanError,
    RdmaError,
    TransportError,
    check,
    error_class,
    lib,
    library_path,
)
from . import bootstrap
from . import engine
from . import log
from .engine import Engine, KVPoll, Receiver, Sender, room_for_key
from .layout import (
    PeerCompat,
    RankMapping,
    Topology,
    check_peer,
    coalesce_runs,
    dcp_pack_buffer_bytes,
    dcp_token_plan,
    pair_runs,
    pair_token_plan,
    rank_mapping,
)
from .shared import SharedPool, alloc_shared_pool
from .transfer import Agent, Completion, Peer, Region, WriteOp


log._start()


def __getattr__(name: str):
    # pdxfer.sglang is imported on first use: with SGLang installed it loads
    # SGLang's connector base classes (and with them SGLang itself)
    if name == "sglang":
        import importlib

        return importlib.import_module(".sglang", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def abi_version() -> tuple:
    """The loaded library's ABI version as ``(major, minor)``."""
    v = lib.pdxfer_abi_version()
    return (v >> 16, v & 0xFFFF)


__all__ = [
    "ABI_VERSION_MAJOR",
    "Agent",
    "Completion",
    "Peer",
    "Region",
    "SharedPool",
    "WriteOp",
    "ArgumentError",
    "BootstrapError",
    "CompatError",
    "CudaError",
    "EngineError",
    "LayoutError",
    "MemoryError_",
    "NcclError",
    "PdxError",
    "PlanError",
    "RdmaError",
    "TransportError",
    "abi_version",
    "alloc_shared_pool",
    "bootstrap",
    "engine",
    "log",
    "sglang",
    "Engine",
    "KVPoll",
    "Receiver",
    "Sender",
    "room_for_key",
    "check",
    "error_class",
    "library_path",
    "PeerCompat",
    "RankMapping",
    "Topology",
    "check_peer",
    "coalesce_runs",
    "dcp_pack_buffer_bytes",
    "dcp_token_plan",
    "pair_runs",
    "pair_token_plan",
    "rank_mapping",
]
