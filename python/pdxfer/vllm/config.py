"""vLLM's configuration as pdxfer sees it: the connector's extra config, the
KV dtype tag, the topology of one worker rank from its KV cache tensors and
parallel state, and the vLLM flags that fix each refusal.

Pure: imports neither vLLM nor torch (it reads the attributes of the objects
it is given), so it is testable without them.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .._lib import ArgumentError, CompatError, PdxError
from ..layout import Topology

#: kv_connector_extra_config keys and their defaults.
DEFAULTS: Dict[str, Any] = {
    "bootstrap_url": None,  # an external `pdxfer bootstrap`; else the prefill serves one
    "bootstrap_host": "127.0.0.1",
    "bootstrap_port": 8998,  # + the prefill's data-parallel index
    "transport": "auto",
    "cluster": "vllm",
    "token": None,  # the bootstrap's bearer token and cluster secret (else PDXFER_CLUSTER_SECRET)
    "transfer_timeout": 60.0,  # seconds: a decode's transfer, a prefill's wait for its decode
    "layerwise": True,  # send a step's chunk layer by layer from save_kv_layer when the decode waits
}

TRANSPORTS = ("auto", "tcp", "cma", "rdma", "nccl")


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config`` after validation."""

    bootstrap_url: Optional[str]
    bootstrap_host: str
    bootstrap_port: int
    transport: str
    cluster: str
    token: Optional[str]
    transfer_timeout: float
    layerwise: bool = True

    def own_bootstrap_url(self, dp_index: int = 0) -> str:
        """The bootstrap a prefill instance's ranks register with."""
        if self.bootstrap_url:
            return self.bootstrap_url
        return f"http://{self.bootstrap_host}:{self.bootstrap_port + dp_index}"


def settings(extra: Optional[Mapping[str, Any]]) -> ConnectorSettings:
    """Validates ``kv_connector_extra_config`` (unknown keys are refused, so a
    typo is not silently ignored)."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(DEFAULTS))
    if unknown:
        raise ArgumentError(-101, f"kv_connector_extra_config: unknown keys {unknown}; "
                                  f"PdxferConnector takes {sorted(DEFAULTS)}")
    v = {**DEFAULTS, **extra}
    if v["transport"] not in TRANSPORTS:
        raise ArgumentError(-101, f"kv_connector_extra_config.transport={v['transport']!r}; one of {TRANSPORTS}")
    t = float(v["transfer_timeout"])
    if not t > 0:
        raise ArgumentError(-101, f"kv_connector_extra_config.transfer_timeout must be > 0 s, got {t}")
    return ConnectorSettings(
        bootstrap_url=v["bootstrap_url"] or None, bootstrap_host=str(v["bootstrap_host"]),
        bootstrap_port=int(v["bootstrap_port"]), transport=v["transport"], cluster=str(v["cluster"]),
        token=v["token"], transfer_timeout=t, layerwise=bool(v["layerwise"]))


#: vLLM --kv-cache-dtype (and the model dtype under "auto") -> pdxfer's dtype tag.
_DTYPES = {
    "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "half": "fp16", "fp16": "fp16",
    "float32": "fp32", "float": "fp32", "fp32": "fp32",
    "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "fp8_ds_mla": "fp8_ds_mla",
}


def kv_dtype(cache_dtype: str, model_dtype: Any) -> str:
    """pdxfer's dtype tag of vLLM's ``--kv-cache-dtype`` (``auto``: the model's dtype)."""
    name = str(cache_dtype)
    if name == "auto":
        name = str(model_dtype).replace("torch.", "")
    tag = _DTYPES.get(name)
    if tag is None:
        raise CompatError(-105, f"--kv-cache-dtype {cache_dtype} (model dtype {model_dtype}) has no pdxfer "
                                f"dtype tag; one of {sorted(_DTYPES)}")
    return tag


_LAYER = re.compile(r"\.(\d+)\.")


def layer_index(name: str) -> int:
    """The layer number in a vLLM attention layer name (``model.layers.7.self_attn.attn``),
    as vLLM's ``extract_layer_index``."""
    m = _LAYER.findall(name + ".")
    if len(m) != 1:
        raise ArgumentError(-101, f"cannot take one layer index from the KV cache name {name!r}")
    return int(m[0])


@dataclasses.dataclass(frozen=True)
class Parallel:
    """One worker rank's place: vLLM's TP, DCP, PP and DP."""

    tp_size: int = 1
    tp_rank: int = 0
    dcp_size: int = 1
    dcp_rank: int = 0
    dcp_interleave: int = 1
    pp_size: int = 1
    pp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0


def pool_geometry(name: str, t: Any) -> Tuple[int, int, int]:
    """``(num_blocks, block_size, row_bytes)`` of one MLA layer's cache as vLLM
    lays it out (``[num_blocks, 1, block_size, head_size]``, or
    ``[num_blocks, block_size, head_size]``): a block's ``block_size`` rows of
    ``row_bytes`` back to back, the blocks :func:`pool_page_stride` bytes
    apart (a layer-compact layout, or a block-outermost ``BL*`` one whose
    block row interleaves the layers); a layout whose rows are not contiguous
    inside a block is refused."""
    shape = tuple(int(x) for x in t.shape)
    if len(shape) == 4 and shape[1] == 1:
        nb, bs, hs = shape[0], shape[2], shape[3]
        row_stride = int(t.stride()[2])
    elif len(shape) == 3:
        nb, bs, hs = shape
        row_stride = int(t.stride()[1])
    else:
        raise CompatError(-105, f"KV cache {name}: shape {list(shape)} is not an MLA cache "
                                "([num_blocks, 1, block_size, head_size]); PdxferConnector serves MLA models only")
    es = int(t.element_size())
    row = hs * es
    stride = [int(x) for x in t.stride()]
    if stride[-1] != 1 or row_stride != hs or (nb > 1 and stride[0] < bs * hs):
        raise CompatError(-105, f"KV cache {name}: strides {stride} for shape {list(shape)} do not keep a block's "
                                f"{bs} token rows of {row} B contiguous; run vLLM with a --kv-cache-layout whose "
                                "blocks are whole (LBNHC, the MLA default, or a block-outermost BLNHC)")
    return nb, bs, row


def pool_page_stride(name: str, t: Any) -> int:
    """Bytes from one block of ``t``'s layer to the next: the page bytes for a
    layer-compact layout, more for a block-outermost one (``BLNHC``: every
    layer's page of a block side by side) or padded pages."""
    nb, bs, row = pool_geometry(name, t)
    if nb <= 1:
        return bs * row
    return int(t.stride()[0]) * int(t.element_size())


def engine_pools(kv_caches: Mapping[str, Any], pools: List[Any], num_blocks: int) -> List[Tuple]:
    """The pools as :class:`pdxfer.Engine` takes them, in ``pools``' (entry)
    order: ``(tensor, num_blocks)``, or ``(tensor, num_blocks, page_stride)``
    where the blocks are not end to end."""
    names = {id(t): n for n, t in kv_caches.items()}
    out: List[Tuple] = []
    for t in pools:
        name = names.get(id(t), "?")
        nb, bs, row = pool_geometry(name, t)
        stride = pool_page_stride(name, t)
        out.append((t, num_blocks) if stride == bs * row else (t, num_blocks, stride))
    return out


def topology(kv_caches: Mapping[str, Any], par: Parallel, dtype_tag: str,
             producer: bool = False) -> Tuple[Topology, List[Any], int]:
    """The rank's topology (one entry per layer, by layer index), its pools in
    entry order and the block count. Every layer must have the same blocks.
    A rank with DCP > 1 (prefill or decode) holds its share of each request's
    positions in its local blocks; the engine pairs each decode rank with the
    prefill ranks holding the shares it owns. ``producer`` is kept for callers."""
    del producer
    items = sorted(((layer_index(n), n, t) for n, t in kv_caches.items()), key=lambda x: x[0])
    if not items:
        raise ArgumentError(-101, "register_kv_caches: no KV caches")
    entries: List[Tuple[int, int]] = []
    pools: List[Any] = []
    geo = None
    for idx, name, t in items:
        nb, bs, row = pool_geometry(name, t)
        if geo is None:
            geo = (nb, bs)
        elif geo != (nb, bs):
            raise CompatError(-105, f"KV cache {name}: {nb} blocks of {bs} tokens, the first layer has "
                                    f"{geo[0]} of {geo[1]}; hybrid KV caches are not served")
        entries.append((idx, row))
        pools.append(t)
    assert geo is not None
    topo = Topology(
        entries=entries, page_size=geo[1], engine_rank=par.tp_rank, attn_tp_size=par.tp_size,
        attn_tp_rank=par.tp_rank, pp_size=par.pp_size, pp_rank=par.pp_rank, dcp_size=par.dcp_size,
        dcp_rank=par.dcp_rank, dcp_interleave=par.dcp_interleave, kv_dtype=dtype_tag)
    return topo, pools, geo[0]


#: pdxfer refusal kinds -> the vLLM launch flags that fix them.
HINTS = {
    "kv_dtype_mismatch": "vLLM: serve the prefill and the decode with the same --kv-cache-dtype (and --dtype)",
    "page_size_mismatch": "vLLM: serve both sides with the same --block-size",
    "geometry_mismatch": "vLLM: serve the same model (--model, --hf-overrides) on both sides",
    "dcp_rank_mismatch": "vLLM: check --tensor-parallel-size and --decode-context-parallel-size on both sides",
    "unsupported_dcp_topology": "vLLM: give each side a --decode-context-parallel-size that divides its "
                                "--tensor-parallel-size, and TP replica counts that divide each other",
    "dcp_requires_mla": "vLLM: --decode-context-parallel-size > 1 needs an MLA model",
    "prefix_misaligned": "vLLM: a decode prefix hit must be a multiple of --block-size x "
                         "--decode-context-parallel-size (and of the prefill's)",
    "pp_mismatch": "vLLM: the decode's --pipeline-parallel-size must be 1 or the prefill's",
    "room_key_collision": "vLLM: two live request ids map to one pdxfer room; retry the request",
    "timeout": "vLLM: the prefill did not deliver within kv_connector_extra_config.transfer_timeout; check "
               "the prefill instance, or raise transfer_timeout in --kv-transfer-config",
    "not_ready": "vLLM: the prefill instance is not registered with its bootstrap (is it up? "
                 "kv_connector_extra_config.bootstrap_port / bootstrap_url must match on both sides)",
}


def vllm_hint(err: Optional[PdxError], fallback: str = "") -> str:
    """``err``'s message with the vLLM flag that fixes it, if any."""
    if err is None:
        return fallback
    kind = getattr(err, "kind", "")
    h = HINTS.get(kind) or HINTS.get("timeout" if "timed out" in str(err) or "deadline" in str(err) else "")
    return f"{err} ({kind}). {h}" if h else f"{err} ({kind})"


def num_tokens_for_pages(pages: Sequence[int], capacity: int) -> int:
    """Tokens ``pages`` hold at ``capacity`` positions a page."""
    return len(pages) * capacity
