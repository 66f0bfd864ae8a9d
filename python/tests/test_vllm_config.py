"""pdxfer.vllm.config without vLLM: the extra config's validation, dtype tags,
layer indices, MLA cache geometry from a tensor's shape and strides, the
topology of a rank (block-outermost strides served as pool page strides),
and the refusals (non-MLA shapes, rows not contiguous inside a block, a DCP
prefill) naming the vLLM flag to change."""

import pytest

import pdxfer
from pdxfer.vllm import config as C


class T:
    """A tensor as vLLM's KV cache views show it: shape, stride, element size."""

    def __init__(self, shape, stride=None, es=2):
        self.shape = shape
        st, acc = [], 1
        for d in reversed(shape):
            st.append(acc)
            acc *= d
        self._stride = stride or list(reversed(st))
        self._es = es

    def stride(self):
        return self._stride

    def element_size(self):
        return self._es


def test_settings_defaults_and_refusals():
    s = C.settings({"bootstrap_port": 9000})
    assert s.transport == "auto" and s.cluster == "vllm" and s.transfer_timeout == 60.0
    assert s.own_bootstrap_url(2) == "http://127.0.0.1:9002"
    assert C.settings({"bootstrap_url": "http://h:1"}).own_bootstrap_url(3) == "http://h:1"
    with pytest.raises(pdxfer.PdxError, match="unknown keys"):
        C.settings({"bootstrap_prot": 1})
    with pytest.raises(pdxfer.PdxError, match="transport"):
        C.settings({"transport": "ucx"})
    with pytest.raises(pdxfer.PdxError, match="transfer_timeout"):
        C.settings({"transfer_timeout": 0})


def test_dtype_tags():
    assert C.kv_dtype("auto", "torch.bfloat16") == "bf16"
    assert C.kv_dtype("auto", "torch.float16") == "fp16"
    assert C.kv_dtype("fp8", "torch.bfloat16") == "fp8_e4m3"
    assert C.kv_dtype("fp8_ds_mla", "torch.bfloat16") == "fp8_ds_mla"
    assert "fp8_ds_mla" in pdxfer.layout.DTYPES
    with pytest.raises(pdxfer.PdxError):
        C.kv_dtype("int4", "torch.bfloat16")


def test_layer_index():
    assert C.layer_index("model.layers.7.self_attn.attn") == 7
    with pytest.raises(pdxfer.PdxError):
        C.layer_index("model.attn")


def test_mla_geometry_and_topology():
    caches = {f"model.layers.{i}.self_attn.attn": T([32, 1, 16, 576]) for i in (1, 0)}
    par = C.Parallel(tp_size=2, tp_rank=1, dcp_size=2, dcp_rank=1, dcp_interleave=16)
    topo, pools, nb = C.topology(caches, par, "bf16")
    assert nb == 32 and topo.page_size == 16 and topo.entries == [(0, 1152), (1, 1152)]
    assert (topo.dcp_size, topo.dcp_rank, topo.dcp_interleave, topo.attn_tp_rank) == (2, 1, 16, 1)
    assert pools[0] is caches["model.layers.0.self_attn.attn"]


def test_refusals_name_the_flag():
    with pytest.raises(pdxfer.PdxError, match="MLA"):
        C.pool_geometry("l.0.a", T([32, 2, 16, 128]))
    # block-outermost (layers interleaved inside a block row): served, the blocks page_stride apart
    bo = T([32, 1, 16, 576], stride=[2 * 16 * 576, 16 * 576, 576, 1])
    assert C.pool_geometry("l.0.a", bo) == (32, 16, 1152)
    assert C.pool_page_stride("l.0.a", bo) == 2 * 16 * 1152
    caches = {"model.layers.0.a": bo, "model.layers.1.a": T([32, 1, 16, 576])}
    topo, pools, nb = C.topology(caches, C.Parallel(), "bf16")
    assert C.engine_pools(caches, pools, nb) == [(bo, 32, 2 * 16 * 1152), (caches["model.layers.1.a"], 32)]
    # rows not contiguous inside a block (head-major, or a row pitch): refused naming the flag
    with pytest.raises(pdxfer.PdxError, match="kv-cache-layout"):
        C.pool_geometry("l.0.a", T([32, 16, 576], stride=[16 * 1024, 1024, 1]))
    with pytest.raises(pdxfer.PdxError, match="kv-cache-layout"):
        C.pool_geometry("l.0.a", T([32, 1, 16, 576], stride=[8 * 576, 16 * 576, 576, 1]))
    caches = {"model.layers.0.self_attn.attn": T([8, 1, 16, 576])}
    # a prefill with DCP holds its share of each request: served
    topo, _, _ = C.topology(caches, C.Parallel(tp_size=2, tp_rank=1, dcp_size=2, dcp_rank=1), "bf16",
                            producer=True)
    assert (topo.dcp_size, topo.dcp_rank) == (2, 1)
    with pytest.raises(pdxfer.PdxError, match="hybrid"):
        C.topology({"model.layers.0.a": T([8, 1, 16, 576]), "model.layers.1.a": T([8, 1, 32, 576])},
                   C.Parallel(), "bf16")


def test_hints_name_vllm_flags():
    class E:
        kind = "kv_dtype_mismatch"

        def __str__(self):
            return "dtype differs"

    assert "--kv-cache-dtype" in C.vllm_hint(E())
