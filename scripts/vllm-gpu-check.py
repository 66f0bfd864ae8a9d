"""The vLLM connector's device path on a GPU: PdxferConnector's worker side
with torch CUDA tensors as KV caches (vLLM's MLA shape, ``[num_blocks, 1,
block_size, 576]`` bf16), a prefill and a decode worker in this process over
tcp (device pools on both sides). The prefill's KV rows are written by CUDA
work queued behind a ``torch.cuda._sleep`` on the current stream and the
connector's ``wait_for_save`` is called at once: its send is ordered after
that work by the CUDA event it records, so a decode row read back wrong
means the event was not honoured. Every decode byte is checked.

vLLM itself need not be installed: without it, this script puts stand-ins for
the names the connector imports from vLLM's ``kv_connector.v1.base`` into
``sys.modules`` (a base class that keeps the config and the bound metadata,
the role enum, the metadata and results classes); everything the check
exercises is pdxfer's code. ``--memory host`` runs the same on CPU tensors.

``--flow router`` (the default): the decode registers first and the prefill's
``wait_for_save`` sends after the event it records. ``--flow sequential``: the
prefill's step runs before any decode exists, each layer's rows written behind
its own GPU sleep and ``save_kv_layer`` called at once (the event queued with
that layer's save); the decode registers after, and the queued sends go layer
by layer, each after its layer's event.

    PDXFER_LIB=target/libpdxfer.so PYTHONPATH=python python3 scripts/vllm-gpu-check.py
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import sys
import time
import types


def stub_vllm() -> None:
    """Stand-ins for vLLM's connector base module (only when vLLM is absent)."""

    class KVConnectorRole(enum.Enum):
        SCHEDULER = 0
        WORKER = 1

    class KVConnectorMetadata:
        pass

    class SupportsHMA:
        pass

    @dataclasses.dataclass
    class KVConnectorTransferResults:
        finished_sending: set
        finished_recving: set
        failed_recving: set = dataclasses.field(default_factory=set)

    class KVConnectorBase_V1:
        def __init__(self, vllm_config, role, kv_cache_config=None):
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._role = role
            self._connector_metadata = None

        def bind_connector_metadata(self, m):
            self._connector_metadata = m

        def clear_connector_metadata(self):
            self._connector_metadata = None

        def _get_connector_metadata(self):
            return self._connector_metadata

    names = ["vllm", "vllm.distributed", "vllm.distributed.kv_transfer",
             "vllm.distributed.kv_transfer.kv_connector", "vllm.distributed.kv_transfer.kv_connector.v1"]
    for n in names:
        m = types.ModuleType(n)
        m.__path__ = []
        sys.modules[n] = m
    base = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.base")
    for c in (KVConnectorRole, KVConnectorMetadata, SupportsHMA, KVConnectorTransferResults, KVConnectorBase_V1):
        setattr(base, c.__name__, c)
    sys.modules[base.__name__] = base
    ps = types.ModuleType("vllm.distributed.parallel_state")
    ps.model_parallel_is_initialized = lambda: False
    sys.modules[ps.__name__] = ps
    sys.modules["vllm.distributed"].parallel_state = ps


def config(role: str, port: int, block: int):
    ns = types.SimpleNamespace
    return ns(
        kv_transfer_config=ns(kv_role=role, engine_id=role, kv_connector_extra_config={
            "bootstrap_port": port, "transport": "tcp", "transfer_timeout": 30.0}),
        model_config=ns(use_mla=True, dtype="torch.bfloat16", model="gpu-check"),
        parallel_config=ns(tensor_parallel_size=1, decode_context_parallel_size=1, pipeline_parallel_size=1,
                           data_parallel_rank=0, data_parallel_size=1, cp_kv_cache_interleave_size=1),
        cache_config=ns(block_size=block, cache_dtype="auto"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--memory", choices=("device", "host"), default="device")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--stub-vllm", action="store_true", help="use the stand-ins even if vLLM is importable")
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--flow", choices=("router", "sequential"), default="router")
    a = ap.parse_args()
    import torch

    try:
        if a.stub_vllm:
            raise ImportError
        import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
        print("vllm-gpu-check: vLLM's own base classes")
    except ImportError:
        stub_vllm()
        print("vllm-gpu-check: vLLM not importable here: stand-ins for its connector base module")
    from pdxfer.vllm.connector import PdxferConnector, PdxferConnectorMetadata, RecvReq, SendReq
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    dev = "cuda" if a.memory == "device" else "cpu"
    if dev == "cuda" and not torch.cuda.is_available():
        print("vllm-gpu-check: torch.cuda is not available", file=sys.stderr)
        return 3
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    nblocks = -(-a.tokens // a.block) + 4
    names = [f"model.layers.{i}.self_attn.attn" for i in range(a.layers)]

    def caches():
        return {n: torch.zeros(nblocks, 1, a.block, 576, dtype=torch.bfloat16, device=dev) for n in names}

    pc, dc = caches(), caches()
    pre = PdxferConnector(config("kv_producer", port, a.block), KVConnectorRole.WORKER)
    dec = PdxferConnector(config("kv_consumer", port, a.block), KVConnectorRole.WORKER)
    pre.register_kv_caches(pc)
    dec.register_kv_caches(dc)
    n = a.tokens
    pblocks = list(range(2, 2 + -(-n // a.block)))
    dblocks = list(reversed(range(1, 1 + -(-n // a.block))))
    g = torch.Generator(device="cpu").manual_seed(7)
    want = {nm: torch.randint(-30000, 30000, (n, 576), dtype=torch.int16, generator=g) for nm in names}
    pos = torch.arange(n)
    bl = torch.tensor(pblocks)[pos // a.block]

    def write(nm: str) -> None:
        pc[nm].view(torch.int16)[bl.to(dev), 0, (pos % a.block).to(dev), :] = want[nm].to(dev, non_blocking=True)

    def decode_registers() -> None:
        m = PdxferConnectorMetadata()
        m.recvs["d"] = RecvReq(key="gpu-check", bootstrap=f"http://127.0.0.1:{port}", block_ids=dblocks,
                               prefix_len=0, num_tokens=n)
        dec.bind_connector_metadata(m)
        dec.start_load_kv(None)
        dec.clear_connector_metadata()

    t0 = time.monotonic()
    if a.flow == "sequential":
        # one prefill step before any decode: each layer's saves queued with its event
        m = PdxferConnectorMetadata()
        m.sends["p"] = SendReq(key="gpu-check", block_ids=pblocks, computed=n, num_prompt=n)
        m.send_done = {"p"}
        pre.bind_connector_metadata(m)
        pre.start_load_kv(None)
        for nm in names:
            if dev == "cuda":
                torch.cuda._sleep(int(2e7))  # GPU time before this layer's writes
            write(nm)
            pre.save_kv_layer(nm, pc[nm], None)
        pre.wait_for_save()
        pre.clear_connector_metadata()
        decode_registers()
        return finish(a, pre, dec, dc, want, names, dblocks, t0, time.monotonic(), expect_layers=len(names))
    # the decode first (router flow): its metadata waits in the prefill engine
    decode_registers()
    m = PdxferConnectorMetadata()
    m.sends["p"] = SendReq(key="gpu-check", block_ids=pblocks, computed=0, num_prompt=n)
    pre.bind_connector_metadata(m)
    pre.start_load_kv(None)
    pre.clear_connector_metadata()
    while pre._worker.engine.poll(pre._worker.sends["p"].room) < 2 and time.monotonic() - t0 < a.timeout:
        time.sleep(0.01)
    # the step's forward: rows written by work queued behind a sleep on the current stream
    if dev == "cuda":
        torch.cuda._sleep(int(2e8))  # ~0.1-0.2 s of GPU time before the writes
    for nm in names:
        write(nm)
    m = PdxferConnectorMetadata()
    m.sends["p"] = SendReq(key="gpu-check", block_ids=pblocks, computed=n, num_prompt=n)
    m.send_done = {"p"}
    pre.bind_connector_metadata(m)
    pre.wait_for_save()  # records the event and sends: no host synchronisation before it
    pre.clear_connector_metadata()
    return finish(a, pre, dec, dc, want, names, dblocks, t0, time.monotonic(), expect_layers=None)


def finish(a, pre, dec, dc, want, names, dblocks, t0, t_send, expect_layers) -> int:
    """Waits for both sides, checks every decode byte (and, for queued saves,
    that they went layer by layer)."""
    import torch

    dev = "cuda" if a.memory == "device" else "cpu"
    n = a.tokens
    pos = torch.arange(n)
    got_r, got_s, failed = set(), set(), set()
    while (not got_r or not got_s) and time.monotonic() - t0 < a.timeout:
        r = dec.get_transfer_results(set())
        got_r |= r.finished_recving
        failed |= r.failed_recving
        got_s |= pre.get_transfer_results(set()).finished_sending
        time.sleep(0.005)
    dt = time.monotonic() - t_send
    if failed or not got_r or not got_s:
        print(f"vllm-gpu-check: FAILED: recving={got_r} sending={got_s} failed={failed}", file=sys.stderr)
        return 1
    dpos_bl = torch.tensor(dblocks)[pos // a.block]
    bad = 0
    for nm in names:
        rows = dc[nm].view(torch.int16)[dpos_bl.to(dev), 0, (pos % a.block).to(dev), :].cpu()
        bad += int((rows != want[nm]).any(dim=1).sum())
    nbytes = n * 576 * 2 * a.layers
    layer_sends = pre._worker.layer_sends.get("p", 0)
    pre.shutdown()
    dec.shutdown()
    if expect_layers is not None and layer_sends != expect_layers:
        print(f"vllm-gpu-check: FAILED: {layer_sends} layer-wise sends, {expect_layers} queued", file=sys.stderr)
        return 1
    if bad:
        print(f"vllm-gpu-check: FAILED: {bad} of {n * a.layers} decode rows differ", file=sys.stderr)
        return 1
    print(f"vllm-gpu-check: OK: {nbytes} bytes ({n} tokens x {a.layers} layers x 1152 B, {a.memory} pools, "
          f"tcp, {a.flow} flow) landed and verified; {nbytes / dt / 1e9:.2f} GB/s from the send to finished")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cuda")
    sys.exit(main())
