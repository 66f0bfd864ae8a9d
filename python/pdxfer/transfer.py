"""The data plane from Python: register memory, open a peer, submit batches
of writes, poll or wait, and read the completion records a receiver gets.

Buffers are anything exposing an address: a numpy array, a ``bytearray``, a
ctypes array, or a raw ``(address, length)`` pair of ints.

    rx = Agent(listen="127.0.0.1:0"); dst = rx.register(np.zeros(1 << 20, np.uint8))
    tx = Agent();                      src = tx.register(np.arange(4096, dtype=np.uint8))
    with tx.connect(rx.listen_addr, transport="tcp") as peer:
        b = peer.submit([WriteOp(src.id, 0, dst.id, 0, 4096)], room=7, checksum=True)
        done = peer.wait(b)            # Completion(batch_id, bytes, checksum, room, epoch, ...)
    rx.next_completion()               # the receiver's record, after the data landed
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

from ._handle import NativeHandle, guarded
from ._lib import lib, check, ArgumentError

__all__ = [
    "Agent",
    "Peer",
    "Region",
    "WriteOp",
    "Completion",
    "TRANSPORTS",
    "TRANSPORT_NAMES",
]

TRANSPORTS = {"auto": 0, "local": 1, "cma": 2, "tcp": 3, "rdma": 4, "nccl": 5}
TRANSPORT_NAMES = {v: k for k, v in TRANSPORTS.items()}
_BATCH_CHECKSUM = 1
_IN_PROGRESS = 1


class _AgentOptions(ctypes.Structure):
    """``PdxAgentOptions``."""

    _fields_ = [("struct_size", ctypes.c_uint64), ("listen", ctypes.c_char_p), ("secret", ctypes.c_char_p)]


class _Region(ctypes.Structure):
    """``PdxRegion``."""

    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("id", ctypes.c_uint64),
        ("addr", ctypes.c_uint64),
        ("len", ctypes.c_uint64),
        ("kind", ctypes.c_uint32),
        ("device_ordinal", ctypes.c_uint32),
    ]


class _PeerOptions(ctypes.Structure):
    """``PdxPeerOptions``."""

    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("transport", ctypes.c_uint32),
        ("streams", ctypes.c_uint32),
        ("threads", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("timeout_ms", ctypes.c_uint64),
    ]


class _WriteOp(ctypes.Structure):
    """``PdxWriteOp``."""

    _fields_ = [
        ("local_region", ctypes.c_uint64),
        ("local_offset", ctypes.c_uint64),
        ("remote_region", ctypes.c_uint64),
        ("remote_offset", ctypes.c_uint64),
        ("len", ctypes.c_uint64),
    ]


class _BatchOptions(ctypes.Structure):
    """``PdxBatchOptions``."""

    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("timeout_ms", ctypes.c_uint64),
        ("room", ctypes.c_uint64),
        ("epoch", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]


class _Completion(ctypes.Structure):
    """``PdxCompletion``."""

    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("batch_id", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("checksum", ctypes.c_uint64),
        ("has_checksum", ctypes.c_uint32),
        ("peer_pid", ctypes.c_uint32),
        ("room", ctypes.c_uint64),
        ("epoch", ctypes.c_uint64),
        ("session", ctypes.c_uint64),
    ]


_vp = ctypes.c_void_p
_u64 = ctypes.c_uint64
_sz = ctypes.c_size_t
_st = ctypes.c_int32


def _sig(name, res, args):
    f = getattr(lib, name)
    f.restype = res
    f.argtypes = args


_sig("pdxfer_agent_create", _st, [ctypes.POINTER(_AgentOptions), ctypes.POINTER(_vp)])
_sig("pdxfer_agent_destroy", None, [_vp])
_sig("pdxfer_agent_listen_addr", _st, [_vp, ctypes.c_char_p, _sz, ctypes.POINTER(_sz)])
_sig("pdxfer_agent_next_completion", _st, [_vp, _u64, ctypes.POINTER(_Completion)])
_sig("pdxfer_register_memory", _st, [_vp, _vp, _sz, ctypes.POINTER(_Region)])
_sig("pdxfer_alloc_shared_memory", _st, [_vp, _sz, ctypes.POINTER(_Region)])
_sig("pdxfer_register_device_memory", _st, [_vp, _u64, _sz, ctypes.c_uint32, ctypes.POINTER(_Region)])
_sig("pdxfer_unregister_memory", _st, [_vp, _u64, _u64])
_sig("pdxfer_agent_regions", _st, [_vp, ctypes.POINTER(_Region), _sz, ctypes.POINTER(_sz)])
_sig("pdxfer_peer_open", _st, [_vp, ctypes.c_char_p, ctypes.POINTER(_PeerOptions), ctypes.POINTER(_vp)])
_sig("pdxfer_peer_open_local", _st, [_vp, _vp, ctypes.POINTER(_vp)])
_sig("pdxfer_peer_close", None, [_vp])
_sig("pdxfer_peer_transport", _st, [_vp, ctypes.POINTER(ctypes.c_uint32)])
_sig("pdxfer_peer_regions", _st, [_vp, ctypes.POINTER(_Region), _sz, ctypes.POINTER(_sz)])
_sig("pdxfer_submit", _st, [_vp, ctypes.POINTER(_WriteOp), _sz, ctypes.POINTER(_BatchOptions), ctypes.POINTER(_u64)])
_sig("pdxfer_submit_reads", _st, [_vp, ctypes.POINTER(_WriteOp), _sz, ctypes.POINTER(_BatchOptions), ctypes.POINTER(_u64)])
_sig("pdxfer_poll", _st, [_vp, _u64, ctypes.POINTER(_Completion)])
_sig("pdxfer_wait", _st, [_vp, _u64, _u64, ctypes.POINTER(_Completion)])


@dataclass(frozen=True)
class Region:
    """A registered region's descriptor."""

    id: int
    addr: int
    len: int
    kind: str  # "host" or "device"
    device_ordinal: int = 0

    @classmethod
    def _from_c(cls, r: _Region) -> "Region":
        return cls(r.id, r.addr, r.len, "device" if r.kind == 1 else "host", r.device_ordinal)


@dataclass(frozen=True)
class WriteOp:
    """``len`` bytes from ``local_offset`` of ``local_region`` to ``remote_offset`` of the peer's ``remote_region``."""

    local_region: int
    local_offset: int
    remote_region: int
    remote_offset: int
    len: int


@dataclass(frozen=True)
class Completion:
    """A completion record. ``peer_pid`` and ``session`` are set on the receiver side."""

    batch_id: int
    bytes: int
    checksum: Optional[int]
    room: int
    epoch: int
    peer_pid: int = 0
    session: int = 0

    @classmethod
    def _from_c(cls, c: _Completion) -> "Completion":
        return cls(c.batch_id, c.bytes, c.checksum if c.has_checksum else None, c.room, c.epoch, c.peer_pid, c.session)


def _new_completion() -> _Completion:
    return _Completion(struct_size=ctypes.sizeof(_Completion))


def _buffer_address(buf) -> Tuple[int, int]:
    """(address, length in bytes) of a numpy array, bytearray, ctypes object or (addr, len) pair."""
    if isinstance(buf, tuple) and len(buf) == 2:
        return int(buf[0]), int(buf[1])
    iface = getattr(buf, "__array_interface__", None)
    if iface is not None:
        if not buf.flags["C_CONTIGUOUS"]:
            raise ArgumentError(-101, "array must be C-contiguous to be registered")
        if iface["data"][1]:
            raise ArgumentError(-101, "array is read-only; peers write into registered memory")
        return iface["data"][0], buf.nbytes
    if isinstance(buf, bytearray):
        n = len(buf)
        return ctypes.addressof((ctypes.c_char * n).from_buffer(buf)), n
    if isinstance(buf, ctypes.Array) or isinstance(buf, ctypes.Structure):
        return ctypes.addressof(buf), ctypes.sizeof(buf)
    raise ArgumentError(-101, f"cannot take the address of {type(buf).__name__}; pass a numpy array, bytearray, ctypes object or (addr, len)")


class Agent:
    """One process's data-plane endpoint: registry, listener, received completions.

    ``listen="127.0.0.1:0"`` accepts peers (picks a port); ``None`` sends only.
    ``secret`` is the cluster secret every peer must prove (at least 16 bytes;
    ``None`` reads ``PDXFER_CLUSTER_SECRET``); without one only a loopback
    listener is allowed (``AuthRequired`` otherwise).
    Registered buffers are kept alive by the agent until unregistered or closed.
    """

    def __init__(self, listen: Optional[str] = None, secret: Optional[str] = None):
        if secret and (lib.pdxfer_abi_version() & 0xFFFF) < 4:
            # an older library reads only the first 16 bytes: it would ignore the secret
            raise ArgumentError(-101, "Agent(secret=) needs libpdxfer ABI 1.4 or newer")
        h = _vp()
        opts = _AgentOptions(
            struct_size=ctypes.sizeof(_AgentOptions),
            listen=listen.encode() if listen else None,
            secret=secret.encode() if secret else None,
        )
        check(lib.pdxfer_agent_create(ctypes.byref(opts), ctypes.byref(h)))
        self._hd = NativeHandle(h, lib.pdxfer_agent_destroy, "agent")
        self._keep = {}

    def _handle(self):
        return self._hd.raw

    @property
    @guarded
    def listen_addr(self) -> str:
        """``host:port`` peers connect to."""
        n = _sz()
        buf = ctypes.create_string_buffer(128)
        check(lib.pdxfer_agent_listen_addr(self._handle(), buf, 128, ctypes.byref(n)))
        return buf.value.decode()

    @guarded
    def register(self, buf) -> Region:
        """Registers host memory (numpy array, bytearray, ctypes object, or (addr, len))."""
        addr, n = _buffer_address(buf)
        r = _Region(struct_size=ctypes.sizeof(_Region))
        check(lib.pdxfer_register_memory(self._handle(), _vp(addr), n, ctypes.byref(r)))
        reg = Region._from_c(r)
        self._keep[reg.id] = buf
        return reg

    @guarded
    def alloc_shared(self, length: int):
        """Allocates and registers ``length`` zeroed bytes of shared memory (a memfd);
        same-host cma peers write it with memcpy. Returns ``(region, array)`` where
        ``array`` is a numpy ``uint8`` view (valid until :meth:`unregister` or :meth:`close`)."""
        r = _Region(struct_size=ctypes.sizeof(_Region))
        check(lib.pdxfer_alloc_shared_memory(self._handle(), length, ctypes.byref(r)))
        reg = Region._from_c(r)
        import numpy as np

        arr = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(reg.addr))
        return reg, arr

    @guarded
    def register_device(self, dptr: int, length: int, ordinal: int = 0) -> Region:
        """Registers CUDA device memory (raises without a CUDA driver)."""
        r = _Region(struct_size=ctypes.sizeof(_Region))
        check(lib.pdxfer_register_device_memory(self._handle(), dptr, length, ordinal, ctypes.byref(r)))
        return Region._from_c(r)

    @guarded
    def unregister(self, region: Union[Region, int], timeout: float = 5.0) -> None:
        """Unregisters, waiting up to ``timeout`` s for in-flight transfers touching it."""
        rid = region.id if isinstance(region, Region) else int(region)
        check(lib.pdxfer_unregister_memory(self._handle(), rid, int(timeout * 1000)))
        self._keep.pop(rid, None)

    @guarded
    def regions(self) -> List[Region]:
        """This agent's registered regions."""
        n = _sz()
        check(lib.pdxfer_agent_regions(self._handle(), None, 0, ctypes.byref(n)))
        arr = (_Region * max(n.value, 1))()
        check(lib.pdxfer_agent_regions(self._handle(), arr, n.value, ctypes.byref(n)))
        return [Region._from_c(arr[i]) for i in range(n.value)]

    @guarded
    def connect(self, addr: str, transport: str = "auto", streams: int = 1, threads: int = 1, timeout: float = 10.0) -> "Peer":
        """Connects to the agent at ``addr`` over ``transport`` (auto, cma, tcp, rdma; nccl is an engine transport only)."""
        if transport not in TRANSPORTS:
            raise ArgumentError(-101, f"unknown transport {transport!r} ({', '.join(TRANSPORTS)})")
        o = _PeerOptions(struct_size=ctypes.sizeof(_PeerOptions), transport=TRANSPORTS[transport], streams=streams, threads=threads, timeout_ms=int(timeout * 1000))
        h = _vp()
        check(lib.pdxfer_peer_open(self._handle(), addr.encode(), ctypes.byref(o), ctypes.byref(h)))
        return Peer(h, self)

    @guarded
    def connect_local(self, target: "Agent") -> "Peer":
        """A same-process peer writing into ``target``'s regions."""
        h = _vp()
        with target._hd.use() as t:
            check(lib.pdxfer_peer_open_local(self._handle(), t, ctypes.byref(h)))
        return Peer(h, self)

    @guarded
    def next_completion(self, timeout: float = 5.0) -> Optional[Completion]:
        """The next completion record received, or ``None`` after ``timeout`` s."""
        c = _new_completion()
        st = lib.pdxfer_agent_next_completion(self._handle(), int(timeout * 1000), ctypes.byref(c))
        if st == -107:  # timeout
            return None
        check(st)
        return Completion._from_c(c)

    def close(self) -> None:
        """Destroys the agent (close its peers first). Safe while other threads
        call the agent: it waits for their calls; later calls raise."""
        self._hd.close()
        self._keep.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter teardown
            pass


class Peer:
    """A connection to one peer. Use :meth:`submit`, then :meth:`wait` or :meth:`poll`."""

    def __init__(self, handle, agent: Agent):
        self._hd = NativeHandle(handle, lib.pdxfer_peer_close, "peer")
        self._agent = agent

    def _handle(self):
        return self._hd.raw

    @property
    @guarded
    def transport(self) -> str:
        """The transport in use (``cma``, ``tcp``, ``local``)."""
        v = ctypes.c_uint32()
        check(lib.pdxfer_peer_transport(self._handle(), ctypes.byref(v)))
        return TRANSPORT_NAMES[v.value]

    @guarded
    def remote_regions(self) -> List[Region]:
        """The peer's region descriptors."""
        n = _sz()
        check(lib.pdxfer_peer_regions(self._handle(), None, 0, ctypes.byref(n)))
        arr = (_Region * max(n.value, 1))()
        check(lib.pdxfer_peer_regions(self._handle(), arr, n.value, ctypes.byref(n)))
        return [Region._from_c(arr[i]) for i in range(n.value)]

    def submit(self, ops: Sequence[Union[WriteOp, Tuple[int, int, int, int, int]]], timeout: float = 30.0, room: int = 0, epoch: int = 0, checksum: bool = False) -> int:
        """Submits a batch of writes; returns its id. Out-of-bounds ops raise and nothing is sent."""
        return self._submit(lib.pdxfer_submit, ops, timeout, room, epoch, checksum)

    def submit_reads(self, ops: Sequence[Union[WriteOp, Tuple[int, int, int, int, int]]], timeout: float = 30.0, room: int = 0, epoch: int = 0, checksum: bool = False) -> int:
        """Submits one-sided reads (cma, local): each op's bytes go from the peer's
        ``remote_region`` into ``local_region``. tcp raises ``ArgumentError`` kind ``unsupported``."""
        return self._submit(lib.pdxfer_submit_reads, ops, timeout, room, epoch, checksum)

    @guarded
    def _submit(self, fn, ops, timeout, room, epoch, checksum) -> int:
        arr = (_WriteOp * max(len(ops), 1))()
        for i, op in enumerate(ops):
            t = (op.local_region, op.local_offset, op.remote_region, op.remote_offset, op.len) if isinstance(op, WriteOp) else tuple(op)
            arr[i] = _WriteOp(*t)
        o = _BatchOptions(struct_size=ctypes.sizeof(_BatchOptions), timeout_ms=int(timeout * 1000), room=room, epoch=epoch, flags=_BATCH_CHECKSUM if checksum else 0)
        b = _u64()
        check(fn(self._handle(), arr, len(ops), ctypes.byref(o), ctypes.byref(b)))
        return b.value

    @guarded
    def poll(self, batch: int) -> Optional[Completion]:
        """``None`` while pending, the completion when done; raises the batch's failure."""
        c = _new_completion()
        st = lib.pdxfer_poll(self._handle(), batch, ctypes.byref(c))
        if st == _IN_PROGRESS:
            return None
        check(st)
        return Completion._from_c(c)

    @guarded
    def wait(self, batch: int, timeout: float = 30.0) -> Completion:
        """Waits for the batch; raises its failure (or ``TimeoutError``-kind ``ArgumentError`` code -107)."""
        c = _new_completion()
        check(lib.pdxfer_wait(self._handle(), batch, int(timeout * 1000), ctypes.byref(c)))
        return Completion._from_c(c)

    def close(self) -> None:
        """Closes the connection; pending batches fail. Safe while other threads
        call the peer: it waits for their calls; later calls raise."""
        self._hd.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter teardown
            pass
