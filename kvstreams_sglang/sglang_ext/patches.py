"""The hooks SGLang 0.5.17 has no extension point for, installed in the scheduler process.

``install(server_args)`` is idempotent and touches only what the flags need:

- kv-streams: the ``kvstreams`` radix cache backend (``stream_cache.KVStreamRadixCache``) is
  registered; ``ForwardBatch.init_new`` adds each request's position offset
  (``stream_cache.OFFSET_ATTR``) to ``positions`` (and, under kv4rl, puts each stream's saved INT8
  side row under the row its turn runs in); ``Scheduler.handle_generate_request`` refuses, with a
  400 and the reason, token ids outside the vocabulary (any request) and a stream turn that would
  not fit (``sessions.turn_refusal``), before SGLang touches the session, applies the eviction a turn
  carries (``sessions.pop_turn_eviction``) in the step that admits it, and pins a stream's turns
  to its radix namespace; ``Scheduler.abort_request`` frees a stream whose turn it drops from the
  waiting queue (SGLang would leave the session busy for good); ``PrefillAdder.add_one_req`` holds
  a stream's first turn back while a sibling that computes the same shared prefix runs (in this
  batch, or in one whose result is not processed yet: overlap scheduling), so the prefix is computed
  once; the scheduler gets ``kvstreams_*`` RPC methods (open, evict, session info, pool info) whose
  arguments and results travel as JSON (``RPC_ARGS``: SGLang's RPC parameters are flat scalars); the
  warning SGLang logs on every streaming-session turn that asks for logprobs is filtered out.
  (Turn batching is SGLang's own ``--enable-prefill-delayer``: KV streams keep overlap scheduling.)
- kv4rl: the ``kv4rl`` attention backend is registered; ``KVCacheConfigurator`` builds
  ``KV4TokenToKVPool`` where it would build ``MHATokenToKVPool``; capacity profiling uses the
  KV4 bytes per token (``DefaultPoolConfigurator``'s cell size) and sets the INT8 side cache
  aside (out of the profiled bytes); SGLang's ``support_triton`` name check answers False for
  ``kv4rl`` off CUDA (its Triton helpers cannot run there).
- hf-numerics: ``ModelRunner.load_model`` switches the loaded model to HF's numerics (``hf_numerics``).
"""

from __future__ import annotations

import json
import logging
import time
from array import array

import torch

RPC_ARGS = "kvstreams_json"  # the one parameter of a kvstreams RPC: its keyword arguments as JSON
_installed: set[str] = set()


def install(server_args) -> None:
    if getattr(server_args, "enable_kv_streams", False) and "streams" not in _installed:
        _install_stream_cache()
        _install_positions()
        _install_turn_guard()
        _install_abort_hook()
        _install_sibling_deferral()
        _install_rpc()
        _quiet_session_logprob_warning()
        _installed.add("streams")
    if getattr(server_args, "kv4rl", False) and "kv4rl" not in _installed:
        _install_kv4rl()
        _installed.add("kv4rl")
    if getattr(server_args, "hf_numerics", False) and "hf_numerics" not in _installed:
        _install_hf_numerics()
        _installed.add("hf_numerics")
    if getattr(server_args, "kv4rl_batch_invariant", False) and "batch_invariant" not in _installed:
        _install_batch_invariant()
        _installed.add("batch_invariant")


def _install_batch_invariant() -> None:
    """``--kv4rl-batch-invariant``: from the model's load on, the model runner's process sends its bf16 ``mm`` /
    ``addmm`` and fp32 row means through ``kernels.batch_invariant`` (registered for the runner's device, for the
    process's life: CUDA graphs captured after the load record those kernels). The attention backend reads the flag
    for its own plans."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    from ..kernels.batch_invariant import batch_invariant

    original = ModelRunner.load_model

    def load_model(self, *args, **kwargs):
        if not getattr(self, "_kvstreams_invariant", None):
            self._kvstreams_invariant = batch_invariant(device_type=torch.device(self.device).type.upper())
            self._kvstreams_invariant.__enter__()  # held as long as the runner: never released
            logging.getLogger(__name__).info("--kv4rl-batch-invariant: batch-invariant matmuls and row means")
        return original(self, *args, **kwargs)

    ModelRunner.load_model = load_model


def _install_hf_numerics() -> None:
    """Once the model has loaded, its modules compute with HF's numerics (``hf_numerics``); weight updates load
    into the same modules."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    from . import hf_numerics

    original = ModelRunner.load_model

    def load_model(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        counts = hf_numerics.apply(self.model, self.model_config.hf_config,
                                   hf_numerics.parse_parts(self.server_args.hf_numerics_parts),
                                   fused_norms=not getattr(self.server_args, "kv4rl_batch_invariant", False))
        logging.getLogger(__name__).info("--hf-numerics: %s", counts)
        return out

    ModelRunner.load_model = load_model


def _install_stream_cache() -> None:
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    from .stream_cache import BACKEND_NAME, make_stream_cache

    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, make_stream_cache)


def _install_positions() -> None:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from .host_copy import host_to_device
    from .stream_cache import OFFSET_ATTR, KVStreamRadixCache

    original = ForwardBatch.init_new.__func__

    def init_new(cls, batch, model_runner, *args, **kwargs):
        cache = getattr(batch, "tree_cache", None)
        if isinstance(cache, KVStreamRadixCache) and batch.forward_mode.is_extend():
            cache.load_side_rows(batch.reqs)
        ret = original(cls, batch, model_runner, *args, **kwargs)
        if ret.positions is None or ret.forward_mode.is_idle():
            return ret
        offsets = [getattr(r, OFFSET_ATTR, 0) for r in batch.reqs]
        if any(offsets):
            if not ret.forward_mode.is_decode():  # one offset per new token, laid out on the host
                offsets = [o for o, n in zip(offsets, ret.extend_seq_lens_cpu, strict=True) for _ in range(n)]
            ret.positions = ret.positions + host_to_device(offsets, ret.positions.dtype, ret.positions.device)
        return ret

    ForwardBatch.init_new = classmethod(init_new)


class _SessionLogprobDefault(logging.Filter):
    """SGLang's scheduler sets ``logprob_start_len`` to the input's length for every ``return_logprob`` request
    (logprobs of the new tokens: what a stream turn asks for), then, for a streaming session, warns that the
    value it set is ignored and returns the new tokens' logprobs. On a KV-streams server that is every turn: a
    line per turn (~36k in a 100 s learning run, 11 MB of log) burying the warnings that mean something."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("logprob_start_len=%d is not supported for streaming sessions")


def _quiet_session_logprob_warning() -> None:
    logging.getLogger("sglang.srt.managers.schedule_batch").addFilter(_SessionLogprobDefault())


def _install_turn_guard() -> None:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler

    from trainer_masks import EvictionError

    from .sessions import eviction_spans, ids_refusal, pop_turn_eviction, turn_refusal
    from .stream_cache import KVStreamRadixCache

    original = Scheduler.handle_generate_request

    def refuse(self, recv_req, reason: str) -> None:
        # as SGLang answers a turn for a session that does not exist: a one-token request that finishes at once
        req = Req(recv_req.rid, recv_req.input_text, array("q", [0]), recv_req.sampling_params,
                  vocab_size=self.model_config.vocab_size, http_worker_ipc=recv_req.http_worker_ipc)
        req.tokenizer = self.tokenizer
        req.set_finish_with_abort(reason)
        self.init_req_max_new_tokens(req)
        self._add_request_to_queue(req)

    def handle_generate_request(self, recv_req):
        cache = self.tree_cache
        if not isinstance(cache, KVStreamRadixCache):
            return handle(self, recv_req)
        t0 = time.perf_counter()
        try:  # SGLang's request creation included, and the turn's evict_spans and begin_turn (timed on their own)
            return handle(self, recv_req)
        finally:
            cache.host_clock.add("handle_generate_request", time.perf_counter() - t0)

    def handle(self, recv_req):
        reason = ids_refusal(recv_req.input_ids, self.model_config.vocab_size)
        cache = self.tree_cache
        evict = pop_turn_eviction(recv_req)
        idle_stream = False
        if reason is None and recv_req.session_params is not None and isinstance(cache, KVStreamRadixCache):
            session = self.session_controller.get(recv_req.session_params.id)
            idle_stream = (session is not None and session.streaming and not session.close_on_finish
                           and not session._inflight)
        if reason is None and evict is not None and not idle_stream:
            reason = ("kvstreams: custom_params.kvstreams_evict rides only with a turn of an idle KV stream "
                      "(session_params.id of a /kvstreams/open stream); nothing was changed")
        if reason is None and evict is not None:
            try:  # the turn's eviction first, in place, in the step that admits the turn
                cache.evict_spans(session, eviction_spans(evict))
            except (EvictionError, ValueError, TypeError) as e:
                reason = (f"kvstreams: the turn's eviction was refused ({e}); the stream is unchanged, the turn "
                          "did not run")
        if reason is None and idle_stream:
            state = cache.begin_turn(session, recv_req)
            recv_req.extra_key = state.extra_key
            reason = turn_refusal(session, state, recv_req, max_req_len=self.max_req_len,
                                  max_req_input_len=self.max_req_input_len, context_len=self.model_config.context_len)
            if reason is not None and evict is not None:
                reason += " (the eviction it carried was applied)"
        if reason is not None:
            return refuse(self, recv_req, reason)
        return original(self, recv_req)

    Scheduler.handle_generate_request = handle_generate_request


def _install_abort_hook() -> None:
    from sglang.srt.managers.scheduler import Scheduler

    from .stream_cache import KVStreamRadixCache

    original = Scheduler.abort_request

    def abort_request(self, recv_req):
        cache = self.tree_cache
        queued = [r for r in self.waiting_queue if isinstance(cache, KVStreamRadixCache) and cache.stream_of(r)]
        original(self, recv_req)
        waiting = set(map(id, self.waiting_queue))
        for req in queued:
            if id(req) not in waiting:  # dropped before it ran: SGLang never tells the session, which would stay busy
                req.session.abort_req()
                req.session = None

    Scheduler.abort_request = abort_request


def _install_sibling_deferral() -> None:
    from sglang.srt.managers import schedule_policy

    from .stream_cache import KVStreamRadixCache

    Adder = schedule_policy.PrefillAdder
    original = Adder.add_one_req

    def add_one_req(self, req, *args, **kwargs):
        cache = self.tree_cache
        if not isinstance(cache, KVStreamRadixCache):
            return original(self, req, *args, **kwargs)
        prompt = cache.unshared_prompt(req)
        if prompt is not None and cache.prompt_in_flight(prompt, req):
            return schedule_policy.AddReqResult.OTHER  # a later round: the sibling's prefix is in the tree then
        result = original(self, req, *args, **kwargs)
        if prompt is not None and req in self.can_run_list:
            cache.prompts_in_flight[prompt] = req  # this turn computes the prefix
        return result

    Adder.add_one_req = add_one_req


def _install_rpc() -> None:
    from sglang.srt.managers import scheduler as scheduler_module
    from sglang.srt.managers.io_struct import RpcReqOutput

    from trainer_masks import EvictionError

    Scheduler = scheduler_module.Scheduler

    def stream_session(self, session_id: str):
        session = self.session_controller.get(session_id)
        if session is None:
            raise EvictionError(f"session {session_id!r} is not open")
        if not session.streaming:
            raise EvictionError(f"session {session_id!r} is not a streaming session (open it with /kvstreams/open)")
        return session

    def kvstreams_open(self, session_id: str, shared_prefix_len: int | None = None, extra_key: str | None = None):
        stream_session(self, session_id)
        state = self.tree_cache.open_stream(session_id, shared_prefix_len, extra_key)
        return dict(session_id=session_id, shared_prefix_len=state.shared_prefix_len, extra_key=state.extra_key)

    def kvstreams_evict(self, session_id: str, spans):
        session = stream_session(self, session_id)
        evicted = self.tree_cache.evict_spans(session, spans)
        return self.tree_cache.info(session) | dict(evicted=evicted)

    def kvstreams_session_info(self, session_id: str):
        return self.tree_cache.info(stream_session(self, session_id))

    def kvstreams_pool_info(self):
        """Free/total token slots, the tree's evictable and locked tokens, what open streams hold and the stream
        counters, the pool class, its bytes, the per-token size capacity was computed with, and the dtype the model
        computes in (``--dtype auto`` runs an fp32 checkpoint in fp16)."""
        from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator

        allocator = self.token_to_kv_pool_allocator
        runner = self.tp_worker.model_runner
        cache = self.tree_cache
        kv_bytes = allocator.get_kvcache().get_kv_size_bytes()
        configurator = create_memory_pool_configurator(runner.kv_cache_configurator)
        return dict(available_tokens=int(allocator.available_size()), total_tokens=int(allocator.size),
                    evictable_tokens=int(cache.evictable_size()), protected_tokens=int(cache.protected_size()),
                    open_streams=len(cache.streams), stream_tokens=cache.stream_tokens(), **cache.counters,
                    pool=type(allocator.get_kvcache()).__name__, open_sessions=len(self.session_controller.sessions),
                    kv_bytes=int(sum(kv_bytes) if isinstance(kv_bytes, tuple) else kv_bytes),
                    cell_bytes=int(configurator._cell_size),
                    max_running_requests=int(runner.req_to_token_pool.size),
                    model_dtype=str(runner.dtype).removeprefix("torch."))

    def kvstreams_host_clock(self):
        """The scheduler's host time so far in the stream cache's hooks, the turn request hook and (kv4rl) the
        backend's step planning (``backend.*``): ``{hook: {"calls", "seconds"}}`` (``host_clock``)."""
        out = {}
        for prefix, owner in (("", self.tree_cache), ("backend.", self.tp_worker.model_runner.attn_backend)):
            clock = getattr(owner, "host_clock", None)  # (--kv4rl without streams: no stream cache)
            if clock is not None:
                out.update({prefix + name: v for name, v in clock.report().items()})
        return out

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

    Scheduler.kvstreams_open = kvstreams_open
    Scheduler.kvstreams_evict = kvstreams_evict
    Scheduler.kvstreams_session_info = kvstreams_session_info
    Scheduler.kvstreams_pool_info = kvstreams_pool_info
    Scheduler.kvstreams_host_clock = kvstreams_host_clock
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
        # one INT8 row per req_to_token row: the requests' and the reserved row 0 (padded CUDA-graph rows)
        rows = self.server_args.max_running_requests
        side = KV4TokenToKVPool.side_bytes(rows + 1, *shape(self, self.layer_info.num_effective_layers), sink=sink,
                                           recent=recent)
        share = side / available if available > 0 else 1.0
        # every request row holds its INT8 side row, whether or not the KV could hold that many requests
        (logging.getLogger(__name__).warning if share > 0.2 else logging.getLogger(__name__).info)(
            "kv4rl: the INT8 side cache (a row of %d sink + recent positions per request row, --max-running-requests "
            "%d) takes %.2f GiB, %.0f%% of the KV memory", sink + recent, rows, side / 2**30, 100 * share)
        return max(0, available - side)

    original_build = Configurator._build_token_to_kv_pool

    def _build_token_to_kv_pool(self, *, req_to_token_pool, **kwargs):
        sink, recent = kv4_settings(self)

        def make_pool(*args, post_capture_active=False, **pool_kwargs):
            if post_capture_active:
                raise RuntimeError("--kv4rl: post-capture KV sizing (SGLANG_ENABLE_POST_CAPTURE_KV_SIZING) is not "
                                   "supported")
            return KV4TokenToKVPool(*args, sink=sink, recent=recent, num_rows=req_to_token_pool.req_to_token.shape[0],
                                    forward_stream=self.forward_stream, **pool_kwargs)

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
