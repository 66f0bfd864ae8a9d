"""The transfer engine from Python: one :class:`Engine` per rank (prefill or
decode), rooms with SGLang's :class:`KVPoll` lifecycle, per-room
:class:`Sender` / :class:`Receiver` objects.

Pools are host memory given as integer addresses, as writable buffers
(numpy arrays, ``bytearray``, ``memoryview`` ...) or as CPU tensors with
``data_ptr()`` (torch bf16 tensors have no buffer protocol); the engine keeps a reference
to every buffer object it was given until :meth:`Engine.close`. With
``pool_device=n`` the pools are CUDA device memory of device ``n``: integer
device addresses or objects with ``data_ptr()`` and ``nbytes`` (e.g. torch
CUDA tensors); the rules for device pools are in docs/gpu.md, "KV pools in
device memory". Errors are :class:`pdxfer.PdxError` subclasses (``.kind`` e.g.
``out_of_bounds``, ``prefix_misaligned``, ``unknown_room``, ``dcp_rank_mismatch``).
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from ._handle import NativeHandle, guarded
from ._lib import ArgumentError, PdxError, check, error_class, lib
from .layout import CTopology, Topology

try:  # numpy is optional
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None

__all__ = [
    "KVPoll",
    "Engine",
    "Sender",
    "Receiver",
    "ROLE_PREFILL",
    "ROLE_DECODE",
    "buffer_address",
    "device_address",
    "POOL_HOST",
    "POOL_CUDA",
    "RoomTelemetry",
    "room_for_key",
]

ROLE_PREFILL = 1
ROLE_DECODE = 2
NO_STAGING = 1
NO_ONE_COPY = 2
NO_PREFAULT = 4
POOL_HOST = 0
POOL_CUDA = 1

_vp = ctypes.c_void_p
_cp = ctypes.c_char_p
_i64p = ctypes.POINTER(ctypes.c_int64)


class KVPoll(enum.IntEnum):
    """SGLang's ``KVPoll`` values."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class CKvPool(ctypes.Structure):
    """``PdxKvPool``."""

    _fields_ = [
        ("layer_id", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("base", ctypes.c_void_p),
        ("page_bytes", ctypes.c_uint64),
        ("num_pages", ctypes.c_uint64),
    ]


class CKvPoolDesc(ctypes.Structure):
    """``PdxKvPoolDesc`` (ABI 1.7): a pool with its page stride."""

    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("layer_id", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("base", ctypes.c_void_p),
        ("page_bytes", ctypes.c_uint64),
        ("page_stride", ctypes.c_uint64),
        ("num_pages", ctypes.c_uint64),
    ]


class CAuxBuffer(ctypes.Structure):
    """``PdxAuxBuffer``."""

    _fields_ = [
        ("base", ctypes.c_void_p),
        ("item_bytes", ctypes.c_uint64),
        ("count", ctypes.c_uint64),
    ]


class CEngineConfig(ctypes.Structure):
    """``PdxEngineConfig``."""

    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("role", ctypes.c_uint32),
        ("dp_size", ctypes.c_uint32),
        ("dp_rank", ctypes.c_uint32),
        ("workers", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("cluster", _cp),
        ("bootstrap", _cp),
        ("token", _cp),
        ("topology", ctypes.POINTER(CTopology)),
        ("pools", ctypes.POINTER(CKvPool)),
        ("num_pools", ctypes.c_uint64),
        ("aux", ctypes.POINTER(CAuxBuffer)),
        ("num_aux", ctypes.c_uint64),
        ("transport", _cp),
        ("host", _cp),
        ("staging_bytes", ctypes.c_uint64),
        ("room_timeout_ms", ctypes.c_uint64),
        ("batch_timeout_ms", ctypes.c_uint64),
        ("lease_ttl_ms", ctypes.c_uint64),
        ("state", ctypes.POINTER(CAuxBuffer)),
        ("num_state", ctypes.c_uint64),
        # ABI 1.2
        ("pool_memory", ctypes.c_uint32),
        ("pool_device", ctypes.c_uint32),
        # ABI 1.3
        ("metrics_listen", _cp),
        # ABI 1.7
        ("pool_descs", ctypes.POINTER(CKvPoolDesc)),
        ("num_pool_descs", ctypes.c_uint64),
    ]


TELEMETRY_UNSET = 2**64 - 1


class CRoomTelemetry(ctypes.Structure):
    """``PdxRoomTelemetry`` (ABI 1.3)."""

    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("room", ctypes.c_uint64),
        ("attempt", ctypes.c_uint64),
        ("state", ctypes.c_int32),
        ("reserved", ctypes.c_uint32),
        ("created_unix_ns", ctypes.c_uint64),
        ("queued_ns", ctypes.c_uint64),
        ("planned_ns", ctypes.c_uint64),
        ("first_byte_ns", ctypes.c_uint64),
        ("last_ack_ns", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("batches", ctypes.c_uint64),
        ("retries", ctypes.c_uint64),
    ]


@dataclass(frozen=True)
class RoomTelemetry:
    """One room's telemetry (:meth:`Sender.telemetry` / :meth:`Receiver.telemetry`).

    Times are seconds from the room's creation; ``None`` where this side does
    not see the step (a decode sees no planning, first byte, batches or
    retries) or the room has not reached it. ``queued``: prefill, the first
    chunk queued; decode, the metadata sent. ``planned``: a prefill worker
    planned the first chunk. ``first_byte``: the first batch posted.
    ``last_ack``: the room succeeded. ``bytes``: the room's KV bytes
    (prefill: to every decode rank; decode: as the prefill ranks reported).
    """

    room: int
    attempt: int
    state: "KVPoll"
    created_unix_ns: int
    queued: Optional[float]
    planned: Optional[float]
    first_byte: Optional[float]
    last_ack: Optional[float]
    bytes: int
    batches: Optional[int]
    retries: Optional[int]

    @classmethod
    def _from_c(cls, t: CRoomTelemetry) -> "RoomTelemetry":
        def secs(v: int) -> Optional[float]:
            return None if v == TELEMETRY_UNSET else v / 1e9

        def count(v: int) -> Optional[int]:
            return None if v == TELEMETRY_UNSET else int(v)

        return cls(int(t.room), int(t.attempt), KVPoll(t.state), int(t.created_unix_ns),
                   secs(t.queued_ns), secs(t.planned_ns), secs(t.first_byte_ns), secs(t.last_ack_ns),
                   int(t.bytes), count(t.batches), count(t.retries))


class CSendOptions(ctypes.Structure):
    """``PdxSendOptions`` (ABI 1.4)."""

    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("aux_index", ctypes.c_uint64),
        ("cuda_event", ctypes.c_uint64),
        ("ready_flag", ctypes.c_void_p),
        ("first_layer", ctypes.c_uint32),
        ("num_layers", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]


def _event_handle(event: Any) -> int:
    """The raw ``CUevent`` of a ``torch.cuda.Event`` (``.cuda_event``), a CuPy
    event (``.ptr``) or an int; 0 for None.

    An event given that yields handle 0 is refused (``ArgumentError``): PyTorch
    creates a ``torch.cuda.Event``'s CUDA event at its first ``record()``, so a
    never-recorded one has handle 0, which the C ABI reads as "no event" and the
    send would then have no ordering at all. Record the event before the send;
    pass ``event=None`` for no event."""
    if event is None:
        return 0
    if isinstance(event, bool):
        raise TypeError("event must be a torch.cuda.Event, a CuPy event or an int CUevent handle, not bool")
    if isinstance(event, int):
        h = event
    else:
        for attr in ("cuda_event", "ptr"):
            v = getattr(event, attr, None)
            if isinstance(v, int) and not isinstance(v, bool):
                h = v
                break
        else:
            raise TypeError(
                f"event must be a torch.cuda.Event, a CuPy event or an int CUevent handle, not {type(event).__name__}"
            )
    if h == 0:
        raise ArgumentError(
            -101,
            f"the {type(event).__name__} event has CUDA handle 0 (a torch.cuda.Event never recorded has none): "
            "record the event before the send, or pass event=None for no ordering",
        )
    if h < 0:
        raise ArgumentError(-101, f"CUevent handle {h:#x} is negative")
    return h


def _sig(name: str, args: list) -> None:
    f = getattr(lib, name)
    f.restype = ctypes.c_int32
    f.argtypes = args


_u64 = ctypes.c_uint64
_sig("pdxfer_engine_create", [ctypes.POINTER(CEngineConfig), ctypes.POINTER(_vp)])
_sig("pdxfer_engine_destroy", [_vp])
_sig("pdxfer_engine_sender", [_vp, _u64])
_sig("pdxfer_engine_send", [_vp, _u64, _i64p, ctypes.c_size_t, _u64, ctypes.c_uint32, _u64])
_sig("pdxfer_engine_send_ex", [_vp, _u64, _i64p, ctypes.c_size_t, _u64, ctypes.c_uint32, ctypes.POINTER(CSendOptions)])
_sig("pdxfer_engine_receiver", [_vp, _u64, ctypes.c_uint32, _u64])
_sig("pdxfer_engine_send_metadata", [_vp, _u64, _i64p, ctypes.c_size_t, _u64, _u64])
_sig("pdxfer_engine_poll", [_vp, _u64, ctypes.POINTER(ctypes.c_int32)])
_sig("pdxfer_engine_wait", [_vp, _u64, _u64, ctypes.POINTER(ctypes.c_int32)])
_sig(
    "pdxfer_engine_failure",
    [_vp, _u64, ctypes.POINTER(ctypes.c_int32), ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)],
)
_sig("pdxfer_engine_abort", [_vp, _u64, ctypes.POINTER(ctypes.c_uint32)])
_sig("pdxfer_engine_is_fenced", [_vp, _u64, ctypes.POINTER(ctypes.c_uint32)])
_sig("pdxfer_engine_clear", [_vp, _u64])
_sig("pdxfer_engine_set_state_indices", [_vp, _u64, ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t])
_sig("pdxfer_engine_room_bytes", [_vp, _u64, ctypes.POINTER(ctypes.c_uint64)])
_sig("pdxfer_engine_set_request_pages", [_vp, _u64, _u64])
_sig("pdxfer_engine_decode_prefix_len", [_vp, _u64, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)])
_sizep = ctypes.POINTER(ctypes.c_size_t)
_sig("pdxfer_engine_metrics", [_vp, ctypes.c_char_p, ctypes.c_size_t, _sizep])
_sig("pdxfer_engine_metrics_address", [_vp, ctypes.c_char_p, ctypes.c_size_t, _sizep])
_sig("pdxfer_engine_room_telemetry", [_vp, _u64, ctypes.POINTER(CRoomTelemetry)])
_sig("pdxfer_room_for_key", [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64)])
_sig("pdxfer_engine_bind_room_key", [_vp, ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64)])


def _key_bytes(key: Any) -> bytes:
    if isinstance(key, str):
        return key.encode()
    if isinstance(key, (bytes, bytearray)):
        return bytes(key)
    raise ArgumentError(-101, f"a room key is a str or bytes, not a {type(key).__name__}")


def room_for_key(key: Any) -> int:
    """The room id of a string key (a serving engine's request id), the same
    on every side and host; :meth:`Engine.bind_room_key` also refuses a
    second key that maps to a room bound on that engine."""
    k = _key_bytes(key)
    out = ctypes.c_uint64()
    check(lib.pdxfer_room_for_key(k, len(k), ctypes.byref(out)))
    return out.value


def buffer_address(buf: Any) -> Tuple[int, Optional[int]]:
    """``(address, nbytes)`` of a pool given as an int (nbytes unknown: None),
    a numpy array (C-contiguous, writable), a host tensor with ``data_ptr()``
    (contiguous, on the CPU: e.g. a torch bf16 tensor, which has no buffer
    protocol), or any writable buffer object."""
    if isinstance(buf, bool):
        raise ArgumentError(-101, "a pool base must be an address or a buffer, not a bool")
    if isinstance(buf, int):
        if buf <= 0:
            raise ArgumentError(-100, f"pool address {buf:#x} is NULL or negative")
        return buf, None
    if hasattr(buf, "data_ptr") and not (_np is not None and isinstance(buf, _np.ndarray)):
        dev = getattr(buf, "device", None)
        if dev is not None and getattr(dev, "type", "cpu") != "cpu":
            raise ArgumentError(-101, f"a host pool tensor must be on the CPU, this one is on {dev}; "
                                      "pass pool_device=<ordinal> for device pools")
        return device_address(buf)
    if _np is not None and isinstance(buf, _np.ndarray):
        if not buf.flags["C_CONTIGUOUS"]:
            raise ArgumentError(-101, "pool arrays must be C-contiguous")
        if not buf.flags["WRITEABLE"]:
            raise ArgumentError(-101, "pool arrays must be writable (the decode side writes into them)")
        return int(buf.ctypes.data), int(buf.nbytes)
    try:
        mv = memoryview(buf)
    except TypeError:
        raise ArgumentError(-101, f"cannot take the address of a {type(buf).__name__}") from None
    if mv.readonly or not mv.c_contiguous:
        raise ArgumentError(-101, "pool buffers must be writable and C-contiguous")
    c = (ctypes.c_char * mv.nbytes).from_buffer(mv)
    return ctypes.addressof(c), mv.nbytes


def device_address(buf: Any) -> Tuple[int, Optional[int]]:
    """``(address, nbytes)`` of a device pool: an int device address (nbytes
    unknown: None) or an object with ``data_ptr()`` (and ``nbytes``, or
    ``numel()`` and ``element_size()``), e.g. a contiguous torch CUDA tensor."""
    if isinstance(buf, bool):
        raise ArgumentError(-101, "a pool base must be an address or a tensor, not a bool")
    if isinstance(buf, int):
        if buf <= 0:
            raise ArgumentError(-100, f"pool address {buf:#x} is NULL or negative")
        return buf, None
    if hasattr(buf, "data_ptr"):
        if hasattr(buf, "is_contiguous") and not buf.is_contiguous():
            raise ArgumentError(-101, "device pool tensors must be contiguous")
        n = getattr(buf, "nbytes", None)
        if n is None and hasattr(buf, "numel"):
            n = buf.numel() * buf.element_size()
        return int(buf.data_ptr()), None if n is None else int(n)
    raise ArgumentError(-101, f"cannot take the device address of a {type(buf).__name__}")


def _pages(pages: Any) -> Tuple[Any, int, Any]:
    """(pointer, count, keep-alive) of a page list as int64."""
    if _np is not None:
        a = _np.ascontiguousarray(_np.asarray(pages, dtype=_np.int64).reshape(-1))
        return a.ctypes.data_as(_i64p), len(a), a
    vals = [int(x) for x in pages]
    arr = (ctypes.c_int64 * len(vals))(*vals)
    return ctypes.cast(arr, _i64p), len(vals), arr


def _ms(seconds: Optional[float]) -> int:
    if seconds is None:
        return 0
    if seconds < 0:
        raise ArgumentError(-101, f"timeout must be >= 0, got {seconds}")
    return max(1, int(round(seconds * 1000))) if seconds > 0 else 0


class Engine:
    """One rank's transfer engine.

    ``role``: ``"prefill"`` or ``"decode"``. ``pools``: one per topology entry,
    in order; each an int address (then ``num_pages`` is required) or a buffer
    (its size gives the page count), or a ``(base, num_pages)`` tuple, or a
    ``(base, num_pages, page_stride)`` tuple for a pool whose pages are
    ``page_stride`` bytes apart (block-outermost or padded layouts: a whole
    number of pages, the same for every pool; ``base`` may then be a strided
    tensor view, its ``data_ptr()`` page 0; docs/engine.md, "Page stride").
    ``aux``: items ``(base, item_bytes)`` or ``(base, item_bytes, count)``
    (count taken from the buffer's size when omitted). Timeouts are seconds.
    ``pool_device``: CUDA device ordinal when the KV pools are device memory
    (a decode's: tcp, rdma, nccl or auto, not cma; see the module docs); aux
    and state stay host memory. ``transport="nccl"``: NCCL point-to-point
    between engines with device pools on both sides, one GPU per rank. ``metrics_listen``: ``"host:port"`` to serve the
    engine's Prometheus text on ``GET /metrics`` (port 0 picks one; see
    :attr:`metrics_address`); no authentication, keep it on loopback or a
    monitoring network.
    ``one_copy`` (prefill): copy rows straight into same-host decode ranks'
    KV pools where they are shared pools (:func:`pdxfer.alloc_shared_pool`),
    no staging; ``False`` keeps every write on the staged path.
    ``prefault`` (decode): fault the host KV pools, aux and state buffers in at
    creation (no byte changed), so the first request takes no page faults;
    ``False`` leaves them to first touch.
    ``token``: the cluster secret (at least 16 bytes), which guards bootstrap
    writes and authenticates every peer connection; ``None`` reads
    ``PDXFER_CLUSTER_SECRET``, and without either only loopback listeners are
    allowed (``auth_required``).
    """

    def __init__(
        self,
        role: str,
        cluster: str,
        bootstrap: str,
        topology: Topology,
        pools: Sequence[Any],
        *,
        aux: Sequence[Tuple] = (),
        state: Sequence[Tuple] = (),
        num_pages: Optional[int] = None,
        token: Optional[str] = None,
        transport: str = "auto",
        host: Optional[str] = None,
        staging_bytes: int = 0,
        no_staging: bool = False,
        one_copy: bool = True,
        prefault: bool = True,
        workers: int = 0,
        dp_size: int = 1,
        dp_rank: int = 0,
        room_timeout: Optional[float] = None,
        batch_timeout: Optional[float] = None,
        lease_ttl: Optional[float] = None,
        pool_device: Optional[int] = None,
        metrics_listen: Optional[str] = None,
    ):
        roles = {"prefill": ROLE_PREFILL, "decode": ROLE_DECODE}
        if role not in roles:
            raise ArgumentError(-101, f"role must be 'prefill' or 'decode', got {role!r}")
        self.role = role
        self.topology = topology
        self._keep: List[Any] = []
        cpools = (CKvPool * max(1, len(pools)))()
        cdescs = (CKvPoolDesc * max(1, len(pools)))()
        strided = False
        for i, item in enumerate(pools):
            n_given, stride = num_pages, 0
            if isinstance(item, tuple):
                if len(item) == 3:
                    item, n_given, stride = item
                    stride = int(stride)
                else:
                    item, n_given = item
            if stride and hasattr(item, "data_ptr") and not isinstance(item, int):
                # a strided view: its data_ptr() is page 0, its extent is the stride's
                base, nbytes = int(item.data_ptr()), None
            else:
                base, nbytes = buffer_address(item) if pool_device is None else device_address(item)
            self._keep.append(item)
            layer, row = topology.entries[i] if i < len(topology.entries) else (i, 0)
            page_bytes = int(row) * topology.page_size
            step = stride or page_bytes
            if n_given is None:
                if nbytes is None:
                    raise ArgumentError(-101, f"pool {i} is an address: pass num_pages or (base, num_pages)")
                n_given = (nbytes - page_bytes) // step + 1 if page_bytes and nbytes >= page_bytes else 0
            elif nbytes is not None and page_bytes and int(n_given) > 0 \
                    and (int(n_given) - 1) * step + page_bytes > nbytes:
                raise ArgumentError(
                    -101, f"pool {i}: {n_given} pages of {page_bytes} B, {step} B apart, exceed its buffer of "
                          f"{nbytes} B")
            strided = strided or (stride != 0 and stride != page_bytes)
            cpools[i] = CKvPool(int(layer), 0, base, page_bytes, int(n_given))
            cdescs[i] = CKvPoolDesc(ctypes.sizeof(CKvPoolDesc), int(layer), 0, base, page_bytes, stride,
                                    int(n_given))
        self._keep.extend([cpools, cdescs])
        caux = self._rows(aux, "aux")
        cstate = self._rows(state, "state")
        topo, keep_t = topology._c()
        b = lambda s: None if s is None else s.encode()  # noqa: E731
        cfg = CEngineConfig(
            ctypes.sizeof(CEngineConfig), roles[role], dp_size, dp_rank, workers,
            (NO_STAGING if no_staging else 0) | (0 if one_copy else NO_ONE_COPY)
            | (0 if prefault else NO_PREFAULT), 0, b(cluster), b(bootstrap), b(token),
            ctypes.pointer(topo),
            None if strided else ctypes.cast(cpools, ctypes.POINTER(CKvPool)), 0 if strided else len(pools),
            ctypes.cast(caux, ctypes.POINTER(CAuxBuffer)), len(aux), b(transport), b(host),
            staging_bytes, _ms(room_timeout), _ms(batch_timeout), _ms(lease_ttl),
            ctypes.cast(cstate, ctypes.POINTER(CAuxBuffer)), len(state),
            POOL_HOST if pool_device is None else POOL_CUDA, 0 if pool_device is None else int(pool_device),
            b(metrics_listen),
            ctypes.cast(cdescs, ctypes.POINTER(CKvPoolDesc)) if strided else None, len(pools) if strided else 0,
        )
        h = _vp()
        check(lib.pdxfer_engine_create(ctypes.byref(cfg), ctypes.byref(h)))
        self._hd = NativeHandle(h, lambda raw: check(lib.pdxfer_engine_destroy(raw)), "engine", closed_code=-903)
        # events and ready flags of sends, alive until their room is cleared
        self._room_keep: dict = {}

    # ----- handle -----

    def _rows(self, bufs: Sequence[Tuple], what: str):
        """``(buffer, item_bytes[, count])`` tuples as ``PdxAuxBuffer`` structs."""
        arr = (CAuxBuffer * max(1, len(bufs)))()
        for i, a in enumerate(bufs):
            base, nbytes = buffer_address(a[0])
            self._keep.append(a[0])
            item = int(a[1])
            if len(a) > 2:
                count = int(a[2])
            elif nbytes is None:
                raise ArgumentError(-101, f"{what} {i} is an address: pass (base, item_bytes, count)")
            else:
                count = nbytes // item if item else 0
            arr[i] = CAuxBuffer(base, item, count)
        return arr

    @guarded
    def set_state_indices(self, room: int, rows: Sequence[int]) -> None:
        """The room's state rows, one per state buffer (prefill: before the last
        chunk; decode: before ``send_metadata``)."""
        arr = (ctypes.c_int64 * max(1, len(rows)))(*rows)
        check(lib.pdxfer_engine_set_state_indices(self._live(), room, arr, len(rows)))

    def set_request_pages(self, room: int, total_pages: int) -> None:
        """Prefill: the request's page count after the decode prefix, before its
        first chunk (an all-CP-ranks CP rank sends its share of those pages)."""
        check(lib.pdxfer_engine_set_request_pages(self._live(), room, int(total_pages)))

    def _live(self) -> ctypes.c_void_p:
        return self._hd.raw

    def close(self) -> None:
        """Deregisters the rank and stops the engine (idempotent); the pool
        buffers may be freed afterwards. Safe while other threads call the
        engine: it waits for their calls; later calls raise ``engine is closed``."""
        hd = getattr(self, "_hd", None)
        if hd is not None:
            hd.close()
        self._keep = []

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass

    # ----- rooms -----

    @guarded
    def bind_room_key(self, key: Any) -> int:
        """The room of ``key`` (a request id, ``str`` or ``bytes``), bound on
        this engine until :meth:`clear`; a different key whose room is bound
        here raises ``room_key_collision`` (nothing changes)."""
        k = _key_bytes(key)
        out = ctypes.c_uint64()
        check(lib.pdxfer_engine_bind_room_key(self._live(), k, len(k), ctypes.byref(out)))
        return out.value

    @guarded
    def sender(self, room: int) -> "Sender":
        """Prefill: opens ``room``; poll until ``WaitingForInput``, then :meth:`Sender.send`."""
        check(lib.pdxfer_engine_sender(self._live(), room))
        return Sender(self, room)

    @guarded
    def receiver(self, room: int, prefill_dp: int = 0, timeout: Optional[float] = None) -> "Receiver":
        """Decode: opens ``room`` against prefill DP group ``prefill_dp`` (connects and
        re-checks the prefill ranks; a layout mismatch raises here)."""
        check(lib.pdxfer_engine_receiver(self._live(), room, prefill_dp, _ms(timeout)))
        return Receiver(self, room)

    @guarded
    def send(self, room: int, pages: Any, num_tokens: Optional[int] = None, last: bool = True,
             aux_index: int = 0, event: Any = None, ready_flag: Optional[ctypes.c_uint64] = None,
             layers: Optional[Tuple[int, int]] = None) -> None:
        """Prefill: queues a chunk (see :meth:`Sender.send`). ``event``: a CUDA
        event recorded after the rows were written (device pools; the engine's
        stream waits on it, the caller does not); ``ready_flag``: a
        ``ctypes.c_uint64`` set non-zero once the rows are written (host pools;
        a worker waits for it); ``layers``: ``(first_layer, num_layers)`` for a
        layer-wise send (see :meth:`Sender.send_layers`). The event and flag
        are kept alive until :meth:`clear`."""
        p, n, keep = _pages(pages)
        if num_tokens is None:
            num_tokens = n * self.topology.page_size * self.topology.dcp_size
        h = self._live()
        if event is None and ready_flag is None and layers is None:
            check(lib.pdxfer_engine_send(h, room, p, n, num_tokens, 1 if last else 0, aux_index))
            return
        o = CSendOptions()
        o.struct_size = ctypes.sizeof(CSendOptions)
        o.aux_index = aux_index
        o.cuda_event = _event_handle(event)
        if ready_flag is not None:
            if not isinstance(ready_flag, ctypes.c_uint64):
                raise TypeError("ready_flag must be a ctypes.c_uint64")
            o.ready_flag = ctypes.addressof(ready_flag)
        if layers is not None:
            o.first_layer, o.num_layers = int(layers[0]), int(layers[1])
        check(lib.pdxfer_engine_send_ex(h, room, p, n, num_tokens, 1 if last else 0, ctypes.byref(o)))
        if event is not None or ready_flag is not None:
            self._room_keep.setdefault(room, []).append((event, ready_flag))

    @guarded
    def send_metadata(self, room: int, dst_pages: Any, decode_prefix_len: int = 0, aux_index: int = 0) -> None:
        """Decode: tells the prefill ranks where the room's KV goes."""
        p, n, keep = _pages(dst_pages)
        check(lib.pdxfer_engine_send_metadata(self._live(), room, p, n, decode_prefix_len, aux_index))

    @guarded
    def poll(self, room: int) -> KVPoll:
        """The room's state (``Failed`` for an unknown room, as SGLang)."""
        v = ctypes.c_int32()
        check(lib.pdxfer_engine_poll(self._live(), room, ctypes.byref(v)))
        return KVPoll(v.value)

    @guarded
    def wait(self, room: int, timeout: float) -> KVPoll:
        """Waits up to ``timeout`` seconds for ``Success`` or ``Failed``; returns the state then."""
        v = ctypes.c_int32()
        check(lib.pdxfer_engine_wait(self._live(), room, _ms(timeout), ctypes.byref(v)))
        return KVPoll(v.value)

    @guarded
    def failure(self, room: int) -> Optional[PdxError]:
        """The room's failure as a typed exception object (not raised), or None."""
        h = self._live()
        st = ctypes.c_int32()
        need = ctypes.c_size_t(0)
        check(lib.pdxfer_engine_failure(h, room, ctypes.byref(st), None, 0, ctypes.byref(need)))
        if st.value == 0:
            return None
        buf = ctypes.create_string_buffer(need.value)
        check(lib.pdxfer_engine_failure(h, room, ctypes.byref(st), buf, need.value, ctypes.byref(need)))
        return error_class(st.value)(st.value, buf.value.decode(errors="replace"))

    @guarded
    def abort(self, room: int) -> bool:
        """Aborts the room; True when no write for it can still land locally."""
        f = ctypes.c_uint32()
        check(lib.pdxfer_engine_abort(self._live(), room, ctypes.byref(f)))
        return bool(f.value)

    @guarded
    def is_fenced(self, room: int) -> bool:
        """True when no write for the (aborted) room can still land locally."""
        f = ctypes.c_uint32()
        check(lib.pdxfer_engine_is_fenced(self._live(), room, ctypes.byref(f)))
        return bool(f.value)

    @guarded
    def clear(self, room: int) -> None:
        """Forgets a terminal room so its id can be reused."""
        check(lib.pdxfer_engine_clear(self._live(), room))
        self._room_keep.pop(room, None)

    def _text(self, fn) -> str:
        """A NUL-terminated string from ``fn(handle, buf, cap, &len)``, through
        the size query; retried when it grew in between."""
        h = self._live()
        need = ctypes.c_size_t(0)
        check(fn(h, None, 0, ctypes.byref(need)))
        while True:
            cap = need.value + 4096
            buf = ctypes.create_string_buffer(cap)
            st = fn(h, buf, cap, ctypes.byref(need))
            if st != -104:  # buffer_too_small: it grew; ask again with the new length
                check(st)
                return buf.value.decode()

    @guarded
    def metrics(self) -> str:
        """The engine's metrics as Prometheus text: live rooms by state, rooms
        finished and failures by kind, the transfer latency histogram per
        transport, bytes / batches / wire time per transport and peer, gather
        time, staging and registered memory."""
        return self._text(lib.pdxfer_engine_metrics)

    @property
    @guarded
    def metrics_address(self) -> Optional[str]:
        """``host:port`` of the ``/metrics`` responder (``metrics_listen``), or None."""
        h = self._live()
        need = ctypes.c_size_t(0)
        st = lib.pdxfer_engine_metrics_address(h, None, 0, ctypes.byref(need))
        if st == -105:  # unsupported: created without metrics_listen
            return None
        check(st)
        return self._text(lib.pdxfer_engine_metrics_address)

    @guarded
    def telemetry(self, room: int) -> RoomTelemetry:
        """The room's telemetry (live rooms, finished or not; a cleared room raises ``unknown_room``)."""
        t = CRoomTelemetry()
        t.struct_size = ctypes.sizeof(CRoomTelemetry)
        check(lib.pdxfer_engine_room_telemetry(self._live(), room, ctypes.byref(t)))
        return RoomTelemetry._from_c(t)

    @guarded
    def room_bytes(self, room: int) -> int:
        """Decode: KV bytes received for the room."""
        v = ctypes.c_uint64()
        check(lib.pdxfer_engine_room_bytes(self._live(), room, ctypes.byref(v)))
        return v.value

    def decode_prefix_len(self, room: int) -> Optional[int]:
        """Prefill: the decode prefix length the decode ranks sent for the room
        (the first chunk starts right after it), or None before their metadata."""
        v = ctypes.c_uint64()
        known = ctypes.c_uint32()
        check(lib.pdxfer_engine_decode_prefix_len(self._live(), room, ctypes.byref(v), ctypes.byref(known)))
        return v.value if known.value else None


class _Room:
    def __init__(self, engine: Engine, room: int):
        self.engine = engine
        self.room = room

    def poll(self) -> KVPoll:
        """The room's :class:`KVPoll` state."""
        return self.engine.poll(self.room)

    def wait(self, timeout: float) -> KVPoll:
        """Waits up to ``timeout`` s for a terminal state."""
        return self.engine.wait(self.room, timeout)

    def failure_exception(self) -> Optional[PdxError]:
        """Why the room failed, as a typed :class:`pdxfer.PdxError` (returned, not raised); None if it has not."""
        return self.engine.failure(self.room)

    def abort(self) -> bool:
        """Aborts the room; True when fenced already (see :meth:`is_fenced`)."""
        return self.engine.abort(self.room)

    def is_fenced(self) -> bool:
        """True when no write for the room can still land locally."""
        return self.engine.is_fenced(self.room)

    def clear(self) -> None:
        """Forgets the (terminal) room."""
        self.engine.clear(self.room)

    def telemetry(self) -> RoomTelemetry:
        """The room's :class:`RoomTelemetry` (until it is cleared)."""
        return self.engine.telemetry(self.room)


class Sender(_Room):
    """Prefill side of one room."""

    def set_state_indices(self, rows: Sequence[int]) -> None:
        """State rows (one per state buffer) sent after the last chunk's KV."""
        self.engine.set_state_indices(self.room, rows)

    def set_request_pages(self, total_pages: int) -> None:
        """The request's page count after the decode prefix (before the first chunk)."""
        self.engine.set_request_pages(self.room, total_pages)

    def decode_prefix_len(self) -> Optional[int]:
        """The decode prefix the decode ranks hold (None before their metadata)."""
        return self.engine.decode_prefix_len(self.room)

    def send(self, pages: Any, num_tokens: Optional[int] = None, last: bool = True, aux_index: int = 0,
             event: Any = None, ready_flag: Optional[ctypes.c_uint64] = None) -> None:
        """Queues a chunk: this rank's page ids (list or numpy) holding ``num_tokens``
        sequence positions (default: the pages' full capacity, ``page_size * dcp_size`` each);
        only the ``last`` chunk may be partial; the aux row ``aux_index`` follows it.
        ``event`` (device pools: a ``torch.cuda.Event``, a CuPy event or a raw
        ``CUevent`` int, recorded before this call: an event with no CUDA handle
        yet raises ``ArgumentError``) or ``ready_flag`` (host pools: a ``ctypes.c_uint64`` the
        caller sets non-zero) orders the gather after the caller's writes, so
        the caller need not synchronise before sending."""
        self.engine.send(self.room, pages, num_tokens, last, aux_index, event=event, ready_flag=ready_flag)

    def send_layers(self, pages: Any, first_layer: int, num_layers: int, num_tokens: Optional[int] = None,
                    last: bool = True, aux_index: int = 0, event: Any = None,
                    ready_flag: Optional[ctypes.c_uint64] = None) -> None:
        """Sends layers ``first_layer .. first_layer + num_layers`` (topology
        entries, by position) of a chunk as soon as they are written. A chunk's
        layers come in order over many calls with the same ``pages``,
        ``num_tokens``, ``last`` and ``aux_index``; the decode sees one
        completion after every layer (and the aux/state rows) landed. A layer
        out of order, repeated or missing raises ``layer_order``."""
        self.engine.send(self.room, pages, num_tokens, last, aux_index, event=event, ready_flag=ready_flag,
                         layers=(first_layer, num_layers))


class Receiver(_Room):
    """Decode side of one room."""

    def set_state_indices(self, rows: Sequence[int]) -> None:
        """State rows (one per state buffer) the prefill's state lands in; call before ``send_metadata``."""
        self.engine.set_state_indices(self.room, rows)

    def send_metadata(self, dst_pages: Any, decode_prefix_len: int = 0, aux_index: int = 0) -> None:
        """Sends the destination virtual page ids, the decode prefix already held
        (a multiple of ``page_size * dcp_size``) and the aux row to the prefill ranks."""
        self.engine.send_metadata(self.room, dst_pages, decode_prefix_len, aux_index)

    def bytes_received(self) -> int:
        """KV bytes received so far."""
        return self.engine.room_bytes(self.room)
