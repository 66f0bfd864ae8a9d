"""How SGLang's ``KVArgs``, ``server_args`` and parallel state become a pdxfer
:class:`~pdxfer.Topology`, pools, aux and state buffers.

SGLang keeps the parallel layout in its runtime context
(``sglang.srt.runtime_context.get_parallel()``: ``attn_tp_size``,
``attn_dcp_size`` ...), not in ``KVArgs``. :func:`parallel_layout` reads it from
there, falls back to ``server_args`` (``tp_size``, ``dp_size``,
``enable_dp_attention``, ``attn_cp_size``, ``dcp_size``, ``pp_size``), and lets
fields set on ``KVArgs`` override both (``dcp_size``, ``dcp_rank``,
``attn_tp_size``, ...).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from .._lib import ArgumentError
from ..layout import POOL_HYBRID_MLA, POOL_MHA, POOL_MLA, Topology

#: Layer ids pdxfer gives entries SGLang left without one: the n-th repeat of
#: a layer id (an MHA pool's V entries) moves up by this band, draft entries
#: (the last ``num_draft_entries``) start at ``DRAFT_LAYER_BASE``.
LAYER_BAND = 1 << 20
DRAFT_LAYER_BASE = 1 << 24

#: State types whose rooms carry one row per state tensor (the request's slot),
#: which pdxfer moves; the page-indexed ones (SWA, DSA, ...) are refused.
ROW_STATE_TYPES = ("mamba", "request_row")

_DTYPES = {
    None: "bf16", "": "bf16", "auto": "bf16", "bfloat16": "bf16", "bf16": "bf16",
    "float16": "fp16", "half": "fp16", "fp16": "fp16", "float32": "fp32", "fp32": "fp32",
    "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
}


def _get(obj: Any, name: str, default: Any = None) -> Any:
    v = getattr(obj, name, None) if obj is not None else None
    return default if v is None else v


def sglang_parallel() -> Any:
    """SGLang's parallel context of this process, or None when SGLang (or its
    runtime context) is not there."""
    try:
        from sglang.srt.runtime_context import get_parallel
    except Exception:  # noqa: BLE001 - any import failure means "not inside SGLang"
        return None
    try:
        return get_parallel()
    except Exception:  # noqa: BLE001 - not published yet
        return None


@dataclass
class ParallelLayout:
    """One rank's place in SGLang's parallel layout."""

    engine_rank: int
    attn_tp_size: int
    attn_tp_rank: int
    attn_cp_size: int
    attn_cp_rank: int
    attn_dp_size: int
    attn_dp_rank: int
    system_dp_size: int
    system_dp_rank: int
    pp_size: int
    pp_rank: int
    dcp_size: int
    dcp_rank: int

    @property
    def dp_size(self) -> int:
        """DP groups as SGLang's bootstrap table counts them."""
        return self.system_dp_size if self.system_dp_size > 1 else self.attn_dp_size

    @property
    def dp_rank(self) -> int:
        return self.system_dp_rank if self.system_dp_size > 1 else self.attn_dp_rank


def parallel_layout(kv_args: Any, server_args: Any, parallel: Any = None) -> ParallelLayout:
    """The layout of the rank ``kv_args`` describes (see the module docs)."""
    par = parallel if parallel is not None else sglang_parallel()
    rank = int(_get(kv_args, "engine_rank", 0))
    tp = int(_get(server_args, "tp_size", 1))
    dp = int(_get(server_args, "dp_size", 1))
    dp_attention = bool(_get(server_args, "enable_dp_attention", False))
    attn_dp = dp if dp_attention else 1
    attn_cp = int(_get(server_args, "attn_cp_size", 1))
    attn_tp = max(1, tp // max(1, attn_dp * attn_cp))
    base = {
        "attn_tp_size": attn_tp,
        "attn_tp_rank": rank % attn_tp,
        "attn_cp_size": attn_cp,
        "attn_cp_rank": 0,
        "attn_dp_size": attn_dp,
        "attn_dp_rank": 0,
        "system_dp_size": 1 if dp_attention else dp,
        "pp_size": int(_get(server_args, "pp_size", 1)),
        "dcp_size": int(_get(server_args, "dcp_size", 1)),
    }
    if par is not None:
        for k, src in (("attn_tp_size", "attn_tp_size"), ("attn_tp_rank", "attn_tp_rank"),
                       ("attn_cp_size", "attn_cp_size"), ("attn_cp_rank", "attn_cp_rank"),
                       ("attn_dp_size", "attn_dp_size"), ("attn_dp_rank", "attn_dp_rank"),
                       ("system_dp_size", "dp_size"), ("pp_size", "pp_size"),
                       ("dcp_size", "attn_dcp_size"), ("dcp_rank", "attn_dcp_rank")):
            v = getattr(par, src, None)
            if v is not None:
                base[k] = int(v)
        if base["system_dp_size"] > 1 and base["attn_dp_size"] > 1:
            base["system_dp_size"] = 1  # dp_size counts the attention DP groups
    base.setdefault("dcp_rank", base["attn_tp_rank"] % max(1, base["dcp_size"]))
    base["system_dp_rank"] = int(_get(kv_args, "system_dp_rank", 0))
    base["pp_rank"] = int(_get(kv_args, "pp_rank", 0))
    for k in list(base):  # KVArgs fields override SGLang's state and server_args
        v = getattr(kv_args, k, None)
        if v is not None and not callable(v):
            base[k] = int(v)
    return ParallelLayout(engine_rank=rank, **base)


#: The SGLang launch flag of each non-replicated prefill CP storage.
CP_STORAGE_FLAGS = {"layer_split": "--enable-dsa-cache-layer-split", "kv_sharded": "--enable-kv-cache-sharding"}


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def cp_send_mode(lay: ParallelLayout, par: Any, hybrid_mla: bool, mode: str) -> Tuple[bool, bool]:
    """``(enable_all_cp_ranks_for_transfer, is_dummy_cp_rank)`` exactly as SGLang
    0.5.23's ``CommonKVManager.__init__`` sets them (``common/conn.py:373-389``,
    ``:431-440``): every CP rank sends unless CP-TP group sharing is on, when
    ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER`` is set, for a CP > 1 prefill
    of a hybrid-MLA model or with DSA cache-layer split, on a hybrid-MLA decode,
    or with KV cache sharding; otherwise a prefill's CP ranks other than 0 are dummies."""
    sharing = bool(_get(par, "enable_cp_tp_group_sharing", False))
    cp = lay.attn_cp_size
    cp_sharded_prefill = cp > 1 and (hybrid_mla or bool(_get(par, "enable_dsa_cache_layer_split", False)))
    hybrid_decode = hybrid_mla and mode == "decode"
    shard = int(_get(par, "kv_shard_size", cp if _get(par, "enable_kv_cache_sharding", False) else 1))
    all_cp = not sharing and (_env_flag("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER") or cp_sharded_prefill
                              or hybrid_decode or shard > 1)
    dummy = mode == "prefill" and not all_cp and not sharing and cp > 1 and lay.attn_cp_rank != 0
    return all_cp, dummy


def transfer_layout(lay: ParallelLayout, par: Any) -> ParallelLayout:
    """The layout a rank registers for transfers: its own, except under SGLang's
    CP-TP group sharing, where CP rank r (holding every KV head) transfers as
    TP rank r of a CP-1 prefill (``common/conn.py:1580-1583``)."""
    if not _get(par, "enable_cp_tp_group_sharing", False):
        return lay
    return dataclasses.replace(lay, attn_tp_size=lay.attn_cp_size, attn_tp_rank=lay.attn_cp_rank,
                               attn_cp_size=1, attn_cp_rank=0)


def cp_storage(par: Any) -> str:
    """How this prefill's CP ranks store the KV (a key of :data:`pdxfer.layout.CP_STORAGES`)."""
    if _get(par, "enable_dsa_cache_layer_split", False):
        return "layer_split"
    if _get(par, "enable_kv_cache_sharding", False):
        return "kv_sharded"
    return "replicated"


def kv_dtype(kv_args: Any, server_args: Any) -> str:
    """pdxfer's dtype name for ``kv_cache_dtype_str`` (or ``--kv-cache-dtype``)."""
    d = getattr(kv_args, "kv_cache_dtype_str", None) or _get(server_args, "kv_cache_dtype", None)
    d = str(d).replace("torch.", "") if d is not None else None
    if d not in _DTYPES:
        raise ArgumentError(-101, f"kv_cache_dtype {d!r} has no pdxfer dtype; known: {sorted(k for k in _DTYPES if k)}")
    return _DTYPES[d]


def entry_layer_ids(kv_args: Any, is_mla: bool) -> List[int]:
    """One distinct layer id per KV entry, as SGLang pairs them: ``kv_layer_ids``
    when SGLang filled it, else positional (``prefill_start_layer + i``; an MHA
    pool lists its K entries, then its V entries; draft entries last). The n-th
    repeat of an id is moved up by ``n * LAYER_BAND``."""
    n = len(kv_args.kv_item_lens)
    draft = int(_get(kv_args, "num_draft_entries", 0))
    ids = list(getattr(kv_args, "kv_layer_ids", None) or [])
    if ids and len(ids) != n:
        raise ArgumentError(-101, f"kv_layer_ids has {len(ids)} ids for {n} KV entries")
    if not ids:
        start = int(_get(kv_args, "prefill_start_layer", 0))
        target = n - draft
        groups = 1 if is_mla else 2
        if target % groups:
            raise ArgumentError(-101, f"an MHA pool lists K then V entries: {target} target entries is odd")
        per = target // groups
        ids = [start + i for i in range(per)] * groups
        dper = draft // groups if draft % groups == 0 else draft
        ids += [DRAFT_LAYER_BASE + (j % dper if dper else j) for j in range(draft)]
    seen: dict = {}
    out = []
    for lid in ids:
        k = seen.get(lid, 0)
        seen[lid] = k + 1
        out.append(int(lid) + k * LAYER_BAND)
    return out


def topologies(kv_args: Any, server_args: Any, lay: ParallelLayout, is_mla: bool, mode: str
               ) -> Tuple[Topology, List[int], Optional[Topology], List[int]]:
    """This rank's pdxfer topology and the KV entries it covers, and, for an
    MLA pool with speculative-draft entries, the draft's own topology and
    entries. SGLang's Mooncake path replicates draft KV to every decode DCP
    rank into a draft pool paged by the virtual DCP page (``page_size *
    dcp_size`` tokens per page, not sharded), so the draft moves in an engine
    of its own: DCP 1, that page size on the decode."""
    p = int(kv_args.page_size)
    items = [int(x) for x in kv_args.kv_item_lens]
    bad = [i for i in items if i <= 0 or i % p]
    if bad:
        raise ArgumentError(-101, f"kv_item_lens {bad} are not positive multiples of page_size {p}")
    hybrid = bool(getattr(kv_args, "is_hybrid_mla_backend", False))
    pool = POOL_HYBRID_MLA if hybrid else (POOL_MLA if is_mla else POOL_MHA)
    ids = entry_layer_ids(kv_args, is_mla or hybrid)
    draft = int(_get(kv_args, "num_draft_entries", 0))
    split = draft > 0 and (is_mla or hybrid)
    main_idx = list(range(len(items) - draft)) if split else list(range(len(items)))
    draft_idx = list(range(len(items) - draft, len(items))) if split else []
    common = dict(engine_rank=lay.engine_rank, attn_tp_size=lay.attn_tp_size, attn_tp_rank=lay.attn_tp_rank,
                  attn_cp_size=lay.attn_cp_size, attn_cp_rank=lay.attn_cp_rank, pp_size=lay.pp_size,
                  pp_rank=lay.pp_rank, kv_dtype=kv_dtype(kv_args, server_args), pool=pool)
    main = Topology(entries=[(ids[i], items[i] // p) for i in main_idx], page_size=p,
                    dcp_size=lay.dcp_size, dcp_rank=lay.dcp_rank, **common)
    if not split:
        return main, main_idx, None, []
    dp = p * lay.dcp_size if mode == "decode" else p
    bad = [items[i] for i in draft_idx if items[i] % dp]
    if bad:
        raise ArgumentError(-101, f"draft kv_item_lens {bad} are not multiples of the draft page of {dp} tokens "
                                  f"(page_size {p} x dcp_size {lay.dcp_size} on the decode)")
    dtopo = Topology(entries=[(ids[i], items[i] // dp) for i in draft_idx], page_size=dp, dcp_size=1,
                     dcp_rank=0, **common)
    return main, main_idx, dtopo, draft_idx


def kv_pools(kv_args: Any, which: Sequence[int]) -> List[Tuple[int, int]]:
    """``(address, num_pages)`` of the KV entries ``which``."""
    return [(int(kv_args.kv_data_ptrs[i]), int(kv_args.kv_data_lens[i]) // int(kv_args.kv_item_lens[i]))
            for i in which]


def aux_buffers(kv_args: Any) -> List[Tuple[int, int, int]]:
    """``(address, item_bytes, count)`` per metadata buffer (SGLang's ``MetadataBuffers``)."""
    return [(int(ptr), int(i), int(n) // int(i))
            for ptr, n, i in zip(_get(kv_args, "aux_data_ptrs", []), _get(kv_args, "aux_data_lens", []),
                                 _get(kv_args, "aux_item_lens", [])) if int(i) > 0]


def state_type_name(t: Any) -> str:
    return str(getattr(t, "value", t))


def state_buffers(kv_args: Any) -> Tuple[List[Tuple[int, int, int]], List[int]]:
    """pdxfer state buffers (one per state tensor) and, per SGLang state
    component, how many of them it has. Page-indexed state types are refused
    (``unsupported``): their rooms carry many rows per tensor."""
    types = list(_get(kv_args, "state_types", []))
    if not types:
        return [], []
    ptrs = _get(kv_args, "state_data_ptrs", [])
    lens = _get(kv_args, "state_data_lens", [])
    items = _get(kv_args, "state_item_lens", [])
    if not (len(ptrs) == len(lens) == len(items) == len(types)):
        raise ArgumentError(-101, "state_types, state_data_ptrs, state_data_lens and state_item_lens differ in length")
    bufs: List[Tuple[int, int, int]] = []
    per: List[int] = []
    for t, ps, ls, its in zip(types, ptrs, lens, items):
        name = state_type_name(t)
        if name not in ROW_STATE_TYPES:
            raise ArgumentError(
                -105, f"pdxfer moves per-request state rows ({', '.join(ROW_STATE_TYPES)}); "
                      f"the {name!r} state pool is indexed by pages, which pdxfer does not move yet. "
                      "Serve this model with --disaggregation-transfer-backend mooncake")
        for ptr, n, i in zip(ps, ls, its):
            bufs.append((int(ptr), int(i), int(n) // int(i)))
        per.append(len(ps))
    return bufs, per


def state_rows(state_indices: Optional[Sequence[Any]], per_component: Sequence[int]) -> List[int]:
    """The room's row in every state buffer, from SGLang's per-component
    ``state_indices`` (one index per component, or one per tensor)."""
    if state_indices is None or len(state_indices) != len(per_component):
        got = None if state_indices is None else len(state_indices)
        raise ArgumentError(-101, f"state_indices has {got} components for {len(per_component)} state pools")
    rows: List[int] = []
    for c, (idx, n) in enumerate(zip(state_indices, per_component)):
        flat = _flatten(idx)
        if len(flat) == 1:
            rows += flat * n
        elif len(flat) == n:
            rows += flat
        else:
            raise ArgumentError(-101, f"state component {c}: {len(flat)} indices for {n} state tensors (one row each)")
    return rows


def _flatten(x: Any) -> List[int]:
    if x is None:
        return []
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, (list, tuple)):
        out: List[int] = []
        for v in x:
            out += _flatten(v)
        return out
    return [int(x)]


def pool_device(kv_args: Any) -> Optional[int]:
    """The CUDA device of the KV pools: SGLang's pools live on ``gpu_id``.
    ``PDXFER_SGLANG_POOL_MEMORY=host`` says they are host memory (CPU-only tests)."""
    mem = os.environ.get("PDXFER_SGLANG_POOL_MEMORY", "device").lower()
    if mem == "host":
        return None
    if mem != "device":
        raise ArgumentError(-101, f"PDXFER_SGLANG_POOL_MEMORY must be 'device' or 'host', got {mem!r}")
    gpu = getattr(kv_args, "gpu_id", None)
    return None if gpu is None else int(gpu)
