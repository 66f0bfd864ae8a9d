"""``PdxferConnector``: vLLM 0.33's KV connector (``KVConnectorBase_V1``) over
pdxfer's engine, for MLA models.

The flow (the sequential proxy flow: the prefill first):

- Prefill scheduler: a request with ``do_remote_decode`` is computed as usual;
  ``build_connector_meta`` tells the workers, every step, its blocks and how
  many of its tokens are computed after that step. ``request_finished`` holds
  its blocks and returns ``kv_transfer_params`` (``do_remote_prefill``, the
  room key, the prefill's bootstrap, the token count), which the proxy
  forwards verbatim to the decode request. The blocks are freed once every
  worker reported the request in ``finished_sending``.
- Prefill worker: one pdxfer engine (role prefill) over the layer caches
  (vLLM block ids are pdxfer pages). A room per request (the key bound to the
  engine: collisions refused); once the decode's ranks sent their metadata the
  computed pages beyond the decode's prefix go out, page-aligned chunks while
  the prefill runs and the rest with the last chunk; ``finished_sending`` once
  the room is terminal and fenced (every write landed or was cut off).
- Decode scheduler: ``get_num_new_matched_tokens`` returns the prompt beyond
  the local prefix hit, to be loaded asynchronously; ``update_state_after_alloc``
  notes the blocks to fill and the local prefix (``decode_prefix_len``).
- Decode worker: a pdxfer engine (role decode) per prefill bootstrap; a
  receiver per request, the blocks sent as metadata; ``finished_recving`` once
  every byte landed. A failure (a prefill killed, a geometry or dtype
  mismatch, the transfer timeout) reports the request in ``failed_recving``
  and ``finished_recving`` and its blocks as load errors, and logs the typed
  reason with the vLLM flag to change on the ``pdxfer`` logger.
- Aborts: a prefill request aborted after its room opened is aborted in pdxfer
  and its blocks freed after the room is fenced; a decode request aborted while
  waiting is aborted in pdxfer and reported (once) in ``finished_recving`` only
  once the room is fenced, so no write lands in reused blocks.

What is refused is in docs/vllm.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

try:  # 0.33: KVConnectorTransferResults carries failed_recving
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

from .._lib import BootstrapError, CompatError, PdxError
from ..bootstrap import BootstrapServer
from ..engine import Engine, KVPoll
from . import config as _cfg

logger = logging.getLogger("pdxfer.vllm")


def _log_with_vllm() -> None:
    """The ``pdxfer`` logger (the connector's and the library's records) writes
    through vLLM's handlers at INFO when nothing configured it: ``vllm serve``
    sets up only the ``vllm`` logger, and Python's last-resort handler would
    drop INFO and print bare warnings without the process prefix."""
    root = logging.getLogger("pdxfer")
    if root.handlers:
        return
    handlers = logging.getLogger("vllm").handlers
    if not handlers:
        return
    for h in handlers:
        root.addHandler(h)
    if root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    root.propagate = False

#: kv_transfer_params keys this connector writes and reads.
PARAM_ROOM_KEY = "pdxfer_room_key"
PARAM_BOOTSTRAP = "remote_bootstrap_addr"
PARAM_NUM_TOKENS = "remote_num_tokens"


@dataclasses.dataclass
class SendReq:
    """Prefill: one request's state as the workers need it this step."""

    key: str
    block_ids: List[int]
    computed: int  # tokens computed once this step ran
    num_prompt: int


@dataclasses.dataclass
class RecvReq:
    """Decode: one request to load."""

    key: str
    bootstrap: str
    block_ids: List[int]  # the blocks to fill (beyond the local prefix hit)
    prefix_len: int  # tokens of the local prefix hit (decode_prefix_len)
    num_tokens: int  # prompt tokens the prefill computed


class PdxferConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, one per step."""

    def __init__(self) -> None:
        self.sends: Dict[str, SendReq] = {}
        self.recvs: Dict[str, RecvReq] = {}
        self.send_done: Set[str] = set()  # prefill requests finished: report when fenced
        self.aborts: Set[str] = set()  # requests aborted: abort their rooms


def _params(request: Any) -> Dict[str, Any]:
    return dict(getattr(request, "kv_transfer_params", None) or {})


def _room_key(request: Any) -> str:
    p = _params(request)
    return str(p.get("transfer_id") or p.get(PARAM_ROOM_KEY) or request.request_id)


class PdxferConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's KV connector over pdxfer (MLA models; see the module doc).

    ``SupportsHMA``: vLLM's hybrid KV cache manager (on by default) may stay
    on; an MLA model has one KV cache group, and a hybrid model (several
    groups) is refused when its request finishes."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        _log_with_vllm()
        kt = vllm_config.kv_transfer_config
        self.settings = _cfg.settings(kt.kv_connector_extra_config)
        self.kv_role = kt.kv_role
        self.is_producer = kt.kv_role in ("kv_producer", "kv_both")
        self.is_consumer = kt.kv_role in ("kv_consumer", "kv_both")
        self.engine_id = kt.engine_id
        mc = vllm_config.model_config
        if mc is not None and not getattr(mc, "use_mla", False):
            raise CompatError(-105, f"PdxferConnector serves MLA models only; {mc.model} is not MLA "
                                    "(vLLM: use another --kv-transfer-config connector for it)")
        pc = vllm_config.parallel_config
        self.dcp_size = int(getattr(pc, "decode_context_parallel_size", 1) or 1)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.dp_index = int(getattr(pc, "data_parallel_rank", 0) or 0)
        self.dtype_tag = _cfg.kv_dtype(vllm_config.cache_config.cache_dtype, getattr(mc, "dtype", "auto"))
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _SchedulerSide(self)
            self._worker = None
        else:
            self._sched = None
            self._worker = _WorkerSide(self)

    # ----- class-level queries -----

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> Optional[str]:
        return None  # MLA: the default (layer-compact) layout

    @property
    def requires_kv_delivery(self) -> bool:
        return self.is_producer

    # ----- scheduler side -----

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._sched.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        return self._sched.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: Tuple[List[int], ...]
                                    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        if len(block_ids) != 1:
            raise CompatError(-105, f"request {request.request_id}: {len(block_ids)} KV cache groups (a hybrid "
                                    "model); PdxferConnector serves MLA models with one KV cache group")
        return self._sched.request_finished(request, list(block_ids[0]))

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_work()

    def update_connector_output(self, connector_output: Any) -> None:
        if self._sched is not None:
            self._sched.update_connector_output(connector_output)

    # ----- worker side -----

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # whole-request readiness: the request runs once every byte landed

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker.save_kv_layer(layer_name)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Dict[str, Any]) -> bool:
        return bool(dict(extra_config or {}).get("layerwise", True))

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        s, r, _ = self._worker.get_finished()
        return s or None, r or None

    def get_transfer_results(self, finished_req_ids: Set[str]) -> Any:
        s, r, f = self._worker.get_finished()
        if KVConnectorTransferResults is None:  # pragma: no cover
            return s, r
        return KVConnectorTransferResults(finished_sending=s, finished_recving=r, failed_recving=f)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()


class _SchedulerSide:
    def __init__(self, c: PdxferConnector):
        self.c = c
        self.blocks: Dict[str, List[int]] = {}  # prefill requests being computed
        self.prompt_len: Dict[str, int] = {}
        self.keys: Dict[str, str] = {}
        self.recvs: Dict[str, RecvReq] = {}  # decode loads to start next step
        self.loading: Set[str] = set()  # decode requests whose load started
        self.held: Set[str] = set()  # requests whose blocks wait for the workers
        self.pending_done: Set[str] = set()
        self.pending_aborts: Set[str] = set()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        p = _params(request)
        if self.c.is_consumer and p.get("do_remote_prefill"):
            n = int(p.get(PARAM_NUM_TOKENS) or len(request.prompt_token_ids))
            return max(0, n - num_computed_tokens), n > num_computed_tokens
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        p = _params(request)
        rid = request.request_id
        if self.c.is_consumer and p.get("do_remote_prefill") and num_external_tokens > 0:
            all_ids = list(blocks.get_block_ids()[0])
            unhashed = list(blocks.get_unhashed_block_ids())
            hit_blocks = len(all_ids) - len(unhashed)
            virtual = self.c.block_size * self.c.dcp_size
            bootstrap = p.get(PARAM_BOOTSTRAP)
            if not bootstrap:
                raise CompatError(-105, f"request {rid}: kv_transfer_params has no {PARAM_BOOTSTRAP} "
                                        "(forward the prefill's kv_transfer_params verbatim)")
            n = int(p.get(PARAM_NUM_TOKENS) or len(request.prompt_token_ids))
            need = -(-(n - hit_blocks * virtual) // virtual)
            self.recvs[rid] = RecvReq(key=_room_key(request), bootstrap=str(bootstrap),
                                      block_ids=unhashed[:need], prefix_len=hit_blocks * virtual, num_tokens=n)
            # one transfer per request (a preempted, resumed request recomputes)
            request.kv_transfer_params = {**p, "do_remote_prefill": False}
        elif self.c.is_producer and p.get("do_remote_decode"):
            self.keys[rid] = _room_key(request)
            self.prompt_len[rid] = len(request.prompt_token_ids)

    def build_connector_meta(self, so: Any) -> KVConnectorMetadata:
        m = PdxferConnectorMetadata()
        if self.c.is_producer:
            for nr in so.scheduled_new_reqs:
                if nr.req_id in self.keys:
                    self.blocks[nr.req_id] = list(nr.block_ids[0])
                    self._send_entry(m, nr.req_id, nr.num_computed_tokens + so.num_scheduled_tokens[nr.req_id])
            cr = so.scheduled_cached_reqs
            for i, rid in enumerate(cr.req_ids):
                if rid in self.keys:
                    new = cr.new_block_ids[i]
                    if rid in cr.resumed_req_ids:
                        self.blocks[rid] = list(new[0]) if new else []
                    elif new:
                        self.blocks.setdefault(rid, []).extend(new[0])
                    self._send_entry(m, rid, cr.num_computed_tokens[i] + so.num_scheduled_tokens[rid])
        m.recvs, self.recvs = self.recvs, {}
        self.loading |= set(m.recvs)
        m.send_done, self.pending_done = self.pending_done, set()
        m.aborts, self.pending_aborts = self.pending_aborts, set()
        return m

    def _send_entry(self, m: PdxferConnectorMetadata, rid: str, computed: int) -> None:
        m.sends[rid] = SendReq(key=self.keys[rid], block_ids=list(self.blocks.get(rid, [])),
                               computed=min(computed, self.prompt_len[rid]), num_prompt=self.prompt_len[rid])

    def request_finished(self, request: Any, block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        rid = request.request_id
        p = _params(request)
        status = str(getattr(request, "status", ""))
        if rid in self.keys:  # prefill
            key = self.keys.pop(rid)
            self.prompt_len.pop(rid, None)
            scheduled = self.blocks.pop(rid, None) is not None
            if "LENGTH_CAPPED" in status or "STOPPED" in status:
                self.held.add(rid)
                self.pending_done.add(rid)
                return True, {
                    "do_remote_prefill": True, "do_remote_decode": False, PARAM_ROOM_KEY: key,
                    PARAM_BOOTSTRAP: self.c.settings.own_bootstrap_url(self.c.dp_index),
                    PARAM_NUM_TOKENS: len(request.prompt_token_ids), "remote_engine_id": self.c.engine_id,
                    "tp_size": self.c._vllm_config.parallel_config.tensor_parallel_size,
                    "dcp_size": self.c.dcp_size,
                }
            if not scheduled:  # aborted before any step: no room was opened
                return False, None
            self.held.add(rid)
            self.pending_aborts.add(rid)
            self.pending_done.add(rid)
            return True, None
        if rid in self.loading or rid in self.recvs:  # decode, aborted while its load runs
            if rid in self.recvs:  # not started: nothing to fence
                del self.recvs[rid]
                return False, None
            self.held.add(rid)
            self.pending_aborts.add(rid)
            return True, None
        del p
        return False, None

    def update_connector_output(self, out: Any) -> None:
        for rid in (out.finished_sending or ()):
            self.held.discard(rid)
        for rid in (out.finished_recving or ()):
            self.loading.discard(rid)
            self.held.discard(rid)

    def has_pending_work(self) -> bool:
        return bool(self.held or self.pending_done or self.pending_aborts or self.recvs)


@dataclasses.dataclass
class _Send:
    room: int
    key: str
    block_ids: List[int]
    computed: int
    num_prompt: int
    sent: int = 0  # tokens beyond the decode prefix already queued
    last_sent: bool = False
    done: bool = False  # the scheduler finished the request
    aborted: bool = False
    deadline: float = 0.0
    # layer-wise saves recorded before the decode sent its metadata: per step,
    # (tokens computed once it ran, one event per layer recorded after that
    # layer's writes), sent in order, each layer after its event, once it does
    queued: List[Tuple[int, List[Any]]] = dataclasses.field(default_factory=list)
    created: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass
class _Recv:
    room: int
    req: RecvReq
    engine: Optional[Engine]
    deadline: float
    started: bool = False
    aborted: bool = False
    created: float = dataclasses.field(default_factory=time.monotonic)


class _WorkerSide:
    def __init__(self, c: PdxferConnector):
        self.c = c
        self.lock = threading.Lock()
        self.engine: Optional[Engine] = None  # prefill
        self.decode_engines: Dict[str, Engine] = {}
        self.bootstrap: Optional[BootstrapServer] = None
        self.topology = None
        self.pools: List[Any] = []
        self.engine_pools: List[Any] = []
        self.num_blocks = 0
        self.pool_device: Optional[int] = None
        self.sends: Dict[str, _Send] = {}
        self.recvs: Dict[str, _Recv] = {}
        self.finished_sending: Set[str] = set()
        self.finished_recving: Set[str] = set()
        self.failed_recving: Set[str] = set()
        self.load_errors: Set[int] = set()
        self.par: Optional[_cfg.Parallel] = None
        self.chunks_sent: Dict[str, int] = {}  # chunks queued per request (telemetry and tests)
        self.layer_sends: Dict[str, int] = {}  # layer-wise sends per request
        self.layer_chunks: Dict[str, Any] = {}  # this step's layer-wise chunk and next layer, per request
        self.layer_events: Dict[str, Tuple[int, List[Any]]] = {}  # this step's saves to queue, per request
        self.layer_pos: Dict[str, int] = {}
        self.landed_bytes = 0  # decode: KV bytes landed on this worker (every request)
        self.landed_requests = 0

    # ----- setup -----

    def _parallel(self) -> _cfg.Parallel:
        pc = self.c._vllm_config.parallel_config
        try:
            from vllm.distributed import parallel_state as ps
            if ps.model_parallel_is_initialized():
                dcp = ps.get_dcp_group()
                return _cfg.Parallel(
                    tp_size=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                    dcp_size=dcp.world_size, dcp_rank=dcp.rank_in_group,
                    dcp_interleave=int(getattr(pc, "cp_kv_cache_interleave_size", 1) or 1),
                    pp_size=ps.get_pp_group().world_size, pp_rank=ps.get_pp_group().rank_in_group,
                    dp_size=int(pc.data_parallel_size), dp_rank=int(pc.data_parallel_rank or 0))
        except ImportError:  # pragma: no cover
            pass
        if pc.tensor_parallel_size != 1 or self.c.dcp_size != 1 or pc.pipeline_parallel_size != 1:
            raise CompatError(-105, "vLLM's parallel state is not initialised in this worker, so its "
                                    "TP/DCP/PP ranks are unknown")
        return _cfg.Parallel()

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        self.par = self._parallel()
        self.topology, self.pools, self.num_blocks = _cfg.topology(kv_caches, self.par, self.c.dtype_tag,
                                                                   producer=self.c.is_producer)
        self.engine_pools = _cfg.engine_pools(kv_caches, self.pools, self.num_blocks)
        names = sorted(kv_caches, key=_cfg.layer_index)
        self.layer_pos = {n: i for i, n in enumerate(names)}
        dev = getattr(self.pools[0], "device", None)
        self.pool_device = (dev.index or 0) if dev is not None and dev.type == "cuda" else None
        if self.c.is_producer:
            s = self.c.settings
            url = s.own_bootstrap_url(self.c.dp_index)
            if not s.bootstrap_url and self.par.tp_rank == 0 and self.par.pp_rank == 0:
                host = url.split("://", 1)[1]
                self.bootstrap = BootstrapServer(host, token=s.token)
            self.engine = self._engine("prefill", url)
            logger.info("pdxfer prefill rank tp %d/%d dcp %d/%d registered with %s (%d layers, %d blocks of %d)",
                        self.par.tp_rank, self.par.tp_size, self.par.dcp_rank, self.par.dcp_size, url,
                        len(self.pools), self.num_blocks, self.topology.page_size)

    def _engine(self, role: str, url: str) -> Engine:
        s = self.c.settings
        pools = self.engine_pools
        deadline = time.monotonic() + s.transfer_timeout
        while True:
            try:
                return Engine(role, s.cluster, url, self.topology, pools, token=s.token, transport=s.transport,
                              dp_size=self.par.dp_size, dp_rank=self.par.dp_rank, pool_device=self.pool_device,
                              room_timeout=2 * s.transfer_timeout if role == "prefill" else s.transfer_timeout)
            except BootstrapError as e:  # the prefill's rank 0 has not started its bootstrap yet
                if time.monotonic() > deadline:
                    raise BootstrapError(e.code, _cfg.vllm_hint(e)) from e
                time.sleep(0.05)

    def _decode_engine(self, url: str) -> Engine:
        e = self.decode_engines.get(url)
        if e is None:
            e = self._engine("decode", url)
            self.decode_engines[url] = e
        return e

    # ----- per step -----

    def start_load_kv(self, meta: Optional[PdxferConnectorMetadata]) -> None:
        if meta is None:
            return
        now = time.monotonic()
        for rid in meta.aborts:
            self._abort(rid)
        for rid, r in meta.recvs.items():
            try:
                eng = self._decode_engine(r.bootstrap)
                room = eng.bind_room_key(r.key)
            except PdxError as e:
                self._fail_recv(rid, r, None, None, e)
                continue
            self.recvs[rid] = _Recv(room=room, req=r, engine=eng, deadline=now + self.c.settings.transfer_timeout)
        for rid, s in meta.sends.items():
            st = self.sends.get(rid)
            if st is None:
                room = self.engine.bind_room_key(s.key)
                self.engine.sender(room)
                st = _Send(room=room, key=s.key, block_ids=s.block_ids, computed=0, num_prompt=s.num_prompt,
                           deadline=now + 2 * self.c.settings.transfer_timeout)
                self.sends[rid] = st
            st.block_ids = s.block_ids
        self._pump_recvs()
        if self.engine is not None:
            for rid, st in list(self.sends.items()):
                self._send_queued(rid, st)
        self.plan_layerwise(meta)

    def wait_for_save(self, meta: Optional[PdxferConnectorMetadata]) -> None:
        # layers of a layer-wise chunk that save_kv_layer did not see this
        # step (a layer without attention metadata): the rest go now, in
        # order, ordered after the whole forward
        for rid, ((pages, n, final), nxt) in list(self.layer_chunks.items()):
            st = self.sends[rid]
            try:
                self.engine.send(st.room, pages, n, final, event=self._event(), layers=(nxt, len(self.pools) - nxt))
                st.sent += n
                st.last_sent = final
                self._count_chunk(rid)
            except PdxError as e:
                logger.warning("pdxfer: request %s: layer-wise send refused: %s", rid, _cfg.vllm_hint(e))
                self.engine.abort(st.room)
                st.aborted = True
        self.layer_chunks = {}
        for rid, (computed, events) in self.layer_events.items():
            st = self.sends.get(rid)
            if st is None or st.aborted:
                continue
            if len(events) < len(self.pools):  # layers not saved this step: after the whole forward
                last = self._event()
                events = events + [last] * (len(self.pools) - len(events))
            st.queued.append((computed, events))
        self.layer_events = {}
        # the step's forward wrote its KV before this (vLLM calls it after the
        # forward, on the same stream); sends are ordered after it
        if meta is not None:
            for rid, s in meta.sends.items():
                st = self.sends.get(rid)
                if st is not None:
                    st.computed = max(st.computed, s.computed)
            for rid in meta.send_done:
                st = self.sends.get(rid)
                if st is not None:
                    st.done = True
        self._pump_sends()

    def _next_chunk(self, st: "_Send", computed: int) -> Optional[Tuple[List[int], int, bool]]:
        """The chunk a room can send once ``computed`` tokens are written:
        ``(pages, tokens, last)``; page-aligned unless last; None when nothing
        is ready or the decode has not sent its metadata."""
        cap = self.topology.page_size * self.topology.dcp_size
        if not self._decode_waits(st):
            return None
        prefix = self.engine.decode_prefix_len(st.room) or 0
        start = prefix + st.sent
        if start % cap:
            return None
        final = computed >= st.num_prompt
        if final:
            n = max(0, st.num_prompt - start)
        else:
            n = ((computed - start) // cap) * cap
            if n <= 0:
                return None
        first = start // cap
        return (st.block_ids[first:first + -(-n // cap)] if n else []), n, final

    def _decode_waits(self, st: "_Send") -> bool:
        """The room's decode ranks sent their metadata (pages can go)."""
        p = self.engine.poll(st.room)
        return p == KVPoll.WaitingForInput or p == KVPoll.Transferring

    def _send_queued(self, rid: str, st: "_Send") -> None:
        """The layer-wise saves queued before the decode came, in step order,
        each layer's send after the event recorded when it was saved."""
        if not st.queued or st.aborted or not self._decode_waits(st):
            return
        queued, st.queued = st.queued, []
        for computed, events in queued:
            if st.last_sent:
                break
            ch = self._next_chunk(st, computed)
            if ch is None:
                continue  # not a whole page yet: a later step's chunk takes these tokens
            pages, n, final = ch
            try:
                if n == 0:  # everything was in the decode's prefix
                    self.engine.send(st.room, pages, n, final, event=events[-1])
                else:
                    for pos, ev in enumerate(events):
                        self.engine.send(st.room, pages, n, final, event=ev, layers=(pos, 1))
                        self.layer_sends[rid] = self.layer_sends.get(rid, 0) + 1
            except PdxError as e:
                logger.warning("pdxfer: request %s: queued layer-wise send refused: %s", rid, _cfg.vllm_hint(e))
                self.engine.abort(st.room)
                st.aborted = True
                return
            st.sent += n
            st.last_sent = final
            self._count_chunk(rid)

    def plan_layerwise(self, meta: Optional[PdxferConnectorMetadata]) -> None:
        """Before the forward: the rooms whose decode is waiting send this
        step's chunk layer by layer from ``save_kv_layer``."""
        self.layer_chunks = {}
        self.layer_events = {}
        if meta is None or not self.c.settings.layerwise or self.engine is None:
            return
        for rid, s in meta.sends.items():
            st = self.sends.get(rid)
            if st is None or st.aborted or st.last_sent:
                continue
            computed = min(s.computed, st.num_prompt)
            if self._decode_waits(st):
                ch = self._next_chunk(st, computed)
                if ch is not None and ch[1] > 0:
                    self.layer_chunks[rid] = (ch, 0)
            else:  # no decode yet: each layer's save is queued with its event
                self.layer_events[rid] = (computed, [])

    def save_kv_layer(self, layer_name: str) -> None:
        if not self.layer_chunks and not self.layer_events:
            return
        pos = self.layer_pos.get(layer_name)
        if pos is None:
            return
        for computed, events in self.layer_events.values():
            if pos == len(events):
                # ordered after this layer's KV writes on the current stream
                events.append(self._event())
        for rid, ((pages, n, final), nxt) in list(self.layer_chunks.items()):
            st = self.sends[rid]
            if pos != nxt:
                continue
            try:
                # ordered after this layer's KV writes on the current stream
                self.engine.send(st.room, pages, n, final, event=self._event(), layers=(pos, 1))
            except PdxError as e:
                logger.warning("pdxfer: request %s: layer-wise send refused: %s", rid, _cfg.vllm_hint(e))
                self.engine.abort(st.room)
                st.aborted = True
                del self.layer_chunks[rid]
                continue
            self.layer_sends[rid] = self.layer_sends.get(rid, 0) + 1
            if pos + 1 == len(self.pools):
                del self.layer_chunks[rid]
                st.sent += n
                st.last_sent = final
                self._count_chunk(rid)
            else:
                self.layer_chunks[rid] = ((pages, n, final), pos + 1)

    def _count_chunk(self, rid: str) -> None:
        self.chunks_sent[rid] = self.chunks_sent.get(rid, 0) + 1
        for d in (self.chunks_sent, self.layer_sends):
            if len(d) > 4096:
                d.pop(next(iter(d)))

    def _pump_sends(self) -> None:
        for rid, st in list(self.sends.items()):
            if st.aborted or st.last_sent or rid in self.layer_chunks:
                continue
            self._send_queued(rid, st)
            if st.aborted or st.last_sent:
                continue
            ch = self._next_chunk(st, st.computed)
            if ch is None:
                continue
            pages, n, final = ch
            try:
                # device pools: the gather waits for the KV writes queued on
                # the current stream (the step's forward), not the host
                self.engine.send(st.room, pages, n, last=final, event=self._event())
            except PdxError as e:
                logger.warning("pdxfer: request %s: send refused: %s", rid, _cfg.vllm_hint(e))
                self.engine.abort(st.room)
                st.aborted = True
                continue
            st.sent += n
            st.last_sent = final
            self._count_chunk(rid)

    def _event(self) -> Any:
        """A CUDA event recorded now on the current stream (device pools), else None."""
        if self.pool_device is None:
            return None
        import torch

        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.pool_device))
        return ev

    def _pump_recvs(self) -> None:
        now = time.monotonic()
        for rid, r in list(self.recvs.items()):
            if r.started or r.aborted:
                continue
            try:
                rcv = r.engine.receiver(r.room, 0)
                rcv.send_metadata(r.req.block_ids, r.req.prefix_len)
                r.started = True
            except BootstrapError as e:
                if e.kind == "not_ready" and now < r.deadline:
                    self._clear(r.engine, r.room)
                    r.room = r.engine.bind_room_key(r.req.key)
                    continue
                self._fail_recv(rid, r.req, r.engine, r.room, e)
            except PdxError as e:
                self._fail_recv(rid, r.req, r.engine, r.room, e)

    def _clear(self, eng: Engine, room: int) -> None:
        try:
            eng.clear(room)
        except PdxError:  # unknown room (never opened): its key is released all the same
            pass

    @staticmethod
    def _abort_room(eng: Engine, room: int) -> None:
        try:
            eng.abort(room)
        except PdxError:  # unknown room: nothing to abort
            pass

    @staticmethod
    def _fenced(eng: Engine, room: int) -> bool:
        try:
            return eng.is_fenced(room)
        except PdxError:
            return True

    def _fail_recv(self, rid: str, req: RecvReq, eng: Optional[Engine], room: Optional[int], err: PdxError) -> None:
        msg = _cfg.vllm_hint(err)
        logger.error("pdxfer: request %s: KV load from %s failed: %s", rid, req.bootstrap, msg)
        if eng is not None and room is not None:
            self._abort_room(eng, room)
        r = self.recvs.get(rid)
        if r is not None and eng is not None and room is not None and not self._fenced(eng, room):
            r.aborted = True  # reported once fenced
            r.failed = True  # type: ignore[attr-defined]
            return
        self.recvs.pop(rid, None)
        if eng is not None and room is not None:
            self._clear(eng, room)
        self.failed_recving.add(rid)
        self.finished_recving.add(rid)
        self.load_errors |= set(req.block_ids)

    def _abort(self, rid: str) -> None:
        st = self.sends.get(rid)
        if st is not None:
            self.engine.abort(st.room)
            st.aborted = True
            st.done = True
        r = self.recvs.get(rid)
        if r is not None:
            if r.engine is not None:
                self._abort_room(r.engine, r.room)
            r.aborted = True

    def get_finished(self) -> Tuple[Set[str], Set[str], Set[str]]:
        self._pump_recvs()
        self._pump_sends()
        now = time.monotonic()
        for rid, st in list(self.sends.items()):
            p = self.engine.poll(st.room)
            if p not in (KVPoll.Success, KVPoll.Failed) and now > st.deadline:
                logger.error("pdxfer: request %s: no decode took its KV within %.0f s; aborting its room "
                             "(vLLM: raise kv_connector_extra_config.transfer_timeout)", rid,
                             2 * self.c.settings.transfer_timeout)
                self.engine.abort(st.room)
                p = self.engine.poll(st.room)
            if p == KVPoll.Failed and not st.aborted:
                err = self.engine.failure(st.room)
                logger.warning("pdxfer: request %s: send failed: %s", rid, _cfg.vllm_hint(err))
            if st.done and p in (KVPoll.Success, KVPoll.Failed) and self.engine.is_fenced(st.room):
                self._clear(self.engine, st.room)
                del self.sends[rid]
                self.finished_sending.add(rid)
                logger.info("pdxfer: request %s: %s after %.3f s (%d chunks); its blocks are freed", rid,
                            "sent" if p == KVPoll.Success else "not sent", now - st.created,
                            self.chunks_sent.get(rid, 0))
        for rid, r in list(self.recvs.items()):
            eng = r.engine
            p = eng.poll(r.room) if r.started else KVPoll.Bootstrapping
            if r.aborted:
                if not r.started or self._fenced(eng, r.room):
                    self._clear(eng, r.room)
                    del self.recvs[rid]
                    self.finished_recving.add(rid)
                    if getattr(r, "failed", False):
                        self.failed_recving.add(rid)
                        self.load_errors |= set(r.req.block_ids)
                continue
            if p == KVPoll.Success:
                self._landed(rid, r)
                self._clear(eng, r.room)
                del self.recvs[rid]
                self.finished_recving.add(rid)
            elif p == KVPoll.Failed:
                err = eng.failure(r.room)
                self._fail_recv(rid, r.req, eng, r.room, err)
            elif now > r.deadline:
                self._fail_recv(rid, r.req, eng, r.room, PdxError(-107, f"no KV within {self.c.settings.transfer_timeout:.0f} s"))
        with self.lock:
            s, self.finished_sending = self.finished_sending, set()
            r_, self.finished_recving = self.finished_recving, set()
            f, self.failed_recving = self.failed_recving, set()
        return s, r_, f

    def _landed(self, rid: str, r: "_Recv") -> None:
        """Counts and logs a load that landed (``landed_bytes``: this worker's total)."""
        try:
            n = r.engine.room_bytes(r.room)
        except PdxError:
            n = 0
        self.landed_bytes += n
        self.landed_requests += 1
        logger.info("pdxfer: request %s: %d KV bytes of %d tokens (%d from the local prefix) landed from %s "
                    "in %.3f s; this worker: %d requests, %d bytes", rid, n, r.req.num_tokens, r.req.prefix_len,
                    r.req.bootstrap, time.monotonic() - r.created, self.landed_requests, self.landed_bytes)

    def take_load_errors(self) -> Set[int]:
        out, self.load_errors = self.load_errors, set()
        return out

    def close(self) -> None:
        for e in list(self.decode_engines.values()):
            e.close()
        self.decode_engines.clear()
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.bootstrap is not None:
            self.bootstrap.stop()
            self.bootstrap = None


del os
