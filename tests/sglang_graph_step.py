"""Decode steps of the kv4rl backend run eagerly and as SGLang's CUDA-graph runner drives them; dumps what the tests
check.

    python tests/sglang_graph_step.py OUT.json [--device cuda]

Two copies of the same state (a ``KV4TokenToKVPool`` and its ``req_to_token`` rows, prefilled through the backend's
eager extend; one row compacted by an eviction, so its slots sit at logical positions with a gap and its next position
is past its row length, as kv-streams leaves a row), each with its own ``KV4RLAttnBackend`` (the eager copy's planning
its region lists with the torch rule, the graph copy's with the planner kernels). Every step runs the same
new tokens (random q/k/v per layer) through both:

- eager: ``init_forward_metadata`` and ``forward_decode`` per layer (SGLang without graphs);
- graph: ``init_cuda_graph_state`` once; per captured batch size, ``init_forward_metadata_out_graph(in_capture=True)``
  on a dummy batch of the runner's static buffers; before each replay the runner's work (the real rows copied into
  the static buffers, padding rows at ``req_pool_idx`` 0, ``seq_len`` = the backend's fill value, position 0, slot 0,
  garbage q/k/v) and ``init_forward_metadata_out_graph`` on its padded view (``out_cache_loc`` unpadded); then
  ``init_forward_metadata_in_graph`` + ``forward_decode`` per layer on the static inputs. On CUDA that part is
  captured once per batch size in a ``torch.cuda.CUDAGraph`` (after two eager warm-up runs, as SGLang does) and
  replayed; it also runs eagerly right before each replay, to tell capture errors from numerics.

Between decode steps one request takes a new turn (an eager extend on both copies). Run as a subprocess: on CPU it
needs ``tests/sglang_cpu_shims`` and ``SGLANG_USE_CPU_ENGINE=1`` (``test_sglang.sglang_env``).

``--prefill``: extend steps instead, as SGLang's "full" prefill graph runner drives them (``PrefillGraphRunner``):
one capture per token bucket over ``PREFILL_SLOTS`` request slots (a dummy batch: one request holding the bucket,
the other slots empty); before each replay the real requests in the first slots, the unused ones with ``seq_len``
0, the bucket's padding tokens at position 0 and slot 0 with garbage q/k/v, and the planning on the slot-padded view
(``positions`` and ``out_cache_loc`` of the real tokens only); then ``forward_extend`` per layer on the bucket.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

if __name__ == "__main__" and "cuda" not in sys.argv:
    # the planner kernels run under Triton's interpreter here; it must be on before SGLang's imports load Triton's
    # standard library (``tl.sum``, ``tl.cumsum``), or those stay compiled functions the interpreter cannot call
    os.environ["TRITON_INTERPRET"] = "1"

import torch

from kvstreams_sglang.kv4 import side_width

HQ, HKV, D, LAYERS = 16, 4, 128, 2  # GQA group 4, head_dim 128: what the CUDA decode kernel takes
SINK, RECENT = 4, 16  # small, so short rows already have an INT4 region
SIDE_ROW = side_width(SINK, RECENT)  # INT8 side slots per request row
ROWS, WIDTH, SLOTS = 8, 512, 4096  # req_to_token rows (plus SGLang's reserved row 0), row width, pool slots
CAPTURE_BS = (4, 8)  # captured batch sizes (largest first at capture, as SGLang does)
# request row -> (tokens prefilled, evicted logical span or None)
REQUESTS = {1: (40, None), 2: (7, None), 3: (130, (20, 50)), 5: (1, None), 6: (75, None)}
STEPS = [[1, 2, 3, 5, 6], [2, 3, 6], [1, 2, 3, 5], [1, 2, 3, 5, 6], [3], [1, 2, 3, 5, 6]]  # rows decoding
TURN_BEFORE = {3: (6, 9)}  # before step 3: row 6 appends 9 tokens (an eager extend)
PREFILL_BUCKETS, PREFILL_SLOTS = (64, 32), 4  # "full" prefill graphs: token buckets (largest first), request slots
# prefill steps: (row, new tokens) per request; buckets 32 and 64, all four slots used or not, an evicted row (3)
PREFILL_STEPS = [[(1, 5), (2, 9)], [(3, 20)], [(1, 3), (5, 2), (6, 11), (2, 1)], [(1, 25), (3, 20)], [(6, 30)],
                 [(2, 40), (5, 24)]]


class Copy:
    """One pool + backend + the requests' bookkeeping."""

    def __init__(self, device: torch.device, dtype: torch.dtype, *, plan_kernel: bool):
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.runtime_context import get_parallel

        from kvstreams_sglang.sglang_ext.backend import KV4RLAttnBackend
        from kvstreams_sglang.sglang_ext.pool import KV4TokenToKVPool

        self.device, self.dtype = device, dtype
        self.req_pool = ReqToTokenPool(size=ROWS, max_context_len=WIDTH, device=str(device), enable_memory_saver=False)
        self.pool = KV4TokenToKVPool(size=SLOTS, page_size=1, dtype=dtype, head_num=HKV, head_dim=D, layer_num=LAYERS,
                                     device=str(device), enable_memory_saver=False, sink=SINK, recent=RECENT,
                                     num_rows=self.req_pool.req_to_token.shape[0])
        runner = SimpleNamespace(token_to_kv_pool=self.pool, req_to_token_pool=self.req_pool, device=str(device),
                                 model_config=SimpleNamespace(num_attention_heads=HQ))
        with get_parallel().override(attn_tp_size=1):
            self.backend = KV4RLAttnBackend(runner)
        self.backend.plan_kernel = plan_kernel
        self.layers = [SimpleNamespace(layer_id=i, tp_q_head_num=HQ, tp_k_head_num=HKV, tp_v_head_num=HKV,
                                       qk_head_dim=D, v_head_dim=D, scaling=D ** -0.5, is_cross_attention=False)
                       for i in range(LAYERS)]
        self.length: dict[int, int] = {}  # row -> tokens in its row
        self.next_pos: dict[int, int] = {}  # row -> the next logical position
        self.next_slot = 1  # slot 0 is the padding slot

    def alloc(self, n: int) -> torch.Tensor:
        slots = torch.arange(self.next_slot, self.next_slot + n, device=self.device)
        self.next_slot += n
        return slots

    def extend(self, row: int, qkv: list) -> None:
        """Append ``len(qkv[0][0])`` tokens to ``row`` through the eager extend."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        n = qkv[0][0].shape[0]
        start, pos0 = self.length.get(row, 0), self.next_pos.get(row, 0)
        slots = self.alloc(n)
        self.req_pool.req_to_token[row, start:start + n] = slots.to(torch.int32)
        lens = torch.tensor([start + n])
        fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=1,
                             req_pool_indices=torch.tensor([row], device=self.device), seq_lens=lens.to(self.device),
                             seq_lens_cpu=lens, extend_seq_lens=torch.tensor([n], device=self.device),
                             positions=torch.arange(pos0, pos0 + n, device=self.device), out_cache_loc=slots)
        self.backend.init_forward_metadata(fb)
        for layer, (q, k, v) in zip(self.layers, qkv, strict=True):
            self.backend.forward_extend(q, k, v, layer, fb)
        self.length[row], self.next_pos[row] = start + n, pos0 + n

    def extend_inputs(self, reqs: list[tuple[int, int]]) -> dict:
        """What SGLang's scheduler prepares for an extend step of several requests: new slots in their rows."""
        rows, lens, new, positions, slots = [], [], [], [], []
        for row, n in reqs:
            start, pos0 = self.length.get(row, 0), self.next_pos.get(row, 0)
            got = self.alloc(n)
            self.req_pool.req_to_token[row, start:start + n] = got.to(torch.int32)
            self.length[row], self.next_pos[row] = start + n, pos0 + n
            rows.append(row), lens.append(start + n), new.append(n), slots.append(got.cpu())
            positions.append(torch.arange(pos0, pos0 + n))
        return dict(req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(lens), extend_seq_lens=torch.tensor(new),
                    positions=torch.cat(positions), out_cache_loc=torch.cat(slots))

    def eager_extend(self, inputs: dict, qkv: list) -> list[torch.Tensor]:
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        dev = self.device
        fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=inputs["req_pool_indices"].numel(),
                             **{k: v.to(dev) for k, v in inputs.items()}, seq_lens_cpu=inputs["seq_lens"],
                             extend_seq_lens_cpu=inputs["extend_seq_lens"].tolist())
        self.backend.init_forward_metadata(fb)
        return [self.backend.forward_extend(q, k, v, layer, fb) for layer, (q, k, v) in zip(self.layers, qkv,
                                                                                             strict=True)]

    def evict(self, row: int, span: tuple[int, int]) -> None:
        """Compact the row as kv-streams does: drop the tokens at logical positions ``span``, keep the others in
        order (their slots keep their positions; the next position does not move)."""
        n = self.length[row]
        slots = self.req_pool.req_to_token[row, :n].clone()
        pos = self.pool.slot_positions[slots.long()]
        keep = slots[(pos < span[0]) | (pos >= span[1])]
        self.req_pool.req_to_token[row, :n] = 0
        self.req_pool.req_to_token[row, :keep.numel()] = keep
        self.length[row] = keep.numel()

    def decode_inputs(self, rows: list[int]) -> dict:
        """What SGLang's scheduler prepares for a decode step: a new slot per request in its row."""
        slots = self.alloc(len(rows))
        for r, s in zip(rows, slots.tolist(), strict=True):
            self.req_pool.req_to_token[r, self.length[r]] = s
            self.length[r] += 1
        positions = torch.tensor([self.next_pos[r] for r in rows])
        for r in rows:
            self.next_pos[r] += 1
        lens = torch.tensor([self.length[r] for r in rows])
        return dict(req_pool_indices=torch.tensor(rows), seq_lens=lens, positions=positions, out_cache_loc=slots.cpu())

    def cache_state(self) -> dict[str, torch.Tensor]:
        """Every byte a real request can read: INT4 entries of slots >= 1, INT8 side entries of rows >= 1,
        slot positions of slots >= 1."""
        row = SIDE_ROW
        out = {"slot_positions": self.pool.slot_positions[1:]}
        for i, c in enumerate(self.pool.layers):
            for name in ("k_codes", "k_meta", "v_codes", "v_meta"):
                out[f"{i}.{name}"] = getattr(c, name)[1:]
            for name in ("k_side", "k_side_scale", "v_side", "v_side_scale"):
                out[f"{i}.{name}"] = getattr(c, name)[row:]
        return out

    def snapshot(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every tensor of the pool a step writes, with a copy of its bytes (``restore`` puts them back in place)."""
        names = ("k_codes", "k_meta", "v_codes", "v_meta", "k_side", "k_side_scale", "v_side", "v_side_scale")
        held = [self.pool.slot_positions] + [getattr(c, n) for c in self.pool.layers for n in names]
        return [(t, t.clone()) for t in held]

    @staticmethod
    def restore(snap: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for t, saved in snap:
            t.copy_(saved)

    def row0_side_untouched(self) -> bool:
        row = SIDE_ROW
        return all(bool((getattr(c, n)[:row] == 0).all()) for c in self.pool.layers
                   for n in ("k_side", "k_side_scale", "v_side", "v_side_scale"))


class GraphRunner:
    """The parts of SGLang's ``DecodeCudaGraphRunner`` the backend sees: static input buffers, capture per batch
    size, a padded view per replay."""

    def __init__(self, copy: Copy, capture: bool):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        self.copy, self.capture = copy, capture
        be, dev, max_bs = copy.backend, copy.device, max(CAPTURE_BS)
        be.init_cuda_graph_state(max_bs, max_bs)
        self.fill = be.get_cuda_graph_seq_len_fill_value()
        i64 = dict(dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.zeros(max_bs, **i64)
        self.seq_lens = torch.full((max_bs,), self.fill, **i64)
        self.seq_lens_cpu = torch.full((max_bs,), self.fill, dtype=torch.int64)
        self.positions = torch.zeros(max_bs, **i64)
        self.out_cache_loc = torch.zeros(max_bs, **i64)
        self.qkv = [[torch.zeros(max_bs, h * D, dtype=copy.dtype, device=dev) for h in (HQ, HKV, HKV)]
                    for _ in range(LAYERS)]
        self.mode = ForwardMode.DECODE
        self.batches, self.graphs, self.outputs = {}, {}, {}
        for bs in sorted(CAPTURE_BS, reverse=True):
            fb = SimpleNamespace(forward_mode=self.mode, batch_size=bs, req_pool_indices=self.req_pool_indices[:bs],
                                 seq_lens=self.seq_lens[:bs], seq_lens_cpu=self.seq_lens_cpu[:bs],
                                 positions=self.positions[:bs], out_cache_loc=self.out_cache_loc[:bs],
                                 seq_lens_sum=bs * self.fill)
            self.batches[bs] = fb
            be.init_forward_metadata_out_graph(fb, in_capture=True)
            for _ in range(2):  # the runner's warm-up launches (eager, on the CPU too), then the capture
                self.run_once(bs)
            if capture:
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self.outputs[bs] = self.run_once(bs)
                self.graphs[bs] = graph

    def run_once(self, bs: int) -> list[torch.Tensor]:
        be, fb = self.copy.backend, self.batches[bs]
        be.init_forward_metadata_in_graph(fb)
        return [be.forward_decode(q[:bs], k[:bs], v[:bs], layer, fb)
                for layer, (q, k, v) in zip(self.copy.layers, self.qkv, strict=True)]

    def load(self, inputs: dict, qkv: list, garbage: torch.Generator) -> tuple[int, SimpleNamespace]:
        """``load_batch``: pad to a captured size, fill the static buffers (padding rows as SGLang's registry pads
        them), then the backend's out-graph planning on the padded view."""
        dev, raw = self.copy.device, inputs["req_pool_indices"].numel()
        bs = min(b for b in CAPTURE_BS if b >= raw)
        for buf, src, pad in ((self.req_pool_indices, "req_pool_indices", 0), (self.seq_lens, "seq_lens", self.fill),
                              (self.seq_lens_cpu, "seq_lens", self.fill), (self.positions, "positions", 0),
                              (self.out_cache_loc, "out_cache_loc", 0)):
            buf[:raw].copy_(inputs[src])
            buf[raw:bs].fill_(pad)
        for static, real in zip(self.qkv, qkv, strict=True):
            for s, x in zip(static, real, strict=True):
                s[:raw].copy_(x)
                s[raw:bs].copy_(torch.randn(bs - raw, x.shape[1], generator=garbage).to(s))  # whatever the model made
        view = SimpleNamespace(batch_size=bs, forward_mode=self.mode, actual_forward_mode=self.mode,
                               input_ids=None, positions=self.positions[:bs],
                               req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
                               seq_lens_cpu=self.seq_lens_cpu[:bs],
                               seq_lens_sum=int(inputs["seq_lens"].sum()) + (bs - raw) * self.fill,
                               num_padding=bs - raw, encoder_lens=None,
                               out_cache_loc=inputs["out_cache_loc"].to(dev), spec_info=None)
        self.copy.backend.init_forward_metadata_out_graph(view)
        return bs, view


class PrefillGraphRunner:
    """The parts of SGLang's "full" ``PrefillCudaGraphRunner`` the backend sees: static buffers over
    ``PREFILL_SLOTS`` request slots and the largest bucket's tokens, a capture per bucket, a slot-padded view per
    replay."""

    def __init__(self, copy: Copy, capture: bool):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        self.copy, self.capture = copy, capture
        be, dev, r, t = copy.backend, copy.device, PREFILL_SLOTS, max(PREFILL_BUCKETS)
        i64 = dict(dtype=torch.int64, device=dev)
        self.req_pool_indices, self.seq_lens = torch.zeros(r, **i64), torch.zeros(r, **i64)
        self.extend_seq_lens, self.seq_lens_cpu = torch.zeros(r, **i64), torch.zeros(r, dtype=torch.int64)
        self.positions, self.out_cache_loc = torch.zeros(t, **i64), torch.zeros(t, **i64)
        self.qkv = [[torch.zeros(t, h * D, dtype=copy.dtype, device=dev) for h in (HQ, HKV, HKV)]
                    for _ in range(LAYERS)]
        self.mode = ForwardMode.EXTEND
        self.graphs, self.outputs = {}, {}
        for bucket in PREFILL_BUCKETS:  # capture_prepare: one request holds the bucket, the other slots are empty
            lens = [bucket] + [0] * (r - 1)
            self.req_pool_indices.copy_(torch.arange(r))
            for buf in (self.seq_lens, self.extend_seq_lens, self.seq_lens_cpu):
                buf.copy_(torch.tensor(lens))
            self.positions.zero_(), self.out_cache_loc.zero_()
            be.init_forward_metadata_out_graph(self.view(bucket, self.positions[:bucket],
                                                         self.out_cache_loc[:bucket]), in_capture=True)
            for _ in range(2):  # the runner's warm-up launches (eager, on the CPU too), then the capture
                self.run_once(bucket)
            if capture:
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self.outputs[bucket] = self.run_once(bucket)
                self.graphs[bucket] = graph

    def view(self, bucket: int, positions, out_cache_loc) -> SimpleNamespace:
        return SimpleNamespace(forward_mode=self.mode, batch_size=PREFILL_SLOTS, req_pool_indices=self.req_pool_indices,
                               seq_lens=self.seq_lens, seq_lens_cpu=self.seq_lens_cpu,
                               extend_seq_lens=self.extend_seq_lens, positions=positions, out_cache_loc=out_cache_loc,
                               input_ids=torch.zeros(bucket, dtype=torch.int64))

    def run_once(self, bucket: int) -> list[torch.Tensor]:
        be = self.copy.backend
        fb = self.view(bucket, self.positions[:bucket], self.out_cache_loc[:bucket])
        return [be.forward_extend(q[:bucket], k[:bucket], v[:bucket], layer, fb)
                for layer, (q, k, v) in zip(self.copy.layers, self.qkv, strict=True)]

    def load(self, inputs: dict, qkv: list, garbage: torch.Generator) -> int:
        """``load_batch``: pad the tokens to a bucket and the requests to the slots (unused slots: row 0, length
        0), then the backend's out-graph planning on the slot-padded view of the real batch."""
        raw, bs = inputs["out_cache_loc"].numel(), inputs["req_pool_indices"].numel()
        bucket = min(b for b in PREFILL_BUCKETS if b >= raw)
        for buf, src in ((self.req_pool_indices, "req_pool_indices"), (self.seq_lens, "seq_lens"),
                         (self.seq_lens_cpu, "seq_lens"), (self.extend_seq_lens, "extend_seq_lens")):
            buf[:bs].copy_(inputs[src])
            buf[bs:].zero_()
        for buf, src in ((self.positions, "positions"), (self.out_cache_loc, "out_cache_loc")):
            buf[:raw].copy_(inputs[src])
            buf[raw:bucket].zero_()
        for static, real in zip(self.qkv, qkv, strict=True):
            for s, x in zip(static, real, strict=True):
                s[:raw].copy_(x)
                s[raw:bucket].copy_(torch.randn(bucket - raw, x.shape[1], generator=garbage).to(s))
        dev = self.copy.device
        self.copy.backend.init_forward_metadata_out_graph(self.view(bucket, inputs["positions"].to(dev),
                                                                    inputs["out_cache_loc"].to(dev)))
        return bucket


def prefilled_copies(device: torch.device, gen: torch.Generator) -> tuple[Copy, Copy]:
    """Two copies of the same state: ``REQUESTS`` prefilled through the eager extend, the evictions applied."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # the eager copy plans its lists with the torch rule, the graph copy with the planner kernels
    # (``kernels.region_plan``, the GPU's default): the bit-for-bit comparisons hold the two planners to each other
    eager, graph = Copy(device, dtype, plan_kernel=False), Copy(device, dtype, plan_kernel=True)
    for row, (n, span) in REQUESTS.items():
        qkv = qkv_for(n, gen, dtype, device)
        for c in (eager, graph):
            c.extend(row, qkv)
            if span is not None:
                c.evict(row, span)
    return eager, graph


def compare(step: dict, runner, key: int, n: int, ref: list, eager: Copy, graph: Copy) -> None:
    """The graph path's outputs (first ``n`` rows; replayed from the captured graph of ``key`` when the runner
    captures, else launched again; each against a first eager launch that is then undone) against the eager
    path's ``ref``, and the two copies' caches, into ``step``."""
    # the same step launched eagerly, then undone: an extend is not idempotent (its new tokens' INT8 copies take
    # the ring slots of the oldest recent tokens, which its own prefix lists read); then the step for real:
    # replayed from the captured graph where the runner captures, else launched once more
    before = graph.snapshot()
    hooks = [o[:n].clone() for o in runner.run_once(key)]
    graph.restore(before)
    if runner.capture:
        runner.graphs[key].replay()
        got = [o[:n] for o in runner.outputs[key]]
    else:
        got = [o[:n] for o in runner.run_once(key)]
    step["replay_equals_hooks"] = all(torch.equal(a, b) for a, b in zip(got, hooks, strict=True))
    diff = torch.stack([(a.float() - b.float()).abs() for a, b in zip(got, ref, strict=True)])
    step.update(max_diff=float(diff.max()), mean_diff=float(diff.mean()),
                bitwise=all(torch.equal(a, b) for a, b in zip(got, ref, strict=True)),
                ref_abs_mean=float(torch.stack([r.float().abs() for r in ref]).mean()))
    a, b = eager.cache_state(), graph.cache_state()
    step["caches_equal"] = all(torch.equal(a[k], b[k]) for k in a)
    step["unequal"] = [k for k in a if not torch.equal(a[k], b[k])]
    step["row0_side_untouched"] = graph.row0_side_untouched()


def prefill_main(out: str, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(0)
    eager, graph = prefilled_copies(device, gen)
    runner = PrefillGraphRunner(graph, capture=device.type == "cuda")
    res = {"steps": []}
    garbage = torch.Generator().manual_seed(1)
    for reqs in PREFILL_STEPS:
        inputs, same = eager.extend_inputs(reqs), graph.extend_inputs(reqs)
        assert all(torch.equal(inputs[k], same[k]) for k in inputs)
        raw = inputs["out_cache_loc"].numel()
        qkv = qkv_for(raw, gen, eager.dtype, device)
        ref = eager.eager_extend(inputs, qkv)
        bucket = runner.load(inputs, qkv, garbage)
        step = dict(reqs=reqs, bucket=bucket, tokens=raw)
        compare(step, runner, bucket, raw, ref, eager, graph)
        res["steps"].append(step)
    with open(out, "w") as f:
        json.dump(res, f)


def qkv_for(n: int, gen: torch.Generator, dtype, device) -> list:
    return [[torch.randn(n, h * D, generator=gen).to(device=device, dtype=dtype) for h in (HQ, HKV, HKV)]
            for _ in range(LAYERS)]


def main(out: str, device: torch.device) -> None:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    gen = torch.Generator().manual_seed(0)
    eager, graph = prefilled_copies(device, gen)
    dtype = eager.dtype
    runner = GraphRunner(graph, capture=device.type == "cuda")
    # the batch sizes whose planning ran as a DecodePlanGraph (captured on CUDA; KVSTREAMS_PLAN_GRAPH=0: none)
    plans = graph.backend.plan_graphs
    res = {"fill": runner.fill, "row_lengths": dict(eager.length), "steps": [], "plan_graphs": sorted(plans),
           "plan_graphs_captured": sorted(bs for bs, pg in plans.items() if pg.graph is not None)}
    garbage = torch.Generator().manual_seed(1)
    for i, rows in enumerate(STEPS):
        if i in TURN_BEFORE:
            row, n = TURN_BEFORE[i]
            qkv = qkv_for(n, gen, dtype, device)
            for c in (eager, graph):
                c.extend(row, qkv)
        inputs, same = eager.decode_inputs(rows), graph.decode_inputs(rows)
        assert all(torch.equal(inputs[k], same[k]) for k in inputs)  # the two copies' bookkeeping agrees
        qkv = qkv_for(len(rows), gen, dtype, device)
        fb = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=len(rows),
                             **{k: v.to(device) for k, v in inputs.items()}, seq_lens_cpu=inputs["seq_lens"])
        eager.backend.init_forward_metadata(fb)
        ref, kernels = [], []
        for layer, (q, k, v) in zip(eager.layers, qkv, strict=True):
            ref.append(eager.backend.forward_decode(q, k, v, layer, fb))
            ws = eager.backend.decode_workspace  # None on the CPU (the torch path)
            kernels.append(ws.last_kernel if ws is not None else None)
        bs, _ = runner.load(inputs, qkv, garbage)
        step = dict(rows=rows, bs=bs, lengths=inputs["seq_lens"].tolist(), positions=inputs["positions"].tolist())
        lists = graph.backend.forward_metadata.kv4  # the padding rows' lists: empty (they read nothing)
        step["padding_lists_empty"] = all(bool((lists[k][len(rows):bs + 1] == lists[k][len(rows)]).all())
                                          for k in ("kv_indptr", "side_indptr"))
        compare(step, runner, bs, len(rows), ref, eager, graph)
        if runner.capture:  # which decode kernel each path ran (the CUDA kernel where it takes the shapes): the
            # eager path's per layer, the graph's last captured layer
            step["kernels"] = [*kernels, graph.backend.graph.workspace.last_kernel]
        res["steps"].append(step)
    with open(out, "w") as f:
        json.dump(res, f)


def run(out: Path, device: str, env: dict, *, prefill: bool = False) -> dict:
    """This script in a subprocess (``env``: its environment); returns what it dumped."""
    proc = subprocess.run([sys.executable, __file__, str(out), "--device", device, *(["--prefill"] if prefill else [])],
                          env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"graph steps failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(Path(out).read_text())


if __name__ == "__main__":
    dev = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cpu"
    (prefill_main if "--prefill" in sys.argv else main)(sys.argv[1], torch.device(dev))
