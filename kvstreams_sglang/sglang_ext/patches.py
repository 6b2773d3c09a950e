"""The hooks SGLang 0.5.17 has no extension point for, installed in the scheduler process.

``install(server_args)`` is idempotent and touches only what the flags need:

- kv-streams: ``ForwardBatch.init_new`` adds each request's session position offset
  (``sessions.position_offset``) to ``positions``; the scheduler gets ``kvstreams_*``
  RPC methods (evict, session info, pool info) whose arguments and results travel as JSON
  (``RPC_ARGS``: SGLang's RPC parameters are flat scalars).
- kv4rl: the ``kv4rl`` attention backend is registered; ``KVCacheConfigurator`` builds
  ``KV4TokenToKVPool`` where it would build ``MHATokenToKVPool``; capacity profiling uses the
  KV4 bytes per token (``DefaultPoolConfigurator``'s cell size) and sets the INT8 side cache
  aside (out of the profiled bytes); SGLang's ``support_triton`` name check answers False for
  ``kv4rl`` off CUDA (its Triton helpers cannot run there).
"""

from __future__ import annotations

import json

import torch

RPC_ARGS = "kvstreams_json"  # the one parameter of a kvstreams RPC: its keyword arguments as JSON
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

    def init_new(cls, batch, model_runner, *args, **kwargs):
        ret = original(cls, batch, model_runner, *args, **kwargs)
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
        from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator

        allocator = self.token_to_kv_pool_allocator
        runner = self.tp_worker.model_runner
        kv_bytes = allocator.get_kvcache().get_kv_size_bytes()
        configurator = create_memory_pool_configurator(runner.kv_cache_configurator)
        return dict(available_tokens=int(allocator.available_size()), total_tokens=int(allocator.size),
                    pool=type(allocator.get_kvcache()).__name__, open_sessions=len(self.session_controller.sessions),
                    kv_bytes=int(sum(kv_bytes) if isinstance(kv_bytes, tuple) else kv_bytes),
                    cell_bytes=int(configurator._cell_size),
                    max_running_requests=int(runner.req_to_token_pool.size))

    original = Scheduler.handle_rpc_request

    def handle_rpc_request(self, recv_req):
        if not recv_req.method.startswith("kvstreams_"):
            return original(self, recv_req)
        try:
            result = getattr(self, recv_req.method)(**json.loads((recv_req.parameters or {})[RPC_ARGS]))
            out = RpcReqOutput(success=True, message=json.dumps(result))
        except Exception as e:  # the caller gets the reason; the scheduler keeps running
            out = RpcReqOutput(success=False, message=f"{type(e).__name__}: {e}")
        scheduler_module.barrier(group=self.tp_group.cpu_group)
        return out

    Scheduler.kvstreams_evict = kvstreams_evict
    Scheduler.kvstreams_session_info = kvstreams_session_info
    Scheduler.kvstreams_pool_info = kvstreams_pool_info
    Scheduler.handle_rpc_request = handle_rpc_request


def _install_kv4rl() -> None:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.layers.rotary_embedding import mrope
    from sglang.srt.mem_cache import allocation
    from sglang.srt.mem_cache import kv_cache_configurator as configurator_module
    from sglang.srt.model_executor import forward_batch_info
    from sglang.srt.model_executor import pool_configurator as pool_configurator_module

    from .backend import BACKEND_NAME, KV4RLAttnBackend
    from .pool import KV4TokenToKVPool

    ATTENTION_BACKENDS[BACKEND_NAME] = KV4RLAttnBackend

    for module in (forward_batch_info, allocation, mrope):
        original_support = module.support_triton

        def support_triton(backend, _original=original_support):
            if backend == BACKEND_NAME:
                return torch.cuda.is_available()
            return _original(backend)

        module.support_triton = support_triton

    Configurator = configurator_module.KVCacheConfigurator
    DefaultPoolConfigurator = pool_configurator_module.DefaultPoolConfigurator

    def kv4_settings(kvc):
        args = kvc.server_args
        return args.kv4rl_sink, args.kv4rl_recent

    def shape(kvc, num_layers):
        from sglang.srt.runtime_context import get_parallel

        return num_layers, kvc.model_config.get_num_kv_heads(get_parallel().attn_tp_size), kvc.model_config.head_dim

    def _compute_cell_size(self, kvc, num_layers):
        return KV4TokenToKVPool.cell_size_per_token(*shape(kvc, num_layers))

    original_profile = Configurator._profile_available_bytes

    def _profile_available_bytes(self, pre_model_load_memory):
        available = original_profile(self, pre_model_load_memory)
        sink, recent = kv4_settings(self)
        # one side row per req_to_token row: SGLang's rows are 1..max_running_requests (row 0 pads CUDA graphs)
        side = KV4TokenToKVPool.side_bytes(self.server_args.max_running_requests + 1,
                                           *shape(self, self.layer_info.num_effective_layers), sink=sink,
                                           recent=recent)
        return max(0, available - side)

    original_build = Configurator._build_token_to_kv_pool

    def _build_token_to_kv_pool(self, *, req_to_token_pool, **kwargs):
        sink, recent = kv4_settings(self)

        def make_pool(*args, post_capture_active=False, **pool_kwargs):
            if post_capture_active:
                raise RuntimeError("--kv4rl: post-capture KV sizing (SGLANG_ENABLE_POST_CAPTURE_KV_SIZING) is not "
                                   "supported")
            return KV4TokenToKVPool(*args, sink=sink, recent=recent, num_rows=req_to_token_pool.req_to_token.shape[0],
                                    **pool_kwargs)

        mha = configurator_module.MHATokenToKVPool
        configurator_module.MHATokenToKVPool = make_pool
        try:
            pool = original_build(self, req_to_token_pool=req_to_token_pool, **kwargs)
        finally:
            configurator_module.MHATokenToKVPool = mha
        if not isinstance(pool, KV4TokenToKVPool):
            raise RuntimeError(f"--kv4rl: this model's KV pool is {type(pool).__name__}, not the MHA pool kv4rl "
                               "replaces (MLA / hybrid / SWA models and page-major layouts are not supported)")
        return pool

    DefaultPoolConfigurator._compute_cell_size = _compute_cell_size
    Configurator._profile_available_bytes = _profile_available_bytes
    Configurator._build_token_to_kv_pool = _build_token_to_kv_pool
