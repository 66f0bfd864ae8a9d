"""One vLLM 0.33 instance (prefill or decode) in this process, for the
connector tests: vLLM's own ``VllmConfig`` (a local tiny DeepSeek-V2 MLA
config.json, no weights, no tokenizer), its parallel state on gloo, its
``Scheduler`` (which builds the scheduler-side ``PdxferConnector`` through
``KVConnectorFactory``) and a worker-side connector from the same factory.

What is not vLLM's: the model runner. :class:`Runner` calls the worker
connector in vLLM 0.33's model-runner order (``bind_connector_metadata``,
``start_load_kv``, per layer ``wait_for_layer_load`` / the layer /
``save_kv_layer``, ``wait_for_save``, ``get_transfer_results``,
``get_block_ids_with_load_errors``, ``clear_connector_metadata``) and, in place of
attention, writes each computed token's KV row (a deterministic function of the
token ids up to it, the layer and the position) into the block vLLM's block
table gives it. The KV caches are CPU bf16 tensors shaped as vLLM's CPU_MLA
backend lays them out: ``[num_blocks, 1, block_size, 576]`` per layer.

Driven over a pipe by the test (which plays the PD proxy): commands
``add`` (a request), ``run`` (step until idle), ``check`` (leaks), ``stop``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from typing import Any, Dict, List

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.path.join(HERE, "model")
ROW = 576  # kv_lora_rank 512 + qk_rope_head_dim 64


def kv_rows(token_ids: List[int], start: int, stop: int, layer: int):
    """The KV rows of positions ``start..stop`` (int16 view of bf16) for a request
    whose tokens are ``token_ids``: a function of the tokens up to each
    position, the layer and the position."""
    import torch

    h, hs = 1469598103, []
    for t, tok in enumerate(token_ids[:stop]):
        h = (h * 1000003 + int(tok) + 1) % (1 << 61)
        if t >= start:
            hs.append(h)
    hv = torch.tensor(hs, dtype=torch.int64)[:, None]
    k = torch.arange(1, ROW + 1, dtype=torch.int64)[None, :]
    pos = torch.arange(start, stop, dtype=torch.int64)[:, None]
    v = (hv * (2 * k + 1) + layer * 7919 + pos * 31) % 65536
    return (v - (v >= 32768).to(torch.int64) * 65536).to(torch.int16)


def build_config(role: str, opts: Dict[str, Any]):
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig)

    bs, nb = opts["block_size"], opts["num_blocks"]
    batch_tokens = opts.get("batch_tokens", 40)
    mc = ModelConfig(model=MODEL, skip_tokenizer_init=True, dtype=opts.get("dtype", "bfloat16"), seed=0,
                     max_model_len=opts.get("max_model_len", 2048))
    kt = KVTransferConfig(kv_connector="PdxferConnector",
                          kv_connector_module_path=opts.get("module_path", "pdxfer.vllm"),
                          kv_role=role, engine_id=opts["engine_id"],
                          kv_connector_extra_config=opts["extra"],
                          kv_load_failure_policy=opts.get("failure_policy", "fail"))
    vc = VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=bs, cache_dtype=opts.get("cache_dtype", "auto"),
                                 enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=batch_tokens,
                                         max_model_len=mc.max_model_len, enable_chunked_prefill=True,
                                         is_encoder_decoder=False,
                                         disable_hybrid_kv_cache_manager=opts.get("disable_hma")),
        parallel_config=ParallelConfig(tensor_parallel_size=opts.get("tp", 1),
                                       decode_context_parallel_size=opts.get("dcp", 1),
                                       cp_kv_cache_interleave_size=opts.get("interleave", 1)),
        kv_transfer_config=kt, device_config=DeviceConfig("cpu"))
    # On a CPU without AMX, vLLM's CPU platform gives MLA its reference CPU_MLA
    # kernel and turns chunked prefill and prefix caching off (that kernel cannot
    # continue a prefill), and forces block size 16. These tests run no attention
    # kernel, only vLLM's scheduler and the connector, so they keep the settings
    # they asked for, as a GPU deployment has them, whatever this CPU is.
    vc.cache_config.block_size = bs
    vc.cache_config.enable_prefix_caching = True
    vc.scheduler_config.enable_chunked_prefill = True
    vc.scheduler_config.max_num_batched_tokens = batch_tokens
    vc.cache_config.num_gpu_blocks = nb
    return vc


def kv_cache_config(vc, opts: Dict[str, Any]):
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, MLAAttentionSpec

    bs, nb = opts["block_size"], opts["num_blocks"]
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(vc.model_config.get_num_layers(vc.parallel_config))]
    spec = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=ROW,
                            dtype=getattr(torch, opts.get("dtype", "bfloat16")),
                            cache_dtype_str=opts.get("cache_dtype", "auto"))
    kcc = KVCacheConfig(num_blocks=nb,
                        kv_cache_tensors=[KVCacheTensor(size=nb * spec.page_size_bytes, layers=[n],
                                                        layer_stride=0, block_stride=spec.page_size_bytes)
                                          for n in layers],
                        kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    return kcc, layers


#: What a block-outermost cache's padding page holds (vLLM's allocation is
#: zeroed; a distinct byte shows a write that strayed there).
PAD_BYTE = 0x5A


def block_outermost_caches(kcc, layers: List[str], layout: str):
    """vLLM's own per-layer views (``create_kv_cache_views``) of one int8
    allocation in block-outermost ``layout`` (``BLNHC``): each block row holds
    every layer's page then one padding page, so a layer's blocks are
    ``(len(layers) + 1)`` pages apart. Returns the views by layer name, the
    allocation, and the padding pages as a view of it."""
    import torch
    from vllm.v1.kv_cache_interface import KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = kcc.kv_cache_groups[0].kv_cache_spec
    page, nb, n = spec.page_size_bytes, kcc.num_blocks, len(layers)
    tensor = KVCacheTensor(size=nb * (n + 1) * page, layers=layers, layer_stride=page,
                           block_stride=(n + 1) * page)
    raw = torch.full((tensor.size,), PAD_BYTE, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, nb, KVCacheLayout[layout], tensor)
    for v in views:
        v.zero_()
    kcc.kv_cache_tensors = [tensor]
    return dict(zip(layers, views)), raw, raw.view(nb, n + 1, page)[:, n]


class RankWorker:
    """One worker rank: vLLM's parallel state on gloo, the worker-side
    connector from vLLM's factory, this rank's KV caches, the stand-in forward."""

    def __init__(self, role: str, opts: Dict[str, Any], rank: int):
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed import parallel_state as ps
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        self.role, self.opts, self.rank = role, opts, rank
        self.vc = build_config(role, opts)
        self.kcc, self.layers = kv_cache_config(self.vc, opts)
        tp = opts.get("tp", 1)
        with set_current_vllm_config(self.vc):
            ps.init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                            distributed_init_method=f"tcp://127.0.0.1:{opts['dist_port']}")
            ps.initialize_model_parallel(tp, 1, decode_context_model_parallel_size=opts.get("dcp", 1),
                                         backend="gloo")
            self.dcp = ps.get_dcp_group().world_size
            self.dcp_rank = ps.get_dcp_group().rank_in_group
            self.worker = KVConnectorFactory.create_connector(self.vc, KVConnectorRole.WORKER, self.kcc)
        bs, nb = opts["block_size"], opts["num_blocks"]
        dtype = getattr(torch, opts.get("dtype", "bfloat16"))
        self.pad = None
        if opts.get("kv_layout"):
            self.caches, self.raw, self.pad = block_outermost_caches(self.kcc, self.layers, opts["kv_layout"])
        else:
            self.caches = {n: torch.zeros(nb, 1, bs, ROW, dtype=dtype) for n in self.layers}
        self.worker.register_kv_caches(self.caches)
        self.bs = bs
        self.inter = opts.get("interleave", 1)

    def slots(self, blocks: List[int], start: int, stop: int):
        """(positions this rank owns in start..stop, their blocks, their offsets): vLLM's
        slot mapping under DCP (block_table.py)."""
        import torch

        P, W, I = self.bs, self.dcp, self.inter
        t = torch.arange(start, stop, dtype=torch.int64)
        off = t % (P * W)
        own = ((off // I) % W) == self.dcp_rank
        t = t[own]
        off = off[own]
        local = (off // (W * I)) * I + off % I
        bl = torch.tensor(blocks, dtype=torch.int64)[t // (P * W)] if len(t) else t
        return t, bl, local

    def step(self, pl: Dict[str, Any]) -> Dict[str, Any]:
        import torch

        w = self.worker
        meta = pl["meta"]
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        checks = {rid: self.verify(pl["tokens"][rid], pl["blocks"][rid], 0, n) for rid, n in pl["verify"].items()}
        for li, name in enumerate(self.layers):
            w.wait_for_layer_load(name)
            for rid, start, n in pl["reqs"]:
                t, bl, local = self.slots(pl["blocks"][rid], start, start + n)
                if len(t):
                    rows = kv_rows(pl["tokens"][rid], start, start + n, li)[t - start]
                    self.caches[name].view(torch.int16)[bl, 0, local, :] = rows
            w.save_kv_layer(name, self.caches[name], None)
        w.wait_for_save()
        res = w.get_transfer_results(pl["finished"])
        invalid = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        return {"sending": set(res.finished_sending), "recving": set(res.finished_recving),
                "failed": set(res.failed_recving), "invalid": set(invalid), "checks": checks}

    def verify(self, toks: List[int], blocks: List[int], start: int, stop: int) -> Dict[str, int]:
        """Every byte of the positions this rank owns in ``start..stop``."""
        import torch

        bad, nbytes = 0, 0
        t, bl, local = self.slots(blocks, start, stop)
        for li, name in enumerate(self.layers):
            got = self.caches[name].view(torch.int16)[bl, 0, local, :]
            want = kv_rows(toks, start, stop, li)[t - start]
            bad += int((got != want).any(dim=1).sum())
            nbytes += got.numel() * 2
        out = {"bad_rows": bad, "bytes": nbytes, "tokens": int(len(t))}
        if self.pad is not None:
            out["pad_bytes_changed"] = int((self.pad != PAD_BYTE).sum())
        return out

    def rooms(self) -> int:
        return len(self.worker._worker.sends) + len(self.worker._worker.recvs)


class Runner:
    """Rank 0: vLLM's Scheduler (its scheduler-side connector), its own worker,
    and the other ranks over pipes; their outputs go through vLLM's
    KVOutputAggregator as the multiprocess executor's do."""

    def __init__(self, role: str, opts: Dict[str, Any], conn, followers):
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.role, self.opts, self.conn, self.followers = role, opts, conn, followers
        self.w0 = RankWorker(role, opts, 0)
        self.vc = self.w0.vc
        with set_current_vllm_config(self.vc):
            self.sched = Scheduler(vllm_config=self.vc, kv_cache_config=self.w0.kcc,
                                   structured_output_manager=StructuredOutputManager(self.vc),
                                   block_size=opts["block_size"] * self.w0.dcp, log_stats=False)
        self.agg = KVOutputAggregator(opts.get("tp", 1))
        self.blocks: Dict[str, List[int]] = {}
        self.tokens: Dict[str, List[int]] = {}
        self.loaded: set = set()
        self.prefix: Dict[str, int] = {}
        self.log: List[str] = []
        h = logging.Handler()
        h.emit = lambda rec: self.log.append(rec.getMessage())  # type: ignore[method-assign]
        logging.getLogger("pdxfer").addHandler(h)
        self.bs = opts["block_size"]
        self.steps = 0

    def add(self, spec: Dict[str, Any]) -> None:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        if not getattr(Runner, "_hash_init", False):
            init_none_hash(sha256)
            Runner._hash_init = True
        sp = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True)
        sp.update_from_generation_config({}, 1)
        r = Request(request_id=spec["id"], prompt_token_ids=list(spec["prompt"]), sampling_params=sp,
                    pooling_params=None, mm_features=None,
                    block_hasher=get_request_block_hasher(self.bs * self.w0.dcp, sha256))
        r.kv_transfer_params = spec.get("params")
        self.tokens[r.request_id] = list(spec["prompt"])
        self.sched.add_request(r)

    def abort(self, rid: str) -> None:
        from vllm.v1.request import RequestStatus

        self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)

    def busy(self) -> bool:
        return self.sched.has_requests() or self.sched.connector.has_pending_push_work()

    def step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.sched.schedule()
        self.steps += 1
        meta = so.kv_connector_metadata
        for rid in so.finished_req_ids:
            self.blocks.pop(rid, None)
        reqs = []
        for nr in so.scheduled_new_reqs:
            self.blocks[nr.req_id] = list(nr.block_ids[0])
            reqs.append((nr.req_id, nr.num_computed_tokens, so.num_scheduled_tokens[nr.req_id]))
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            nb = cr.new_block_ids[i]
            if rid in cr.resumed_req_ids:
                self.blocks[rid] = list(nb[0]) if nb else []
            elif nb:
                self.blocks[rid].extend(nb[0])
            reqs.append((rid, cr.num_computed_tokens[i], so.num_scheduled_tokens[rid]))
        verify = {}
        if self.role == "kv_consumer":
            for rid, _, _ in reqs:
                if rid not in self.loaded:
                    self.loaded.add(rid)
                    verify[rid] = len(self.tokens[rid])
        if self.role == "kv_producer":
            for nr in so.scheduled_new_reqs:
                self.conn.send(("scheduled", nr.req_id, nr.num_computed_tokens))
        for rid, rr in getattr(meta, "recvs", {}).items():
            self.prefix[rid] = rr.prefix_len
        ids = [rid for rid, _, _ in reqs]
        pl = {"meta": meta, "reqs": reqs, "finished": set(so.finished_req_ids), "verify": verify,
              "blocks": {r: self.blocks[r] for r in ids}, "tokens": {r: self.tokens[r] for r in ids}}
        for f in self.followers:
            f.send(("step", pl))
        results = [self.w0.step(pl)] + [f.recv()[1] for f in self.followers]
        for rid in verify:
            c = {"bad_rows": 0, "bytes": 0, "tokens": 0}
            for res in results:
                for k, v in res["checks"][rid].items():
                    c[k] = c.get(k, 0) + v
            c["decode_prefix_len"] = self.prefix.get(rid)
            c["ranks"] = len(results)
            self.conn.send(("loaded", rid, c))
        sampled = []
        for rid, start, n in reqs:
            done = start + n >= self.sched.requests[rid].num_tokens
            tok = 7 + len(self.tokens[rid]) if done else None
            sampled.append([tok] if done else [])
            if done:
                self.tokens[rid].append(tok)
        outs = []
        for res in results:
            kvo = KVConnectorOutput(finished_sending=res["sending"] or None, finished_recving=res["recving"] or None,
                                    invalid_block_ids=res["invalid"], failed_recving=res["failed"])
            outs.append(ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                          sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                          pooler_output=None, kv_connector_output=kvo))
        mro = self.agg.aggregate(outs, 0)
        kvo = mro.kv_connector_output
        out = self.sched.update_from_output(so, mro)
        for eco in out.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.conn.send(("finished", o.request_id, str(o.finish_reason), o.kv_transfer_params))
        if kvo is not None and kvo.failed_recving:
            self.conn.send(("failed_recving", sorted(kvo.failed_recving), sorted(kvo.invalid_block_ids)))
        if kvo is not None and kvo.finished_sending:
            self.conn.send(("finished_sending", sorted(kvo.finished_sending)))

    def leaks(self) -> Dict[str, Any]:
        s = self.sched
        bp = s.kv_cache_manager.block_pool
        rooms = self.w0.rooms()
        for f in self.followers:
            f.send(("rooms",))
            rooms += f.recv()[1]
        return {
            "requests": len(s.requests), "waiting": len(s.waiting), "running": len(s.running),
            "free_blocks": bp.free_block_queue.num_free_blocks, "num_blocks": bp.num_gpu_blocks,
            "ref_nonzero": sum(1 for b in bp.blocks if b.ref_cnt != 0),
            "req_to_blocks": len(s.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks),
            "pending_push": s.connector.has_pending_push_work(),
            "worker_rooms": rooms,
        }

    def stop(self) -> None:
        for f in self.followers:
            f.send(("stop",))
            f.recv()
        self.w0.worker.shutdown()


def follower(role: str, opts: Dict[str, Any], rank: int, conn) -> None:
    """Rank ``rank`` > 0 of an instance: steps when rank 0 says so."""
    try:
        w = RankWorker(role, opts, rank)
        conn.send(("ready", rank))
        while True:
            cmd = conn.recv()
            if cmd[0] == "step":
                conn.send(("done", w.step(cmd[1])))
            elif cmd[0] == "rooms":
                conn.send(("rooms", w.rooms()))
            elif cmd[0] == "stop":
                w.worker.shutdown()
                conn.send(("stopped", rank))
                return
    except Exception:  # noqa: BLE001 - rank 0 reads it
        conn.send(("error", traceback.format_exc()))
        raise


def main(role: str, opts: Dict[str, Any], conn, followers=()) -> None:
    try:
        r = Runner(role, opts, conn, list(followers))
        for f in followers:
            ev = f.recv()
            if ev[0] != "ready":
                raise RuntimeError(f"rank failed to start:\n{ev[1]}")
        conn.send(("ready", role))
        while True:
            idle_deadline = None
            while r.busy() or conn.poll():
                while conn.poll():
                    cmd = conn.recv()
                    if cmd[0] == "add":
                        r.add(cmd[1])
                    elif cmd[0] == "abort":
                        r.abort(cmd[1])
                    elif cmd[0] == "sends":
                        ws = r.w0.worker._worker
                        conn.send(("sends", {"chunks": dict(ws.chunks_sent), "layers": dict(ws.layer_sends)}))
                    elif cmd[0] == "logs":
                        conn.send(("logs", list(r.log)))
                    elif cmd[0] == "check":
                        conn.send(("leaks", r.leaks()))
                    elif cmd[0] == "stop":
                        r.stop()
                        conn.send(("stopped", r.steps))
                        return
                if r.busy():
                    r.step()
                    time.sleep(0.002)
                del idle_deadline
                idle_deadline = None
            conn.poll(0.05)
    except Exception:  # noqa: BLE001 - the test reads it
        conn.send(("error", traceback.format_exc()))
        raise
    finally:
        sys.stdout.flush()
