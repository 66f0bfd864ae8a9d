"""SGLang's KV connector classes on pdxfer.

:class:`KVManager`, :class:`KVSender`, :class:`KVReceiver` and
:class:`BootstrapServer` subclass SGLang's ``BaseKVManager`` / ``BaseKVSender``
/ ``BaseKVReceiver`` / ``BaseKVBootstrapServer`` when ``sglang`` is importable
(``sglang/srt/disaggregation/base/conn.py``) and take the constructor
arguments SGLang's scheduler passes (``prefill.py``, ``decode.py``,
``disagg_service.py``). Lifecycle as the scheduler expects it:

- prefill: the manager registers the rank with the bootstrap when it is built;
  a sender is ``Bootstrapping`` until every decode rank of the room sent its
  metadata, then ``WaitingForInput``; ``pop_decode_prefix_len()`` is the
  prefix the decode holds, ``init(num_pages, aux_index)`` the page count after
  it; the send that reaches ``num_pages`` is the last (aux row and state rows
  follow its KV).
- decode: ``try_ensure_parallel_info(addr)`` is True once the prefill instance
  lists every rank (``prefill_info_table[addr]`` is then filled); a receiver is
  ``WaitingForInput`` once ``init(prefill_dp_rank)`` connected to its prefill
  ranks, and follows the room from ``send_metadata`` on.

Failures do not raise out of ``send`` / ``send_metadata`` / ``init`` (the
scheduler does not catch there): the room turns ``Failed`` and
``failure_exception()`` raises :class:`KVTransferError`, which carries
SGLang's ``failure_reason`` / ``is_from_another_rank`` and pdxfer's typed
``.kind`` (``dcp_rank_mismatch``, ``prefix_misaligned``, ...), with the SGLang
server arguments to change where a launch setting is the cause.

Settings (environment): ``PDXFER_SGLANG_CLUSTER`` (default ``sglang``; the
same on prefill and decode), ``PDXFER_SGLANG_TRANSPORT`` (default ``auto``),
``PDXFER_SGLANG_POOL_MEMORY`` (``device``, the default, or ``host``),
``PDXFER_SGLANG_BOOTSTRAP_TOKEN``; SGLang's own
``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` / ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``
(300 s each) bound a room's life (prefill: both, decode: the waiting one) and
``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE`` turns on deferred release.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Dict, List, Optional
from urllib.parse import urlsplit

from .. import bootstrap as _bootstrap
from .._lib import ArgumentError, BootstrapError, CompatError, EngineError, PdxError
from ..engine import Engine
from . import config as _cfg

try:  # SGLang's own base classes and value types when SGLang is installed
    from sglang.srt.disaggregation.base.conn import (
        BaseKVBootstrapServer,
        BaseKVManager,
        BaseKVReceiver,
        BaseKVSender,
        KVPoll,
        KVTransferMetric,
    )

    HAVE_SGLANG = True
except Exception:  # noqa: BLE001 - sglang absent or not importable here
    from ..engine import KVPoll  # the same values
    from ._base import (  # type: ignore[assignment]
        BaseKVBootstrapServer,
        BaseKVManager,
        BaseKVReceiver,
        BaseKVSender,
        KVTransferMetric,
    )

    HAVE_SGLANG = False

logger = logging.getLogger(__name__)

__all__ = ["KVManager", "KVSender", "KVReceiver", "BootstrapServer", "KVTransferError",
           "PrefillServerInfo", "HAVE_SGLANG", "sglang_hint"]

#: The SGLang launch arguments that fix each pdxfer refusal.
_HINTS = {
    "prefill_cp_with_decode_dcp": "SGLang: prefill attention CP pairs with a DCP decode over replicated KV: "
                                  "relaunch the prefill without --enable-dsa-cache-layer-split and "
                                  "--enable-kv-cache-sharding, or the decode with --dcp-size 1",
    "dcp_rank_mismatch": "SGLang: give the prefill --dcp-size 1 or the decode's --dcp-size, with the same "
                         "--tp-size on both sides, and do not override KVArgs.dcp_rank; then restart the "
                         "decode so its ranks re-register",
    "unsupported_dcp_topology": "SGLang: launch the prefill with --dcp-size 1 or the decode's --dcp-size",
    "dcp_requires_mla": "SGLang: decode --dcp-size > 1 needs an MLA model; launch the decode with --dcp-size 1",
    "kv_dtype_mismatch": "SGLang: launch both sides with the same --kv-cache-dtype",
    "page_size_mismatch": "SGLang: launch both sides with the same --page-size",
    "pp_mismatch": "SGLang: the decode's --pp-size must be 1 or the prefill's --pp-size",
    "geometry_mismatch": "SGLang: both sides must serve the same --model-path (and the same "
                         "--speculative-algorithm / draft model)",
    "prefix_misaligned": "SGLang: under decode DCP the decode prefix must be a multiple of "
                         "--page-size x --dcp-size",
}


def sglang_hint(err: PdxError) -> str:
    """``err``'s message with the SGLang server arguments that fix it, if any."""
    h = _HINTS.get(getattr(err, "kind", ""))
    return f"{err}. {h}" if h else str(err)


class KVTransferError(EngineError, RuntimeError):
    """A failed room, as the SGLang scheduler reads it (``failure_reason``,
    ``bootstrap_room``, ``is_from_another_rank``); ``.kind`` / ``.code`` are
    pdxfer's (the cause's, when there is one: also in ``__cause__``)."""

    def __init__(self, bootstrap_room: int, failure_reason: str, cause: Optional[PdxError] = None,
                 is_from_another_rank: bool = False):
        super().__init__(cause.code if cause is not None else -901, failure_reason)
        self.bootstrap_room = bootstrap_room
        self.failure_reason = failure_reason
        self.is_from_another_rank = is_from_another_rank
        self.cause = cause
        if cause is not None:
            self.__cause__ = cause

    def __str__(self) -> str:
        return f"KVTransferError(bootstrap_room={self.bootstrap_room}): {self.failure_reason}"


class SGLangCompatError(CompatError, RuntimeError):
    """A launch-setting refusal (SGLang raises ``RuntimeError`` for these)."""


@dataclasses.dataclass
class PrefillServerInfo:
    """What ``prefill_info_table[addr]`` holds (the fields the scheduler reads)."""

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: Optional[int]
    kv_cache_dtype: Optional[str]
    follow_bootstrap_room: bool
    dcp_size: int = 1
    enable_dsa_cache_layer_split: bool = False
    decode_allocation_policy: str = "early"
    prefill_http_port: Optional[int] = None
    enable_kv_cache_sharding: bool = False


def _mode(mode: Any) -> str:
    m = str(getattr(mode, "value", mode)).lower()
    if m not in ("prefill", "decode"):
        raise ArgumentError(-101, f"disaggregation mode must be prefill or decode, got {mode!r}")
    return m


def _url(addr: str) -> str:
    return addr if "://" in addr else f"http://{addr}"


def _host(h: Optional[str]) -> str:
    if not h or h in ("0.0.0.0", "::", "[::]"):
        return "127.0.0.1"
    return h


def _env(name: str, default: Optional[str]) -> Optional[str]:
    v = os.environ.get(name)
    return v if v else default


class KVManager(BaseKVManager):
    """One rank's connector: its pools and topology (from ``KVArgs``, SGLang's
    parallel state and ``server_args``) and its pdxfer engines (prefill: one,
    registered at construction; decode: one per prefill bootstrap address)."""

    supports_deferred_decode_kv_release = True  # abort is fenced: the drain is known
    supports_host_destination = False
    supports_role_switch = False

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any = None,
                 is_mla_backend: Optional[bool] = False, parallel: Any = None, **_: Any):
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.mode = _mode(disaggregation_mode)
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.is_hybrid_mla_backend = bool(getattr(args, "is_hybrid_mla_backend", False))
        self.kv_cache_dtype_str = getattr(args, "kv_cache_dtype_str", None)
        lay = _cfg.parallel_layout(args, server_args, parallel)
        self.layout = lay
        for k, v in dataclasses.asdict(lay).items():
            setattr(self, k, v)
        self.pp_rank = lay.pp_rank
        par = parallel if parallel is not None else _cfg.sglang_parallel()
        self.topology, main_idx, self.draft_topology, draft_idx = _cfg.topologies(
            args, server_args, _cfg.transfer_layout(lay, par), self.is_mla_backend, self.mode)
        self.pools = _cfg.kv_pools(args, main_idx)
        self.draft_pools = _cfg.kv_pools(args, draft_idx)
        self.aux = _cfg.aux_buffers(args)
        self.state, self.state_components = _cfg.state_buffers(args)
        self.pool_device = _cfg.pool_device(args)
        self.cluster = getattr(server_args, "pdxfer_cluster", None) or _env("PDXFER_SGLANG_CLUSTER", "sglang")
        self.transport = getattr(server_args, "pdxfer_transport", None) or _env("PDXFER_SGLANG_TRANSPORT", "auto")
        self.token = _env("PDXFER_SGLANG_BOOTSTRAP_TOKEN", None)
        # SGLang's deadlines: a prefill room may wait for its decode (bootstrap) and
        # then for the transfer; a decode room waits from init to the last byte
        bootstrap_s = float(os.environ.get("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "") or 300)
        waiting_s = float(os.environ.get("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "") or 300)
        self.room_timeout = bootstrap_s + waiting_s if self.mode == "prefill" else waiting_s
        self.enable_deferred_decode_kv_release = (
            os.environ.get("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "").lower() in ("1", "true")
        )
        self.enable_all_cp_ranks_for_transfer, self.is_dummy_cp_rank = _cfg.cp_send_mode(
            lay, par, self.is_hybrid_mla_backend, self.mode)
        storage = _cfg.cp_storage(par)
        for t in (self.topology, self.draft_topology):
            if t is not None and self.mode == "prefill":
                t.cp_mode = "all-cp" if self.enable_all_cp_ranks_for_transfer else "rank0"
                t.cp_storage = storage
        self.transfer_infos: Dict[int, Any] = {}
        self.prefill_info_table: Dict[str, PrefillServerInfo] = {}
        self._prefill_topology: Dict[str, Dict[str, Any]] = {}
        self._engines: Dict[Any, Engine] = {}
        self._lock = threading.Lock()
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        if self.mode == "prefill":
            self.register_to_bootstrap()

    # ----- bootstrap -----

    def own_bootstrap_url(self) -> str:
        """Prefill: the bootstrap this instance's ranks register with (the
        ``--disaggregation-bootstrap-port`` on ``--dist-init-addr``'s host, else ``--host``)."""
        sa = self.server_args
        url = getattr(sa, "pdxfer_bootstrap_url", None)
        if url:
            return url
        port = getattr(sa, "disaggregation_bootstrap_port", None)
        if port is None:
            raise ArgumentError(-101, "server_args has no disaggregation_bootstrap_port")
        dist = getattr(sa, "dist_init_addr", None)
        host = dist.rsplit(":", 1)[0] if dist else getattr(sa, "host", None)
        return f"http://{_host(host)}:{int(port)}"

    def engine(self, bootstrap_addr: Optional[str] = None, draft: bool = False) -> Engine:
        """The engine registered with ``bootstrap_addr`` (prefill: its own
        bootstrap); ``draft``: the one of the speculative-draft entries (cluster
        ``<cluster>.draft``; see :func:`pdxfer.sglang.config.topologies`)."""
        url = _url(bootstrap_addr) if bootstrap_addr else self.own_bootstrap_url()
        with self._lock:
            e = self._engines.get((url, draft))
            if e is None:
                lay = self.layout
                tmo = self.room_timeout
                if draft:
                    e = Engine(self.mode, self.cluster + ".draft", url, self.draft_topology, self.draft_pools,
                               token=self.token, transport=self.transport, dp_size=lay.dp_size,
                               dp_rank=lay.dp_rank, pool_device=self.pool_device, room_timeout=tmo)
                else:
                    e = Engine(self.mode, self.cluster, url, self.topology, self.pools, aux=self.aux,
                               state=self.state, token=self.token, transport=self.transport,
                               dp_size=lay.dp_size, dp_rank=lay.dp_rank, pool_device=self.pool_device,
                               room_timeout=tmo)
                self._engines[(url, draft)] = e
            return e

    def engines(self, bootstrap_addr: Optional[str] = None) -> List[Engine]:
        """The engine of the target entries, and the draft entries' if any."""
        out = [self.engine(bootstrap_addr)]
        if self.draft_topology is not None:
            out.append(self.engine(bootstrap_addr, draft=True))
        return out

    def register_to_bootstrap(self) -> None:
        """Prefill: registers the rank (creates its engines); idempotent. The
        bootstrap server may start after the scheduler (SGLang starts both at
        once): unreachable, it is retried with back-off for up to
        ``PDXFER_SGLANG_REGISTER_TIMEOUT`` seconds (60), then logged; the first
        sender tries again and fails its room (typed) if it still cannot."""
        if self.mode != "prefill":
            return
        deadline = time.monotonic() + float(_env("PDXFER_SGLANG_REGISTER_TIMEOUT", "60"))
        pause = 0.05
        while True:
            try:
                self.engines()
                return
            except BootstrapError as e:
                if time.monotonic() + pause > deadline:
                    logger.error("pdxfer: could not register with the bootstrap at %s: %s",
                                 self.own_bootstrap_url(), e)
                    return
                time.sleep(pause)
                pause = min(pause * 2, 2.0)

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Decode: True once the prefill instance at ``bootstrap_addr`` lists
        every rank; fills ``prefill_info_table`` and registers this rank there.
        A launch mismatch pdxfer can see from the instance's layout raises
        (as SGLang does) a ``RuntimeError`` that names the arguments to change."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        url = _url(bootstrap_addr)
        clusters = [self.cluster] + ([self.cluster + ".draft"] if self.draft_topology is not None else [])
        try:
            with _bootstrap.BootstrapClient(url, token=self.token) as c:
                summaries = [c.summary(name, "prefill") for name in clusters]
        except BootstrapError:
            return False
        if not all(x.get("ready") and x.get("layout") for x in summaries):
            return False
        lay = summaries[0]["layout"]
        storage = (lay.get("cp") or {}).get("storage", "replicated")
        if int(lay["attn_cp_size"]) > 1 and storage == "kv_sharded" and self.layout.dcp_size == 1:
            raise SGLangCompatError(-105, (
                f"the prefill's {lay['attn_cp_size']} attention CP ranks (at {bootstrap_addr}) shard the KV by "
                f"page id (--enable-kv-cache-sharding), which pdxfer does not move; relaunch the prefill "
                f"without --enable-kv-cache-sharding"))
        if self.layout.dcp_size > 1 and int(lay["attn_cp_size"]) > 1 and storage != "replicated":
            # the prefill's CP ranks do not each hold every token: nothing a DCP decode can take
            flag = _cfg.CP_STORAGE_FLAGS.get(storage, storage)
            raise SGLangCompatError(-206, (
                f"PD decode DCP needs the prefill's attention CP ranks to hold replicated KV, but the prefill "
                f"(attention CP={lay['attn_cp_size']}, at {bootstrap_addr}) stores it {storage} ({flag}); "
                f"relaunch the prefill without {flag}, or decode with --dcp-size 1"))
        try:
            self.engines(bootstrap_addr)  # registers this decode rank there
        except BootstrapError:
            return False
        self._prefill_topology[bootstrap_addr] = lay
        self.prefill_info_table[bootstrap_addr] = PrefillServerInfo(
            attn_tp_size=int(lay["attn_tp_size"]), attn_cp_size=int(lay["attn_cp_size"]),
            dp_size=int(lay["dp_size"]), pp_size=int(lay["pp_size"]), page_size=int(lay["page_size"]),
            kv_cache_dtype=self.kv_cache_dtype_str if lay.get("kv_dtype") == self.topology.kv_dtype
            else lay.get("kv_dtype"),
            follow_bootstrap_room=True, dcp_size=int(lay.get("dcp_size", 1)),
            enable_dsa_cache_layer_split=storage == "layer_split", enable_kv_cache_sharding=storage == "kv_sharded")
        return True

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        """A decode rank's KV equals the prefill's digested range only when
        neither DCP relayout, a TP width change nor PP stages split it."""
        info = self.prefill_info_table.get(bootstrap_addr)
        if info is None:
            return False
        lay = self.layout
        return (info.dcp_size, info.attn_tp_size, info.pp_size) == (lay.dcp_size, lay.attn_tp_size, lay.pp_size)

    # ----- decode-side helpers the scheduler calls -----

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int = 0) -> bool:
        """Decode: no write for the aborted room can still land (pdxfer's fence;
        ``required_acks`` is implied by it)."""
        with self._lock:
            engines = list(self._engines.values())
        return all(e.is_fenced(int(bootstrap_room)) for e in engines)

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """Decode: nothing to forget beyond the room (``clear`` forgets it)."""

    def _ensure_prefill_recompute_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="pdxfer-sglang")
            return self._executor

    def submit_prefill_recompute(self, receiver: "KVReceiver", payload: Any = None) -> None:
        """PD retraction rebootstrap is not supported: the receiver's room fails (typed)."""
        receiver._fail(ArgumentError(-105, "pdxfer does not drive the prefill's /generate for a "
                                           "retraction rebootstrap; use --disaggregation-decode-retraction-"
                                           "backup host_pool or the mooncake backend"))

    # ----- lifecycle -----

    def close(self) -> None:
        """Deregisters and stops every engine of this manager."""
        with self._lock:
            engines, self._engines = list(self._engines.values()), {}
            ex, self._executor = self._executor, None
        for e in engines:
            e.close()
        if ex is not None:
            ex.shutdown(wait=False)

    teardown = close


_ORDER = {KVPoll.Failed: 0, KVPoll.Bootstrapping: 1, KVPoll.WaitingForInput: 2, KVPoll.Transferring: 3,
          KVPoll.Success: 4}


class _Room:
    """What a sender and a receiver share: the request's room in each engine of
    the manager (the target entries', and the draft entries' when they move
    apart) and a locally recorded failure."""

    def _setup(self, mgr: KVManager, bootstrap_addr: Optional[str], bootstrap_room: Optional[int]) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room or 0)
        self._rooms: List[Any] = []
        self._error: Optional[KVTransferError] = None
        self.conclude_state: Optional[int] = None

    @property
    def _room(self) -> Any:
        """The target entries' room (aux and state ride with it)."""
        return self._rooms[0] if self._rooms else None

    def _fail(self, err: PdxError, abort: bool = True) -> None:
        if self._error is None:
            self._error = KVTransferError(self.bootstrap_room, sglang_hint(err), err)
        self.conclude_state = KVPoll.Failed
        if abort:
            self._abort_rooms()

    def _abort_rooms(self) -> None:
        for r in self._rooms:
            try:
                r.abort()
            except PdxError:
                pass

    def _engine_poll(self) -> int:
        """The least advanced state of the rooms (``Failed`` if any failed)."""
        if self._error is not None:
            return KVPoll.Failed
        st = min((int(r.poll()) for r in self._rooms), key=lambda v: _ORDER[v])
        if st in (KVPoll.Success, KVPoll.Failed):
            self.conclude_state = st
        return st

    def failure_exception(self) -> None:
        """Raises why the room failed (:class:`KVTransferError`, typed ``.kind``)."""
        if self._error is None:
            for r in self._rooms:
                cause = r.failure_exception()
                if cause is not None:
                    self._error = KVTransferError(self.bootstrap_room, sglang_hint(cause), cause)
                    break
            else:
                self._error = KVTransferError(self.bootstrap_room, "room failed without a recorded reason")
        raise self._error

    def abort(self) -> None:
        """Aborts the room (the peers are told; see ``is_abort_release_safe``)."""
        self.conclude_state = KVPoll.Failed
        if self._error is None:
            self._error = KVTransferError(self.bootstrap_room, "aborted by the scheduler")
        self._abort_rooms()

    def is_abort_release_safe(self) -> bool:
        """True when no write for the room can still land here."""
        return all(r.is_fenced() for r in self._rooms)

    def clear(self) -> None:
        """Forgets the (terminal) room so its id can be reused; a room whose
        writes are still in flight is kept, and forgotten by a later ``clear``."""
        kept = []
        for r in self._rooms:
            try:
                r.clear()
            except PdxError:
                kept.append(r)
        self._rooms = kept


class KVSender(_Room, BaseKVSender):
    """Prefill side of one request."""

    def __init__(self, mgr: KVManager, bootstrap_addr: Optional[str] = None, bootstrap_room: Optional[int] = None,
                 req_has_disagg_prefill_dp_rank: bool = False, *_: Any, **__: Any):
        self._setup(mgr, bootstrap_addr, bootstrap_room)
        self.req_has_disagg_prefill_dp_rank = req_has_disagg_prefill_dp_rank
        self.num_kv_indices = 0
        self.aux_index = 0
        self.curr_idx = 0
        self._t_first: Optional[float] = None
        self._t_done: Optional[float] = None
        self._bytes = 0
        try:
            for e in mgr.engines():
                self._rooms.append(e.sender(self.bootstrap_room))
        except PdxError as e:
            self._fail(e)

    def poll(self) -> int:
        """``Bootstrapping`` until the decode ranks' metadata arrived, then the room's state."""
        if not self._rooms and self._error is None:
            return KVPoll.Failed
        st = self._engine_poll()
        if st == KVPoll.Success and self._t_done is None:
            self._t_done = time.monotonic()
        return st

    def failure_exception(self) -> None:
        """Raises why the room failed and forgets the room, as SGLang's senders
        do (the scheduler does not ``clear`` a failed prefill request)."""
        try:
            super().failure_exception()
        finally:
            self.clear()

    def poll_pp_consensus(self) -> int:
        """PP rank 0's poll, which SGLang forwards to the other PP ranks."""
        return self.poll()

    def pop_decode_prefix_len(self) -> int:
        """The prefix the decode holds (the first page to send starts there).
        A PP rank may be told ``WaitingForInput`` by rank 0 a moment before its
        own metadata lands: it waits for it (up to 30 s). A dummy CP rank
        (no decode contacts it) returns 0 at once, as SGLang's does, so the
        CP group's reduced poll is not held up."""
        if self._room is None or self._error is not None or self.kv_mgr.is_dummy_cp_rank:
            return 0
        deadline = time.monotonic() + 30.0
        while True:
            p = self._room.decode_prefix_len()
            if p is not None:
                return int(p)
            if self._room.poll() == KVPoll.Failed or time.monotonic() > deadline:
                self._fail(EngineError(-901, f"room {self.bootstrap_room}: no decode metadata arrived"))
                return 0
            time.sleep(0.001)

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None) -> None:
        """The request's page count after the decode prefix, and its aux row."""
        self.num_kv_indices = int(num_kv_indices)
        self.aux_index = int(aux_index or 0)
        try:  # an all-CP-ranks sender moves its share of these pages
            for r in self._rooms:
                r.set_request_pages(self.num_kv_indices)
        except PdxError as e:
            self._fail(e)

    def mark_prefill_complete(self) -> None:
        """Nothing to publish: pdxfer sends as soon as the decode's metadata is there."""

    def get_max_transfer_tokens(self) -> Optional[int]:
        """No per-send limit (the DCP pack buffer is pdxfer's own and is sliced by it)."""
        return None

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """A chunk with pages, and the last one even without: it carries the
        aux and state rows and concludes the room (a request whose every
        token the decode holds sends only that)."""
        return num_pages > 0 or last_chunk

    def send(self, kv_indices: Any, state_indices: Optional[List] = None, num_kv_tokens: Optional[int] = None,
             event: Any = None, **_: Any) -> None:
        """Queues the next chunk of page ids; the one reaching ``num_kv_indices``
        is the last, and carries the state rows (and the aux row). ``event``:
        when the scheduler gives one (a ``torch.cuda.Event`` recorded after the
        forward that wrote the chunk; device pools), the engine's stream waits
        on it instead of the scheduler synchronising."""
        if not self._rooms or self._error is not None:
            return
        n = len(kv_indices)
        self.curr_idx += n
        last = self.curr_idx >= self.num_kv_indices
        if self._t_first is None:
            self._t_first = time.monotonic()
        try:
            if last and self.kv_mgr.state:
                self._room.set_state_indices(_cfg.state_rows(state_indices, self.kv_mgr.state_components))
            for r in self._rooms[1:]:  # the draft entries: the same pages, no aux
                r.send(kv_indices, num_kv_tokens, last=last, aux_index=0, event=event)
            self._room.send(kv_indices, num_kv_tokens, last=last, aux_index=self.aux_index, event=event)
        except PdxError as e:
            self._fail(e)
            return
        t = self.kv_mgr.topology
        tokens = num_kv_tokens if num_kv_tokens is not None else n * t.page_size
        rows = sum(r for _, r in t.entries)
        if self.kv_mgr.draft_topology is not None:
            rows += sum(r for _, r in self.kv_mgr.draft_topology.entries)
        self._bytes += int(tokens) * rows

    def get_transfer_metric(self) -> Any:
        """First send to ``Success`` seen by ``poll``; the KV bytes this rank sent."""
        lat = None
        if self._t_first is not None and self._t_done is not None:
            lat = self._t_done - self._t_first
        return KVTransferMetric(transfer_latency_s=lat, transfer_total_bytes=self._bytes or None)


class KVReceiver(_Room, BaseKVReceiver):
    """Decode side of one request."""

    require_staging = False

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None,
                 prefill_dp_rank: Optional[int] = None, *_: Any, **__: Any):
        self._setup(mgr, bootstrap_addr, bootstrap_room)
        self._metadata_sent = False
        self.abort_notified = False
        self.bootstrap_infos: List[Dict[str, Any]] = []
        self.prefill_dp_rank: Optional[int] = None
        self.prefill_info: Optional[PrefillServerInfo] = None
        if prefill_dp_rank is not None:
            self.init(prefill_dp_rank)

    @property
    def supports_host_destination(self) -> bool:  # type: ignore[override]
        return False

    def init(self, prefill_dp_rank: int = 0) -> None:
        """Connects the room to the prefill ranks of DP group ``prefill_dp_rank``
        (``WaitingForInput`` once done; a launch mismatch fails the room)."""
        if self._rooms or self._error is not None:
            return
        self.prefill_dp_rank = int(prefill_dp_rank)
        mgr = self.kv_mgr
        self.prefill_info = mgr.prefill_info_table.get(self.bootstrap_addr)
        try:
            for eng in mgr.engines(self.bootstrap_addr):
                self._rooms.append(eng.receiver(self.bootstrap_room, self.prefill_dp_rank))
        except PdxError as e:
            if isinstance(e, CompatError):
                e = SGLangCompatError(e.code, e.detail)
            self._fail(e)
            return
        lay = mgr._prefill_topology.get(self.bootstrap_addr)
        n = 1
        if lay is not None:
            tp_p, pp_p = int(lay["attn_tp_size"]), int(lay["pp_size"])
            tp_d = mgr.layout.attn_tp_size
            n = (max(1, tp_p // tp_d) if tp_p > tp_d else 1) * (pp_p if mgr.layout.pp_size == 1 else 1)
            if (lay.get("cp") or {}).get("mode") == "all_cp":  # every CP rank sends (and answers)
                n *= int(lay["attn_cp_size"])
        self.bootstrap_infos = [{"prefill_dp_rank": self.prefill_dp_rank, "index": i} for i in range(n)]

    def poll(self) -> int:
        """``Bootstrapping`` before ``init``, ``WaitingForInput`` after it until
        ``send_metadata``, then the room's state."""
        if self._error is not None:
            return KVPoll.Failed
        if not self._rooms:
            return KVPoll.Bootstrapping
        st = self._engine_poll()
        if not self._metadata_sent and st == KVPoll.Bootstrapping:
            return KVPoll.WaitingForInput
        return st

    def send_metadata(self, kv_indices: Any, aux_index: Optional[int] = None, state_indices: Optional[List] = None,
                      decode_prefix_len: Optional[int] = None, destination: Any = None, **_: Any) -> None:
        """Where the request's KV goes: its (virtual DCP) page ids after the
        decode prefix, the metadata row, the state rows, the prefix held."""
        if not self._rooms:
            self.init(0)
        if not self._rooms or self._error is not None:
            return
        if destination is not None and str(getattr(destination, "value", destination)) != "device":
            self._fail(ArgumentError(-105, "pdxfer receives KV into device pools only (no host destination)"))
            return
        try:
            if self.kv_mgr.state:
                self._room.set_state_indices(_cfg.state_rows(state_indices, self.kv_mgr.state_components))
            for r in self._rooms[1:]:  # the draft pool is paged by the same virtual page ids
                r.send_metadata(kv_indices, int(decode_prefix_len or 0), 0)
            self._room.send_metadata(kv_indices, int(decode_prefix_len or 0), int(aux_index or 0))
        except PdxError as e:
            self._fail(e)
            return
        self._metadata_sent = True

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Deferred KV release: aborts the room so the prefill ranks stop and
        fence (``kv_mgr.is_abort_release_safe`` then says when)."""
        if self._rooms:
            self._abort_rooms()
            self.abort_notified = True

    def abort(self) -> None:
        super().abort()
        if self._rooms:
            self.abort_notified = True


class BootstrapServer(BaseKVBootstrapServer):
    """SGLang's bootstrap server slot: pdxfer's bootstrap server on ``host:port``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: Optional[str] = None):
        self._srv = _bootstrap.BootstrapServer(listen=f"{host}:{int(port)}",
                                               token=token or _env("PDXFER_SGLANG_BOOTSTRAP_TOKEN", None))
        self.url = self._srv.url
        self.host = urlsplit(self.url).hostname
        self.port = int(urlsplit(self.url).port or 0)

    def close(self) -> None:
        """Stops the server."""
        self._srv.stop()
