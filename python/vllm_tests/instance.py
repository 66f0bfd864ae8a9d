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


def build(role: str, opts: Dict[str, Any]):
    import torch
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig, set_current_vllm_config)
    from vllm.distributed import parallel_state as ps
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor, MLAAttentionSpec
    from vllm.v1.structured_output import StructuredOutputManager

    bs, nb = opts["block_size"], opts["num_blocks"]
    dtype = getattr(torch, opts.get("dtype", "bfloat16"))
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
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=opts.get("batch_tokens", 40),
                                         max_model_len=mc.max_model_len, enable_chunked_prefill=True,
                                         is_encoder_decoder=False, disable_hybrid_kv_cache_manager=True),
        parallel_config=ParallelConfig(tensor_parallel_size=1),
        kv_transfer_config=kt, device_config=DeviceConfig("cpu"))
    vc.cache_config.num_gpu_blocks = nb
    with set_current_vllm_config(vc):
        if not ps.model_parallel_is_initialized():
            ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                            distributed_init_method=f"tcp://127.0.0.1:{opts['dist_port']}")
            ps.initialize_model_parallel(1, 1, backend="gloo")
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(mc.get_num_layers(vc.parallel_config))]
    spec = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=ROW, dtype=dtype,
                            cache_dtype_str=opts.get("cache_dtype", "auto"))
    kcc = KVCacheConfig(num_blocks=nb,
                        kv_cache_tensors=[KVCacheTensor(size=nb * spec.page_size_bytes, layers=[n],
                                                        layer_stride=0, block_stride=spec.page_size_bytes)
                                          for n in layers],
                        kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    sched = Scheduler(vllm_config=vc, kv_cache_config=kcc, structured_output_manager=StructuredOutputManager(vc),
                      block_size=bs, log_stats=False)
    worker = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kcc)
    caches = {n: torch.zeros(nb, 1, bs, ROW, dtype=dtype) for n in layers}
    worker.register_kv_caches(caches)
    return vc, sched, worker, caches, layers


class Runner:
    """The model runner's connector calls and a stand-in forward (see the module doc)."""

    def __init__(self, role: str, opts: Dict[str, Any], conn):
        self.role, self.opts, self.conn = role, opts, conn
        self.vc, self.sched, self.worker, self.caches, self.layers = build(role, opts)
        self.blocks: Dict[str, List[int]] = {}
        self.tokens: Dict[str, List[int]] = {}
        self.loaded: set = set()  # decode requests whose loaded KV was checked
        self.prefix: Dict[str, int] = {}  # decode: the local prefix hit the connector sent
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
                    block_hasher=get_request_block_hasher(self.bs, sha256))
        r.kv_transfer_params = spec.get("params")
        self.tokens[r.request_id] = list(spec["prompt"])
        self.sched.add_request(r)

    def abort(self, rid: str) -> None:
        from vllm.v1.request import RequestStatus

        self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)

    def busy(self) -> bool:
        return self.sched.has_requests() or self.sched.connector.has_pending_push_work()

    def step(self) -> None:
        import torch
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.sched.schedule()
        self.steps += 1
        meta = so.kv_connector_metadata
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        for rid in so.finished_req_ids:
            self.blocks.pop(rid, None)
        sched_reqs = []  # (rid, start, n)
        for nr in so.scheduled_new_reqs:
            self.blocks[nr.req_id] = list(nr.block_ids[0])
            sched_reqs.append((nr.req_id, nr.num_computed_tokens, so.num_scheduled_tokens[nr.req_id]))
        cr = so.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            nb = cr.new_block_ids[i]
            if rid in cr.resumed_req_ids:
                self.blocks[rid] = list(nb[0]) if nb else []
            elif nb:
                self.blocks[rid].extend(nb[0])
            sched_reqs.append((rid, cr.num_computed_tokens[i], so.num_scheduled_tokens[rid]))
        for rid, start, n in sched_reqs:
            if self.role == "kv_consumer" and rid not in self.loaded:
                self.loaded.add(rid)
                v = self.verify(rid, 0, len(self.tokens[rid]))
                v["decode_prefix_len"] = self.prefix.get(rid)
                self.conn.send(("loaded", rid, v))
        if self.role == "kv_producer":
            for nr in so.scheduled_new_reqs:
                self.conn.send(("scheduled", nr.req_id, nr.num_computed_tokens))
        for rid, rr in getattr(meta, "recvs", {}).items():
            self.prefix[rid] = rr.prefix_len
        for li, name in enumerate(self.layers):
            w.wait_for_layer_load(name)
            for rid, start, n in sched_reqs:
                toks = self.tokens[rid]
                rows = kv_rows(toks, start, start + n, li)
                pos = torch.arange(start, start + n)
                bl = torch.tensor(self.blocks[rid], dtype=torch.int64)[pos // self.bs]
                self.caches[name].view(torch.int16)[bl, 0, pos % self.bs, :] = rows
            w.save_kv_layer(name, self.caches[name], None)
        w.wait_for_save()
        res = w.get_transfer_results(so.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        ids = [rid for rid, _, _ in sched_reqs]
        sampled = []
        for rid, start, n in sched_reqs:
            req = self.sched.requests[rid]
            done = start + n >= req.num_tokens
            tok = 7 + len(self.tokens[rid]) if done else None
            sampled.append([tok] if done else [])
            if done:
                self.tokens[rid].append(tok)
        kvo = KVConnectorOutput(finished_sending=res.finished_sending or None,
                                finished_recving=res.finished_recving or None,
                                invalid_block_ids=invalid, failed_recving=res.failed_recving)
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                pooler_output=None, kv_connector_output=kvo)
        outs = self.sched.update_from_output(so, mro)
        for eco in outs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.conn.send(("finished", o.request_id, str(o.finish_reason), o.kv_transfer_params))
        if res.failed_recving:
            self.conn.send(("failed_recving", sorted(res.failed_recving), sorted(invalid)))
        if res.finished_sending:
            self.conn.send(("finished_sending", sorted(res.finished_sending)))

    def verify(self, rid: str, start: int, stop: int) -> Dict[str, Any]:
        """Every byte of positions ``start..stop`` of ``rid`` in its blocks."""
        import torch

        bad, nbytes = 0, 0
        toks = self.tokens[rid]
        pos = torch.arange(start, stop)
        bl = torch.tensor(self.blocks[rid], dtype=torch.int64)[pos // self.bs]
        for li, name in enumerate(self.layers):
            got = self.caches[name].view(torch.int16)[bl, 0, pos % self.bs, :]
            want = kv_rows(toks, start, stop, li)
            bad += int((got != want).any(dim=1).sum())
            nbytes += got.numel() * 2
        return {"bad_rows": bad, "bytes": nbytes, "tokens": stop - start}

    def leaks(self) -> Dict[str, Any]:
        s = self.sched
        bp = s.kv_cache_manager.block_pool
        return {
            "requests": len(s.requests), "waiting": len(s.waiting), "running": len(s.running),
            "free_blocks": bp.free_block_queue.num_free_blocks, "num_blocks": bp.num_gpu_blocks,
            "ref_nonzero": sum(1 for b in bp.blocks if b.ref_cnt != 0),
            "req_to_blocks": len(s.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks),
            "pending_push": s.connector.has_pending_push_work(),
            "worker_rooms": len(self.worker._worker.sends) + len(self.worker._worker.recvs),
        }


def main(role: str, opts: Dict[str, Any], conn) -> None:
    try:
        r = Runner(role, opts, conn)
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
                    elif cmd[0] == "logs":
                        conn.send(("logs", list(r.log)))
                    elif cmd[0] == "check":
                        conn.send(("leaks", r.leaks()))
                    elif cmd[0] == "stop":
                        r.worker.shutdown()
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
