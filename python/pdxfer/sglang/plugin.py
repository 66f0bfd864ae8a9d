"""The SGLang plugin that makes ``--disaggregation-transfer-backend pdxfer`` work.

SGLang (0.5.23) calls every function registered in the ``sglang.srt.plugins``
entry-point group (``load_plugins()``, in the launcher and in every scheduler
process; ``SGLANG_PLUGINS`` may restrict which run) and then applies the
hooks they registered. :func:`register` is that function for pdxfer. It

1. adds ``pdxfer`` to the ``--disaggregation-transfer-backend`` choices,
2. adds ``TransferBackend.PDXFER`` (value ``"pdxfer"``) to SGLang's enum, so
   ``TransferBackend("pdxfer")`` works where the scheduler builds it,
3. wraps ``sglang.srt.disaggregation.utils.get_kv_class`` (an ``AROUND`` hook;
   SGLang propagates it to ``prefill.py``, ``decode.py`` and
   ``disagg_service.py``) so it returns pdxfer's manager, sender, receiver and
   bootstrap server for that backend, and SGLang's ``KVArgs`` as for any,
4. wraps ``handle_pd_disaggregation``, whose decode-DCP check lists the
   built-in backends only, so a pdxfer decode may run with ``--dcp-size > 1``
   (pdxfer relays MLA KV out by token; SGLang's staging buffer, which pdxfer
   does not use, stays refused).

Nothing of SGLang is modified on disk.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

BACKEND = "pdxfer"
_CLASS_NAMES = {"manager": "KVManager", "sender": "KVSender", "receiver": "KVReceiver",
                "bootstrap_server": "BootstrapServer"}


def add_enum_member(enum_cls: Any, name: str, value: Any) -> Any:
    """Adds ``name = value`` to an existing ``enum.Enum`` (idempotent) and returns it."""
    existing = enum_cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member = object.__new__(enum_cls)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = enum_cls
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def get_kv_class_hook(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    """``get_kv_class`` for the ``pdxfer`` backend; other backends unchanged."""
    kind = getattr(class_type, "value", class_type)
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND or kind == "kvargs":
        return original(transfer_backend, class_type)
    from . import conn

    name = _CLASS_NAMES.get(kind)
    if name is None:
        raise ValueError(f"pdxfer has no {kind!r} class")
    return getattr(conn, name)


def handle_pd_disaggregation_hook(original: Any, server_args: Any, *args: Any, **kwargs: Any) -> Any:
    """Runs SGLang's PD argument checks; a pdxfer decode with ``--dcp-size > 1``
    passes the backend check as ``nixl`` (a DCP-capable backend) and gets
    ``pdxfer`` back right after."""
    from sglang.srt.arg_groups.overrides import declare_resolution
    from sglang.srt.arg_groups.model_override_base import resolving_view

    cfg = resolving_view(server_args)
    dcp_decode = (cfg.disaggregation_transfer_backend == BACKEND and cfg.disaggregation_mode == "decode"
                  and int(cfg.dcp_size or 1) > 1)
    if not dcp_decode:
        return original(server_args, *args, **kwargs)
    if os.environ.get("SGLANG_DISAGG_STAGING_BUFFER", "").lower() in ("1", "true"):
        raise ValueError("SGLANG_DISAGG_STAGING_BUFFER requires disaggregation_transfer_backend='mooncake' or "
                         "'nixl', got 'pdxfer' (pdxfer stages through its own buffers: unset it)")
    declare_resolution(server_args, "pdxfer.sglang.plugin", disaggregation_transfer_backend="nixl")
    try:
        return original(server_args, *args, **kwargs)
    finally:
        declare_resolution(server_args, "pdxfer.sglang.plugin", disaggregation_transfer_backend=BACKEND)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (see the module docs)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    try:
        from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices

        if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
            add_disagg_transfer_backend_choices([BACKEND])
    except ImportError:  # an SGLang without the choices registry: the enum still takes the name
        logger.warning("pdxfer: SGLang has no transfer-backend choices registry")
    from sglang.srt.disaggregation.utils import TransferBackend

    add_enum_member(TransferBackend, "PDXFER", BACKEND)
    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", get_kv_class_hook, HookType.AROUND)
    HookRegistry.register("sglang.srt.arg_groups.pd_disaggregation_hook.handle_pd_disaggregation",
                          handle_pd_disaggregation_hook, HookType.AROUND)
