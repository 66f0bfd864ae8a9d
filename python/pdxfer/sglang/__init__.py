"""pdxfer as an SGLang KV transfer backend.

Select it with ``--disaggregation-transfer-backend pdxfer`` on the prefill and
the decode servers; the ``pdxfer`` plugin (entry point group
``sglang.srt.plugins``, :mod:`pdxfer.sglang.plugin`) registers the backend
name and makes SGLang's ``get_kv_class`` return the classes below. See
:mod:`pdxfer.sglang.conn` for the lifecycle and settings, and
:mod:`pdxfer.sglang.config` for how ``KVArgs`` and SGLang's parallel state map
onto pdxfer's topology.
"""

from ..engine import KVPoll as _PdxPoll
from .conn import (
    HAVE_SGLANG,
    BootstrapServer,
    KVManager,
    KVReceiver,
    KVSender,
    KVTransferError,
    PrefillServerInfo,
    SGLangCompatError,
    sglang_hint,
)

KVPoll = _PdxPoll

__all__ = [
    "HAVE_SGLANG",
    "BootstrapServer",
    "KVManager",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "PrefillServerInfo",
    "SGLangCompatError",
    "sglang_hint",
]
