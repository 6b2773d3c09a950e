"""The hooks SGLang 0.5.10 has no extension point for, installed in the scheduler process.

``install(server_args)`` is idempotent and touches only what the flags need:

- kv-streams: ``ForwardBatch.init_new`` adds each request's session position offset
  (``sessions.position_offset``) to ``positions``; the scheduler gets ``kvstreams_*``
  RPC methods (evict, session info, pool info) whose results travel back as JSON.
- kv4rl: the ``kv4rl`` attention backend is registered; ``_init_pools`` builds
  ``KV4TokenToKVPool`` where it would build ``MHATokenToKVPool``; capacity profiling uses the
  KV4 bytes per token and sets the INT8 side cache aside; SGLang's ``support_triton`` name
  check answers False for ``kv4rl`` off CUDA (its Triton helpers cannot run there).
"""

from __future__ import annotations

import json
import math

import torch

_installed: set[str] = set()


def install(server_args) -> None:
    if getattr(server_args, "enable_kv_streams", False) and "streams" not in _installed:
        _install_positions()
        _install_rpc()
        _installed.add("streams")
    if getattr(server_args, "kv4rl", False) and "kv4rl" not in _installed:
        _install_kv4rl()
        _installed.add("kv4rl")


def _install_positions() -> None:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from .sessions import position_offset

    original = ForwardBatch.init_new.__func__

    def init_new(cls, batch, model_runner):
        ret = original(cls, batch, model_runner)
        if ret.positions is None or ret.forward_mode.is_idle():
            return ret
        offsets = [position_offset(r) for r in batch.reqs]
        if any(offsets):
            off = torch.tensor(offsets, dtype=ret.positions.dtype, device=ret.positions.device)
            if not ret.forward_mode.is_decode():
                off = torch.repeat_interleave(off, ret.extend_seq_lens.to(off.device).long())
            ret.positions = ret.positions + off
        return ret

    ForwardBatch.init_new = classmethod(init_new)


def _install_rpc() -> None:
    from sglang.srt.managers import scheduler as scheduler_module
    from sglang.srt.managers.io_struct import RpcReqOutput

    from .sessions import evict_session_spans, session_info

    Scheduler = scheduler_module.Scheduler

    def kvstreams_evict(self, session_id: str, spans):
        return evict_session_spans(self, session_id, spans)

    def kvstreams_session_info(self, session_id: str):
        return session_info(self, session_id)

    def kvstreams_pool_info(self):
        """Free/total token slots, the pool class, its bytes, and the per-token size capacity was computed with."""
        allocator = self.token_to_kv_pool_allocator
        runner = self.tp_worker.model_runner
        kv_bytes = allocator.get_kvcache().get_kv_size_bytes()
        return dict(available_tokens=int(allocator.available_size()), total_tokens=int(allocator.size),
                    pool=type(allocator.get_kvcache()).__name__, open_sessions=len(self.session_controller.sessions),
                    kv_bytes=int(sum(kv_bytes) if isinstance(kv_bytes, tuple) else kv_bytes),
                    cell_bytes=int(runner.get_cell_size_per_token(runner.num_effective_layers)),
                    max_running_requests=int(runner.req_to_token_pool.size))

    original = Scheduler.handle_rpc_request

    def handle_rpc_request(self, recv_req):
        if not recv_req.method.startswith("kvstreams_"):
            return original(self, recv_req)
        try:
            result = getattr(self, recv_req.method)(**(recv_req.parameters or {}))
            out = RpcReqOutput(True, json.dumps(result))
        except Exception as e:  # the caller gets the reason; the scheduler keeps running
            out = RpcReqOutput(False, f"{type(e).__name__}: {e}")
        scheduler_module.barrier()
        return out

    Scheduler.kvstreams_evict = kvstreams_evict
    Scheduler.kvstreams_session_info = kvstreams_session_info
    Scheduler.kvstreams_pool_info = kvstreams_pool_info
    Scheduler.handle_rpc_request = handle_rpc_request


def _install_kv4rl() -> None:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache import common as mem_common
    from sglang.srt.model_executor import forward_batch_info
    from sglang.srt.model_executor import model_runner_kv_cache_mixin as mixin_module

    from .backend import BACKEND_NAME, KV4RLAttnBackend
    from .pool import KV4TokenToKVPool

    ATTENTION_BACKENDS[BACKEND_NAME] = KV4RLAttnBackend

    for module in (forward_batch_info, mem_common):
        original_support = module.support_triton

        def support_triton(backend, _original=original_support):
            if backend == BACKEND_NAME:
                return torch.cuda.is_available()
            return _original(backend)

        module.support_triton = support_triton

    Mixin = mixin_module.ModelRunnerKVCacheMixin

    def kv4_settings(runner):
        args = runner.server_args
        return args.kv4rl_sink, args.kv4rl_recent

    def shape(runner, num_layers):
        from sglang.srt.layers.dp_attention import get_attention_tp_size

        return num_layers, runner.model_config.get_num_kv_heads(get_attention_tp_size()), runner.model_config.head_dim

    def get_cell_size_per_token(self, num_layers):
        return KV4TokenToKVPool.cell_size_per_token(*shape(self, num_layers))

    original_profile = Mixin.profile_max_num_token

    def profile_max_num_token(self, pre_model_load_memory):
        tokens = original_profile(self, pre_model_load_memory)
        sink, recent = kv4_settings(self)
        layers = self.num_effective_layers
        side = KV4TokenToKVPool.side_bytes(self.server_args.max_running_requests, *shape(self, layers), sink=sink,
                                           recent=recent)
        return max(0, tokens - math.ceil(side / get_cell_size_per_token(self, layers)))

    original_init_pools = Mixin._init_pools

    def _init_pools(self):
        sink, recent = kv4_settings(self)

        def make_pool(*args, **kwargs):
            return KV4TokenToKVPool(*args, sink=sink, recent=recent, num_rows=self.req_to_token_pool.size, **kwargs)

        mha = mixin_module.MHATokenToKVPool
        mixin_module.MHATokenToKVPool = make_pool
        try:
            original_init_pools(self)
        finally:
            mixin_module.MHATokenToKVPool = mha
        if not isinstance(self.token_to_kv_pool, KV4TokenToKVPool):
            raise RuntimeError(f"--kv4rl: this model's KV pool is {type(self.token_to_kv_pool).__name__}, not the "
                               "MHA pool kv4rl replaces (MLA / hybrid / SWA models are not supported)")

    Mixin.get_cell_size_per_token = get_cell_size_per_token
    Mixin.profile_max_num_token = profile_max_num_token
    Mixin._init_pools = _init_pools
