"""Stand-ins for SGLang's connector base classes, used when ``sglang`` is not
importable, so the adapter works (and is tested) without SGLang installed.
With SGLang installed the adapter subclasses SGLang's own classes instead."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class KVTransferMetric:
    """SGLang's per-sender transfer metric."""

    transfer_latency_s: Optional[float] = None
    alloc_latency_s: Optional[float] = None
    transfer_total_bytes: Optional[int] = None




class BaseKVManager:
    """Stand-in for ``BaseKVManager``."""

    enable_deferred_decode_kv_release: bool = False
    supports_host_destination: bool = False


class BaseKVSender:
    """Stand-in for ``BaseKVSender``."""


class BaseKVReceiver:
    """Stand-in for ``BaseKVReceiver``."""


class BaseKVBootstrapServer:
    """Stand-in for ``BaseKVBootstrapServer``."""
