"""SGLang's disaggregation connector interface on pdxfer.

Classes with the constructor arguments and method names of SGLang's
``BaseKVManager`` / ``BaseKVSender`` / ``BaseKVReceiver`` /
``BaseKVBootstrapServer`` (``python/sglang/srt/disaggregation/base/conn.py``),
implemented on :class:`pdxfer.Engine` and pdxfer's bootstrap server, so SGLang
can use pdxfer in place of its Mooncake backend:

- :class:`KVManager` ``(args, mode, server_args, is_mla_backend)``: ``args`` is
  SGLang's ``KVArgs`` (``kv_data_ptrs``, ``kv_data_lens``, ``kv_item_lens``,
  ``aux_data_ptrs``, ``aux_data_lens``, ``aux_item_lens``, ``page_size``,
  ``engine_rank``, optional ``kv_layer_ids``, ``prefill_start_layer``,
  ``dcp_size``, ``dcp_rank``); ``mode`` is ``"prefill"``/``"decode"`` or
  SGLang's ``DisaggregationMode``; ``server_args`` may carry ``tp_size``,
  ``dp_size``, ``kv_cache_dtype``, ``disaggregation_bootstrap_port``, ``host``
  and the pdxfer extras ``pdxfer_cluster``, ``pdxfer_bootstrap_url``,
  ``pdxfer_transport``.
- :class:`KVSender` ``(mgr, bootstrap_addr, bootstrap_room, dest_tp_ranks, pp_rank)``:
  ``init(num_kv_indices, aux_index)``, ``send(kv_indices, state_indices, num_kv_tokens)``,
  ``poll()``, ``failure_exception()``, ``clear()``, ``abort()``.
- :class:`KVReceiver` ``(mgr, bootstrap_addr, bootstrap_room)``:
  ``init(prefill_dp_rank)``, ``send_metadata(kv_indices, aux_index, state_indices,
  decode_prefix_len)``, ``poll()``, ``failure_exception()``, ``clear()``, ``abort()``.
- :class:`BootstrapServer` ``(host, port)``.

Differences from Mooncake: the bootstrap is pdxfer's store (the prefill's
``bootstrap_addr`` names it); ``kv_indices`` are page ids (decode: the virtual
DCP page ids, the same list on every DCP rank); the pools are host memory.
``failure_exception()`` raises the room's typed :class:`pdxfer.PdxError`.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional

from . import bootstrap as _bootstrap
from ._lib import EngineError
from .engine import Engine, KVPoll
from .layout import POOL_MHA, POOL_MLA, Topology

__all__ = ["KVPoll", "KVManager", "KVSender", "KVReceiver", "BootstrapServer", "KVTransferError"]


class KVTransferError(EngineError):
    """A room failed without a recorded reason (SGLang's ``KVTransferError``)."""


def _mode(mode: Any) -> str:
    m = getattr(mode, "value", mode)
    m = str(m).lower()
    if m not in ("prefill", "decode"):
        raise ValueError(f"mode must be prefill or decode, got {mode!r}")
    return m


def _url(addr: str) -> str:
    return addr if "://" in addr else f"http://{addr}"


def _dtype(server_args: Any) -> str:
    d = getattr(server_args, "kv_cache_dtype", None) or "bf16"
    return {"auto": "bf16", "bfloat16": "bf16", "float16": "fp16", "fp8": "fp8_e4m3"}.get(d, d)


class KVManager:
    """One rank's connector state: its pools (from ``KVArgs``), its topology and
    its pdxfer engine (prefill: created by :meth:`register_to_bootstrap`; decode:
    one per prefill bootstrap address, created on first use)."""

    def __init__(self, args: Any, mode: Any, server_args: Any = None, is_mla_backend: bool = True):
        self.kv_args = args
        self.mode = _mode(mode)
        self.server_args = server_args
        self.is_mla_backend = is_mla_backend
        p = int(args.page_size)
        items = [int(x) for x in args.kv_item_lens]
        if any(i % p for i in items):
            raise ValueError(f"kv_item_lens {items} must be multiples of page_size {p}")
        start = int(getattr(args, "prefill_start_layer", 0) or 0)
        ids = getattr(args, "kv_layer_ids", None)
        ids = list(ids) if ids is not None else [start + i for i in range(len(items))]
        dcp = int(getattr(args, "dcp_size", 1) or 1)
        dcp_rank = int(getattr(args, "dcp_rank", 0) or 0)
        tp = int(getattr(server_args, "tp_size", 0) or dcp)
        rank = int(args.engine_rank)
        self.topology = Topology(
            entries=[(int(l), i // p) for l, i in zip(ids, items)], page_size=p, engine_rank=rank,
            attn_tp_size=tp, attn_tp_rank=rank % tp, dcp_size=dcp, dcp_rank=dcp_rank,
            kv_dtype=_dtype(server_args), pool=POOL_MLA if is_mla_backend else POOL_MHA)
        self.pools = [(int(ptr), int(n) // i) for ptr, n, i in zip(args.kv_data_ptrs, args.kv_data_lens, items)]
        self.aux = [(int(ptr), int(i), int(n) // int(i))
                    for ptr, n, i in zip(getattr(args, "aux_data_ptrs", []) or [],
                                         getattr(args, "aux_data_lens", []) or [],
                                         getattr(args, "aux_item_lens", []) or []) if int(i) > 0]
        self.cluster = getattr(server_args, "pdxfer_cluster", None) or "sglang"
        self.transport = getattr(server_args, "pdxfer_transport", None) or "auto"
        self.dp_size = int(getattr(server_args, "dp_size", 1) or 1)
        self.dp_rank = int(getattr(args, "system_dp_rank", 0) or 0)
        self._engines: Dict[str, Engine] = {}
        self._lock = threading.Lock()

    def _bootstrap_url(self) -> str:
        url = getattr(self.server_args, "pdxfer_bootstrap_url", None)
        if url:
            return url
        host = getattr(self.server_args, "host", None) or "127.0.0.1"
        port = getattr(self.server_args, "disaggregation_bootstrap_port", None)
        if port is None:
            raise ValueError("server_args needs pdxfer_bootstrap_url or disaggregation_bootstrap_port")
        return f"http://{host}:{port}"

    def engine(self, bootstrap_addr: Optional[str] = None) -> Engine:
        """The engine registered with ``bootstrap_addr`` (prefill: its own bootstrap)."""
        url = _url(bootstrap_addr) if bootstrap_addr else self._bootstrap_url()
        with self._lock:
            e = self._engines.get(url)
            if e is None:
                e = Engine(self.mode, self.cluster, url, self.topology, self.pools, aux=self.aux,
                           transport=self.transport, dp_size=self.dp_size, dp_rank=self.dp_rank)
                self._engines[url] = e
            return e

    def register_to_bootstrap(self) -> None:
        """Prefill: creates the engine, which registers the rank with the bootstrap."""
        if self.mode == "prefill":
            self.engine()

    def close(self) -> None:
        """Deregisters and stops every engine of this manager."""
        with self._lock:
            engines, self._engines = list(self._engines.values()), {}
        for e in engines:
            e.close()


class _Conn:
    def __init__(self, mgr: KVManager, bootstrap_addr: Optional[str], bootstrap_room: int):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room)
        self._room = None

    def poll(self) -> KVPoll:
        """SGLang's ``KVPoll`` value of the room (``Bootstrapping`` before ``init``)."""
        if self._room is None:
            return KVPoll.Bootstrapping
        return self._room.poll()

    def failure_exception(self) -> None:
        """Raises why the room failed (a typed :class:`pdxfer.PdxError`)."""
        err = self._room.failure_exception() if self._room is not None else None
        if err is None:
            raise KVTransferError(-901, f"room {self.bootstrap_room} failed without a recorded reason")
        raise err

    def abort(self) -> None:
        """Aborts the room (decode: the prefill ranks are told, see ``is_fenced``)."""
        if self._room is not None:
            self._room.abort()

    def is_fenced(self) -> bool:
        """True when no write for the aborted room can still land locally."""
        return self._room is None or self._room.is_fenced()

    def clear(self) -> None:
        """Forgets the (terminal) room."""
        if self._room is not None:
            self._room.clear()
            self._room = None


class KVSender(_Conn):
    """Prefill side of one request."""

    def __init__(self, mgr: KVManager, bootstrap_addr: Optional[str], bootstrap_room: int,
                 dest_tp_ranks: Any = None, pp_rank: int = 0, *args: Any, **kwargs: Any):
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        self.dest_tp_ranks = dest_tp_ranks
        self.pp_rank = pp_rank
        self.num_kv_indices = 0
        self.aux_index = 0
        self.curr_idx = 0
        self._room = mgr.engine().sender(self.bootstrap_room)

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        """The request's page count and aux row."""
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = int(aux_index or 0)

    def send(self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: Optional[int] = None) -> None:
        """Sends the next chunk of page ids; the chunk that reaches ``num_kv_indices``
        is the last. ``num_kv_tokens``: positions in the chunk (default: full pages)."""
        n = len(kv_indices)
        self.curr_idx += n
        last = self.curr_idx >= self.num_kv_indices
        self._room.send(kv_indices, num_kv_tokens, last=last, aux_index=self.aux_index)

    def pop_decode_prefix_len(self) -> int:
        """Mooncake's hook for the decode prefix; pdxfer applies it on the prefill side itself."""
        return 0


class KVReceiver(_Conn):
    """Decode side of one request."""

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: int,
                 prefill_dp_rank: Optional[int] = None, *args: Any, **kwargs: Any):
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        if prefill_dp_rank is not None:
            self.init(prefill_dp_rank)

    def init(self, prefill_dp_rank: int = 0) -> None:
        """Resolves and connects the prefill ranks of DP group ``prefill_dp_rank``."""
        self._room = self.kv_mgr.engine(self.bootstrap_addr).receiver(self.bootstrap_room, int(prefill_dp_rank))

    def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None, state_indices: Any = None,
                      decode_prefix_len: Optional[int] = None, **kwargs: Any) -> None:
        """Where the request's KV goes: the (virtual) page ids, the aux row and the
        decode prefix already held (a multiple of ``page_size * dcp_size``)."""
        if self._room is None:
            self.init(0)
        self._room.send_metadata(kv_indices, int(decode_prefix_len or 0), int(aux_index or 0))


class BootstrapServer:
    """SGLang's ``BaseKVBootstrapServer(host, port)``: pdxfer's bootstrap server in this process."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: Optional[str] = None):
        self._srv = _bootstrap.BootstrapServer(listen=f"{host}:{port}", token=token)
        self.url = self._srv.url
        self.port = int(self.url.rsplit(":", 1)[1])

    def close(self) -> None:
        """Stops the server."""
        self._srv.stop()
