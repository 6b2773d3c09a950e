"""The ``kv4rl`` attention backend: SGLang's ``AttentionBackend`` over ``KV4TokenToKVPool``.

``init_forward_metadata`` builds, once per step, what every layer reads (FlashInfer's plan
pattern): each request's row of ``req_to_token`` with the logical positions of its tokens,
split into the INT4 and INT8 region lists by the rule of ``kv4.regions``, and where the new
tokens' INT8 copies go. The layers then run ``kernels.attend.kv4_attention_step``, the same step
as the built-in engine: the Triton/CUDA kernels on CUDA, their torch references elsewhere. The
backend writes the KV itself (quantise + scatter), so ``save_kv_cache=False`` is refused.

CUDA graphs (SGLang 0.5.17's contract): decode steps are captured. ``init_cuda_graph_state``
allocates what a captured step reads (``GraphBuffers``); ``init_forward_metadata_out_graph`` runs
eagerly before the capture and before every replay, plans the step exactly as the eager path
does (same lists, same ``slot_positions`` write) into those buffers; the captured launches read
only them, so ``init_forward_metadata_in_graph`` has nothing to record. The planning itself is
captured too (``DecodePlanGraph``, one small graph per batch size over the runner's static inputs,
replayed in ``init_forward_metadata_out_graph``): a step's host work is then three launches, not
~30 (``KVSTREAMS_PLAN_GRAPH=0``: planned op by op). It stays out of the step's graph on purpose:
SGLang records the decode step's "reads done" event before the replay and lets the next batch's
``req_to_token`` writes run from there, so whatever reads the row table must run before it.
The graph runner pads a batch to a captured size with rows of ``req_pool_idx`` 0, ``seq_len``
1 (our fill value) and position 0; those rows get empty lists (their output is 0 and
discarded), write their new token's INT4 codes to the padding slot 0 and no INT8 copy, so they
never touch a real request's KV. Prefill on "breakable" graphs (SGLang's CUDA default) runs attention
eagerly through ``init_forward_metadata``; on "full" prefill graphs (``--cuda-graph-backend-prefill full``)
``init_forward_metadata_out_graph`` plans extend steps into ``PrefillGraphBuffers`` the same way, and the
captured layers read only those (every kernel grid fixed by the token bucket).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.runtime_context import get_parallel

from ..kernels import KV4DecodeWorkspace
from ..kernels.attend import kv4_attention_step
from ..kernels.region_plan import planned_region_lists
from ..kv4.regions import new_side_slots, row_region_lists
from .host_clock import HostClock, timed
from .pool import KV4TokenToKVPool

BACKEND_NAME = "kv4rl"
GRAPH_SEQ_LEN_FILL = 1  # a padded graph row's seq_len: the shortest a row can be, so it widens no gather
PADDING_ROW = 0  # SGLang's reserved req_to_token row: a graph batch's padding rows, never a request's


@dataclass
class KV4StepMetadata:
    mode: str  # "extend" | "decode"
    qo_indptr: torch.Tensor
    out_slots: torch.Tensor
    side_slots: torch.Tensor
    kv4: dict
    decode_plan: object | None
    max_new_tokens: int | None = None  # extend: the longest request's new tokens, from the host
    graph: bool = False  # an extend planned into PrefillGraphBuffers: out_slots / side_slots are the static buffers,
    # as long as the largest captured step (a step's layers take their first num_tokens entries)

    def slots_for(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(out_slots, side_slots) of a layer call on ``n`` query rows; a plan over other than ``n`` tokens is refused
        (the store would scatter rows it does not cover)."""
        if self.graph and n <= self.out_slots.numel():
            return self.out_slots[:n], self.side_slots[:n]
        if n != self.out_slots.numel():
            raise RuntimeError(f"kv4rl: {n} query rows for a step planned over {self.out_slots.numel()} tokens")
        return self.out_slots, self.side_slots


@dataclass
class GraphBuffers:
    """What a captured decode step reads besides the layer inputs, at fixed addresses; rewritten in
    place before every replay."""

    workspace: KV4DecodeWorkspace  # the region lists (static CSR buffers) and the kernels' partial results
    out_slots: torch.Tensor  # [max_bs] int64: each new token's INT4 slot (padding rows: slot 0)
    side_slots: torch.Tensor  # [max_bs] int64: its INT8 side slot (-1: none, as for every padding row)
    qo_indptr: torch.Tensor  # [max_bs + 1] int32: 0, 1, ..., max_bs (one new token per request)

    @classmethod
    def empty(cls, max_bs: int, num_q_heads: int, pool: KV4TokenToKVPool, max_context: int, device,
              invariant: bool = False) -> GraphBuffers:
        workspace = KV4DecodeWorkspace(max_bs, num_q_heads, pool.head_num, pool.head_dim, max_context, device,
                                       max_side=pool.sink + pool.recent, invariant=invariant)
        return cls(workspace, torch.zeros(max_bs, dtype=torch.int64, device=device),
                   torch.full((max_bs,), -1, dtype=torch.int64, device=device),
                   torch.arange(max_bs + 1, dtype=torch.int32, device=device))

    @property
    def max_bs(self) -> int:
        return self.out_slots.numel()


@dataclass
class DecodePlanGraph:
    """One captured batch size's decode planning over the graph runner's static inputs (``req_pool_indices``,
    ``seq_lens``, ``positions``, padded as SGLang pads them) and ``GraphBuffers.out_slots``, writing the graph buffers
    in place: captured in a CUDA graph of its own (on CUDA) or run as is (elsewhere). Its plan and metadata are the
    same at every replay (they point at the static buffers), so they are built once."""

    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # the runner's req_pool_indices, seq_lens, positions
    run: Callable[[], None]  # the planning ops
    metadata: KV4StepMetadata
    graph: torch.cuda.CUDAGraph | None = None

    def reads(self, fb) -> bool:
        """Whether ``fb`` (a replay's view) holds its inputs in the buffers this plan was captured over."""
        return all(t is not None and t.data_ptr() == s.data_ptr() and t.numel() >= s.numel()
                   for t, s in zip((fb.req_pool_indices, fb.seq_lens, fb.positions), self.inputs, strict=True))

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.run()


@dataclass
class PrefillGraphBuffers:
    """What a captured prefill step (SGLang's "full" prefill graphs: one graph per token bucket over a fixed number
    of request slots) reads besides the layer inputs, at fixed addresses; rewritten in place before every replay.
    Tokens past the real ones (the bucket's padding) store into the padding slot 0 and keep no INT8 copy; request
    slots past the real requests have no new token and empty lists."""

    qo_indptr: torch.Tensor  # [slots + 1] int32
    out_slots: torch.Tensor  # [max_tokens] int64
    side_slots: torch.Tensor  # [max_tokens] int64 (-1: none)
    kv_indptr: torch.Tensor  # [slots + 1] int32
    kv_indices: torch.Tensor  # [slots * row width] int32: a request's INT4 list is at most its row
    side_indptr: torch.Tensor  # [slots + 1] int32
    side_indices: torch.Tensor  # [slots * (sink + recent)] int32

    @classmethod
    def empty(cls, slots: int, max_tokens: int, width: int, side: int, device) -> PrefillGraphBuffers:
        def i32(n):
            return torch.zeros(n, dtype=torch.int32, device=device)
        return cls(i32(slots + 1), torch.zeros(max_tokens, dtype=torch.int64, device=device),
                   torch.full((max_tokens,), -1, dtype=torch.int64, device=device), i32(slots + 1),
                   i32(slots * width), i32(slots + 1), i32(slots * side))

    @property
    def slots(self) -> int:
        return self.qo_indptr.numel() - 1

    def lists(self) -> dict[str, torch.Tensor]:
        return dict(kv_indptr=self.kv_indptr, kv_indices=self.kv_indices, side_indptr=self.side_indptr,
                    side_indices=self.side_indices)

    def write(self, qo: torch.Tensor, out_slots: torch.Tensor, side_slots: torch.Tensor, kv4: dict) -> None:
        """Copy one step's plan in; the rest of every buffer keeps whatever it held (nothing reads past the lists'
        ``indptr``), except the token tail: padding tokens store into slot 0 without an INT8 copy."""
        n = out_slots.numel()
        if qo.numel() != self.qo_indptr.numel() or n > self.out_slots.numel():
            raise ValueError(f"kv4rl: a prefill graph step of {qo.numel() - 1} requests / {n} tokens does not fit "
                             f"the captured {self.slots} request slots / {self.out_slots.numel()} tokens")
        self.qo_indptr.copy_(qo)
        self.out_slots[:n].copy_(out_slots)
        self.out_slots[n:].zero_()
        self.side_slots[:n].copy_(side_slots)
        self.side_slots[n:].fill_(-1)
        for name in ("kv_indptr", "side_indptr"):
            getattr(self, name).copy_(kv4[name])
        for name in ("kv_indices", "side_indices"):
            src, dst = kv4[name], getattr(self, name)
            if src.numel() > dst.numel():
                raise ValueError(f"kv4rl: {src.numel()} {name} for a prefill graph buffer of {dst.numel()}")
            dst[:src.numel()].copy_(src)


class KV4RLAttnBackend(AttentionBackend):
    def __init__(self, model_runner):
        super().__init__()
        self.host_clock = HostClock()  # host time planning each step (/kvstreams/host_clock, as backend.*)
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, KV4TokenToKVPool):
            raise RuntimeError("the kv4rl attention backend needs the kv4rl KV pool: launch with --kv4rl "
                               f"(got {type(pool).__name__})")
        self.pool = pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        if pool.num_rows < self.req_to_token.shape[0]:
            raise RuntimeError(f"kv4rl: the INT8 side cache has {pool.num_rows} request rows, req_to_token "
                               f"{self.req_to_token.shape[0]} (SGLang's reserved row 0 included)")
        self.device = torch.device(model_runner.device)
        self.use_triton = self.device.type == "cuda"
        # the region lists from the two-kernel planner (``kernels.region_plan``) rather than ~75 torch ops: the
        # same lists; the host's planning time per step is what the scheduler cannot hide.
        # KVSTREAMS_PLAN_KERNEL=0 plans with the torch rule (an A/B switch for the benches)
        self.plan_kernel = self.use_triton and os.environ.get("KVSTREAMS_PLAN_KERNEL", "1") != "0"
        # decode planning captured per batch size (DecodePlanGraph); KVSTREAMS_PLAN_GRAPH=0 plans op by op
        self.plan_graph_env = os.environ.get("KVSTREAMS_PLAN_GRAPH", "1") != "0"
        self.plan_graphs: dict[int, DecodePlanGraph] = {}
        self.plan_graph_pool = None  # one memory pool for all of them (they never replay at once)
        # --kv4rl-batch-invariant: plans that do not depend on the batch (``kernels.decode.plan_decode``)
        self.invariant = bool(getattr(getattr(model_runner, "server_args", None), "kv4rl_batch_invariant", False))
        self.num_q_heads = model_runner.model_config.num_attention_heads // get_parallel().attn_tp_size
        self.forward_metadata: KV4StepMetadata | None = None
        self.decode_workspace = None  # the eager decode kernels' partial outputs, tickets, launch arguments
        if self.use_triton:
            self.decode_workspace = KV4DecodeWorkspace(self.req_to_token.shape[0], self.num_q_heads, pool.head_num,
                                                       pool.head_dim, device=self.device, invariant=self.invariant)
        self.graph: GraphBuffers | None = None  # CUDA graphs: set by init_cuda_graph_state
        self.prefill_graph: PrefillGraphBuffers | None = None  # "full" prefill graphs: set at their first capture
        prefill = getattr(getattr(getattr(model_runner, "server_args", None), "cuda_graph_config", None), "prefill",
                          None)
        self.prefill_graph_tokens = max(prefill.bs) if prefill is not None and prefill.bs else None

    # ---- per step, eager ----

    @timed("plan_step")
    def init_forward_metadata(self, forward_batch):
        fb = forward_batch
        fm = fb.forward_mode
        if fm.is_idle():
            self.forward_metadata = None
            return
        if fm.is_decode():
            n = fb.req_pool_indices.numel()
            out_slots = fb.out_cache_loc.long()
            side_slots, kv4 = self._decode_lists(fb.req_pool_indices, fb.seq_lens, fb.positions, out_slots,
                                                 *self._host_sizes(fb, n))
            plan = self.decode_workspace.plan(**kv4) if self.use_triton else None
            qo = torch.arange(n + 1, dtype=torch.int32, device=self.device)
            self.forward_metadata = KV4StepMetadata("decode", qo, out_slots, side_slots, kv4, plan)
            return
        if fm.name != "EXTEND":
            raise NotImplementedError(f"kv4rl: forward mode {fm.name} is not supported (extend and decode only: no "
                                      "mixed chunks, no speculative decoding, no split prefill)")
        out_slots = fb.out_cache_loc.long()
        width, total = self._host_sizes(fb, fb.req_pool_indices.numel())
        # host sizes: the lists and every layer's kernel grid are sized without a device sync
        new_cpu = getattr(fb, "extend_seq_lens_cpu", None)
        max_new = int(max(new_cpu)) if new_cpu else None
        qo, side_slots, kv4 = self._extend_lists(fb.req_pool_indices, fb.seq_lens, fb.extend_seq_lens, fb.positions,
                                                 out_slots, width, total if new_cpu else None)
        self.forward_metadata = KV4StepMetadata("extend", qo, out_slots, side_slots, kv4, None, max_new)

    def _extend_lists(self, rows, seq_lens, num_new, positions, out_slots, width: int, total: int | None):
        """One extend step's plan, shared by the eager and the graph path: the new tokens' logical positions go into
        ``slot_positions``; each request's prefix (its row minus its ``num_new`` new tokens) is split into the region
        lists, the new tokens attend to each other in full precision. Requests with no new token (a graph's unused
        request slots: ``seq_len`` 0) get empty lists. ``total``: a host bound of ``seq_lens.sum()`` (no host sync).
        Returns (qo_indptr, the new tokens' side slots, the lists)."""
        dev = self.device
        rows, seq_lens, num_new, p_new = rows.long(), seq_lens.long(), num_new.long(), positions.long()
        n = out_slots.numel()
        prefix = seq_lens - num_new
        qo = torch.zeros(rows.numel() + 1, dtype=torch.int32, device=dev)
        qo[1:] = torch.cumsum(num_new, 0)
        sink, recent = self.pool.sink, self.pool.recent
        # every slot remembers the position its token was computed at (rows get compacted)
        self.pool.slot_positions[out_slots] = p_new[:n].to(torch.int32)
        last = max(n - 1, 0)  # a request with no new token indexes its neighbour's (its lists are empty anyway)
        first_new = p_new[qo[:-1].long().clamp(max=last)]
        end_after = p_new[(qo[1:].long() - 1).clamp(min=0, max=last)] + 1
        stream_of = torch.repeat_interleave(torch.arange(rows.numel(), device=dev), num_new, output_size=n)
        side_slots = new_side_slots(rows[stream_of], p_new[:n], end_after[stream_of], sink=sink, recent=recent)
        # new tokens attend to each other in full precision, the prefix through KV4
        kv4 = self._region_lists(rows, prefix, first_new, width, capacity=total)
        return qo, side_slots, kv4

    def _decode_lists(self, rows, seq_lens, positions, out_slots, width: int, total: int | None = None, *,
                      padded: bool = False, out: tuple[torch.Tensor, ...] | None = None):
        """One decode step's plan, shared by the eager and the graph path: the new tokens' logical
        positions go into ``slot_positions``, then each request's row (``seq_lens``, new token
        included, the widest ``width``) is split into the region lists; the new token is stored
        first and attends to itself. ``total``: a host bound of ``seq_lens.sum()`` for lists built
        without a host sync (the graph path). ``padded``: rows at ``PADDING_ROW`` are a graph batch's
        padding (empty lists, no INT8 copy; their token goes to the padding slot ``out_slots`` holds);
        ``out``: the lists' static buffers (``planned_region_lists``). Returns (the new tokens' side
        slots, the lists)."""
        sink, recent = self.pool.sink, self.pool.recent
        rows, seq_lens, p_new = rows.long(), seq_lens.long(), positions.long()
        self.pool.slot_positions[out_slots] = p_new.to(torch.int32)
        end = p_new + 1
        side_slots = new_side_slots(rows, p_new, end, sink=sink, recent=recent)
        if padded:
            real = rows != PADDING_ROW
            side_slots = torch.where(real, side_slots, -1)
            seq_lens = torch.where(real, seq_lens, 0)
        kv4 = self._region_lists(rows, seq_lens, end, width, capacity=total, out=out)
        return side_slots, kv4

    def _region_lists(self, rows, lengths, ends, width: int, *, capacity: int | None,
                      out: tuple[torch.Tensor, ...] | None = None) -> dict[str, torch.Tensor]:
        """The region lists of requests holding the first ``lengths`` slots of their ``rows`` (at most ``width``),
        whose next positions are ``ends``: ``kernels.region_plan`` (``plan_kernel``; into ``out`` if given) or the
        torch rule."""
        sink, recent = self.pool.sink, self.pool.recent
        if self.plan_kernel:
            return planned_region_lists(rows, lengths, ends, self.req_to_token, self.pool.slot_positions, sink=sink,
                                        recent=recent, capacity=capacity, out=out)
        if out is not None:
            raise ValueError("kv4rl: lists planned into static buffers need the planner kernels")
        return row_region_lists(rows, lengths, ends, self.req_to_token, self.pool.slot_positions, width=width,
                                sink=sink, recent=recent, capacity=capacity)

    @staticmethod
    def _host_sizes(fb, n: int) -> tuple[int, int]:
        """(longest row, sum of rows) of the first ``n`` requests, from the host mirror of ``seq_lens``
        when SGLang keeps one (no device sync)."""
        if n == 0:
            return 0, 0
        if fb.seq_lens_cpu is not None:
            lens = fb.seq_lens_cpu[:n]
            return int(lens.max()), int(lens.sum())
        lens = fb.seq_lens[:n]
        return int(lens.max()), int(lens.sum())

    # ---- CUDA graphs (decode) ----

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        if max_num_tokens != max_bs:
            raise NotImplementedError(f"kv4rl captures one token per request ({max_num_tokens} tokens for {max_bs} "
                                      "requests: speculative decoding is not supported)")
        # a request's INT4 list holds at most its row's slots: the row width, and no more than the pool has
        max_context = min(self.req_to_token.shape[1], self.pool.size)
        self.graph = GraphBuffers.empty(max_bs, self.num_q_heads, self.pool, max_context, self.device,
                                        invariant=self.invariant)

    def get_cuda_graph_seq_len_fill_value(self):
        return GRAPH_SEQ_LEN_FILL

    @timed("plan_graph_step")
    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Before a capture (``in_capture``: a dummy batch, planned as all padding) and before every
        replay (``forward_batch``: the runner's padded view; its ``out_cache_loc`` holds the real
        rows only): plan the step as ``init_forward_metadata`` does and copy it into the graph
        buffers. Host sizes come from ``seq_lens_cpu``: no device sync."""
        fb, g = forward_batch, self.graph
        if fb.forward_mode.name == "EXTEND":
            return self._extend_out_graph(fb, in_capture)
        if g is None:
            raise RuntimeError("kv4rl: init_cuda_graph_state was not called")
        if not fb.forward_mode.is_decode():
            raise NotImplementedError(f"kv4rl: CUDA graphs capture decode and extend steps, not "
                                      f"{fb.forward_mode.name}")
        bs = fb.batch_size
        real = 0 if in_capture else fb.out_cache_loc.numel()
        if not real <= bs <= g.max_bs:
            raise ValueError(f"kv4rl: {real} requests in a graph batch of {bs} (captured up to {g.max_bs})")
        if self.plan_graph_env and self.plan_kernel:
            if in_capture:
                self._capture_decode_plan(fb, bs)
            pg = self.plan_graphs.get(bs)
            if pg is not None and pg.reads(fb):  # three launches: the real rows' slots, the padding's, the plan
                g.out_slots[:real].copy_(fb.out_cache_loc[:real])
                g.out_slots[real:bs].zero_()
                pg.replay()
                self.forward_metadata = pg.metadata
                return
        out_slots = fb.out_cache_loc[:real].long()
        side_slots, kv4 = self._decode_lists(fb.req_pool_indices[:real], fb.seq_lens[:real], fb.positions[:real],
                                             out_slots, *self._host_sizes(fb, real))
        g.out_slots[:real].copy_(out_slots)
        g.out_slots[real:bs].zero_()  # padding rows store into the padding slot,
        g.side_slots[:real].copy_(side_slots)
        g.side_slots[real:bs].fill_(-1)  # and keep no INT8 copy
        plan = g.workspace.plan(**kv4, batch_size=bs, graph=True)  # padding rows: empty lists
        lists = dict(kv_indptr=plan.kv_indptr, kv_indices=plan.kv_indices, side_indptr=plan.side_indptr,
                     side_indices=plan.side_indices)
        self.forward_metadata = KV4StepMetadata("decode", g.qo_indptr[: bs + 1], g.out_slots[:bs],
                                                g.side_slots[:bs], lists, plan)

    def _capture_decode_plan(self, fb, bs: int) -> None:
        """Before SGLang captures batch size ``bs``: its planning (``_decode_lists`` over the runner's static inputs,
        padding rows told by ``PADDING_ROW``, written into the graph buffers) as a ``DecodePlanGraph``: run once
        eagerly (the planner kernels compile; the capture's dummy batch, all padding, is planned), then captured on
        CUDA."""
        g = self.graph
        inputs = (fb.req_pool_indices[:bs], fb.seq_lens[:bs], fb.positions[:bs])
        if bool((inputs[0] != PADDING_ROW).any()):
            raise RuntimeError(f"kv4rl: SGLang's capture batch of {bs} holds request rows other than the padding row "
                               f"{PADDING_ROW}; its planning would write their KV (KVSTREAMS_PLAN_GRAPH=0 plans the "
                               "capture as all padding)")
        out_slots, side_slots, lists = g.out_slots[:bs], g.side_slots[:bs], g.workspace.static_lists(bs)
        width = min(self.req_to_token.shape[1], self.pool.size)

        def run():
            side, _ = self._decode_lists(*inputs, out_slots, width, padded=True, out=lists)
            side_slots.copy_(side)

        plan = g.workspace.static_plan(bs)
        metadata = KV4StepMetadata("decode", g.qo_indptr[: bs + 1], out_slots, side_slots,
                                   dict(kv_indptr=plan.kv_indptr, kv_indices=plan.kv_indices,
                                        side_indptr=plan.side_indptr, side_indices=plan.side_indices), plan)
        out_slots.zero_()
        run()
        graph = None
        if self.device.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            if self.plan_graph_pool is None:
                self.plan_graph_pool = torch.cuda.graph_pool_handle()
            try:
                with torch.cuda.graph(graph, pool=self.plan_graph_pool):
                    run()
            except Exception as e:
                raise RuntimeError(f"kv4rl: capturing the decode planning of batch size {bs} failed ({e}); "
                                   "KVSTREAMS_PLAN_GRAPH=0 plans every step op by op instead") from e
        self.plan_graphs[bs] = DecodePlanGraph(inputs, run, metadata, graph)

    def _extend_out_graph(self, fb, in_capture: bool) -> None:
        """SGLang's "full" prefill graphs: before a capture (the runner's dummy batch) and before every replay (the
        slot-padded view: ``batch_size`` request slots, unused ones with ``seq_len`` 0; ``out_cache_loc`` and
        ``positions`` of the real tokens only), plan the step as ``init_forward_metadata`` does and copy it into
        ``PrefillGraphBuffers``. The captured layers read only those buffers, and every kernel's grid is fixed by
        the bucket's token count (a request may hold all of them), so nothing is planned inside the graph."""
        r = fb.batch_size
        out_slots = fb.out_cache_loc.long()
        if self.prefill_graph is None:
            if not in_capture:
                raise RuntimeError("kv4rl: a prefill graph replay before any capture")
            side = self.pool.sink + self.pool.recent
            self.prefill_graph = PrefillGraphBuffers.empty(r, max(self.prefill_graph_tokens or 0, out_slots.numel()),
                                                           self.req_to_token.shape[1], side, self.device)
        width, total = self._host_sizes(fb, r)
        qo, side_slots, kv4 = self._extend_lists(fb.req_pool_indices[:r], fb.seq_lens[:r], fb.extend_seq_lens[:r],
                                                 fb.positions, out_slots, width, total)
        if in_capture:  # the runner's dummy batch is all padding (its warm-up launches run it): no INT8 copies
            side_slots = torch.full_like(side_slots, -1)
        g = self.prefill_graph
        g.write(qo, out_slots, side_slots, kv4)
        self.forward_metadata = KV4StepMetadata("extend", g.qo_indptr, g.out_slots, g.side_slots, g.lists(), None,
                                                None, graph=True)

    def init_forward_metadata_in_graph(self, forward_batch):
        """Nothing to record: the captured store and decode launches read the graph buffers that
        ``init_forward_metadata_out_graph`` rewrote in place."""

    # ---- per layer ----

    def _forward(self, q, k, v, layer, save_kv_cache, forward_batch=None):
        if not save_kv_cache:
            raise NotImplementedError("kv4rl writes the KV it attends to: save_kv_cache=False is not supported")
        if layer.qk_head_dim != layer.v_head_dim or layer.is_cross_attention:
            raise NotImplementedError("kv4rl supports self-attention with equal K/V head dims")
        md = self.forward_metadata
        n = q.shape[0]
        out_slots, side_slots = md.slots_for(n)
        q_ = q.reshape(n, layer.tp_q_head_num, layer.qk_head_dim)
        k_ = k.reshape(n, layer.tp_k_head_num, layer.qk_head_dim)
        v_ = v.reshape(n, layer.tp_v_head_num, layer.v_head_dim)
        plan = md.decode_plan
        workspace = self.graph.workspace if plan is not None and plan.graph else self.decode_workspace
        # extend: write straight into the output SGLang preallocated for this layer (its attention op then skips
        # its copy), when it is this step's [n, Hq * D] buffer
        into = getattr(forward_batch, "_attn_output", None) if md.mode == "extend" and self.use_triton else None
        if into is not None and (into.shape != (n, layer.tp_q_head_num * layer.v_head_dim) or not into.is_contiguous()):
            into = None
        out = kv4_attention_step(self.pool.layer_cache(layer.layer_id), q_, k_, v_, mode=md.mode,
                                 qo_indptr=md.qo_indptr, out_slots=out_slots, side_slots=side_slots,
                                 kv4=md.kv4, sm_scale=layer.scaling, use_triton=self.use_triton,
                                 decode_plan=plan, decode_workspace=workspace,
                                 # a graph's grid covers a request holding every token of the bucket
                                 max_new_tokens=n if md.graph else md.max_new_tokens,
                                 out=None if into is None else into.view(n, layer.tp_q_head_num, layer.v_head_dim),
                                 invariant=self.invariant)
        return out.reshape(n, layer.tp_q_head_num * layer.v_head_dim).to(q.dtype)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, save_kv_cache, forward_batch)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, save_kv_cache)

    def support_triton(self):
        return self.use_triton
