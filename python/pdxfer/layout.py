"""The layout core from Python: DCP token plans, runs, peer checks, rank mapping.

Every function accepts lists or numpy arrays. With numpy input the results are
numpy ``int64`` arrays filled by the library directly (no per-element Python
work); with lists they are lists.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ._lib import lib, check, ArgumentError

try:  # numpy is optional
    import numpy as _np
except ImportError:  # pragma: no cover - exercised only without numpy
    _np = None

__all__ = [
    "dcp_token_plan",
    "pair_token_plan",
    "pair_runs",
    "coalesce_runs",
    "dcp_pack_buffer_bytes",
    "Topology",
    "PeerCompat",
    "RankMapping",
    "check_peer",
    "rank_mapping",
    "POOL_MLA",
    "POOL_HYBRID_MLA",
    "POOL_MHA",
    "DTYPES",
]

_i64p = ctypes.POINTER(ctypes.c_int64)
_u64p = ctypes.POINTER(ctypes.c_uint64)
_u32p = ctypes.POINTER(ctypes.c_uint32)
_sizep = ctypes.POINTER(ctypes.c_size_t)


class DcpPlanArgs(ctypes.Structure):
    """``PdxDcpPlanArgs``."""

    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("src_pages", _i64p),
        ("num_src_pages", ctypes.c_size_t),
        ("dst_pages", _i64p),
        ("num_dst_pages", ctypes.c_size_t),
        ("page_size", ctypes.c_uint64),
        ("dcp_size", ctypes.c_uint64),
        ("dcp_rank", ctypes.c_uint64),
        ("src_page_offset", ctypes.c_uint64),
        ("decode_prefix_len", ctypes.c_uint64),
        ("num_tokens", ctypes.c_int64),
    ]


class Layout(ctypes.Structure):
    """``PdxLayout``."""

    _fields_ = [
        ("page_size", ctypes.c_uint64),
        ("dcp_size", ctypes.c_uint64),
        ("interleave", ctypes.c_uint64),
    ]


class PairPlanArgs(ctypes.Structure):
    """``PdxPairPlanArgs``."""

    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("src_layout", Layout),
        ("src_rank", ctypes.c_uint64),
        ("src_pages", _i64p),
        ("num_src_pages", ctypes.c_size_t),
        ("src_origin", ctypes.c_uint64),
        ("dst_layout", Layout),
        ("dst_rank", ctypes.c_uint64),
        ("dst_pages", _i64p),
        ("num_dst_pages", ctypes.c_size_t),
        ("dst_origin", ctypes.c_uint64),
        ("start", ctypes.c_uint64),
        ("num_tokens", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]


class Run(ctypes.Structure):
    """``PdxRun``."""

    _fields_ = [("src", ctypes.c_int64), ("dst", ctypes.c_int64), ("len", ctypes.c_int64)]


class CTopology(ctypes.Structure):
    """``PdxTopology``."""

    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("engine_rank", ctypes.c_uint32),
        ("attn_tp_size", ctypes.c_uint32),
        ("attn_tp_rank", ctypes.c_uint32),
        ("attn_cp_size", ctypes.c_uint32),
        ("attn_cp_rank", ctypes.c_uint32),
        ("pp_size", ctypes.c_uint32),
        ("pp_rank", ctypes.c_uint32),
        ("dcp_size", ctypes.c_uint32),
        ("dcp_rank", ctypes.c_uint32),
        ("dcp_interleave", ctypes.c_uint32),
        ("page_size", ctypes.c_uint32),
        ("kv_dtype", ctypes.c_uint32),
        ("pool_kind", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("num_entries", ctypes.c_uint64),
        ("entry_layer_ids", _u32p),
        ("entry_row_bytes", _u64p),
        ("cp_mode", ctypes.c_uint32),
        ("cp_storage", ctypes.c_uint32),
    ]


class CPeerCompat(ctypes.Structure):
    """``PdxPeerCompat``."""

    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("mode", ctypes.c_uint32),
        ("num_decode_ranks_served", ctypes.c_uint32),
        ("num_entry_pairs", ctypes.c_uint64),
    ]


class CRankMapping(ctypes.Structure):
    """``PdxRankMapping``."""

    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("tp_rank_begin", ctypes.c_uint32),
        ("tp_rank_end", ctypes.c_uint32),
        ("tp_others_dummy", ctypes.c_uint32),
        ("cp_rank_begin", ctypes.c_uint32),
        ("cp_rank_end", ctypes.c_uint32),
        ("pp_rank_begin", ctypes.c_uint32),
        ("pp_rank_end", ctypes.c_uint32),
        ("required_dst_info_num", ctypes.c_uint32),
        ("required_prefill_response_num", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]


class CRankTargets(ctypes.Structure):
    """``PdxRankTargets`` (ABI 1.7): the rank lists in the caller's arrays."""

    _fields_ = [
        ("struct_size", ctypes.c_uint64),
        ("tp_ranks", ctypes.POINTER(ctypes.c_uint32)),
        ("tp_dummy", ctypes.POINTER(ctypes.c_uint32)),
        ("cp_ranks", ctypes.POINTER(ctypes.c_uint32)),
        ("pp_ranks", ctypes.POINTER(ctypes.c_uint32)),
        ("capacity", ctypes.c_uint64),
        ("num_tp_ranks", ctypes.c_uint64),
        ("num_cp_ranks", ctypes.c_uint64),
        ("num_pp_ranks", ctypes.c_uint64),
        ("required_dst_info_num", ctypes.c_uint32),
        ("required_prefill_response_num", ctypes.c_uint32),
    ]


PLAN_PACKED = 1
MAP_ALL_CP_RANKS = 1

lib.pdxfer_dcp_token_plan.restype = ctypes.c_int32
lib.pdxfer_dcp_token_plan.argtypes = [ctypes.POINTER(DcpPlanArgs), _i64p, _i64p, ctypes.c_size_t, _sizep]
lib.pdxfer_pair_token_plan.restype = ctypes.c_int32
lib.pdxfer_pair_token_plan.argtypes = [ctypes.POINTER(PairPlanArgs), _i64p, _i64p, ctypes.c_size_t, _sizep]
lib.pdxfer_pair_runs.restype = ctypes.c_int32
lib.pdxfer_pair_runs.argtypes = [ctypes.POINTER(PairPlanArgs), ctypes.POINTER(Run), ctypes.c_size_t, _sizep]
lib.pdxfer_coalesce_runs.restype = ctypes.c_int32
lib.pdxfer_coalesce_runs.argtypes = [_i64p, _i64p, ctypes.c_size_t, ctypes.POINTER(Run), ctypes.c_size_t, _sizep]
lib.pdxfer_dcp_pack_buffer_bytes.restype = ctypes.c_int32
lib.pdxfer_dcp_pack_buffer_bytes.argtypes = [
    _u64p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, _u64p,
]
lib.pdxfer_check_peer.restype = ctypes.c_int32
lib.pdxfer_check_peer.argtypes = [ctypes.POINTER(CTopology), ctypes.POINTER(CTopology), ctypes.POINTER(CPeerCompat)]
lib.pdxfer_rank_mapping.restype = ctypes.c_int32
lib.pdxfer_rank_mapping.argtypes = [
    ctypes.POINTER(CTopology), ctypes.POINTER(CTopology), ctypes.c_uint32, ctypes.POINTER(CRankMapping),
]
# ABI 1.7; an older 1.x library (PDXFER_LIB) gives the ranges of pdxfer_rank_mapping only
_HAS_RANK_TARGETS = hasattr(lib, "pdxfer_rank_targets")
if _HAS_RANK_TARGETS:
    lib.pdxfer_rank_targets.restype = ctypes.c_int32
    lib.pdxfer_rank_targets.argtypes = [
        ctypes.POINTER(CTopology), ctypes.POINTER(CTopology), ctypes.c_uint32, ctypes.POINTER(CRankTargets),
    ]


def _is_np(*xs) -> bool:
    return _np is not None and any(isinstance(x, _np.ndarray) for x in xs)


class _I64:
    """An int64 view of a list or numpy array, kept alive for one call."""

    def __init__(self, x, what: str):
        if _np is not None and isinstance(x, _np.ndarray):
            if x.ndim != 1:
                raise ArgumentError(-101, f"{what} must be one-dimensional, got shape {x.shape}")
            self.keep = _np.ascontiguousarray(x, dtype=_np.int64)
            self.n = int(self.keep.shape[0])
            self.ptr = self.keep.ctypes.data_as(_i64p)
        else:
            seq = list(x)
            self.n = len(seq)
            try:
                self.keep = (ctypes.c_int64 * self.n)(*seq)
            except TypeError as e:
                raise ArgumentError(-101, f"{what} must hold integers: {e}") from None
            self.ptr = ctypes.cast(self.keep, _i64p)


def _rows_out(n: int, numpy: bool):
    if numpy:
        a, b = _np.empty(n, dtype=_np.int64), _np.empty(n, dtype=_np.int64)
        return a, b, a.ctypes.data_as(_i64p), b.ctypes.data_as(_i64p)
    a, b = (ctypes.c_int64 * n)(), (ctypes.c_int64 * n)()
    return a, b, ctypes.cast(a, _i64p), ctypes.cast(b, _i64p)


def _call_rows(fn, args, numpy: bool, guess: Optional[int] = None) -> Tuple:
    """Fills row arrays; with an exact ``guess`` of the length one call does it,
    else a size query comes first."""
    n = ctypes.c_size_t(0)
    if guess is None:
        check(fn(ctypes.byref(args), None, None, 0, ctypes.byref(n)))
        guess = n.value
    a, b, pa, pb = _rows_out(guess, numpy)
    st = fn(ctypes.byref(args), pa, pb, guess, ctypes.byref(n))
    if st == -104:  # buffer_too_small: the guess was wrong; the library wrote the length
        a, b, pa, pb = _rows_out(n.value, numpy)
        st = fn(ctypes.byref(args), pa, pb, n.value, ctypes.byref(n))
    check(st)
    if n.value != len(a):
        a, b = a[: n.value], b[: n.value]
    if numpy:
        return a, b
    return list(a), list(b)


def _runs_out(fill, numpy: bool, cap: int):
    """Calls ``fill(out, capacity, out_len)`` once with a buffer of ``cap`` runs
    (an upper bound), again only if the library asks for more."""
    n = ctypes.c_size_t(0)
    for _ in range(2):
        if numpy:
            arr = _np.empty((cap, 3), dtype=_np.int64)
            out = arr.ctypes.data_as(ctypes.POINTER(Run))
        else:
            arr = (Run * cap)()
            out = ctypes.cast(arr, ctypes.POINTER(Run))
        st = fill(out if cap else None, cap, ctypes.byref(n))
        if st == -104:  # buffer_too_small: retry with the size it wrote
            cap = n.value
            continue
        check(st)
        break
    if numpy:
        return arr[: n.value]
    return [(r.src, r.dst, r.len) for r in arr[: n.value]]


def dcp_token_plan(
    src_pages,
    dst_pages,
    *,
    page_size: int,
    dcp_size: int,
    dcp_rank: int,
    src_page_offset: int = 0,
    decode_prefix_len: int = 0,
    num_tokens: Optional[int] = None,
):
    """SGLang's ``build_dcp_token_transfer_plan`` for one chunk and one decode rank.

    Returns ``(src_rows, dst_rows)``. Raises :class:`pdxfer.PlanError` with
    ``.kind`` ``prefix_misaligned``, ``tokens_exceed_source`` or
    ``insufficient_destination``.
    """
    s, d = _I64(src_pages, "src_pages"), _I64(dst_pages, "dst_pages")
    args = DcpPlanArgs(
        ctypes.sizeof(DcpPlanArgs), s.ptr, s.n, d.ptr, d.n,
        page_size, dcp_size, dcp_rank, src_page_offset, decode_prefix_len,
        -1 if num_tokens is None else num_tokens,
    )
    # SGLang's rank r owns chunk offsets o0, o0 + D, ... < n: the exact length, no size query
    guess = None
    if dcp_size > 0 and page_size > 0 and 0 <= dcp_rank < dcp_size:
        n = s.n * page_size if num_tokens is None else num_tokens
        o0 = (dcp_rank - (decode_prefix_len + src_page_offset * page_size)) % dcp_size
        guess = max(0, -(-(n - o0) // dcp_size)) if n >= 0 else None
    return _call_rows(lib.pdxfer_dcp_token_plan, args, _is_np(src_pages, dst_pages), guess)


def _pair_args(src_layout, src_rank, src_pages, src_origin, dst_layout, dst_rank, dst_pages,
               dst_origin, start, num_tokens, flags):
    s, d = _I64(src_pages, "src_pages"), _I64(dst_pages, "dst_pages")
    args = PairPlanArgs(
        ctypes.sizeof(PairPlanArgs), Layout(*src_layout), src_rank, s.ptr, s.n, src_origin,
        Layout(*dst_layout), dst_rank, d.ptr, d.n, dst_origin, start, num_tokens, flags, 0,
    )
    return args, (s, d)


def pair_token_plan(*, src_layout: Tuple[int, int, int], src_rank: int, src_pages, src_origin: int = 0,
                    dst_layout: Tuple[int, int, int], dst_rank: int, dst_pages, dst_origin: int = 0,
                    start: Optional[int] = None, num_tokens: int):
    """The general planner's per-token plan for one (prefill rank, decode rank) pair.

    Layouts are ``(page_size, dcp_size, interleave)``. ``start`` defaults to the
    later of the two origins. Returns ``(src_rows, dst_rows)``.
    """
    start = max(src_origin, dst_origin) if start is None else start
    args, keep = _pair_args(src_layout, src_rank, src_pages, src_origin, dst_layout, dst_rank,
                            dst_pages, dst_origin, start, num_tokens, 0)
    return _call_rows(lib.pdxfer_pair_token_plan, args, _is_np(src_pages, dst_pages))


def pair_runs(*, src_layout: Tuple[int, int, int], src_rank: int, src_pages, src_origin: int = 0,
              dst_layout: Tuple[int, int, int], dst_rank: int, dst_pages, dst_origin: int = 0,
              start: Optional[int] = None, num_tokens: int, packed: bool = False):
    """Runs ``(src, dst, len)`` for one pair; with ``packed`` the source is the
    pair's staging buffer (indices ``0..n``). numpy input gives an ``(k, 3)`` array."""
    start = max(src_origin, dst_origin) if start is None else start
    args, keep = _pair_args(src_layout, src_rank, src_pages, src_origin, dst_layout, dst_rank,
                            dst_pages, dst_origin, start, num_tokens, PLAN_PACKED if packed else 0)
    s_pages, d_pages = keep
    bound = num_tokens if not (packed and src_layout[1] == 1) else min(num_tokens, d_pages.n)
    return _runs_out(lambda out, cap, n: lib.pdxfer_pair_runs(ctypes.byref(args), out, cap, n),
                     _is_np(src_pages, dst_pages), bound)


def coalesce_runs(src_rows, dst_rows):
    """Groups row pairs into runs ``(src, dst, len)``; a run breaks wherever
    either side does not advance by exactly 1 (SGLang's ``group_concurrent_contiguous``)."""
    s, d = _I64(src_rows, "src_rows"), _I64(dst_rows, "dst_rows")
    if s.n != d.n:
        raise ArgumentError(-101, f"src_rows and dst_rows differ in length: {s.n} vs {d.n}")
    return _runs_out(lambda out, cap, n: lib.pdxfer_coalesce_runs(s.ptr, d.ptr, s.n, out, cap, n),
                     _is_np(src_rows, dst_rows), s.n)


def dcp_pack_buffer_bytes(kv_item_lens: Sequence[int], page_size: int, max_tokens: int, dcp_size: int) -> int:
    """Bytes of one DCP pack buffer: ``D * ceil(max_tokens/D) * sum(item_len/P)``."""
    lens = (ctypes.c_uint64 * len(kv_item_lens))(*kv_item_lens)
    out = ctypes.c_uint64(0)
    check(lib.pdxfer_dcp_pack_buffer_bytes(lens, len(kv_item_lens), page_size, max_tokens, dcp_size,
                                           ctypes.byref(out)))
    return out.value


POOL_MLA, POOL_HYBRID_MLA, POOL_MHA = 0, 1, 2
#: Prefill attention CP send modes (``PDXFER_CP_MODE_*``): CP rank 0 sends, or every CP rank its pages.
CP_MODES = {"rank0": 0, "all-cp": 1}
#: How a prefill's CP ranks store the KV (``PDXFER_CP_STORAGE_*``).
CP_STORAGES = {"replicated": 0, "layer_split": 1, "kv_sharded": 2}
DTYPES = {"auto": 0, "bf16": 1, "fp16": 2, "fp32": 3, "fp8_e4m3": 4, "fp8_e5m2": 5, "fp8_ds_mla": 6}


@dataclass
class Topology:
    """One side's parallel topology and KV geometry (entries: ``(layer_id, row_bytes)``)."""

    entries: List[Tuple[int, int]]
    page_size: int = 64
    engine_rank: int = 0
    attn_tp_size: int = 1
    attn_tp_rank: int = 0
    attn_cp_size: int = 1
    attn_cp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    dcp_size: int = 1
    dcp_rank: int = 0
    dcp_interleave: int = 1
    kv_dtype: str = "bf16"
    pool: int = POOL_MLA
    #: prefill: which attention CP ranks send (a key of :data:`CP_MODES`)
    cp_mode: str = "rank0"
    #: prefill: how the CP ranks store the KV (a key of :data:`CP_STORAGES`)
    cp_storage: str = "replicated"

    @classmethod
    def mla(cls, layers: int = 61, row_bytes: int = 1152, **kw) -> "Topology":
        """An MLA pool of ``layers`` entries of ``row_bytes`` each."""
        return cls(entries=[(i, row_bytes) for i in range(layers)], **kw)

    def _c(self):
        if self.kv_dtype not in DTYPES:
            raise ArgumentError(-101, f"unknown kv_dtype {self.kv_dtype!r}; one of {sorted(DTYPES)}")
        if self.cp_mode not in CP_MODES or self.cp_storage not in CP_STORAGES:
            raise ArgumentError(-101, f"unknown cp_mode {self.cp_mode!r} or cp_storage {self.cp_storage!r}; "
                                      f"one of {sorted(CP_MODES)} and {sorted(CP_STORAGES)}")
        n = len(self.entries)
        ids = (ctypes.c_uint32 * n)(*[e[0] for e in self.entries])
        rows = (ctypes.c_uint64 * n)(*[e[1] for e in self.entries])
        t = CTopology(
            ctypes.sizeof(CTopology), self.engine_rank, self.attn_tp_size, self.attn_tp_rank,
            self.attn_cp_size, self.attn_cp_rank, self.pp_size, self.pp_rank, self.dcp_size,
            self.dcp_rank, self.dcp_interleave, self.page_size, DTYPES[self.kv_dtype], self.pool, 0,
            n, ctypes.cast(ids, _u32p), ctypes.cast(rows, _u64p), CP_MODES[self.cp_mode],
            CP_STORAGES[self.cp_storage],
        )
        return t, (ids, rows)


@dataclass
class PeerCompat:
    """Result of :func:`check_peer`."""

    mode: str
    num_decode_ranks_served: int
    num_entry_pairs: int


def check_peer(prefill: Topology, decode: Topology) -> PeerCompat:
    """Checks that ``prefill`` may send to ``decode``; raises :class:`pdxfer.CompatError`
    (``.kind`` e.g. ``dcp_rank_mismatch``) naming both sides otherwise."""
    p, keep_p = prefill._c()
    d, keep_d = decode._c()
    out = CPeerCompat(ctypes.sizeof(CPeerCompat))
    check(lib.pdxfer_check_peer(ctypes.byref(p), ctypes.byref(d), ctypes.byref(out)))
    return PeerCompat(("pages", "token_relayout")[out.mode], out.num_decode_ranks_served, out.num_entry_pairs)


@dataclass
class RankMapping:
    """Which prefill ranks a decode rank contacts (reference 3.1-3.3)."""

    target_tp_ranks: List[int]
    dummy_tp: List[bool]
    target_cp_ranks: List[int]
    target_pp_ranks: List[int]
    required_dst_info_num: int
    required_prefill_response_num: int


def rank_mapping(decode: Topology, prefill: Topology, *, all_cp_ranks: bool = False) -> RankMapping:
    """Resolves the decode rank's targets against the prefill instance's
    topology: any set of prefill ranks, gaps included (a DCP-sharded prefill
    read by a smaller decode DCP contacts shares d, d + N, ...)."""
    d, keep_d = decode._c()
    p, keep_p = prefill._c()
    flags = MAP_ALL_CP_RANKS if all_cp_ranks else 0
    if _HAS_RANK_TARGETS:
        t = CRankTargets(ctypes.sizeof(CRankTargets))
        check(lib.pdxfer_rank_targets(ctypes.byref(d), ctypes.byref(p), flags, ctypes.byref(t)))  # the counts
        cap = max(t.num_tp_ranks, t.num_cp_ranks, t.num_pp_ranks)
        tp, dummy, cp, pp = ((ctypes.c_uint32 * cap)() for _ in range(4))
        t.tp_ranks, t.tp_dummy, t.cp_ranks, t.pp_ranks = tp, dummy, cp, pp
        t.capacity = cap
        check(lib.pdxfer_rank_targets(ctypes.byref(d), ctypes.byref(p), flags, ctypes.byref(t)))
        return RankMapping(
            target_tp_ranks=list(tp[:t.num_tp_ranks]),
            dummy_tp=[bool(x) for x in dummy[:t.num_tp_ranks]],
            target_cp_ranks=list(cp[:t.num_cp_ranks]),
            target_pp_ranks=list(pp[:t.num_pp_ranks]),
            required_dst_info_num=t.required_dst_info_num,
            required_prefill_response_num=t.required_prefill_response_num,
        )
    out = CRankMapping(ctypes.sizeof(CRankMapping))
    check(lib.pdxfer_rank_mapping(ctypes.byref(d), ctypes.byref(p), flags, ctypes.byref(out)))
    tp = list(range(out.tp_rank_begin, out.tp_rank_end))
    return RankMapping(
        target_tp_ranks=tp,
        dummy_tp=[i > 0 and bool(out.tp_others_dummy) for i in range(len(tp))],
        target_cp_ranks=list(range(out.cp_rank_begin, out.cp_rank_end)),
        target_pp_ranks=list(range(out.pp_rank_begin, out.pp_rank_end)),
        required_dst_info_num=out.required_dst_info_num,
        required_prefill_response_num=out.required_prefill_response_num,
    )
