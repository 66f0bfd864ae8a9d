"""The bootstrap from Python: the embedded server, clients, registrations with
keep-alive, lookups, summaries and the handshake re-check.

Registrations, lookups and hellos are plain dicts in pdxfer's versioned JSON
schema (``make_registration`` builds one from a :class:`pdxfer.Topology`).
Errors are :class:`pdxfer.BootstrapError` (``stale_metadata``,
``not_registered``, ``unauthorized``, ...) or the layout's
:class:`pdxfer.CompatError` (``dcp_rank_mismatch``, ...).
"""

from __future__ import annotations

import ctypes
import json
from typing import Any, Callable, Dict, List, Optional

from ._handle import NativeHandle, guarded
from ._lib import ArgumentError, PdxError, check, lib
from .layout import POOL_HYBRID_MLA, POOL_MHA, POOL_MLA, Topology

__all__ = [
    "SCHEMA_VERSION",
    "BootstrapServer",
    "BootstrapClient",
    "Registration",
    "make_registration",
    "topology_json",
    "verify_peer",
]

SCHEMA_VERSION = 1
_BUFFER_TOO_SMALL = -104

_vp = ctypes.c_void_p
_cp = ctypes.c_char_p
_buf = [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]


class _ServerConfig(ctypes.Structure):
    """``PdxBootstrapServerConfig``."""

    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("listen", ctypes.c_char_p),
        ("token", ctypes.c_char_p),
        ("max_body_bytes", ctypes.c_uint64),
        ("max_connections", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]


def _sig(name: str, args: list) -> None:
    f = getattr(lib, name)
    f.restype = ctypes.c_int32
    f.argtypes = args


_sig("pdxfer_bootstrap_server_start", [ctypes.POINTER(_ServerConfig), ctypes.POINTER(_vp)])
_sig("pdxfer_bootstrap_server_url", [_vp] + _buf)
_sig("pdxfer_bootstrap_server_stop", [_vp])
_sig("pdxfer_bootstrap_client_open", [_cp, _cp, ctypes.POINTER(_vp)])
_sig("pdxfer_bootstrap_client_close", [_vp])
_sig("pdxfer_bootstrap_lookup", [_vp, _cp, _cp, _cp] + _buf)
_sig("pdxfer_bootstrap_summary", [_vp, _cp, _cp] + _buf)
_sig("pdxfer_bootstrap_verify_peer", [_cp, _cp, _cp] + _buf)
_sig("pdxfer_bootstrap_register", [_vp, _cp, ctypes.c_uint64, ctypes.POINTER(_vp)])
_sig("pdxfer_registration_json", [_vp] + _buf)
_sig("pdxfer_registration_hello_json", [_vp] + _buf)
_sig("pdxfer_registration_deregister", [_vp])
_sig("pdxfer_registration_destroy", [_vp])


def _string(call: Callable[..., int], first: int = 16384) -> str:
    """Runs a string-returning export into a ``first``-byte buffer, and again
    with the size the library asked for when that was too small (each call of
    a lookup is one request, so no separate size query)."""
    need = ctypes.c_size_t(first)
    st = _BUFFER_TOO_SMALL
    for _ in range(4):
        buf = ctypes.create_string_buffer(need.value)
        st = call(buf, need.value, ctypes.byref(need))
        if st != _BUFFER_TOO_SMALL:
            check(st)
            return buf.value.decode()
    check(st)
    raise PdxError(_BUFFER_TOO_SMALL, "answer kept growing")  # pragma: no cover


def _b(s: Optional[str]) -> Optional[bytes]:
    return None if s is None else s.encode()


_POOLS = {POOL_MLA: "mla", POOL_HYBRID_MLA: "hybrid_mla", POOL_MHA: "mha"}


def topology_json(t: Topology) -> Dict[str, Any]:
    """A :class:`pdxfer.Topology` in the bootstrap schema's form."""
    if t.pool not in _POOLS:
        raise ArgumentError(-101, f"unknown pool {t.pool!r}")
    return {
        "engine_rank": t.engine_rank,
        "attn_tp_size": t.attn_tp_size,
        "attn_tp_rank": t.attn_tp_rank,
        "attn_cp_size": t.attn_cp_size,
        "attn_cp_rank": t.attn_cp_rank,
        "pp_size": t.pp_size,
        "pp_rank": t.pp_rank,
        "dcp_size": t.dcp_size,
        "dcp_rank": t.dcp_rank,
        "dcp_interleave": t.dcp_interleave,
        "page_size": t.page_size,
        "kv_dtype": t.kv_dtype,
        "pool": _POOLS[t.pool],
        "entries": [{"layer_id": int(l), "row_bytes": int(b)} for l, b in t.entries],
        "cp": {"mode": t.cp_mode.replace("-", "_"), "storage": t.cp_storage},
    }


def make_registration(
    cluster: str,
    role: str,
    topology: Topology,
    endpoints: Optional[Dict[str, str]] = None,
    regions: Optional[List[Dict[str, Any]]] = None,
    dp_rank: int = 0,
    dp_size: int = 1,
    instance_id: Optional[str] = None,
) -> Dict[str, Any]:
    """A registration dict. Without ``instance_id`` the library draws a random
    one when registering; ``epoch`` and the registration time come from the store.
    ``regions`` items: ``{"id", "addr", "len", "kind", "keys": {str: str}}``."""
    reg: Dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "cluster": cluster,
        "role": role,
        "dp_size": dp_size,
        "dp_rank": dp_rank,
        "topology": topology_json(topology),
        "endpoints": dict(endpoints or {}),
        "regions": list(regions or []),
    }
    if instance_id is not None:
        reg["instance_id"] = instance_id
    return reg


class BootstrapServer:
    """The embedded bootstrap server, running in this process until :meth:`stop`."""

    def __init__(
        self,
        listen: str = "127.0.0.1:0",
        token: Optional[str] = None,
        max_body_bytes: int = 0,
        max_connections: int = 0,
    ):
        cfg = _ServerConfig(ctypes.sizeof(_ServerConfig), _b(listen), _b(token), max_body_bytes, max_connections, 0)
        h = _vp()
        check(lib.pdxfer_bootstrap_server_start(ctypes.byref(cfg), ctypes.byref(h)))
        self._hd = NativeHandle(h, lambda raw: check(lib.pdxfer_bootstrap_server_stop(raw)), "bootstrap server")
        self.url = _string(lambda b, c, n: lib.pdxfer_bootstrap_server_url(h, b, c, n))

    def stop(self) -> None:
        """Stops the server (idempotent; safe while other threads use it)."""
        hd = getattr(self, "_hd", None)
        if hd is not None:
            hd.close()

    def __enter__(self) -> "BootstrapServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self):  # pragma: no cover - best effort at interpreter exit
        try:
            self.stop()
        except Exception:
            pass


class Registration:
    """One registered rank; its lease is kept alive by a library thread until
    :meth:`deregister` (removes the entry now) or :meth:`close` (lets it expire)."""

    def __init__(self, handle: ctypes.c_void_p):
        self._hd = NativeHandle(handle, lambda raw: check(lib.pdxfer_registration_destroy(raw)), "registration")

    def _live(self) -> ctypes.c_void_p:
        return self._hd.raw

    @property
    @guarded
    def info(self) -> Dict[str, Any]:
        """The entry as the store holds it now (instance id, epoch, time)."""
        h = self._live()
        return json.loads(_string(lambda b, c, n: lib.pdxfer_registration_json(h, b, c, n)))

    @property
    @guarded
    def hello(self) -> Dict[str, Any]:
        """What this rank says about itself on a direct connection."""
        h = self._live()
        return json.loads(_string(lambda b, c, n: lib.pdxfer_registration_hello_json(h, b, c, n)))

    def deregister(self) -> None:
        """Removes the entry from the store and stops the keep-alive (idempotent;
        safe while other threads use the registration)."""
        self._hd.close(lambda raw: check(lib.pdxfer_registration_deregister(raw)))

    def close(self) -> None:
        """Stops the keep-alive; the entry expires with its lease (idempotent;
        safe while other threads use the registration)."""
        hd = getattr(self, "_hd", None)
        if hd is not None:
            hd.close()

    def __enter__(self) -> "Registration":
        return self

    def __exit__(self, *exc) -> None:
        self.deregister()

    def __del__(self):  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass


class BootstrapClient:
    """A client of a bootstrap server (``http://HOST:PORT``) or of etcd
    (``etcd://HOST:PORT/NAMESPACE``)."""

    def __init__(self, url: str, token: Optional[str] = None):
        h = _vp()
        check(lib.pdxfer_bootstrap_client_open(_b(url), _b(token), ctypes.byref(h)))
        self._hd = NativeHandle(h, lambda raw: check(lib.pdxfer_bootstrap_client_close(raw)), "bootstrap client")

    def _live(self) -> ctypes.c_void_p:
        return self._hd.raw

    @guarded
    def register(self, registration: Dict[str, Any], ttl_ms: int = 3000) -> Registration:
        """Registers a rank (see :func:`make_registration`) and keeps its lease alive."""
        h = _vp()
        check(lib.pdxfer_bootstrap_register(self._live(), json.dumps(registration).encode(), ttl_ms, ctypes.byref(h)))
        return Registration(h)

    @guarded
    def lookup(self, cluster: str, role: str, rank_key: str) -> Dict[str, Any]:
        """The current entry of ``rank_key`` (``"dp0-tp1-cp0-pp0"``)."""
        h = self._live()
        args = (_b(cluster), _b(role), _b(rank_key))
        return json.loads(_string(lambda b, c, n: lib.pdxfer_bootstrap_lookup(h, *args, b, c, n)))

    @guarded
    def summary(self, cluster: str, role: str) -> Dict[str, Any]:
        """Topology and readiness of ``cluster``/``role`` (no endpoints)."""
        h = self._live()
        args = (_b(cluster), _b(role))
        return json.loads(_string(lambda b, c, n: lib.pdxfer_bootstrap_summary(h, *args, b, c, n)))

    def close(self) -> None:
        """Frees the client (idempotent; safe while other threads use it)."""
        hd = getattr(self, "_hd", None)
        if hd is not None:
            hd.close()

    def __enter__(self) -> "BootstrapClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass


def verify_peer(advertised: Dict[str, Any], hello: Dict[str, Any], local: Dict[str, Any]) -> Dict[str, Any]:
    """Re-checks a direct handshake: the entry the bootstrap advertised, what
    the peer said on the connection, and this rank's registration. Returns the
    pair's compatibility; raises ``stale_metadata``, ``peer_identity`` or the
    layout error, naming both entries."""
    args = (json.dumps(advertised).encode(), json.dumps(hello).encode(), json.dumps(local).encode())
    return json.loads(_string(lambda b, c, n: lib.pdxfer_bootstrap_verify_peer(*args, b, c, n)))
